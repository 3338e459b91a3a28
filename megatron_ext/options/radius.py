"""Options of Radius (``--radius-*``): the method's (``megatron_ext.methods.radius``) and
DiLoCo's top-k outer exchange's."""

from __future__ import annotations

from megatron_ext.options.base import ConfigError, check_positive, flag_of, options_dataclass

__all__ = ["RadiusConfig"]


@options_dataclass(group="megatron-ext: Radius (--grad-compression radius)", prefix="radius")
class RadiusConfig:
    """Radius: top-k gradient sparsity with indices reused for T steps, all-reduced densely."""

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
