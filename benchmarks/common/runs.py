"""Running a benchmark's commands and summarizing them: logged runs, lists, the median.

:func:`driver_command` and :func:`lr_schedule_flags` build the CPU driver runs the training
benchmarks make, :func:`run_logged` runs a command with its output in a log file (optionally
at raised priority), :func:`parse_list` reads comma-separated flag values,
:func:`shell_join` prints a copy-pasteable command, :func:`median` is the statistic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.common.machine import PriorityBooster

__all__ = [
    "driver_command",
    "lr_schedule_flags",
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
