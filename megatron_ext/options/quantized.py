"""Options of the quantized gradient exchange (``--quantized-*``): the method's
(``megatron_ext.methods.quantized``), QuantizedAdam's momentum exchange's (through
``megatron_ext.collectives.quantized_adam``) and DiLoCo's quantized outer exchange's.

:data:`BITS` and :func:`check_wire` serve every options class whose values travel through
the quantized collective (``megatron_ext.collectives.quantized``): this one and
``megatron_ext.options.quantized_adam.QuantizedAdamConfig``.
"""

from __future__ import annotations

from dataclasses import field

from megatron_ext.options.base import ConfigError, arg, check_positive, flag_of, options_dataclass

__all__ = ["BITS", "QuantizedConfig", "check_wire"]

BITS = (2, 3, 4, 8)
"""Bit widths the quantized collective packs."""


def check_wire(cls: type, bits: int, block_size: int) -> None:
    """Refuse, naming the flag of ``cls``'s field, ``bits`` not in :data:`BITS` or a
    ``block_size`` below 1."""
    if bits not in BITS:
        raise ConfigError(
            flag_of(cls, "bits"), f"invalid choice {bits!r} ({', '.join(map(str, BITS))})"
        )
    check_positive(cls, "block_size", block_size)


@options_dataclass(
    group="megatron-ext: quantized gradients (--grad-compression quantized)", prefix="quantized"
)
class QuantizedConfig:
    """k-bit quantized gradient exchange with worker and server error compensation."""

    bits: int = field(default=4, metadata=arg(choices=BITS))
    """Bits per gradient value on the wire (the AQ-SGD paper's end-to-end runs: 4)."""

    block_size: int = 256
    """Values per fp16 max-abs scale (rows of the flat bucket)."""

    error_feedback: bool = True
    """Feed each rank's quantization error (worker) and each partition owner's
    re-quantization error (server) back into the next step."""

    rounding: str = field(default="nearest", metadata=arg(choices=("nearest", "stochastic")))
    """Rounding to the quantization grid."""

    def __post_init__(self):
        check_wire(type(self), self.bits, self.block_size)
