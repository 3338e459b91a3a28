"""Processes read from /proc (Linux, no psutil): a process tree and which of it still runs.

Used by the tests that kill a launcher, a parent or a rank and require what it started to
be gone (tests/unit/test_child_processes.py, tests/megatron/test_exit_and_failures.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import List, Sequence


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie left for a parent or an init that does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> List[int]:
    """Direct children of ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces; the fields after its closing parenthesis do not.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def descendants(pid: int) -> List[int]:
    """Children of ``pid``, their children, and so on."""
    found = []
    for child in children(pid):
        found += [child] + descendants(child)
    return found


def survivors(pids: Sequence[int], within: float, poll: float) -> List[int]:
    """Those of ``pids`` still alive after waiting up to ``within`` seconds (checked every
    ``poll`` seconds) for all of them to be gone."""
    deadline = time.time() + within
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(poll)
    return [p for p in pids if alive(p)]


def assert_all_gone(pids: Sequence[int], within: float, poll: float) -> None:
    """Assert that every one of ``pids`` is gone within ``within`` seconds (checked every
    ``poll`` seconds). The failure names each survivor's command line; the survivors are
    killed (SIGKILL) first, so that a failing test leaves nothing running."""
    left = survivors(pids, within=within, poll=poll)
    commands = [Path(f"/proc/{p}/cmdline").read_text() for p in left]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], commands
