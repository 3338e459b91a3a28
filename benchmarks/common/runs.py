"""Running a benchmark's commands and summarizing them: logged runs, lists, the median.

:func:`driver_command` and :func:`lr_schedule_flags` build the CPU driver runs the training
benchmarks make (:func:`add_lr_schedule_args` declares the options the latter reads,
:func:`add_run_args` the options every such benchmark has, read by :func:`extra_train_flags`
and :func:`time_limit`),
:func:`fresh_run_dir` and :func:`run_measured` run one of them, :func:`run_records`,
:func:`run_json` and :func:`stdout_tail` read back what it left in its folder,
:func:`run_logged` runs a command with its output in a log file (optionally at raised
priority), :func:`parse_list`
reads comma-separated flag values, :func:`shell_join` prints a copy-pasteable command,
:func:`median` is the statistic.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.common.machine import CpuMonitor, PriorityBooster, wait_for_quiet
from megatron_ext.report import read_jsonl

__all__ = [
    "driver_command",
    "lr_schedule_flags",
    "add_lr_schedule_args",
    "add_run_args",
    "extra_train_flags",
    "parse_per",
    "time_limit",
    "fresh_run_dir",
    "run_measured",
    "run_records",
    "run_json",
    "stdout_tail",
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


def add_run_args(
    parser: argparse.ArgumentParser,
    *,
    run_timeout: float,
    extra_train_args: bool = True,
    time_limits: bool = False,
    link_checks: bool = False,
) -> None:
    """The options of a benchmark that launches driver runs: ``--model`` (gpt-tiny),
    ``--num-threads`` (torch threads per rank, 1), ``--run-timeout`` (``run_timeout``
    seconds), ``--extra-train-args`` (:func:`extra_train_flags`) unless ``extra_train_args``
    is False, with ``time_limits`` ``--time-limit`` (:func:`time_limit`), and with
    ``link_checks`` ``--check-seconds`` (netbench's measurement of the shaped links)."""
    parser.add_argument("--model", default="gpt-tiny", help="Model preset (default gpt-tiny).")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per rank (1).")
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=run_timeout,
        help=f"Seconds per run before it is stopped ({run_timeout:g}).",
    )
    if extra_train_args:
        parser.add_argument(
            "--extra-train-args",
            default="",
            help="Extra driver flags for every run, one string in shell syntax (write "
            "--extra-train-args='--flag ...' with '=').",
        )
    if time_limits:
        parser.add_argument(
            "--time-limit",
            default="",
            help="Seconds per run at a link rate, RATE=S,... (e.g. 10mbit=1800), in place of "
            "--run-timeout: a stopped run's times are lower bounds.",
        )
    if link_checks:
        parser.add_argument(
            "--check-seconds",
            type=float,
            default=1.0,
            help="netbench's measurement of each shaped link before each run (1.0 s).",
        )


def extra_train_flags(args: argparse.Namespace) -> List[str]:
    """``--extra-train-args`` split as a shell would (quoted values stay one flag value)."""
    return shlex.split(args.extra_train_args)


def parse_per(spec: str, flag: str, kind: Any = float) -> Dict[str, Any]:
    """``KEY=VALUE,...`` of ``flag`` as a dict (``kind`` int: a value may be written 1e3).

    Raises:
        ValueError: naming ``flag``, for an item without ``=VALUE`` or a value that is not a
            number.
    """
    out: Dict[str, Any] = {}
    for part in parse_list(spec):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = int(float(value)) if kind is int else kind(value)
        except ValueError:
            raise ValueError(f"{flag}: expected KEY=NUMBER, got {part!r}") from None
    return out


def time_limit(args: argparse.Namespace, rate: str) -> Optional[float]:
    """The ``--time-limit`` of a run at link ``rate`` (None: none given, ``--run-timeout``
    applies)."""
    return parse_per(args.time_limit, "--time-limit").get(rate)


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


def run_records(run_dir: str) -> Optional[List[Dict[str, Any]]]:
    """The driver's per-iteration records (``<run_dir>/log.jsonl``); None when the run
    wrote no log."""
    path = os.path.join(run_dir, "log.jsonl")
    return read_jsonl(path) if os.path.exists(path) else None


def run_json(run_dir: str, name: str) -> Optional[Dict[str, Any]]:
    """``<run_dir>/<name>`` (the driver's ``comm_report.json``, netbench's
    ``netbench.json``) parsed; None when the run wrote none."""
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def stdout_tail(run_dir: str, chars: int = 2000) -> str:
    """The end of a run's output (``<run_dir>/stdout.txt``, :func:`run_measured`'s): what a
    failed run's result carries as ``error_tail``."""
    with open(os.path.join(run_dir, "stdout.txt")) as f:
        return f.read()[-chars:]


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
