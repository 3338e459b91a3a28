"""The contract between the data-parallel gradient seam and a (compressed) reduction.

What it does:
    megatron-core reduces gradients per *bucket group*: flat, contiguous gradient buffers
    that are all-reduced, or reduce-scattered into shards with the distributed optimizer.
    The adapter in ``megatron_ext.megatron.ddp`` describes each bucket group to a
    :class:`GradReducer` as a :class:`GradSyncContext` (flat buffers, per-parameter slices
    keyed by fully qualified name, shard bounds, process group) and calls
    :meth:`GradReducer.launch`. :class:`DenseGradReducer` is the pass-through: the same
    collectives megatron-core issues, so training is bit-identical to stock.

Why:
    PyTorch's DDP has comm hooks; megatron-core has none. This file is our hook contract,
    independent of Megatron so reducers are testable on plain process groups.

Contract (what a reducer must guarantee):
    * When the returned handle's ``wait()`` returns (or at once, if ``launch`` returns
      None), each bucket's ``grad`` holds the reduced gradient: the whole buffer for
      all-reduce; at least ``grad[shard[0]:shard[1]]`` for reduce-scatter.
    * Gradients arrive already multiplied by megatron's ``gradient_scaling_factor``; the
      reduction uses ``ctx.op`` (SUM, or AVG with ``average_in_collective``).
    * Padding elements of the buffer are zero on input and must stay zero.
    * Every transfer is recorded in ``ctx.meter`` (category ``dp-grad``) with its dense
      equivalent, and issued inside ``ProcessGroupTrafficMeter.tagged("dp-grad")``.
    * State (residuals, counters) is keyed by parameter FQN, never by bucket index.

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.distributed_c10d import _coalescing_manager

from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter, collective_wire_bytes

__all__ = [
    "ParamSlice",
    "BucketView",
    "BucketGroupView",
    "GradSyncContext",
    "DeferredHandle",
    "GradReducer",
    "DenseGradReducer",
]


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter's gradient lives inside a flat bucket buffer."""

    fqn: str
    """Fully qualified parameter name (global layer numbering)."""

    start: int
    """First element in the bucket buffer."""

    end: int
    """One past the last element."""

    shape: Tuple[int, ...]
    """The parameter's shape."""


@dataclass
class BucketView:
    """One flat gradient bucket as seen by a reducer."""

    grad: torch.Tensor
    """The flat gradient buffer (a view into megatron's grad buffer); reduced in place."""

    params: List[ParamSlice]
    """Parameter slices in buffer order."""

    shard: Optional[Tuple[int, int]] = None
    """This rank's [start, end) slice when reduce-scattering, else None."""

    key: str = ""
    """Stable name of the bucket (first and last parameter FQN)."""


@dataclass
class BucketGroupView:
    """A bucket group as bound to a reducer at install time."""

    buckets: List[BucketView]
    """The group's buckets (stable objects: the same views are passed at every launch)."""

    group: Any
    """Process group the bucket group reduces over."""


@dataclass
class GradSyncContext:
    """Everything a reducer needs for one bucket group's reduction."""

    buckets: List[BucketView]
    """Buckets of the group (usually one)."""

    group: Any
    """Data-parallel process group of the reduction."""

    reduce_scatter: bool
    """True: reduce-scatter into shards (distributed optimizer); False: all-reduce."""

    op: Any
    """torch.distributed.ReduceOp.SUM or AVG."""

    async_op: bool
    """Launch asynchronously (overlap with backward); the handle is waited on later."""

    step: int
    """Training iteration (0-based) this reduction belongs to."""

    meter: Optional[CommMeter] = None
    """Byte accounting; None disables recording."""

    reduce_scatter_fn: Callable[..., Any] = field(default=torch.distributed.reduce_scatter_tensor)
    """The reduce-scatter function megatron would call (it may use fp32 accumulation)."""


class DeferredHandle:
    """A handle whose ``wait()`` runs ``finish`` once (waiting on collectives, decompressing).

    Compressed reducers return it with ``async_op``: megatron's ``finish_grad_sync`` calls
    ``wait()`` when it needs the bucket, so decompression happens after communication.
    """

    def __init__(self, finish: Callable[[], None]):
        self._finish: Optional[Callable[[], None]] = finish

    def wait(self) -> None:
        """Finish the reduction (idempotent)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class GradReducer(abc.ABC):
    """Base class of data-parallel gradient reductions (see module docstring).

    Subclasses set ``name`` and ``supports``, implement :meth:`launch`, and keep their
    state in :meth:`state_dict` / :meth:`load_state_dict` keyed by parameter FQN.
    """

    name: str = "base"
    supports: Tuple[str, ...] = ("all_reduce", "reduce_scatter")

    def bind(self, groups: List[BucketGroupView]) -> None:
        """Called once at install with every bucket group (before any checkpoint load), so
        stateful reducers can allocate their state and check cross-rank agreement."""

    @abc.abstractmethod
    def launch(self, ctx: GradSyncContext) -> Optional[Any]:
        """Start the reduction of ``ctx.buckets``; return a handle with ``wait()`` or None."""

    def state_dict(self) -> Dict[str, Any]:
        """Rank-local state (tensors and primitives only)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raise ValueError on missing / unexpected keys."""
        if state:
            raise ValueError(f"{self.name} reducer has no state, got keys {sorted(state)}")


class DenseGradReducer(GradReducer):
    """Pass-through: exactly the collectives megatron-core 0.16 issues, plus accounting."""

    name = "none"

    def launch(self, ctx: GradSyncContext) -> Optional[Any]:
        group_size = torch.distributed.get_world_size(ctx.group)
        rank = torch.distributed.get_rank(ctx.group)
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            # One coalescing manager over the group's buckets, as megatron does.
            with _coalescing_manager(ctx.group, async_ops=ctx.async_op) as cm:
                for bucket in ctx.buckets:
                    if ctx.reduce_scatter:
                        shard_size = bucket.grad.numel() // group_size
                        local = bucket.grad[rank * shard_size : (rank + 1) * shard_size]
                        ctx.reduce_scatter_fn(
                            local, bucket.grad, op=ctx.op, group=ctx.group, async_op=ctx.async_op
                        )
                    else:
                        torch.distributed.all_reduce(
                            bucket.grad, op=ctx.op, group=ctx.group, async_op=ctx.async_op
                        )
        if ctx.meter is not None:
            kind = "reduce_scatter" if ctx.reduce_scatter else "all_reduce"
            for bucket in ctx.buckets:
                nbytes = bucket.grad.numel() * bucket.grad.element_size()
                wire = collective_wire_bytes(kind, nbytes, group_size)
                ctx.meter.record("dp-grad", sent=wire, recv=wire)
        return cm if ctx.async_op else None
