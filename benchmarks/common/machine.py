"""The machine a benchmark shares: waiting for idle CPUs, measuring contention, priority.

:class:`CpuMonitor` measures how busy the CPUs were during a run beside the benchmark's own
CPU time, :func:`wait_for_quiet` waits for other processes to leave the CPUs idle,
:func:`set_priority` / :class:`PriorityBooster` renice the benchmark's processes (and their
autogroups), :func:`add_machine_args` adds ``--quiet-wait`` and ``--priority``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

__all__ = [
    "CpuMonitor",
    "wait_for_quiet",
    "set_priority",
    "PriorityBooster",
    "add_machine_args",
]


def _cpu_busy_s() -> Optional[float]:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...
    values = [int(v) for v in fields[1:]]
    busy = values[0] + values[1] + values[2] + values[5] + values[6]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuMonitor:
    """CPU time used by *other* processes while a measurement runs.

    The benchmarks share a small machine; another process's work slows ours down. On exit
    ``result()`` gives the wall time, our CPU seconds (this process and its waited-for
    children), the machine's busy CPU seconds, the difference ("foreign") and the foreign
    share of the machine's capacity (``foreign / (wall * cores)``). Linux only; elsewhere
    the foreign fields are ``None``.
    """

    def __enter__(self) -> "CpuMonitor":
        self._t0 = time.time()
        self._busy0 = _cpu_busy_s()
        self._own0 = _own_cpu_s()
        self.wall_s = self.own_cpu_s = self.foreign_cpu_s = self.foreign_share = None
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.time() - self._t0
        self.own_cpu_s = _own_cpu_s() - self._own0
        busy1 = _cpu_busy_s()
        if self._busy0 is not None and busy1 is not None:
            self.foreign_cpu_s = max(0.0, (busy1 - self._busy0) - self.own_cpu_s)
            capacity = max(1e-9, self.wall_s * (os.cpu_count() or 1))
            self.foreign_share = self.foreign_cpu_s / capacity

    def result(self) -> Dict[str, Any]:
        """JSON-ready numbers (after the ``with`` block)."""
        return {
            "wall_s": self.wall_s,
            "own_cpu_s": self.own_cpu_s,
            "foreign_cpu_s": self.foreign_cpu_s,
            "foreign_cpu_share": self.foreign_share,
            "load_average_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }


def wait_for_quiet(
    max_wait_s: float, threshold: float = 0.1, window_s: float = 3.0, log=print
) -> Dict[str, Any]:
    """Wait (up to ``max_wait_s``) until other processes use less than ``threshold`` of the CPUs.

    Call it between measurements, when this process is idle. Returns what was seen:
    ``{"waited_s", "busy_share"}`` (the last window's machine-wide busy share).
    """
    t0 = time.time()
    share = None
    while True:
        b0, w0 = _cpu_busy_s(), time.time()
        time.sleep(window_s)
        b1, w1 = _cpu_busy_s(), time.time()
        if b0 is None or b1 is None:
            return {"waited_s": 0.0, "busy_share": None}
        share = (b1 - b0) / ((w1 - w0) * (os.cpu_count() or 1))
        waited = time.time() - t0
        if share < threshold or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "busy_share": round(share, 3)}
        if log:
            log(
                f"  (other processes use {100 * share:.0f}% of the CPUs; waiting for a quiet "
                f"machine, {waited:.0f}/{max_wait_s:.0f} s)"
            )
        time.sleep(7.0)


def set_priority(pid: int, nice: int) -> bool:
    """Give process ``pid`` the scheduling weight of ``nice``, across sessions too.

    With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, the default
    on desktop kernels) the CPU is shared fairly between *sessions* and a process's nice
    value only counts inside its session; netbench and torchrun start every rank in a new
    session. So both the process nice value and its autogroup's nice value are set.
    Negative values need root (CAP_SYS_NICE). Returns whether anything was set.
    """
    done = False
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        done = True
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        done = True
    except OSError:
        pass
    return done


def _children_map() -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses.
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


class PriorityBooster:
    """Keep a process tree at a given priority while it runs (see :func:`set_priority`).

    A background thread walks the descendants of ``root_pid`` every ``interval_s`` seconds
    and sets each new one's priority, so ranks started later (after a link check, by
    torchrun) are covered. Only processes of that tree are touched.
    """

    def __init__(self, root_pid: int, nice: int, interval_s: float = 0.3):
        import threading

        self.root_pid, self.nice, self.interval_s = root_pid, nice, interval_s
        self.boosted: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PriorityBooster":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                children = _children_map()
                todo = [self.root_pid]
                while todo:
                    pid = todo.pop()
                    if pid not in self.boosted and set_priority(pid, self.nice):
                        self.boosted.add(pid)
                    todo.extend(children.get(pid, []))
            except Exception:  # noqa: BLE001 - best effort; never break the measurement
                pass
            self._stop.wait(self.interval_s)


def add_machine_args(p: Any, *, quiet_wait: float, what: str) -> None:
    """``--quiet-wait`` and ``--priority``, shared by the benchmarks."""
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=quiet_wait,
        help=f"Before each {what} wait up to this many seconds for other processes to leave "
        f"the CPUs idle (0: do not wait; default {quiet_wait:g}).",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="Nice value for the benchmark's processes, applied to their autogroups too "
        "(e.g. -10 on a machine shared with other work; needs root). Default: unchanged.",
    )
