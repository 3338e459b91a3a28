"""AQ-SGD and DirectQ sizing and schedule: payload bytes, buffer rows and dtype, warm-up, fit.

What it does:
    Pure functions that both sides of a pipeline boundary, and preflight
    (``megatron_ext/memory.py``), compute alike: :func:`scale_groups` (the shape of the fp16
    scales of a granularity), :func:`_quantized_nbytes` (the wire bytes of ``k`` quantized
    samples), :func:`local_rows` (the tokens of a sample that cross a boundary on this
    rank), :func:`resolve_buffer_dtype` (``--aqsgd-buffer-dtype``), :func:`boundary_sides`
    (the buffers a stage keeps), :func:`warmup_steps` (``--aqsgd-warmup-epochs`` in steps)
    and :func:`_agree_on_fit` (one collective decision at set-up whether the buffers fit).

Why:
    A payload's size must be a pure function of (shape, dtype, bits, which samples were
    visited) so the receiver allocates it before the transfer; preflight estimates memory
    with the same functions without building a codec.

Constraints:
    torch only; torch.distributed only in :func:`_agree_on_fit` (once, at set-up), never
    Megatron. Bad settings raise :class:`~megatron_ext.options.base.ConfigError` naming
    the flag.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from megatron_ext.compressors.quantize import packed_nbytes, scale_shape
from megatron_ext.options.base import ConfigError

__all__ = [
    "boundary_sides",
    "local_rows",
    "resolve_buffer_dtype",
    "scale_groups",
    "warmup_steps",
]

_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def boundary_sides(stage: int, num_stages: int) -> List[str]:
    """The buffers a pipeline stage keeps: "send" unless it is the last stage, "recv" unless
    it is the first (the forward activations of the boundaries it touches)."""
    sides = []
    if stage < num_stages - 1:
        sides.append("send")
    if stage > 0:
        sides.append("recv")
    return sides


def scale_groups(k: int, rows: int, cols: int, granularity: str) -> Tuple[int, ...]:
    """Shape of the fp16 scales of ``k`` quantized ``[rows, cols]`` samples.

    'channel': ``[k, 1, cols]`` (per sample and hidden channel); 'microbatch': ``[1, 1,
    cols]`` (per channel over the ``k`` samples and the sequence: the public AQ-SGD code's
    ``scale_dims=(0, 1)`` of a ``[micro-batch, seq, hidden]`` tensor); 'token': ``[k, rows,
    1]``. A micro-batch scale covers the samples quantized together: all of a DirectQ
    micro-batch or of its gradients, the revisited samples of an AQ-SGD micro-batch."""
    if granularity == "microbatch":
        return (1, 1, cols)
    return (k,) + scale_shape((rows, cols), granularity)


def _quantized_nbytes(k: int, rows: int, cols: int, bits: int, granularity: str) -> int:
    """Wire bytes of ``k`` quantized ``[rows, cols]`` samples: every sample's packed codes
    (padded to a multiple of 8 values) and the fp16 scales (none when ``k`` is 0)."""
    if k == 0:
        return 0
    n = rows * cols
    scales = int(np.prod(scale_groups(k, rows, cols, granularity)))
    return k * packed_nbytes(n + (-n) % 8, bits) + 2 * scales


def warmup_steps(epochs: int, samples: Any) -> int:
    """Steps of a warm-up of ``epochs`` epochs (``--aqsgd-warmup-epochs``).

    An epoch is every fixed sample once: ``num_samples`` (``--fixed-samples`` rounded down
    to a multiple of the data-parallel size) over the global batch (``dp x micro-batch x
    microbatches``). The warm-up lasts ``ceil(epochs x num_samples / global batch)`` steps,
    so every sample has had ``epochs`` full-precision visits when it ends (an epoch that
    ends inside a step finishes with that step).

    Args:
        epochs: warm-up epochs (0: none).
        samples: the :class:`~megatron_ext.methods.registry.SampleSpace` of training
            (its ``train_iters``, when known, must outlast the warm-up).

    Raises:
        ConfigError: naming ``--aqsgd-warmup-epochs`` when epochs are not defined (no
            ``--fixed-samples``) or the warm-up would not end before training does.
    """
    if epochs == 0:
        return 0
    if samples is None or not samples.fixed:
        raise ConfigError(
            ["--aqsgd-warmup-epochs", "--fixed-samples"],
            f"a warm-up of {epochs} epoch(s) counts epochs of the fixed samples; add "
            "--fixed-samples N, or --aqsgd-warmup-epochs 0 to compress from the first step",
        )
    per_step = samples.dp_size * samples.micro_batch_size * samples.num_microbatches
    steps = -(-epochs * samples.num_samples // per_step)
    train_iters = samples.train_iters
    if train_iters is not None and steps >= train_iters:
        raise ConfigError(
            ["--aqsgd-warmup-epochs", "--train-iters"],
            f"a warm-up of {epochs} epoch(s) of {samples.num_samples} fixed samples at "
            f"{per_step} a step lasts {steps} steps, but training has {train_iters}: "
            "nothing would ever be compressed; lower --aqsgd-warmup-epochs or train longer",
        )
    return steps


def local_rows(seq_length: int, config: Any) -> int:
    """Tokens of one sample that cross a pipeline boundary on this rank: megatron-core's
    P2P tensor is ``[seq / context-parallel size (/ tensor-parallel size with sequence
    parallelism), micro batch, hidden]`` (``schedules.get_tensor_shapes``), and with
    context parallelism every rank always holds the same positions of a sample.

    Args:
        seq_length: tokens per sample (``--seq-length``).
        config: the model's ``TransformerConfig`` (read: ``context_parallel_size``,
            ``tensor_model_parallel_size``, ``sequence_parallel``).

    Raises:
        ConfigError: the sequence does not split evenly.
    """
    cp = getattr(config, "context_parallel_size", 1) or 1
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if seq_length % cp:
        raise ConfigError(
            ["--seq-length", "--context-parallel-size"],
            f"aqsgd keeps per-rank shards of each sample; {seq_length} tokens do not split "
            f"over {cp} context-parallel ranks",
        )
    rows = seq_length // cp
    if getattr(config, "sequence_parallel", False):
        if rows % tp:
            raise ConfigError(
                ["--seq-length", "--sequence-parallel"],
                f"{rows} tokens per context-parallel rank do not split over {tp} "
                "tensor-parallel ranks",
            )
        rows //= tp  # the local shard of the sequence
    return rows


def resolve_buffer_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of ``--aqsgd-buffer-dtype name`` for activations of
    ``activation_dtype``: 'auto' stores them in their own dtype (no value of the run is
    out of range or rounded on its first visit)."""
    if name == "auto":
        return activation_dtype
    return _DTYPES[name]


def _agree_on_fit(problem: Optional[Tuple[List[str], str]], group: Any) -> None:
    """One decision for every rank of ``group``: raise on all if the buffers do not fit
    on one (a MIN all-reduce of the fit flag, then the reasons gathered for the message)."""
    if group is None or not torch.distributed.is_initialized():
        if problem is not None:
            raise ConfigError(*problem)
        return
    backend = str(torch.distributed.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    fits = torch.tensor([0 if problem else 1], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(fits, op=torch.distributed.ReduceOp.MIN, group=group)
    if int(fits[0]) == 1:  # once, at start-up
        return
    reasons: List[Any] = [None] * torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank()
    torch.distributed.all_gather_object(reasons, (rank, problem), group=group)
    flags: List[str] = []
    lines = []
    for r, reason in reasons:
        if reason is None:
            continue
        flags += [f for f in reason[0] if f not in flags]
        lines.append(f"rank {r}: {reason[1]}")
    raise ConfigError(
        flags,
        f"the AQ-SGD buffers do not fit on {len(lines)} rank(s), so every rank stops: "
        + "; ".join(lines),
    )
