"""Data-parallel gradient seam: megatron-core bucket groups reduce through a GradReducer.

What it does:
    :func:`install_grad_sync` describes each ``_ParamAndGradBucketGroup`` of the given DDP
    model chunks once, as a :class:`~megatron_ext.collectives.grad_reducer.BucketGroupSpec`
    (flat buffers with per-parameter slices keyed by global FQN, this rank's shard under the
    distributed optimizer, process group, SUM or AVG, async with ``overlap_grad_reduce``,
    megatron's reduce-scatter function, the byte meter), binds it to the reducer, and
    replaces ``start_grad_sync`` on the bucket group *instance* by the installed
    megatron-core release's re-implementation (``megatron_ext.megatron.mcore``), which
    keeps megatron's contract and calls ``bound.launch(step, force_all_reduce)``. Megatron's
    own ``finish_grad_sync`` is kept: it calls our ``start_grad_sync`` when reduction is
    synchronous and waits on our handle when it is overlapped, so a compressed reduction
    starts as soon as its bucket is ready and its decompression runs inside ``wait()``.

Why:
    megatron-core has no DDP comm hook (style notes, fact 1); bucket groups are the unit it
    communicates in, and they are created only inside DDP's constructor, so patching the
    instances after construction reaches every reduction without touching classes.

Constraints:
    * Only the megatron-core releases in ``megatron_ext.megatron.mcore.SUPPORTED``.
    * One distributed-optimizer instance (``num_distributed_optimizer_instances == 1``),
      except as DiLoCo's sites: with ``group`` the site, several instances are the sites,
      and the reduction stays inside one (megatron's all-reduce across instances is not
      issued; the bucket groups are shown a DDP config of one instance).
    * Expert-parallel bucket groups are handled like dense ones, on their own group.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_ext.accounting import CommMeter
from megatron_ext.collectives.grad_reducer import (
    BoundReduction,
    BucketGroupSpec,
    GradReducer,
    ParamSlice,
)
from megatron_ext.config import ConfigError
from megatron_ext.logging import get_logger, log_rank_0
from megatron_ext.megatron import mcore
from megatron_ext.megatron.naming import global_param_names
from megatron_ext.state import StepClock

__all__ = ["GradSyncHandle", "install_grad_sync", "bucket_group_spec"]

logger = get_logger(__name__)


def _param_slices(bucket: Any, names: Dict[Any, str], release: Any) -> List[ParamSlice]:
    grad = bucket.grad_data
    base = grad.data_ptr()
    elem = grad.element_size()
    slices = []
    for param in bucket.params_list:
        # The param's view into the bucket (main_grad, or 0.19's copy for params with an
        # extra fp32 main_grad); its offset is robust to the padding the distributed
        # optimizer inserts (bucket.param_to_index ignores it).
        start = (release.bucket_grad(param).data_ptr() - base) // elem
        slices.append(
            ParamSlice(
                fqn=names[param], start=start, end=start + param.numel(), shape=tuple(param.shape)
            )
        )
    slices.sort(key=lambda s: s.start)
    return slices


def _ranks(group: Any) -> List[int]:
    return list(torch.distributed.get_process_group_ranks(group))


def bucket_group_spec(
    bucket_group: Any,
    names: Dict[Any, str],
    meter: Optional[CommMeter] = None,
    group: Any = None,
) -> BucketGroupSpec:
    """The fixed description of one megatron-core bucket group (see module docstring).

    ``group`` replaces megatron's data-parallel group (see :func:`install_grad_sync`); under
    the distributed optimizer it must be the bucket group's optimizer instance."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    ddp_config = bucket_group.ddp_config
    dist_opt = ddp_config.use_distributed_optimizer
    if group is not None and dist_opt:
        # The distributed optimizer shards over its instance: the subgroup must be it.
        instance = bucket_group.intra_distributed_optimizer_instance_group
        if _ranks(group) != _ranks(instance):
            raise ConfigError(
                ["--outer-groups", "--num-distributed-optimizer-instances"],
                f"with the distributed optimizer a site must be one distributed-optimizer "
                f"instance: this rank's site holds ranks {_ranks(group)}, its instance "
                f"{_ranks(instance)}",
            )
        group = instance
    if group is None:
        group = (
            bucket_group.intra_distributed_optimizer_instance_group
            if dist_opt
            else bucket_group.data_parallel_group
        )
    release = mcore.release()
    buckets = []
    for bucket in bucket_group.buckets:
        slices = _param_slices(bucket, names, release)
        key = f"{slices[0].fqn}..{slices[-1].fqn}" if slices else f"bucket{bucket.bucket_id}"
        buckets.append((bucket.grad_data, slices, key))
    op = torch.distributed.ReduceOp.SUM
    if ddp_config.average_in_collective:
        op = torch.distributed.ReduceOp.AVG
    return BucketGroupSpec.create(
        buckets,
        group,
        op=op,
        distributed_optimizer=dist_opt,
        async_op=ddp_config.overlap_grad_reduce,
        # Read at install time: megatron swaps the module global for the fp32 accumulating
        # variant when a DDP config asks for it; that variant's own handle is the one to wait
        # on (the coalescing manager does not wait on it).
        reduce_scatter_fn=pgb.dist_reduce_scatter_func,
        reduce_scatter_own_handle=bool(
            getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False)
        ),
        meter=meter,
    )


@dataclass
class _GroupExt:
    """What our start_grad_sync needs besides the bucket group itself."""

    bound: BoundReduction
    clock: StepClock
    release: Any


def _ext_start_grad_sync(self, force_all_reduce: Optional[bool] = False):
    ext: _GroupExt = self._megatron_ext
    ext.release.start_grad_sync(self, ext.bound, ext.clock.step, force_all_reduce)


@dataclass
class GradSyncHandle:
    """Returned by :func:`install_grad_sync`; ``remove()`` restores megatron's method."""

    bucket_groups: List[Any] = field(default_factory=list)
    scaling: List[Any] = field(default_factory=list)
    """(bucket, megatron's gradient_scaling_factor) of buckets rescaled for a subgroup."""
    ddp_configs: List[Any] = field(default_factory=list)
    """(bucket group, its DDP config) of bucket groups shown one optimizer instance."""

    def remove(self) -> None:
        """Drop the instance-level override on every patched bucket group."""
        for bucket, factor in self.scaling:
            bucket.gradient_scaling_factor = factor
        self.scaling.clear()
        for bucket_group, ddp_config in self.ddp_configs:
            bucket_group.ddp_config = ddp_config
        self.ddp_configs.clear()
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
    group: Any = None,
) -> GradSyncHandle:
    """Route the gradient reduction of every bucket group of ``model_chunks`` through ``reducer``.

    Args:
        model_chunks: megatron-core ``DistributedDataParallel`` modules (one per virtual
            pipeline chunk).
        reducer: the reduction to use (``DenseGradReducer`` reproduces megatron-core).
        clock: iteration counter read when a reduction starts.
        meter: byte accounting.
        group: a subgroup of megatron's data-parallel group to reduce over instead of it
            (DiLoCo's site, ``--outer-groups``); the buckets' ``gradient_scaling_factor``
            (1/DP when megatron sums) is rescaled to 1/size of ``group`` so the reduced
            gradient is the site's mean; ``remove()`` restores it. Under the distributed
            optimizer ``group`` must be this rank's optimizer instance. None keeps megatron's.

    Returns:
        A handle whose ``remove()`` undoes the installation.

    Raises:
        ConfigError: unsupported megatron-core release or DDP configuration.
    """
    from megatron.core.distributed import DistributedDataParallel

    release = mcore.release()
    specs = []
    for chunk in model_chunks:
        if not isinstance(chunk, DistributedDataParallel):
            raise ConfigError(
                "--grad-compression",
                f"needs megatron-core DistributedDataParallel model chunks, got {type(chunk)}",
            )
        ddp_config = chunk.ddp_config
        if ddp_config.num_distributed_optimizer_instances != 1 and group is None:
            raise ConfigError(
                ["--grad-compression", "--num-distributed-optimizer-instances"],
                "the gradient seam supports several distributed-optimizer instances only as "
                "DiLoCo's sites (--outer-groups)",
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
            specs.append(
                (chunk, bucket_group, bucket_group_spec(bucket_group, names, meter, group))
            )
    # Bind first (it may check cross-rank agreement and raise) so a failure leaves megatron's
    # methods untouched.
    bound = [reducer.bind(spec) for _, _, spec in specs]
    handle = GradSyncHandle()
    if group is not None:
        for chunk, bucket_group, _ in specs:
            # megatron scales by 1/DP (data parallel with context parallel, the whole DP).
            full = torch.distributed.get_world_size(chunk.dp_cp_group)
            ratio = full / torch.distributed.get_world_size(group)
            for bucket in bucket_group.buckets:
                handle.scaling.append((bucket, bucket.gradient_scaling_factor))
                # SUM over the site of grads scaled by 1/DP would give size/DP of the mean;
                # AVG (average_in_collective: factor 1) already averages over the site.
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.gradient_scaling_factor = bucket.gradient_scaling_factor * ratio
            if bucket_group.ddp_config.num_distributed_optimizer_instances > 1:
                # Sites as distributed-optimizer instances: the reduction stays inside the
                # instance (megatron would all-reduce across instances next, on a side
                # stream). The bucket group sees one instance, so megatron's finish_grad_sync
                # waits on our handle instead of that stream.
                handle.ddp_configs.append((bucket_group, bucket_group.ddp_config))
                bucket_group.ddp_config = dataclasses.replace(
                    bucket_group.ddp_config, num_distributed_optimizer_instances=1
                )
    for (_, bucket_group, _), b in zip(specs, bound):
        bucket_group._megatron_ext = _GroupExt(bound=b, clock=clock, release=release)
        bucket_group.start_grad_sync = types.MethodType(_ext_start_grad_sync, bucket_group)
        handle.bucket_groups.append(bucket_group)
    log_rank_0(
        logger,
        20,
        f"megatron_ext: gradient reduction of {len(specs)} bucket group(s) goes through "
        f"the '{reducer.name}' reducer",
    )
    return handle
