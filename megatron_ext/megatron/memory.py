"""Memory a run needs that is easy to miss: pending optimizer state, AQ-SGD buffers per node.

What it does:
    :func:`aqsgd_buffer_plan` adds up AQ-SGD's per-sample buffers of every rank of a node
    from the run's layout, with the functions the codec allocates them with
    (:func:`~megatron_ext.collectives.aqsgd.boundary_sides`, ``buffer_nbytes``,
    ``local_rows``, ``resolve_buffer_dtype`` and the
    :class:`~megatron_ext.methods.registry.SampleSpace` slot count), so the launch scripts
    (:mod:`megatron_ext.preflight`) and ``benchmarks/state_memory.py`` state the
    figure the codec will allocate, before a job starts. Ranks map to pipeline stages as
    Megatron-LM's ``initialize_model_parallel`` orders them (``tp-cp-ep-dp-pp``, or
    ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``), nodes hold consecutive ranks.

    :func:`pending_optimizer_state_nbytes` walks a megatron-core optimizer (a
    ``ChainedOptimizer`` of ``MegatronOptimizer`` wrappers, each around a torch optimizer)
    and adds up the state its torch optimizers will allocate at their first step for the
    parameters they step that have no state yet: two fp32 moments (4 B each per element)
    for Adam-like optimizers, one fp32 momentum for SGD with momentum, and an fp32 master
    copy (4 B per element) where the stepped parameters are not fp32 themselves (a
    precision-aware optimizer keeps the master weights in its state). The fp32 main
    parameters of megatron's mixed-precision and distributed optimizers are allocated when
    the optimizer is built and are therefore already in use, not pending. With the
    distributed optimizer the stepped parameters are this rank's shards, so the sum is
    this rank's share.

Why:
    Methods that allocate large device buffers at install time (AQ-SGD) run their fit
    check before the first step: without this, the check would see memory that Adam takes
    a moment later.

Constraints:
    Reads optimizer objects only (duck-typed on megatron-core's ``chained_optimizers`` /
    ``optimizer`` attributes); imports nothing from Megatron. Optimizers other than Adam
    and SGD variants are counted like Adam (two moments): an upper bound for the common
    ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List

import torch

__all__ = ["AQSGDBufferPlan", "aqsgd_buffer_plan", "pending_optimizer_state_nbytes"]


def _torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    for sub in getattr(optimizer, "chained_optimizers", None) or ():
        yield from _torch_optimizers(sub)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and not hasattr(optimizer, "chained_optimizers"):
        yield from _torch_optimizers(inner)


def _state_bytes_per_element(opt: torch.optim.Optimizer) -> int:
    name = type(opt).__name__.lower()
    if "sgd" in name:
        return 4 if opt.defaults.get("momentum", 0) else 0
    return 8  # Adam, AdamW, fused variants: exp_avg and exp_avg_sq in fp32


def pending_optimizer_state_nbytes(optimizer: Any) -> int:
    """Bytes of optimizer state not allocated yet (see module docstring).

    Args:
        optimizer: a megatron-core optimizer (or a torch optimizer, or None).
    """
    total = 0
    for opt in _torch_optimizers(optimizer):
        per_element = _state_bytes_per_element(opt)
        for group in opt.param_groups:
            for param in group["params"]:
                if opt.state.get(param):
                    continue
                master = 4 if param.dtype != torch.float32 else 0
                total += param.numel() * (per_element + master)
    return total


@dataclass(frozen=True)
class AQSGDBufferPlan:
    """AQ-SGD's per-sample buffers of a run (see :func:`aqsgd_buffer_plan`)."""

    per_side: int
    """Bytes of one boundary side of one rank (``slots x rows x hidden x itemsize``)."""

    slots: int
    """Samples per data-parallel rank."""

    rows: int
    """Tokens of a sample that cross a boundary on one rank."""

    itemsize: int
    """Bytes per stored value."""

    per_rank_max: int
    """The largest rank's buffers (a middle stage: send and receive sides)."""

    per_node: List[int]
    """Bytes of the buffers of each node's ranks."""

    @property
    def per_node_max(self) -> int:
        """The fullest node's buffers."""
        return max(self.per_node)


def aqsgd_buffer_plan(
    *,
    num_samples: int,
    seq_length: int,
    hidden_size: int,
    activation_dtype: torch.dtype,
    buffer_dtype: str = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    world_size: int = 1,
    ranks_per_node: int = 1,
    tp_pp_dp_mapping: bool = False,
) -> AQSGDBufferPlan:
    """AQ-SGD's buffer bytes per rank and per node, as the codec will allocate them.

    Args:
        num_samples: ``--fixed-samples``.
        seq_length: ``--seq-length``.
        hidden_size: ``--hidden-size``.
        activation_dtype: the pipeline's activation dtype (bf16 / fp16 / fp32).
        buffer_dtype: ``--aqsgd-buffer-dtype``.
        tensor_parallel, pipeline_parallel, context_parallel: the parallel sizes.
        sequence_parallel: ``--sequence-parallel``.
        world_size: all ranks (nodes x GPUs per node).
        ranks_per_node: GPUs per node.
        tp_pp_dp_mapping: ``--use-tp-pp-dp-mapping``.

    Raises:
        ValueError: the world does not hold a whole number of model replicas.
    """
    from types import SimpleNamespace

    from megatron_ext.collectives.aqsgd import (
        boundary_sides,
        buffer_nbytes,
        local_rows,
        resolve_buffer_dtype,
    )
    from megatron_ext.methods.registry import SampleSpace

    model_parallel = tensor_parallel * context_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise ValueError(
            f"{world_size} ranks do not hold a whole number of model replicas of "
            f"{model_parallel} ranks"
        )
    dp = world_size // model_parallel
    config = SimpleNamespace(
        context_parallel_size=context_parallel,
        tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=sequence_parallel,
    )
    rows = local_rows(seq_length, config)
    dtype = resolve_buffer_dtype(buffer_dtype, activation_dtype)
    space = SampleSpace(
        fixed=True,
        num_samples=num_samples,
        dp_rank=0,
        dp_size=dp,
        micro_batch_size=1,
        num_microbatches=1,
        seq_length=seq_length,
    )
    per_side = buffer_nbytes(space.num_slots, rows, hidden_size, dtype)
    inner = tensor_parallel * context_parallel
    per_node = [0] * -(-world_size // ranks_per_node)
    per_rank_max = 0
    for rank in range(world_size):
        if tp_pp_dp_mapping:  # tp-cp-ep-pp-dp
            stage = (rank // inner) % pipeline_parallel
        else:  # tp-cp-ep-dp-pp
            stage = rank // (inner * dp)
        nbytes = per_side * len(boundary_sides(stage, pipeline_parallel))
        per_node[rank // ranks_per_node] += nbytes
        per_rank_max = max(per_rank_max, nbytes)
    return AQSGDBufferPlan(
        per_side=per_side,
        slots=space.num_slots,
        rows=rows,
        itemsize=torch.tensor([], dtype=dtype).element_size(),
        per_rank_max=per_rank_max,
        per_node=per_node,
    )
