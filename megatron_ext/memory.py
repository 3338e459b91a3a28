"""AQ-SGD's per-sample buffers per rank and per node, from the run's layout, before a job starts.

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

Constraints:
    Arithmetic over the layout; imports nothing from Megatron (so the pre-flight, which
    ``megatron_ext.megatron`` imports, need not import the adapters). The optimizer's
    pending state, the other figure a fit check needs, is ``megatron_ext.optim.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

__all__ = ["AQSGDBufferPlan", "aqsgd_buffer_plan"]


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
