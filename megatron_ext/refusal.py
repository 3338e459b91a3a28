"""Print a refusal (a one-line error before exiting) once per job, and make sure it is seen.

What it does:
    :func:`report_refusal` is called by every rank that stops on a user-fixable error
    (megatron_ext's ``ConfigError`` and state mismatches, in the driver and in Megatron-LM's
    ``pretrain_gpt.py``, and the driver's checkpoint space check). The first rank of the job
    to call it prints the line to stderr and flushes it; every other rank that calls it waits
    (at most :data:`WAIT_FOR_PRINTER_S`) until that line is out, then returns, so its exit
    cannot come first. A rank whose message differs from the printed one prints its own.
    The printing rank itself stays until every rank has refused (at most :data:`LINGER_S`),
    so a rank that refuses a moment later is not killed before it compared its message.

Why:
    Printing on rank 0 only loses the message whenever another rank exits first: torchrun
    then kills the rest, rank 0 included, often before rank 0 reached its print (seen for
    Protocol Models + Transformer Engine at PP=2 with Megatron-LM 0.19: only ``exitcode: 2``
    reached the terminal). Printing on every rank instead repeats the line once per rank
    (64 times on 64 GPUs) and still loses it when the refusal is raised on some ranks only
    while rank 0 is elsewhere. Electing the printer through the job's c10d store (an atomic
    ``add``) gives exactly one line, from whichever rank refuses first, on any node.

Under torchrun, the last lines:
    torchrun ends every failed job with its ``ChildFailedError`` summary (~40 lines); a line a
    rank printed before sits above it, under everything the ranks printed first (Megatron-LM's
    ~790-line argument dump). torchrun's summary itself reprints a worker's *error file*
    (``$TORCHELASTIC_ERROR_FILE``, set by torchrun for every worker) as the ``traceback`` of
    the first failure, its last line but one. So under torchrun the printing rank writes the
    message there instead of printing it, and exits first: every other refusing rank waits
    (at most :data:`AWAIT_STOP_S`) for torchrun to stop it, so that the printing rank's
    failure is the first one torchrun sees and names as the root cause, the message
    printed once, as the cause on the last screen (on another node, the first refusing rank
    writes the message to its own error file and exits, for that node's summary). This
    needs no launcher of our own: users start the driver and ``pretrain_gpt.py`` with
    torchrun, which starts the ranks itself. Outside torchrun (one process, ``srun``
    starting the ranks) the line goes to stderr, where nothing follows it.

Constraints:
    * The store is the one torchrun's agent (or rank 0, without torchrun) serves at
      ``MASTER_ADDR:MASTER_PORT``; it is reached with a fresh client, so this works before
      ``init_process_group`` as well. Keys are namespaced by ``TORCHELASTIC_RUN_ID`` and the
      restart count, so a restarted job prints again.
    * Without a reachable store (a single process, or rank 0 serving the store and already
      gone) every calling rank prints: a repeated line is better than none.
    * Ranks that never refuse (blocked in a collective with a refusing rank) print nothing
      and are ended by torchrun as before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Optional, TextIO

__all__ = [
    "report_refusal",
    "error_file",
    "WAIT_FOR_PRINTER_S",
    "CONNECT_TIMEOUT_S",
    "LINGER_S",
    "AWAIT_STOP_S",
]

WAIT_FOR_PRINTER_S = 30.0
"""How long a rank that does not print waits for the printing rank's line, in seconds."""

CONNECT_TIMEOUT_S = 10.0
"""How long to try reaching the job's store, in seconds."""

LINGER_S = 2.0
"""How long the printing rank waits for ranks that have not refused yet, in seconds (only
spent when some ranks never refuse, e.g. blocked in a collective with a refusing rank)."""

AWAIT_STOP_S = 10.0
"""Under torchrun, how long a refusing rank that did not print waits for torchrun to stop it
(after the printing rank exited), in seconds; then it exits by itself."""

_KEY_PREFIX = "megatron_ext/refusal"


def _job_store() -> Optional[Any]:
    """A client of the job's c10d store, or None when there is no reachable one."""
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Port 0 ("any free port") names no server to connect to.
    if not addr or not port or int(port) == 0 or world <= 1:
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(
            addr,
            int(port),
            is_master=False,
            timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
            wait_for_workers=False,
        )
    except Exception:  # noqa: BLE001 - any failure to connect means: print it ourselves
        return None


def _key() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_KEY_PREFIX}/{run_id}/{restart}"


def _print(message: str, file: TextIO) -> None:
    print(message, file=file, flush=True)


def error_file() -> Optional[str]:
    """The error file torchrun reads when this worker fails (None outside torchrun)."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


def _write_error_file(path: str, message: str) -> bool:
    """Write ``message`` in the format of torch's ``ErrorHandler.record_exception`` (its
    ``py_callstack`` is what torchrun's summary shows); False if it cannot be written."""
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
        return True
    except OSError:
        return False


def _emit(message: str, file: TextIO) -> None:
    """The printing rank's output: torchrun's error file when there is one (torchrun prints
    it last), else ``file``."""
    path = error_file()
    if path and _write_error_file(path, message):
        return
    _print(message, file)


def _node() -> str:
    """This rank's node in torchrun's numbering (``GROUP_RANK``)."""
    return os.environ.get("GROUP_RANK", "0")


def _await_stop(store: Any, key: str, printed: str) -> None:
    """Under torchrun, a refusing rank that did not print waits for torchrun to stop it, so
    that it does not fail before the printing rank: torchrun's summary lists every failure
    of the node (ranks it stopped included, with their error files) and names the first as
    the cause. Returns at once outside torchrun, after :data:`AWAIT_STOP_S` otherwise.

    On a node other than the printing rank's, the first rank to get here writes the printed
    message to its error file and returns at once: that node's torchrun then reports it too.
    """
    path = error_file()
    if not path:
        return
    try:
        elsewhere = store.get(f"{key}/printer_node").decode() != _node()
        if elsewhere and store.add(f"{key}/node/{_node()}", 1) == 1:
            _write_error_file(path, printed)
            return
    except Exception:  # noqa: BLE001 - no store: wait as on the printer's node
        pass
    if threading.current_thread() is threading.main_thread():
        # torchrun stops workers with SIGTERM; a handler installed for a graceful exit
        # (Megatron-LM's --exit-signal-handler) would only record it.
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
    time.sleep(AWAIT_STOP_S)


def report_refusal(message: str, file: Optional[TextIO] = None, *, defer_s: float = 0.0) -> bool:
    """Print ``message`` once for the whole job; call it on every refusing rank before exiting.

    Args:
        message: the one-line error, e.g. ``megatron-ext train: error: --save: ...``.
        file: where to print (default: stderr).
        defer_s: this rank knows less than another one will say (e.g. "the save failed on
            another rank"): print nothing if another rank prints within ``defer_s`` seconds,
            else report as usual.

    Returns:
        True if this rank printed the message.
    """
    file = file or sys.stderr
    store = _job_store()
    if store is None:
        if defer_s:
            # Nobody to ask: give the better-informed rank the time to print and exit first.
            time.sleep(defer_s)
        _emit(message, file)
        return True
    key = _key()
    if defer_s:
        try:
            store.wait([f"{key}/printed"], timedelta(seconds=defer_s))
            _await_stop(store, key, store.get(f"{key}/printed").decode("utf-8", "replace"))
            return False
        except Exception:  # noqa: BLE001 - nobody printed in time: report it ourselves
            pass
    try:
        first = store.add(f"{key}/count", 1) == 1
    except Exception:  # noqa: BLE001 - the store went away: print it ourselves
        _emit(message, file)
        return True
    if first:
        _emit(message, file)
        try:
            store.set(f"{key}/printer_node", _node())
            store.set(f"{key}/printed", message)
            _linger(store, key)
        except Exception:  # noqa: BLE001 - the line is out; the others wait a bounded time
            pass
        return True
    printed_here = False
    try:
        store.wait([f"{key}/printed"], timedelta(seconds=WAIT_FOR_PRINTER_S))
        printed = store.get(f"{key}/printed").decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the printer died before printing: print it ourselves
        printed = None
    if printed is None:
        # No printer: this rank's failure is the one to report.
        _emit(message, file)
        return True
    if printed != message:
        # A rank-specific refusal (another stage, another node): printed at once, above
        # torchrun's summary, which shows the printing rank's.
        _print(message, file)
        printed_here = True
    try:
        store.add(f"{key}/done", 1)
    except Exception:  # noqa: BLE001 - the printer stops lingering after LINGER_S anyway
        pass
    _await_stop(store, key, printed)
    return printed_here


def _linger(store: Any, key: str) -> None:
    """Keep the printing rank alive (at most :data:`LINGER_S`) until every rank has refused
    and decided whether to print its own line: its exit lets torchrun kill the others."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        arrived = store.add(f"{key}/count", 0)
        if arrived >= world and store.add(f"{key}/done", 0) >= arrived - 1:
            return
        time.sleep(0.05)
