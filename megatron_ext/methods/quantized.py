"""Quantized DP exchange (``--grad-compression quantized``): options, factory, registration.

The collective is ``megatron_ext.collectives.quantized`` (all-to-all of k-bit partitions,
server reduction, all-gather, with worker and server error compensation) on
``megatron_ext.compressors.quantize``. It quantizes the raw gradient and leaves megatron's
Adam as it is; the AQ-SGD authors' end-to-end runs use QuantizedAdam instead (frozen Adam
variance, the momentum exchanged: ``--grad-compression quantized-adam``,
``megatron_ext.methods.quantized_adam``), since error compensation on the gradient does not
carry through Adam's variance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_ext.config import ConfigError, arg, check_positive, flag_of
from megatron_ext.methods.registry import Components, Method, MethodContext, register

__all__ = ["QuantizedConfig", "METHOD"]


@dataclass(frozen=True, kw_only=True)
class QuantizedConfig:
    """k-bit quantized gradient exchange with worker and server error compensation."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: quantized gradients (--grad-compression quantized)"
    ARG_PREFIX: ClassVar[str] = "quantized"

    bits: int = field(default=4, metadata=arg(choices=(2, 3, 4, 8)))
    """Bits per gradient value on the wire (the AQ-SGD paper's end-to-end runs: 4)."""

    block_size: int = 256
    """Values per fp16 max-abs scale (rows of the flat bucket)."""

    error_feedback: bool = True
    """Feed each rank's quantization error (worker) and each partition owner's
    re-quantization error (server) back into the next step."""

    rounding: str = field(default="nearest", metadata=arg(choices=("nearest", "stochastic")))
    """Rounding to the quantization grid."""

    def __post_init__(self):
        cls = type(self)
        if self.bits not in (2, 3, 4, 8):
            raise ConfigError(flag_of(cls, "bits"), f"invalid choice {self.bits!r} (2, 3, 4, 8)")
        check_positive(cls, "block_size", self.block_size)


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.quantized import QuantizedReducer

    return Components(reducer=QuantizedReducer(ctx.options))


METHOD = register(
    Method(
        name="quantized",
        family="grad",
        build=_build,
        options=QuantizedConfig,
        summary="k-bit gradients with worker and server error compensation (all-to-all, "
        "all-gather)",
        bench_label=lambda o: f"quantized-{o.bits}bit",
    )
)
