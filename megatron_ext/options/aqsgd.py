"""Options of AQ-SGD and DirectQ (``--aqsgd-*``): the methods'
(``megatron_ext.methods.aqsgd``) and their codecs' (``megatron_ext.collectives.aqsgd``)."""

from __future__ import annotations

from dataclasses import field
from typing import Optional

from megatron_ext.options.base import ConfigError, arg, check_positive, flag_of, options_dataclass

__all__ = ["AQSGDConfig"]

_BITS = (2, 3, 4, 5, 6, 7, 8)
"""Widths on the wire: 2-8 bits (the paper uses fw 2/3/4 and bw 4/6/8; 1 bit would keep only
the sign)."""


@options_dataclass(
    group="megatron-ext: AQ-SGD / DirectQ (--p2p-compression aqsgd|directq)", prefix="aqsgd"
)
class AQSGDConfig:
    """AQ-SGD: pipeline activations as quantized deltas against per-sample buffers."""

    fw_bits: int = field(default=4, metadata=arg(choices=_BITS))
    """Bits per value of the forward activations (AQ-SGD: of their change since the
    sample's last visit; DirectQ: of the activations themselves)."""

    bw_bits: int = field(default=8, metadata=arg(choices=_BITS))
    """Bits per value of the activation gradients sent backward (directly quantized)."""

    granularity: str = field(
        default="channel", metadata=arg(choices=("channel", "microbatch", "token"))
    )
    """Scope of one fp16 max-abs scale: 'channel' (default), one per sample and hidden
    channel over the sequence; 'microbatch', one per hidden channel over the sequence and
    every sample of the micro-batch (the public AQ-SGD code: scale_dims (0,1) of a
    [micro-batch, seq, hidden] tensor; the paper ran micro-batch 1, where both are the
    same); 'token', one per token over the hidden channels. 'channel' is the default: at
    micro-batch 1 it is the authors' scale, and at larger micro-batches a sample's scale
    is not set by another sample's outliers, for micro-batch times the scale bytes (2
    bytes per channel and sample: 16 / (seq x bits) of the codes, 3.1% at seq 128 and 4
    bits)."""

    rounding: str = field(default="nearest", metadata=arg(choices=("nearest", "stochastic")))
    """Rounding to the quantization grid: 'nearest' (the public code) or 'stochastic'
    (unbiased inside the representable range)."""

    buffer: str = field(default="device", metadata=arg(choices=("device", "host", "disk")))
    """Where the per-sample activation buffers live: device memory, host memory (read
    ahead of the microbatch that needs them, through pinned staging memory) or a
    memory-mapped file per rank and boundary side under --aqsgd-buffer-dir."""

    buffer_dir: Optional[str] = None
    """Directory of the memory-mapped buffer files (--aqsgd-buffer disk)."""

    buffer_dtype: str = field(
        default="auto", metadata=arg(choices=("auto", "fp16", "bf16", "fp32"))
    )
    """Storage dtype of the buffers. 'auto' (default): the dtype of the activations sent
    (bf16 runs: bf16, fp16 runs: fp16, fp32 runs: fp32), so a first visit is stored
    exactly and no activation is out of the buffer's range. The public code stores fp16:
    half the memory of fp32 buffers in an fp32 run, but a bf16 or fp32 activation beyond
    65504 does not fit fp16; such values are stored clamped to the range (with a warning
    once; the values sent stay exact and later deltas carry the difference), never as
    inf."""

    checkpoint_buffers: bool = False
    """Save the buffers and visit flags in checkpoints, so a resumed run continues
    bit-exactly. Off by default: the buffers hold samples x sequence x hidden values per
    boundary (about 1 TB for GPT2-XL in the paper); a resumed run then rebuilds them, every
    sample starting again with a full-precision first visit (stale buffers are never
    reused)."""

    warmup_epochs: int = 1
    """Epochs trained uncompressed first (the authors' --warmup-epochs, default 1): forward
    activations, activation gradients and the data-parallel gradient exchange (any
    --grad-compression) travel in full precision, and AQ-SGD's buffers are filled with the
    exact activations. An epoch is --fixed-samples over --global-batch-size: the warm-up
    lasts ceil(N x fixed samples / global batch) steps. Needs --fixed-samples (DirectQ
    too) and fewer steps than --train-iters. 0: compress from the first step."""

    seed: int = 0
    """Seed of stochastic rounding (derived per step, microbatch, direction and stage)."""

    def __post_init__(self):
        cls = type(self)
        for name in ("fw_bits", "bw_bits"):
            value = getattr(self, name)
            if value not in _BITS:
                raise ConfigError(
                    flag_of(cls, name), f"invalid choice {value!r} (choose from 2 to 8)"
                )
        check_positive(cls, "seed", self.seed, allow_zero=True)
        check_positive(cls, "warmup_epochs", self.warmup_epochs, allow_zero=True)
        if self.buffer == "disk" and not self.buffer_dir:
            raise ConfigError(
                [flag_of(cls, "buffer"), flag_of(cls, "buffer_dir")],
                "disk buffers need a directory (--aqsgd-buffer-dir)",
            )
