"""Running a benchmark's commands and summarizing them: logged runs, lists, the median.

:func:`driver_command` and :func:`lr_schedule_flags` build the CPU driver runs the training
benchmarks make (:func:`add_lr_schedule_args` declares the options the latter reads),
:func:`fresh_run_dir` and :func:`run_measured` run one of them, :func:`run_logged` runs a
command with its output in a log file (optionally at raised priority), :func:`parse_list`
reads comma-separated flag values, :func:`shell_join` prints a copy-pasteable command,
:func:`median` is the statistic.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.common.machine import CpuMonitor, PriorityBooster, wait_for_quiet

__all__ = [
    "driver_command",
    "lr_schedule_flags",
    "add_lr_schedule_args",
    "fresh_run_dir",
    "run_measured",
    "median",
    "shell_join",
    "run_logged",
    "parse_list",
]


def median(values: Sequence[float]) -> Optional[float]:
    """Median, ``None`` for an empty sequence."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def shell_join(argv: Sequence[str]) -> str:
    """A copy-pasteable command line."""
    import shlex

    return " ".join(shlex.quote(str(a)) for a in argv)


def driver_command(
    args: Any,
    run_dir: str,
    micro_batch_size: int,
    global_batch_size: int,
    train_iters: int,
    schedule: Sequence[str],
) -> List[str]:
    """The per-rank command of one CPU run of megatron-ext's driver (``python -m
    megatron_ext.train --cpu``) that writes what a training benchmark reads back.

    Args:
        args: The benchmark's options: ``model`` and ``num_threads``.
        run_dir: The run's folder: the per-iteration log goes to ``<run_dir>/log.jsonl``, the
            bytes sent to ``<run_dir>/comm_report.json``.
        micro_batch_size, global_batch_size, train_iters: The run's batch and length.
        schedule: The flags between the batch and the logging (seed, learning rate,
            evaluation, ``--log-interval``).

    Returns:
        The command; the caller appends the run's own flags (layout, method, extra flags).
    """
    cmd = [sys.executable, "-m", "megatron_ext.train", "--cpu", "--model", args.model]
    cmd += ["--num-threads", str(args.num_threads), "--micro-batch-size", str(micro_batch_size)]
    cmd += ["--global-batch-size", str(global_batch_size), "--train-iters", str(train_iters)]
    cmd += list(schedule)
    cmd += ["--no-progress", "--log-json", os.path.join(run_dir, "log.jsonl")]
    return cmd + ["--comm-report", os.path.join(run_dir, "comm_report.json")]


def add_lr_schedule_args(parser: argparse.ArgumentParser) -> None:
    """The options :func:`lr_schedule_flags` reads: ``--seed`` (1234), ``--lr`` (1e-3) and
    ``--min-lr`` (1e-4)."""
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)


def lr_schedule_flags(args: Any, warmup_iters: int, decay_style: str = "cosine") -> List[str]:
    """The driver flags of a run's seed and learning-rate schedule: ``--seed``, ``--lr`` and
    ``--min-lr`` from ``args``, then ``--lr-decay-style`` and ``--lr-warmup-iters``."""
    flags = ["--seed", str(args.seed), "--lr", str(args.lr), "--min-lr", str(args.min_lr)]
    return flags + ["--lr-decay-style", decay_style, "--lr-warmup-iters", str(warmup_iters)]


def run_logged(
    argv: Sequence[str],
    log_path: str,
    *,
    timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
    echo: bool = False,
    priority: Optional[int] = None,
) -> Tuple[int, float]:
    """Run ``argv`` with stdout and stderr in ``log_path``; returns (exit code, wall seconds).

    A timeout kills the process group and returns exit code 124. ``priority``: a nice
    value for the whole process tree (:class:`PriorityBooster`), e.g. -10 on a machine
    shared with other work; ``None`` leaves priorities alone.
    """
    import contextlib

    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(f"$ {shell_join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE if echo else log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            text=True,
        )
        booster = (
            PriorityBooster(proc.pid, priority)
            if priority is not None
            else contextlib.nullcontext()
        )
        with booster:
            try:
                if echo:
                    for line in proc.stdout:
                        log.write(line)
                        sys.stdout.write(line)
                        sys.stdout.flush()
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                import signal

                # SIGINT first: netbench then stops its ranks and removes its namespaces.
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                code = 124
    return code, time.time() - t0


def fresh_run_dir(out_dir: str, name: str) -> str:
    """``<out_dir>/runs/<name>``, made, without the outputs an earlier run left there
    (``log.jsonl``, ``comm_report.json``, ``netbench.json``) for the benchmark to read back
    as this run's; returns the path."""
    run_dir = os.path.join(out_dir, "runs", name)
    os.makedirs(run_dir, exist_ok=True)
    for stale in ("log.jsonl", "comm_report.json", "netbench.json"):
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    return run_dir


def run_measured(
    args: Any,
    cmd: Sequence[str],
    run_dir: str,
    timeout: float,
    env: Optional[Dict[str, str]] = None,
) -> Tuple[int, float, Dict[str, Any]]:
    """Run one measured command of a benchmark on the shared machine: first wait up to
    ``args.quiet_wait`` seconds for it to be quiet (:func:`wait_for_quiet`; not at 0), then
    run ``cmd`` at ``args.priority`` with its output in ``<run_dir>/stdout.txt``
    (:func:`run_logged`) while :class:`CpuMonitor` watches the other processes.

    Returns:
        The exit code, the wall seconds, and the contention record (the monitor's result
        and ``quiet_wait``, what the wait found).
    """
    quiet = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
    with CpuMonitor() as mon:
        code, wall = run_logged(
            cmd,
            os.path.join(run_dir, "stdout.txt"),
            timeout=timeout,
            env=env,
            priority=args.priority,
        )
    return code, wall, dict(mon.result(), quiet_wait=quiet)


def parse_list(text: str, kind=str) -> List[Any]:
    """``"a,b, c"`` -> ``["a", "b", "c"]`` converted with ``kind`` (floats like 1e6 to int)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if kind is int:
            out.append(int(float(part)))
        else:
            out.append(kind(part))
    return out
