"""Options of Radius (``--radius-*``).

Read by the method (``megatron_ext.methods.radius``) and by DiLoCo's top-k outer exchange
(``megatron_ext.collectives.outer_exchange``); a leaf module, so that the collective need not
import the method registry.

Constraints:
    No torch, no Megatron, no method registry: parsing flags must not need them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_ext.options.base import ConfigError, check_positive, flag_of

__all__ = ["RadiusConfig"]


@dataclass(frozen=True, kw_only=True)
class RadiusConfig:
    """Radius: top-k gradient sparsity with indices reused for T steps, all-reduced densely."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: Radius (--grad-compression radius)"
    ARG_PREFIX: ClassVar[str] = "radius"

    density: float = 0.4
    """Fraction of each weight's entries kept (paper: 0.4-0.5); biases and other 1-D
    parameters are always reduced densely."""

    interval: int = 200
    """Every this many steps (T) the residual is added back, the gradient is all-reduced
    densely and the top-k indices are chosen again (paper: 200)."""

    dense_steps: int = 0
    """Dense all-reduce for the first this many steps (paper: 15-20% of training); the
    sparse phase starts at this step with a dense reselection step."""

    def __post_init__(self):
        cls = type(self)
        if not 0.0 < self.density <= 1.0:
            raise ConfigError(flag_of(cls, "density"), f"must be in (0, 1], got {self.density}")
        check_positive(cls, "interval", self.interval)
        check_positive(cls, "dense_steps", self.dense_steps, allow_zero=True)
