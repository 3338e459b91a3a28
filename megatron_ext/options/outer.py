"""The outer exchanges of DiLoCo (``--outer-compression``) and the options each one reads.

What: :data:`OUTER_EXCHANGES` names the exchanges ``megatron_ext.optim.diloco`` builds; every
one but ``none`` compresses the pseudo-gradient the way that data-parallel method compresses a
gradient, with that method's options dataclass (:data:`OUTER_EXCHANGE_OPTIONS`).

Why a leaf module: the option check of ``--outer-compression`` (``megatron_ext.methods.diloco``)
runs while flags are parsed, before torch is imported, and the exchange itself
(``megatron_ext.collectives.outer_exchange``) must not import the method registry.
"""

from __future__ import annotations

from typing import Dict, Tuple

from megatron_ext.options.powersgd import PowerSGDConfig
from megatron_ext.options.quantized import QuantizedConfig
from megatron_ext.options.radius import RadiusConfig
from megatron_ext.options.separate import SeparateConfig

__all__ = ["OUTER_EXCHANGES", "OUTER_EXCHANGE_OPTIONS"]

OUTER_EXCHANGES: Tuple[str, ...] = ("none", "quantized", "radius", "separate", "powersgd")
"""Names ``megatron_ext.optim.diloco.make_outer_exchange`` builds (``--outer-compression``):
``none`` is the dense all-reduce; the others are
``megatron_ext.collectives.outer_exchange.OuterExchange`` with that data-parallel method's
compression."""

OUTER_EXCHANGE_OPTIONS: Dict[str, type] = {
    "quantized": QuantizedConfig,
    "radius": RadiusConfig,
    "separate": SeparateConfig,
    "powersgd": PowerSGDConfig,
}
"""The options dataclass of each compressed outer exchange (its data-parallel method's)."""
