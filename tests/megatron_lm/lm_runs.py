"""Helpers of the Megatron-LM tests: launch pretrain_gpt.py under torchrun, read its log.

``pretrain(...)`` starts ``python -m torch.distributed.run`` (``torchrun_command`` of
tests/helpers/driver.py) on a free port (retried once if the port was taken meanwhile) with
either megatron-ext's zero-touch launcher (``-m megatron_ext pretrain --cpu
PATH/pretrain_gpt.py``) or a patched ``pretrain_gpt.py`` itself (``MEGATRON_EXT_CPU=1``).
``iterations(output)`` parses Megatron-LM's iteration lines.

With ``MEGATRON_EXT_LM_DEVICE=cuda`` (the GPU session, ``benchmarks/gpu_session.sh``) the same
tests launch on CUDA instead: no ``--cpu``, the unfused softmax (no Apex there), and gloo
between the ranks. When there are fewer GPUs than ranks, the ranks share GPU 0: Megatron-LM
puts a rank on ``cuda:LOCAL_RANK``, so each rank is started by its own torchrun agent as
local rank 0 of its own "node" (``--nnodes N --node-rank i``, one static rendezvous on this
host); their outputs are joined in rank order.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.helpers.dist import free_port
from tests.helpers.driver import launch_env, torchrun_command
from tests.helpers.paths import REPO

TINY_RUN_FILE = REPO / "configs" / "megatron_lm" / "gpt_tiny_separate_cpu.yaml"

_ADDRESS_IN_USE = ("Address already in use", "EADDRINUSE")
DEVICE_ENV = "MEGATRON_EXT_LM_DEVICE"
# On CUDA: the number of ranks instead of each test's (the GPU session runs the methods
# whose dense steps gloo cannot all-reduce on CUDA at 1 rank, over NCCL).
NPROC_ENV = "MEGATRON_EXT_LM_NPROC"


def on_cuda() -> bool:
    """The tests launch on CUDA (``MEGATRON_EXT_LM_DEVICE=cuda``), else on CPU."""
    device = os.environ.get(DEVICE_ENV, "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={device!r}: expected cpu or cuda")
    return device == "cuda"


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
    """Run ``script`` (a pretrain_gpt.py) under torchrun (on CPU, or CUDA: see the module
    docstring) and return its output."""
    run_env = launch_env({"OMP_NUM_THREADS": "1", **(env or {})})
    cuda = on_cuda()
    cpu_flag = [] if cuda else ["--cpu"]
    if zero_touch:
        run_env.pop("MEGATRON_EXT_CPU", None)
        launch = ["-m", "megatron_ext", "pretrain", *cpu_flag, str(script)]
    else:
        if not cuda:
            run_env["MEGATRON_EXT_CPU"] = "1"
        launch = [str(script)]
    if cuda:
        nproc = int(os.environ.get(NPROC_ENV, nproc))
    agents = nproc if _ranks_share_a_device(cuda, nproc) else 1
    if cuda:
        # No Apex on a stock CUDA torch. Ranks sharing one GPU talk over gloo (as the run
        # file says); otherwise NCCL: gloo all-reduces no coalesced CUDA tensors, which
        # Megatron's dense gradient all-reduce is ("ProcessGroupGloo::allreduce_coalesced:
        # unsupported device type cuda", seen on an H200 at DP=2 on one GPU, 2026-11-28).
        backend = "gloo" if agents > 1 else "nccl"
        args = list(args) + ["--no-masked-softmax-fusion", "--distributed-backend", backend]
    for attempt in range(2):
        port = str(free_port())
        procs, logs = [], []
        for node in range(agents):
            layout = []
            if agents > 1:
                layout = ["--nnodes", str(agents), "--node-rank", str(node)]
            command = torchrun_command(
                [*launch, *args],
                nproc if agents == 1 else 1,
                [*layout, "--master-addr", "127.0.0.1", "--master-port", port],
            )
            # Files, not pipes: an agent blocked on a full pipe would stall the other's ranks.
            logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
            procs.append(
                subprocess.Popen(
                    command, stdout=logs[-1][0], stderr=logs[-1][1], text=True, cwd=cwd, env=run_env
                )
            )
        outs = []
        try:
            for proc in procs:
                proc.wait(timeout=timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for out, err in logs:
                out.seek(0), err.seek(0)
                outs.append((out.read(), err.read()))
                out.close(), err.close()
        code = next((p.returncode for p in procs if p.returncode), 0)
        run = Run(code, "".join(o for o, _ in outs), "".join(e for _, e in outs))
        if run.returncode == 0 or not any(s in run.output for s in _ADDRESS_IN_USE):
            return run
    return run


def _ranks_share_a_device(cuda: bool, nproc: int) -> bool:
    """On CUDA with fewer GPUs than ranks: one torchrun agent per rank (module docstring)."""
    import torch

    return cuda and torch.cuda.device_count() < nproc


_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*")
_FIELDS = {
    "loss": re.compile(r" lm loss: ([0-9.E+-]+) \|"),
    "grad_norm": re.compile(r" grad norm: ([0-9.]+) \|"),
    "loss_scale": re.compile(r" loss scale: ([0-9.E+-]+) \|"),  # with --fp16
    "skipped": re.compile(r" number of skipped iterations: +(\d+) \|"),
    # Non-greedy: another rank's output can follow on the same line.
    "bytes": re.compile(r" bytes sent/step \(all ranks\): (.*?) \|"),
}


def iterations(output: str) -> Dict[int, Dict[str, str]]:
    """Megatron-LM's iteration lines: ``{iteration: {"loss", "grad_norm", "loss_scale",
    "skipped", "bytes", "line"}}`` (the fields the line has).

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
