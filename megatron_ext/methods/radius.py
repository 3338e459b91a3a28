"""Radius (``--grad-compression radius``): options, factory and registration.

The algorithm is ``megatron_ext.collectives.radius`` (a gradient reducer and the optimizer
hook that selects its entries from AdamW's moments) on ``megatron_ext.compressors.topk``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict

from megatron_ext.config import ConfigError, check_positive, flag_of
from megatron_ext.methods.registry import (
    BenchContext,
    Components,
    Method,
    MethodContext,
    register,
)

__all__ = ["RadiusConfig", "METHOD"]


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


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.radius import RadiusOptimizerHook, RadiusReducer

    reducer = RadiusReducer(ctx.options)
    return Components(reducer=reducer, optimizer_hooks=[RadiusOptimizerHook(reducer)])


def _bench_defaults(bench: BenchContext) -> Dict[str, Any]:
    # The paper's dense warm-up (15-20% of training) and a reselection interval that
    # reselects several times within a benchmark run.
    return {"interval": 50, "dense_steps": max(1, int(round(0.2 * bench.iters)))}


METHOD = register(
    Method(
        name="radius",
        family="grad",
        build=_build,
        options=RadiusConfig,
        summary="top-k entries chosen from AdamW's update direction, reused for T steps",
        bench_defaults=_bench_defaults,
        bench_label=lambda o: f"radius-{o.density:g}",
    )
)
