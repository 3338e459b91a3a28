"""Radius (``--grad-compression radius``): options, factory and registration.

The algorithm is ``megatron_ext.collectives.radius`` (a gradient reducer and the optimizer
hook that selects its entries from AdamW's moments) on ``megatron_ext.compressors.topk``.

Its options: :class:`~megatron_ext.options.radius.RadiusConfig`.
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_ext.methods.registry import (
    BenchContext,
    Components,
    Method,
    MethodContext,
    register,
)
from megatron_ext.options.radius import RadiusConfig

__all__ = ["RadiusConfig", "METHOD"]


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
