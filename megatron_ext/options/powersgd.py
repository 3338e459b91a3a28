"""Options of PowerSGD (``--powersgd-*``): the method's (``megatron_ext.methods.powersgd``)
and DiLoCo's PowerSGD outer exchange's."""

from __future__ import annotations

from megatron_ext.options.base import ConfigError, check_positive, flag_of, options_dataclass

__all__ = ["PowerSGDConfig"]


@options_dataclass(group="megatron-ext: PowerSGD (--grad-compression powersgd)", prefix="powersgd")
class PowerSGDConfig:
    """PowerSGD (PyTorch's powerSGD_hook algorithm), the standard peer baseline."""

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
