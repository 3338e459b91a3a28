"""PowerSGD (``--grad-compression powersgd``), the peer baseline: options, factory, registration.

The algorithm is ``megatron_ext.collectives.powersgd`` (two all-reduces per bucket) on
``megatron_ext.compressors.lowrank``.

Its options: :class:`~megatron_ext.options.powersgd.PowerSGDConfig`.
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
from megatron_ext.options.powersgd import PowerSGDConfig

__all__ = ["PowerSGDConfig", "METHOD"]


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.powersgd import PowerSGDReducer

    return Components(reducer=PowerSGDReducer(ctx.options))


def _bench_defaults(bench: BenchContext) -> Dict[str, Any]:
    from megatron_ext.compressors.lowrank import equal_bytes_rank

    out: Dict[str, Any] = {"start_step": 30}
    ratio = bench.resolve("separate", "ratio")
    if bench.matrix_shapes and ratio:
        # The rank that sends about as many bytes as SEPARATE at its ratio (equal-bytes peer).
        out["approx_rank"] = equal_bytes_rank(bench.matrix_shapes, ratio)
    return out


METHOD = register(
    Method(
        name="powersgd",
        family="grad",
        build=_build,
        options=PowerSGDConfig,
        summary="PyTorch's PowerSGD (rank-r factors, two all-reduces, error feedback)",
        bench_defaults=_bench_defaults,
        bench_label=lambda o: f"powersgd-r{o.approx_rank}",
    )
)
