"""Options of the quantized gradient exchange (``--quantized-*``).

Read by the method (``megatron_ext.methods.quantized``), by QuantizedAdam's momentum exchange
(``megatron_ext.collectives.quantized_adam``) and by DiLoCo's quantized outer exchange
(``megatron_ext.collectives.outer_exchange``); a leaf module, so that those collectives need
not import the method registry.

Constraints:
    No torch, no Megatron, no method registry: parsing flags must not need them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_ext.options.base import ConfigError, arg, check_positive, flag_of

__all__ = ["QuantizedConfig"]


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
