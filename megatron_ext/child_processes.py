"""Child processes of a training rank die with it (Linux ``PR_SET_PDEATHSIG``).

What it does:
    :func:`children_die_with_parent` makes every child process this process starts from its
    main thread from then on receive SIGKILL when this process dies, however it dies
    (SIGKILL, OOM killer, segfault):

    * ``multiprocessing`` *spawn* children: the command line of
      the new interpreter first calls ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` and exits if its
      parent is already gone;
    * *forked* children (``multiprocessing`` fork context, ``os.fork``): an
      ``os.register_at_fork`` hook does the same in the child.

Why:
    megatron-core's torch_dist checkpoint writer starts a ``multiprocessing`` manager with
    the spawn method on the first save of each rank (``_get_write_results_queue`` in
    ``dist_checkpointing/strategies/filesystem_async.py`` of megatron-core 0.16,
    ``get_write_results_queue`` in 0.19; 0.3 to 0.9 GB each, as it re-imports the rank's
    ``__main__``) and forks one writer per write bucket during a save. Nothing ends them
    when their rank is killed: they are adopted by init and run for ever. torchrun only
    signals the process groups of ranks that are still alive.

Constraints:
    * Linux only; elsewhere :func:`children_die_with_parent` does nothing and returns False.
    * The kernel ties the death signal to the *thread* that created the child. Children
      started from other threads are left alone (a thread pool's short-lived thread would
      otherwise take its children with it).
    * SIGKILL: such a child cannot clean up. These children only serve their rank; a
      checkpoint a dying rank was writing is incomplete anyway.
    * Not covered: ``subprocess`` children (none is started during training), the
      ``forkserver`` server (its command line is built elsewhere) and multiprocessing's
      resource tracker (it exits by itself once every process holding its pipe is gone).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import List

__all__ = ["children_die_with_parent", "die_with_parent"]

_PR_SET_PDEATHSIG = 1
_installed = False
# Set in the parent just before each fork, read by the child (a copy of the parent's memory).
_forked_from_main_thread = False
_parent_pid = 0


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


# -- fork -----------------------------------------------------------------------------------


def _before_fork() -> None:
    global _forked_from_main_thread, _parent_pid
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()
    _parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    if _forked_from_main_thread:
        die_with_parent(_parent_pid)


# -- spawn ----------------------------------------------------------------------------------

# Runs first in the spawned interpreter, before multiprocessing's own bootstrap; inline so it
# does not depend on the child's sys.path.
_SPAWN_PRELUDE = (
    "import ctypes, os; "
    "ctypes.CDLL(None).prctl({option}, {sig}, 0, 0, 0); "
    "os.getppid() == {pid} or os._exit(1); "
)


def _wrap_get_command_line(original):
    def get_command_line(**kwds) -> List[str]:
        cmd = original(**kwds)
        if threading.current_thread() is not threading.main_thread() or "-c" not in cmd:
            return cmd
        i = cmd.index("-c") + 1
        prelude = _SPAWN_PRELUDE.format(
            option=_PR_SET_PDEATHSIG, sig=int(signal.SIGKILL), pid=os.getpid()
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
