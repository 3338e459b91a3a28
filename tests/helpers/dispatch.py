"""A TorchDispatchMode that records what a piece of code asks of the device.

What it does:
    :class:`OpRecorder` sees every aten op run inside it (after autograd, so the backward's
    ops too) and records, per op: its name, the devices of its tensor arguments and
    outputs, and whether an output is a fresh allocation (its storage belongs to no
    argument). Tests use it to check GPU hazards on a CPU-only machine:

    * host synchronizations: ``aten._local_scalar_dense`` (``.item()``, ``.tolist()``,
      ``bool(t)``) and ``aten.nonzero`` (boolean-mask indexing), which wait for the device;
    * host<->device copies: an op whose tensors span two devices (run the code on the
      ``meta`` device, with any host-side tensor on the CPU, to make them visible);
    * atomics: ops that PyTorch documents as nondeterministic on CUDA
      (``index_add``, ``scatter_add``, ``index_put`` with ``accumulate=True``, ...);
    * memory: fresh allocations of at least a given number of elements (clones of
      full-size tensors).

Constraints:
    Tests only. Records; never changes what the ops compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops that run atomically (nondeterministic summation order) on CUDA, per the list in
# torch.use_deterministic_algorithms' documentation.
ATOMIC_OPS = (
    "index_add",
    "scatter_add",
    "scatter_reduce",
    "put",
    "index_put",
    "_index_put_impl",
    "bincount",
)

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique")


@dataclass
class OpRecord:
    """One aten op as it ran."""

    name: str
    """Overload packet name, e.g. ``index_add_``."""
    devices: Tuple[str, ...]
    """Sorted device types of its tensor arguments and outputs."""
    accumulate: bool
    """``index_put`` / ``put``: the ``accumulate`` argument (False for other ops)."""
    fresh: Tuple[Tuple[int, torch.dtype], ...]
    """Element count and dtype of each output that is a new allocation."""


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # meta / wrapper tensors without a data pointer
        return None


class OpRecorder(TorchDispatchMode):
    """See module docstring. Use as a context manager; read :attr:`ops` afterwards."""

    def __init__(self):
        super().__init__()
        self.ops: List[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        storages = {_storage(t) for t in ins} - {None}
        fresh = tuple(
            (t.numel(), t.dtype) for t in outs if _storage(t) is None or _storage(t) not in storages
        )
        devices = tuple(sorted({t.device.type for t in ins + outs}))
        name = func.overloadpacket.__name__
        accumulate = False
        if name.rstrip("_") in ("index_put", "put", "_index_put_impl"):
            accumulate = bool(kwargs.get("accumulate", len(args) > 3 and args[3]))
        self.ops.append(OpRecord(name, devices, accumulate, fresh))
        return out

    # -- queries ---------------------------------------------------------------------------

    def names(self) -> List[str]:
        """Names of the ops run, in order."""
        return [op.name for op in self.ops]

    def mixed_devices(self) -> List[OpRecord]:
        """Ops whose tensors live on more than one device (a host<->device copy)."""
        return [op for op in self.ops if len(op.devices) > 1]

    def syncs(self) -> List[str]:
        """Ops that make the host wait for the device (:data:`SYNC_OPS`)."""
        return [op.name for op in self.ops if op.name.rstrip("_") in SYNC_OPS]

    def atomics(self) -> List[str]:
        """Ops PyTorch lists as nondeterministic on CUDA (:data:`ATOMIC_OPS`); ``index_put``
        counts only with ``accumulate=True``."""
        found = []
        for op in self.ops:
            base = op.name.rstrip("_")
            if base not in ATOMIC_OPS:
                continue
            if base in ("index_put", "put", "_index_put_impl") and not op.accumulate:
                continue
            found.append(op.name)
        return found

    def fresh_allocations(self, min_numel: int) -> List[Tuple[str, torch.dtype]]:
        """``(op, dtype)`` of each output of at least ``min_numel`` elements that an op
        allocated."""
        return [(op.name, dtype) for op in self.ops for n, dtype in op.fresh if n >= min_numel]
