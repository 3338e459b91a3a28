"""AQ-SGD and DirectQ (``--p2p-compression aqsgd|directq``): options, factory, registration.

The codecs are ``megatron_ext.collectives.aqsgd`` (quantized per-sample activation deltas
with their buffers; direct quantization) on ``megatron_ext.compressors.quantize`` (the
quantizer and the bit packing). Both methods take the ``--aqsgd-*`` options; DirectQ uses
the bit widths, scales and rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megatron_ext.config import ConfigError, arg, check_positive, flag_of
from megatron_ext.methods.registry import Components, Method, MethodContext, register

__all__ = ["AQSGDConfig", "METHOD", "DIRECTQ"]

_BITS = (2, 3, 4, 5, 6, 7, 8)
"""Widths on the wire: 2-8 bits (the paper uses fw 2/3/4 and bw 4/6/8; 1 bit would keep only
the sign)."""


@dataclass(frozen=True, kw_only=True)
class AQSGDConfig:
    """AQ-SGD: pipeline activations as quantized deltas against per-sample buffers."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: AQ-SGD / DirectQ (--p2p-compression aqsgd|directq)"
    ARG_PREFIX: ClassVar[str] = "aqsgd"

    fw_bits: int = field(default=4, metadata=arg(choices=_BITS))
    """Bits per value of the forward activations (AQ-SGD: of their change since the
    sample's last visit; DirectQ: of the activations themselves)."""

    bw_bits: int = field(default=8, metadata=arg(choices=_BITS))
    """Bits per value of the activation gradients sent backward (directly quantized)."""

    granularity: str = field(default="channel", metadata=arg(choices=("channel", "token")))
    """Scope of one fp16 max-abs scale: 'channel', one per sample and hidden channel over
    the sequence (the public AQ-SGD code's choice); 'token', one per token over the hidden
    channels."""

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
        if self.buffer == "disk" and not self.buffer_dir:
            raise ConfigError(
                [flag_of(cls, "buffer"), flag_of(cls, "buffer_dir")],
                "disk buffers need a directory (--aqsgd-buffer-dir)",
            )


def _build_aqsgd(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.aqsgd import AQSGDCodec

    codec = AQSGDCodec(ctx.options, ctx)

    def setup():
        from megatron_ext.megatron.memory import pending_optimizer_state_nbytes

        # Adam's moments (and a precision-aware optimizer's fp32 master weights) appear at
        # the first step, after the buffers: the fit check keeps room for them.
        codec.setup(reserve_nbytes=pending_optimizer_state_nbytes(ctx.handles.optimizer))

    return Components(codec=codec, on_install=setup)


def _build_directq(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.aqsgd import DirectQCodec

    codec = DirectQCodec(ctx.options, ctx)

    def setup():
        import torch

        codec.stage = torch.distributed.get_rank(ctx.groups.pp)

    return Components(codec=codec, on_install=setup)


METHOD = register(
    Method(
        name="aqsgd",
        family="p2p",
        build=_build_aqsgd,
        options=AQSGDConfig,
        summary="quantized change of each sample's activation since its last visit, "
        "quantized activation gradients",
        bench_label=lambda o: f"aqsgd-fw{o.fw_bits}bw{o.bw_bits}",
    )
)

DIRECTQ = register(
    Method(
        name="directq",
        family="p2p",
        build=_build_directq,
        options=AQSGDConfig,
        summary="quantized activations and activation gradients (the AQ-SGD paper's baseline)",
        bench_label=lambda o: f"directq-fw{o.fw_bits}bw{o.bw_bits}",
    )
)
