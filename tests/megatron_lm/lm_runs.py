"""Helpers of the Megatron-LM tests: launch pretrain_gpt.py under torchrun, read its log.

``pretrain(...)`` starts ``python -m torch.distributed.run`` on a free port (retried once if
the port was taken meanwhile) with either megatron-ext's zero-touch launcher (``-m
megatron_ext pretrain --cpu PATH/pretrain_gpt.py``) or a patched ``pretrain_gpt.py`` itself
(``MEGATRON_EXT_CPU=1``). ``iterations(output)`` parses Megatron-LM's iteration lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.helpers.dist import free_port

REPO = Path(__file__).resolve().parents[2]
TINY_RUN_FILE = REPO / "configs" / "megatron_lm" / "gpt_tiny_separate_cpu.yaml"

_ADDRESS_IN_USE = ("Address already in use", "EADDRINUSE")


def checkout_release():
    """The release of the checkout in ``MEGATRON_LM_DIR`` (a :class:`MegatronLMRelease`)."""
    from megatron_ext.megatron.lm.releases import detect_checkout_release

    return detect_checkout_release(os.environ["MEGATRON_LM_DIR"])


def hook_module(release=None):
    """The hook module (``core_v0_16`` / ``core_v0_19``) of ``release`` (default: the checkout's)."""
    import importlib

    release = release or checkout_release()
    return importlib.import_module(release.hooks.split(":")[0])


def tiny_args(**overrides: str) -> List[str]:
    """The tiny GPT's flags (from the shipped CPU run file), with ``--flag value`` overrides."""
    from megatron_ext.megatron.lm.runfile import run_file_args

    args = run_file_args(str(TINY_RUN_FILE))
    for key, value in overrides.items():
        args += [f"--{key.replace('_', '-')}", value]
    return args


@dataclass
class Run:
    """A finished launch."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout and stderr together."""
        return self.stdout + "\n" + self.stderr

    def check(self) -> "Run":
        """Fail the test with the output's tail unless the run succeeded."""
        assert self.returncode == 0, f"exit code {self.returncode}\n{self.output[-6000:]}"
        return self


def pretrain(
    script: Path,
    args: Sequence[str],
    *,
    cwd: Path,
    nproc: int = 2,
    zero_touch: bool = True,
    timeout: float = 300,
    env: Optional[Dict[str, str]] = None,
) -> Run:
    """Run ``script`` (a pretrain_gpt.py) under torchrun on CPU and return its output."""
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    if zero_touch:
        run_env.pop("MEGATRON_EXT_CPU", None)
        launch = ["-m", "megatron_ext", "pretrain", "--cpu", str(script)]
    else:
        run_env["MEGATRON_EXT_CPU"] = "1"
        launch = [str(script)]
    for attempt in range(2):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *launch,
            *args,
        ]
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=run_env
        )
        run = Run(proc.returncode, proc.stdout, proc.stderr)
        if run.returncode == 0 or not any(s in run.output for s in _ADDRESS_IN_USE):
            return run
    return run


_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*")
_FIELDS = {
    "loss": re.compile(r" lm loss: ([0-9.E+-]+) \|"),
    "grad_norm": re.compile(r" grad norm: ([0-9.]+) \|"),
    # Non-greedy: another rank's output can follow on the same line.
    "bytes": re.compile(r" bytes sent/step \(all ranks\): (.*?) \|"),
}


def iterations(output: str) -> Dict[int, Dict[str, str]]:
    """Megatron-LM's iteration lines: ``{iteration: {"loss", "grad_norm", "bytes", "line"}}``.

    Values stay strings, exactly as printed (comparisons between runs are then exact).
    """
    out: Dict[int, Dict[str, str]] = {}
    for match in _LINE.finditer(output):
        line = match.group(0)
        record = {"line": line}
        for name, pattern in _FIELDS.items():
            found = pattern.search(line)
            if found:
                record[name] = found.group(1)
        out[int(match.group(1))] = record
    return out
