"""Data-parallel gradient seam: megatron-core bucket groups reduce through a GradReducer.

What it does:
    :func:`install_grad_sync` replaces ``start_grad_sync`` on each
    ``_ParamAndGradBucketGroup`` *instance* of the given DDP model chunks by
    :func:`_ext_start_grad_sync`, which keeps megatron-core 0.16's contract (first-batch
    handling, NaN / large-gradient checks, ``gradient_scaling_factor``, SUM or AVG,
    reduce-scatter for the distributed optimizer, async only with ``overlap_grad_reduce``)
    and hands the actual reduction to a :class:`~megatron_ext.collectives.grad_reducer.GradReducer`.
    Megatron's own ``finish_grad_sync`` is kept: it calls our ``start_grad_sync`` when
    reduction is synchronous and waits on our handle when it is overlapped, so a
    compressed reduction starts as soon as its bucket is ready and its decompression runs
    inside ``wait()``.

Why:
    megatron-core has no DDP comm hook (style notes, fact 1); bucket groups are the unit it
    communicates in, and they are created only inside DDP's constructor, so patching the
    instances after construction reaches every reduction without touching classes.

Constraints:
    * Verified against megatron-core 0.16.x. 0.19 changed ``start_grad_sync`` (it drains
      the previous bucket group and copies "extra main grads" into a comm buffer), so on
      any other release :func:`install_grad_sync` refuses with an error rather than
      silently dropping those steps.
    * One distributed-optimizer instance (``num_distributed_optimizer_instances == 1``).
    * Expert-parallel bucket groups are handled like dense ones, on their own group.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_ext.accounting import CommMeter
from megatron_ext.collectives.grad_reducer import (
    BucketGroupView,
    BucketView,
    DeferredHandle,
    GradReducer,
    GradSyncContext,
    ParamSlice,
)
from megatron_ext.config import ConfigError
from megatron_ext.logging import get_logger, log_rank_0
from megatron_ext.megatron.naming import global_param_names
from megatron_ext.megatron.version import require_mcore

__all__ = ["GradSyncHandle", "install_grad_sync", "StepClock"]

logger = get_logger(__name__)


@dataclass
class StepClock:
    """The training iteration, shared by every seam (set by the training loop)."""

    step: int = 0
    """0-based iteration currently being computed."""


@dataclass
class _GroupExt:
    """What our start_grad_sync needs besides the bucket group itself."""

    reducer: GradReducer
    clock: StepClock
    meter: Optional[CommMeter]
    buckets: List[BucketView]
    reduce_scatter_fn: Callable[..., Any]


def _bucket_views(bucket_group: Any, names: Dict[Any, str]) -> List[BucketView]:
    views = []
    for bucket in bucket_group.buckets:
        grad = bucket.grad_data
        base = grad.data_ptr()
        elem = grad.element_size()
        slices = []
        for param in bucket.params_list:
            # main_grad is a view into the bucket; its offset is robust to the padding the
            # distributed optimizer inserts (bucket.param_to_index ignores it).
            start = (param.main_grad.data_ptr() - base) // elem
            slices.append(
                ParamSlice(
                    fqn=names[param],
                    start=start,
                    end=start + param.numel(),
                    shape=tuple(param.shape),
                )
            )
        slices.sort(key=lambda s: s.start)
        key = f"{slices[0].fqn}..{slices[-1].fqn}" if slices else f"bucket{bucket.bucket_id}"
        views.append(BucketView(grad=grad, params=slices, key=key))
    return views


def _noop() -> None:
    return None


def _ext_start_grad_sync(self, force_all_reduce: Optional[bool] = False):
    """megatron-core 0.16 ``start_grad_sync`` with the collective delegated to a reducer."""
    ext: _GroupExt = self._megatron_ext
    if self.is_first_batch and self.grad_reduce_handle is not None:
        # First batch with overlap: already launched by register_grad_ready.
        return
    assert (
        self.grad_reduce_handle is None
    ), "Should not have multiple communication calls outstanding at once"

    if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
        self.check_grads(
            check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
            check_for_large=self.ddp_config.check_for_large_grads,
        )
    for bucket in self.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor

    op = torch.distributed.ReduceOp.SUM
    if self.ddp_config.average_in_collective:
        op = torch.distributed.ReduceOp.AVG
    async_op = self.ddp_config.overlap_grad_reduce
    use_dist_opt = self.ddp_config.use_distributed_optimizer
    reduce_scatter = use_dist_opt and not force_all_reduce
    group = (
        self.intra_distributed_optimizer_instance_group
        if use_dist_opt
        else self.data_parallel_group
    )
    buckets = ext.buckets
    if reduce_scatter:
        size = group.size()
        rank = group.rank()
        for view in buckets:
            shard = view.grad.numel() // size
            view.shard = (rank * shard, (rank + 1) * shard)
    else:
        for view in buckets:
            view.shard = None
    ctx = GradSyncContext(
        buckets=buckets,
        group=group,
        reduce_scatter=reduce_scatter,
        op=op,
        async_op=async_op,
        step=ext.clock.step,
        meter=ext.meter,
        reduce_scatter_fn=ext.reduce_scatter_fn,
    )
    handle = ext.reducer.launch(ctx)
    if async_op:
        # finish_grad_sync waits on it; a reducer may also have finished synchronously.
        self.grad_reduce_handle = DeferredHandle(handle.wait if handle is not None else _noop)
    else:
        if handle is not None:
            handle.wait()
        self.grad_reduce_handle = None


@dataclass
class GradSyncHandle:
    """Returned by :func:`install_grad_sync`; ``remove()`` restores megatron's method."""

    bucket_groups: List[Any] = field(default_factory=list)

    def remove(self) -> None:
        """Drop the instance-level override on every patched bucket group."""
        for bucket_group in self.bucket_groups:
            if "start_grad_sync" in vars(bucket_group):
                del bucket_group.start_grad_sync
            if hasattr(bucket_group, "_megatron_ext"):
                del bucket_group._megatron_ext
        self.bucket_groups.clear()


def install_grad_sync(
    model_chunks: Sequence[torch.nn.Module],
    reducer: GradReducer,
    *,
    clock: StepClock,
    meter: Optional[CommMeter] = None,
) -> GradSyncHandle:
    """Route the gradient reduction of every bucket group of ``model_chunks`` through ``reducer``.

    Args:
        model_chunks: megatron-core ``DistributedDataParallel`` modules (one per virtual
            pipeline chunk).
        reducer: the reduction to use (``DenseGradReducer`` reproduces megatron-core).
        clock: iteration counter read when a reduction starts.
        meter: byte accounting.

    Returns:
        A handle whose ``remove()`` undoes the installation.

    Raises:
        ConfigError: unsupported megatron-core release or DDP configuration.
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import param_and_grad_buffer as pgb

    require_mcore("data-parallel gradient seam (--grad-compression)", "0.16", "0.17")
    plan = []
    for chunk in model_chunks:
        if not isinstance(chunk, DistributedDataParallel):
            raise ConfigError(
                "--grad-compression",
                f"needs megatron-core DistributedDataParallel model chunks, got {type(chunk)}",
            )
        ddp_config = chunk.ddp_config
        if ddp_config.num_distributed_optimizer_instances != 1:
            raise ConfigError(
                ["--grad-compression", "--num-distributed-optimizer-instances"],
                "the gradient seam supports a single distributed-optimizer instance",
            )
        kinds = {"reduce_scatter" if ddp_config.use_distributed_optimizer else "all_reduce"}
        missing = kinds - set(reducer.supports)
        if missing:
            raise ConfigError(
                ["--grad-compression", "--use-distributed-optimizer"],
                f"'{reducer.name}' does not support {', '.join(sorted(missing))}",
            )
        names = global_param_names(chunk)
        for bucket_group in list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups):
            group = (
                bucket_group.intra_distributed_optimizer_instance_group
                if ddp_config.use_distributed_optimizer
                else bucket_group.data_parallel_group
            )
            plan.append((bucket_group, BucketGroupView(_bucket_views(bucket_group, names), group)))
    # Bind first (it may check cross-rank agreement and raise) so a failure leaves megatron's
    # methods untouched.
    reducer.bind([view for _, view in plan])
    handle = GradSyncHandle()
    for bucket_group, view in plan:
        bucket_group._megatron_ext = _GroupExt(
            reducer=reducer,
            clock=clock,
            meter=meter,
            buckets=view.buckets,
            # Read at install time: megatron swaps the module global for the fp32
            # accumulating variant when a DDP config asks for it.
            reduce_scatter_fn=pgb.dist_reduce_scatter_func,
        )
        bucket_group.start_grad_sync = types.MethodType(_ext_start_grad_sync, bucket_group)
        handle.bucket_groups.append(bucket_group)
    num_groups = len(plan)
    log_rank_0(
        logger,
        20,
        f"megatron_ext: gradient reduction of {num_groups} bucket group(s) goes through "
        f"the '{reducer.name}' reducer",
    )
    return handle
