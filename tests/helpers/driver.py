"""Launching ``megatron-ext train`` as users do, for the tests that run it end to end.

``torchrun_command(program)`` is ``python -m torch.distributed.run --nproc-per-node N
[torchrun flags] PROGRAM...`` (any program: the driver, a script, Megatron-LM's
``pretrain_gpt.py``); ``driver_command(args)`` runs the driver (``-m megatron_ext.train
ARGS``) that way. ``launch_env()`` is the test's environment with this checkout on
``PYTHONPATH``. ``run_driver`` runs the driver to completion and returns its output;
``start_driver`` starts it in the background, its output in a log file. ``base_flags()`` is
the common start of the driver's command lines in these tests: the tiny GPT on CPU, a short
warm-up, one evaluation iteration, no progress bar.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from tests.helpers.paths import REPO

__all__ = [
    "base_flags",
    "torchrun_command",
    "driver_command",
    "launch_env",
    "run_command",
    "run_driver",
    "start_driver",
]


def base_flags(log_interval: int = 4, eval_iters: int = 1) -> List[str]:
    """The driver's flags every launching test starts from (a log line every
    ``log_interval`` iterations, ``eval_iters`` evaluation iterations)."""
    return [
        "--cpu",
        "--model",
        "gpt-tiny",
        "--lr-warmup-iters",
        "2",
        "--log-interval",
        str(log_interval),
        "--eval-iters",
        str(eval_iters),
        "--no-progress",
    ]


def torchrun_command(
    program: Sequence[str], nproc: int = 2, torchrun_args: Sequence[str] = ()
) -> List[str]:
    """``program`` (``-m MODULE ARGS`` or ``SCRIPT ARGS``) under torchrun on ``nproc`` local
    ranks; ``torchrun_args`` go to torchrun itself (rendezvous, ports, timeouts)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        *torchrun_args,
        *program,
    ]


def driver_command(
    args: Sequence[str], nproc: int = 2, torchrun_args: Sequence[str] = ()
) -> List[str]:
    """The driver with ``args`` under torchrun (:func:`torchrun_command`)."""
    return torchrun_command(["-m", "megatron_ext.train", *args], nproc, torchrun_args)


def launch_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The test's environment, ``PYTHONPATH`` this checkout, then ``extra`` over both."""
    return {**os.environ, "PYTHONPATH": str(REPO), **(extra or {})}


def run_command(
    command: Sequence[str],
    cwd,
    *,
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
    merge_output: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``command`` in ``cwd`` (environment :func:`launch_env` with ``env``) to its end;
    stdout and stderr captured as text, in one stream (as a terminal shows them) with
    ``merge_output``."""
    return subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=launch_env(env),
    )


def run_driver(
    args: Sequence[str],
    cwd,
    nproc: int = 2,
    timeout: float = 420,
    env: Optional[Mapping[str, str]] = None,
) -> subprocess.CompletedProcess:
    """The driver with ``args`` on ``nproc`` ranks, run to its end in ``cwd``."""
    return run_command(driver_command(args, nproc), cwd, timeout=timeout, env=env)


def start_driver(
    args: Sequence[str],
    log: Path,
    torchrun_args: Sequence[str] = (),
    env: Optional[Mapping[str, str]] = None,
) -> Tuple[subprocess.Popen, IO[str]]:
    """Start the driver with ``args`` on 2 ranks in ``log``'s folder, stdout and stderr to
    ``log``; returns the process and the open log (the caller closes it)."""
    f = open(log, "w")
    proc = subprocess.Popen(
        driver_command(args, torchrun_args=torchrun_args),
        stdout=f,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(log).parent,
        env=launch_env(env),
    )
    return proc, f
