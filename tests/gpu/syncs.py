"""Host synchronizations per training step, as CUDA's sync debug mode reports them.

What it does:
    :class:`SyncRecorder` runs steps under ``torch.cuda.set_sync_debug_mode("warn")``: every
    synchronizing CUDA call (``item()``, a device-to-host copy, ``nonzero``, a blocking
    ``torch.cuda.synchronize``-like wait inside an op) emits a warning; the recorder catches
    each one and keeps, per step, where it came from: the innermost stack frame outside
    torch and the standard library, ``megatron_ext`` code (``origin="megatron_ext"``),
    megatron-core (``origin="megatron"``) or anything else (``origin="other"``).
    :meth:`SyncRecorder.ext_syncs` lists the ``megatron_ext`` ones of the steady steps so
    tests can require none but the findings strict-device mode documents
    (``tests/helpers/strict_device.py``, ``tests/unit/test_strict_device.py``), while syncs in
    megatron-core itself (its grad-norm ``.item()``) are recorded and not failed on.
    A fused kernel (``megatron_ext/kernels``) synchronizes while torch.compile builds it
    (Triton's autotuning benchmarks the candidate configurations on the device at the
    first launch): a step in which torch.compile compiled a frame is marked ``compiled``,
    and the syncs of ``megatron_ext.kernels.run`` in it are compilation's, not the step's
    (seen on an H200, 2026-11-28: such syncs only at each kernel's first call). A kernel that
    synchronized in a step without a compile still fails the tests.
    :func:`append_report` appends the records to the JSON file named by
    ``MEGATRON_EXT_SYNC_REPORT`` (if set) so a GPU run hands back the whole table.

Constraints:
    On a CPU device nothing synchronizes: the recorder is a no-op whose records say so
    (``captured: false``). Warnings raised in autograd's backward threads reach Python at
    the end of ``backward()``, so their frame is the ``backward`` call site. Test helper;
    pure torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List

import torch

__all__ = ["Sync", "StepSyncs", "SyncRecorder", "append_report"]

REPORT_ENV = "MEGATRON_EXT_SYNC_REPORT"
_LOCK = threading.Lock()


@dataclass
class Sync:
    """One synchronization: where it came from and torch's message."""

    origin: str
    where: str
    message: str


@dataclass
class StepSyncs:
    """The synchronizations of one step."""

    step: str
    steady: bool
    syncs: List[Sync] = field(default_factory=list)
    compiled: bool = False  # torch.compile compiled a frame during the step


# Where a fused kernel's first call is (megatron_ext/kernels/__init__.py, ``run``).
KERNEL_RUN = ("megatron_ext/kernels/__init__.py:", "(run)")


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def _where(stack: List[traceback.FrameSummary]) -> Sync:
    """The sync's origin: the innermost frame outside torch, the standard library and this
    file decides (``megatron_ext``, ``megatron`` for megatron-core, else ``other``), so a
    megatron-core sync reached through megatron_ext's driver is megatron-core's."""
    here = os.path.abspath(__file__)
    for f in reversed(stack):
        name = f.filename.replace("\\", "/")
        if os.path.abspath(f.filename) == here or "/torch/" in name or name.startswith("<"):
            continue
        if "/lib/python3" in name and "/site-packages/" not in name:
            continue  # contextlib, warnings, functools
        for origin, marker in (("megatron_ext", "/megatron_ext/"), ("megatron", "/megatron/")):
            if marker in name:
                short = name[name.rindex(marker) + 1 :]
                return Sync(origin, f"{short}:{f.lineno} ({f.name})", "")
        return Sync("other", f"{name}:{f.lineno} ({f.name})", "")
    return Sync("other", "?", "")


class SyncRecorder:
    """Records the synchronizations of named steps (see module docstring)."""

    def __init__(self, run: str, device: torch.device) -> None:
        self.run = run
        self.device = torch.device(device)
        self.captured = self.device.type == "cuda"
        self.steps: List[StepSyncs] = []

    @contextlib.contextmanager
    def step(self, name: str, *, steady: bool = True) -> Iterator[StepSyncs]:
        """Record the synchronizations inside as step ``name``; ``steady`` steps are the ones
        tests hold to no ``megatron_ext`` sync (warm-up, selection and setup steps are not)."""
        record = StepSyncs(name, steady)
        self.steps.append(record)
        if not self.captured:
            yield record
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            saved = warnings.showwarning

            def hook(message, category, filename, lineno, file=None, line=None):
                text = str(message)
                if "synchroniz" not in text.lower():
                    return saved(message, category, filename, lineno, file, line)
                sync = _where(traceback.extract_stack()[:-1])
                sync.message = text.splitlines()[0][:200]
                record.syncs.append(sync)

            warnings.showwarning = hook
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            compiled = _compiled_frames()
            try:
                yield record
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                warnings.showwarning = saved
                record.compiled = _compiled_frames() > compiled

    def ext_syncs(self, steady_only: bool = True) -> List[str]:
        """``step: where`` of each ``megatron_ext`` sync (of the steady steps), less a fused
        kernel's syncs in a step that compiled (module docstring)."""
        return [
            f"{s.step}: {x.where}"
            for s in self.steps
            if s.steady or not steady_only
            for x in s.syncs
            if x.origin == "megatron_ext" and not (s.compiled and _is_kernel_run(x.where))
        ]

    def summary(self) -> Dict:
        """A JSON-able record of the run: per step, the count and each sync's origin."""
        return {
            "run": self.run,
            "device": str(self.device),
            "captured": self.captured,
            "note": (
                None
                if self.captured
                else "no CUDA device: sync capture is a no-op (nothing was recorded)"
            ),
            "steps": [
                {
                    "step": s.step,
                    "steady": s.steady,
                    "compiled": s.compiled,
                    "count": len(s.syncs),
                    "syncs": [asdict(x) for x in s.syncs],
                }
                for s in self.steps
            ],
        }


def _is_kernel_run(where: str) -> bool:
    return all(part in where for part in KERNEL_RUN)


def append_report(*summaries: Dict) -> None:
    """Append the summaries to the JSON list in ``$MEGATRON_EXT_SYNC_REPORT`` (if set)."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    with _LOCK:
        data = []
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data.extend(summaries)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
