"""Child processes of a training rank die with it, and ranks die with their launcher (Linux).

What it does:
    :func:`children_die_with_parent` makes every child process this process starts from its
    main thread from then on receive SIGKILL when this process dies, however it dies
    (SIGKILL, OOM killer, segfault):

    * ``multiprocessing`` *spawn* children: the command line of
      the new interpreter first calls ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` and exits if its
      parent is already gone;
    * *forked* children (``multiprocessing`` fork context, ``os.fork``): an
      ``os.register_at_fork`` hook does the same in the child.

    :func:`shield_children` makes those same children ignore the signals this process
    handles itself (``--exit-signal-handler``: SIGTERM, SIGINT, SIGUSR1): they end with
    their rank, not before it.

    :func:`die_with_launcher` makes a rank started by torchrun SIGKILL itself as soon as its
    launcher (torchrun's agent, its parent process) is gone; its own children follow it by
    the death signal above.

    :func:`bind_process_lifetimes` does the first and the last; both hosts (the driver and
    Megatron-LM's ``pretrain_gpt.py`` through the session hooks) call it at start-up.

Why:
    megatron-core's torch_dist checkpoint writer starts a ``multiprocessing`` manager with
    the spawn method on the first save of each rank (``_get_write_results_queue`` in
    ``dist_checkpointing/strategies/filesystem_async.py`` of megatron-core 0.16,
    ``get_write_results_queue`` in 0.19; 0.3 to 0.9 GB each, as it re-imports the rank's
    ``__main__``) and forks one writer per write bucket during a save.

    * Nothing ends them when their rank is killed: they are adopted by init and run for
      ever. torchrun only signals the process groups of ranks that are still alive.
    * The manager is in its rank's process group. torchrun forwards a SIGTERM it receives
      to each rank's process group (``os.killpg``), and Slurm signals every process of a
      step: the manager died of it (it ignores SIGINT only), so a rank that caught the
      signal to save failed in that save with ``BrokenPipeError`` (every save after the
      first; measured: SIGTERM at iteration 25 lost iterations 21-26). Shielded, the
      manager and the writers live until their rank is done and has exited.
    * torchrun starts each rank in its own session. A torchrun killed with SIGKILL cannot
      forward anything: its ranks trained on to the end, writing checkpoints with nothing
      supervising them (a scheduler that killed the launcher believes the job gone).

Choice of the launcher watch (measured on this 2-core machine, a launcher SIGKILLed; the
time until its rank was gone, 3 trials each, idle / torch matmuls / a pure-Python loop):
    * ``prctl(PR_SET_PDEATHSIG)`` in the rank: 3-22 / 4-310 / 4-5 ms; but the kernel ties
      it to the *thread* of the launcher that started the rank: a launcher that starts ranks
      from a worker thread which then ends (the rank measured was killed while its launcher
      lived on) would kill healthy ranks;
    * a thread blocked on a pidfd of the launcher (``os.pidfd_open``, Linux >= 5.3):
      6-32 / 28-292 ms / 18-25 ms, and unaffected by the launcher's threads (chosen);
    * a thread polling ``os.getppid()`` every second: up to 1 s (the fallback where
      ``pidfd_open`` is not available).

Constraints:
    * Linux only; elsewhere the functions do nothing and return False / None.
    * The kernel ties the death signal to the *thread* that created the child. Children
      started from other threads are neither tied nor shielded (a thread pool's
      short-lived thread would otherwise take its children with it).
    * SIGKILL: such a child cannot clean up. These children only serve their rank; a
      checkpoint a dying rank was writing is incomplete anyway (the latest marker still
      names the previous one).
    * Shielded children ignore the signals (``SIG_IGN``, which an ``exec`` keeps); a
      ``Process.terminate()`` of one (SIGTERM) no longer ends it: they end by their own
      protocol (the manager's shutdown message, the writers' return) or with their rank.
    * The launcher is the rank's parent process, and only a torchrun worker
      (``TORCHELASTIC_RUN_ID`` set) watches it: a rank started from a shell keeps running
      when the shell exits. A wrapper between torchrun and Python must ``exec`` it.
    * Not covered: ``subprocess`` children (none is started during training), the
      ``forkserver`` server (its command line is built elsewhere) and multiprocessing's
      resource tracker (it exits by itself once every process holding its pipe is gone).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "children_die_with_parent",
    "die_with_parent",
    "shield_children",
    "die_with_launcher",
    "bind_process_lifetimes",
    "LAUNCHER_POLL_S",
]

_PR_SET_PDEATHSIG = 1
_installed = False
# Set in the parent just before each fork, read by the child (a copy of the parent's memory).
_forked_from_main_thread = False
_parent_pid = 0
# Signals the children tied to this process ignore (shield_children).
_shielded: Tuple[int, ...] = ()
_launcher_watch: Optional[threading.Thread] = None

LAUNCHER_POLL_S = 1.0
"""Seconds between two looks at the parent pid where ``os.pidfd_open`` is unavailable."""


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child: receive ``sig`` when the parent dies; exit now if it already died.

    Args:
        parent_pid: the parent's pid when the child was created.
        sig: the signal (SIGKILL).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between the fork and the prctl.
    if os.getppid() != parent_pid:
        os._exit(1)


def shield_children(signals: Sequence[int]) -> None:
    """Children started from now on that die with this process ignore ``signals``.

    Effective only after :func:`children_die_with_parent` (a shielded child that did not
    die with its parent could only be ended by SIGKILL). ``shield_children(())`` ends it.

    Args:
        signals: the signals this process handles itself (its exit signals).
    """
    global _shielded
    _shielded = tuple(int(s) for s in signals)


# -- fork -----------------------------------------------------------------------------------


def _before_fork() -> None:
    global _forked_from_main_thread, _parent_pid
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()
    _parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    if _forked_from_main_thread:
        die_with_parent(_parent_pid)
        for sig in _shielded:
            signal.signal(sig, signal.SIG_IGN)


# -- spawn ----------------------------------------------------------------------------------

# Runs first in the spawned interpreter, before multiprocessing's own bootstrap; inline so it
# does not depend on the child's sys.path.
_SPAWN_PRELUDE = (
    "import ctypes, os, signal; "
    "ctypes.CDLL(None).prctl({option}, {sig}, 0, 0, 0); "
    "os.getppid() == {pid} or os._exit(1); "
    "[signal.signal(s, signal.SIG_IGN) for s in {shielded!r}]; "
)


def _wrap_get_command_line(original):
    def get_command_line(**kwds) -> List[str]:
        cmd = original(**kwds)
        if threading.current_thread() is not threading.main_thread() or "-c" not in cmd:
            return cmd
        i = cmd.index("-c") + 1
        prelude = _SPAWN_PRELUDE.format(
            option=_PR_SET_PDEATHSIG,
            sig=int(signal.SIGKILL),
            pid=os.getpid(),
            shielded=_shielded,
        )
        return cmd[:i] + [prelude + cmd[i]] + cmd[i + 1 :]

    get_command_line.__wrapped__ = original
    return get_command_line


def children_die_with_parent() -> bool:
    """Make children started from now on die with this process (idempotent).

    Returns:
        True when installed (Linux), False elsewhere.
    """
    global _installed
    if not sys.platform.startswith("linux"):
        return False
    if _installed:
        return True
    import multiprocessing.spawn

    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    multiprocessing.spawn.get_command_line = _wrap_get_command_line(
        multiprocessing.spawn.get_command_line
    )
    _installed = True
    return True


# -- the launcher ---------------------------------------------------------------------------


def _launcher_gone(launcher: int) -> None:
    message = (
        f"megatron-ext: the launcher of rank {os.environ.get('RANK', '?')} (pid {launcher}) "
        f"is gone; stopping this process ({os.getpid()}) and its children\n"
    )
    try:
        os.write(2, message.encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_pidfd(fd: int, launcher: int) -> None:
    # Readable once the launcher has exited (EINTR is retried by select, PEP 475).
    select.select([fd], [], [])
    _launcher_gone(launcher)


def _watch_ppid(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(LAUNCHER_POLL_S)
    _launcher_gone(launcher)


def die_with_launcher() -> Optional[str]:
    """Under torchrun: SIGKILL this process as soon as its launcher (its parent) exits.

    Idempotent. Started as early as possible: a launcher that died before the call is
    noticed only when this process was re-parented to init (pid 1).

    Returns:
        How the launcher is watched ("pidfd" or "poll"), or None when not watched (not a
        torchrun worker, or not Linux).
    """
    global _launcher_watch
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    if _launcher_watch is not None:
        return _launcher_watch.name.rsplit("-", 1)[1]
    launcher = os.getppid()
    if launcher == 1:
        _launcher_gone(launcher)
    try:
        fd = os.pidfd_open(launcher)
    except (AttributeError, OSError):
        fd = None
    # The launcher may have exited before the pidfd was opened (then it names a reused pid).
    if os.getppid() != launcher:
        _launcher_gone(launcher)
    if fd is not None:
        target, args, how = _watch_pidfd, (fd, launcher), "pidfd"
    else:
        target, args, how = _watch_ppid, (launcher,), "poll"
    _launcher_watch = threading.Thread(
        target=target, args=args, name=f"megatron-ext-launcher-watch-{how}", daemon=True
    )
    _launcher_watch.start()
    return how


def bind_process_lifetimes() -> None:
    """A rank's children die with it (:func:`children_die_with_parent`) and the rank dies
    with its launcher (:func:`die_with_launcher`); called by both hosts at start-up."""
    children_die_with_parent()
    die_with_launcher()
