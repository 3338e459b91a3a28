"""Options of QuantizedAdam (``--quantized-adam-*``): the method's
(``megatron_ext.methods.quantized_adam``) and its momentum exchange's
(``megatron_ext.collectives.quantized_adam``)."""

from __future__ import annotations

from dataclasses import field

from megatron_ext.options.base import arg, check_positive, options_dataclass
from megatron_ext.options.quantized import BITS, check_wire

__all__ = ["QuantizedAdamConfig"]


@options_dataclass(
    group="megatron-ext: QuantizedAdam (--grad-compression quantized-adam)", prefix="quantized-adam"
)
class QuantizedAdamConfig:
    """QuantizedAdam: frozen Adam variance, k-bit momentum exchange with error compensation."""

    bits: int = field(default=4, metadata=arg(choices=BITS))
    """Bits per momentum value on the wire (the AQ-SGD paper's end-to-end runs: 4)."""

    block_size: int = 512
    """Values per fp16 max-abs scale (the authors' bucket of 512)."""

    warmup_steps: int = 1000
    """Applied optimizer steps of dense gradient all-reduce and ordinary Adam before the
    variance is frozen and the momentum is exchanged quantized (at least 1: the frozen
    variance is the one Adam reached; fp16 steps skipped for overflow do not count). The
    authors warm up for one epoch of ten (10% of training); set it to about 10% of
    --train-iters."""

    def __post_init__(self):
        check_wire(type(self), self.bits, self.block_size)
        check_positive(type(self), "warmup_steps", self.warmup_steps)
