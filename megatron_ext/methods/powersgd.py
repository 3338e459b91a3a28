"""PowerSGD (``--grad-compression powersgd``), the peer baseline: options, factory, registration.

The algorithm is ``megatron_ext.collectives.powersgd`` (two all-reduces per bucket) on
``megatron_ext.compressors.lowrank``.
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

__all__ = ["PowerSGDConfig", "METHOD"]


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """PowerSGD (PyTorch's powerSGD_hook algorithm), the standard peer baseline."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: PowerSGD (--grad-compression powersgd)"
    ARG_PREFIX: ClassVar[str] = "powersgd"

    approx_rank: int = 4
    """Rank of the low-rank approximation of each weight gradient (PyTorch's
    matrix_approximation_rank)."""

    start_step: int = 10
    """Dense all-reduce before this step (PyTorch's start_powerSGD_iter)."""

    min_compression_rate: float = 2.0
    """Compress a matrix only if (rows + cols) * rank is at least this many times smaller
    than rows * cols; others are reduced densely."""

    warm_start: bool = True
    """Reuse the previous step's Q as the starting point of the power iteration."""

    error_feedback: bool = True
    """Add the previous step's approximation error to the gradient before compressing."""

    seed: int = 0
    """Seed of the initial random Q (identical on every rank)."""

    def __post_init__(self):
        cls = type(self)
        check_positive(cls, "approx_rank", self.approx_rank)
        check_positive(cls, "start_step", self.start_step, allow_zero=True)
        if self.min_compression_rate < 1.0:
            raise ConfigError(flag_of(cls, "min_compression_rate"), "must be >= 1")


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
