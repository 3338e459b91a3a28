"""Options of SEPARATE (``--separate-*``): the method's (``megatron_ext.methods.separate``)
and DiLoCo's separate outer exchange's."""

from __future__ import annotations

from dataclasses import field
from typing import Optional

from megatron_ext.options.base import ConfigError, arg, check_positive, flag_of, options_dataclass

__all__ = ["SeparateConfig"]


@options_dataclass(group="megatron-ext: SEPARATE (--grad-compression separate)", prefix="separate")
class SeparateConfig:
    """SEPARATE: common random projection of gradients with moving-average error feedback."""

    ratio: int = 16
    """Compression ratio: each block of --separate-block-size gradient entries is sent as
    block-size / ratio random projections (paper: 16; 8-128 tested). Must divide the block
    size."""

    block_size: int = 256
    """Entries per projection block. The flat gradient bucket is viewed as rows of this
    length, all projected by one shared Gaussian block; the estimator's variance depends on
    the ratio only, while the cost per entry grows with block_size / ratio (see the kernel
    benchmark)."""

    ef_beta: Optional[float] = None
    """Moving-average factor of the error feedback, e <- (1-beta) e + beta (h - local
    estimate of h), reset to zero every --separate-reset-interval steps; 0 disables it.
    Default 1/ratio. The paper writes the same average as e <- b e + (1-b)(h - estimate),
    so its b is 1 - beta here: the default is the paper's b = 1 - 1/ratio (0.94 at ratio
    16, beside its 0.95). Bounded only for beta < 2/ratio, the paper's b > 1 - 2/ratio (its
    b < 0.80 diverging at ratio 16; measured, gpt-tiny ratio 16, 300 steps: beta 0.95 (b
    0.05) -> NaN at step ~40, 0.1 -> loss 6.19, 1/16 -> 6.06, 0 -> 6.21; dense 5.52).
    Values >= 2/ratio are refused."""

    reset_interval: int = 128
    """Reset the error-feedback buffer to zero every this many steps (paper: 128)."""

    refresh_interval: int = 1
    """Steps one random projection is used for: 1 draws a fresh one every step (the
    paper's Algorithm 1, "generate fresh i.i.d. common random Gaussian vectors"); N reuses
    each draw for N steps; 0 reuses it until the next error reset (a reading of the
    paper's Algorithm 2, which keeps a buffer of random variables). Measured in
    docs/methods/separate.md."""

    blocks: str = field(default="bucket", metadata=arg(choices=("bucket", "layer")))
    """How gradients are cut into projected rows: bucket views each flat gradient bucket as
    rows of --separate-block-size entries sharing one projection (rows may span two
    parameters); layer projects every weight matrix on its own, row by row (rows = the
    matrix's rows, block = its row length, one projection per parameter name: the paper's
    per-layer hooks). The ratio must divide every row length."""

    seed: int = 42
    """Seed of the common random projections (derived with the step and the bucket name, so
    every rank builds the same matrix without communicating and a restart reproduces it)."""

    adaptive: bool = False
    """G-SEPARATE: adapt the compression ratio and beta per parameter every
    --separate-adapt-interval steps from the cosine similarity between the compressed and
    the dense averaged gradient (measured with one dense all-reduce at those steps); beta
    stays within [0.5, 1.5] / ratio."""

    adapt_interval: int = 2000
    """Steps between G-SEPARATE adaptations (paper: 2000)."""

    min_ratio: int = 4
    """Smallest compression ratio G-SEPARATE may choose."""

    max_ratio: int = 64
    """Largest compression ratio G-SEPARATE may choose."""

    def __post_init__(self):
        cls = type(self)
        for name in ("ratio", "block_size", "reset_interval", "adapt_interval"):
            check_positive(cls, name, getattr(self, name))
        check_positive(cls, "refresh_interval", self.refresh_interval, allow_zero=True)
        if self.adaptive and self.blocks == "layer":
            raise ConfigError(
                [flag_of(cls, "adaptive"), flag_of(cls, "blocks")],
                "G-SEPARATE adapts ratios within --separate-block-size blocks; use "
                "--separate-blocks bucket with --separate-adaptive",
            )
        if self.block_size % self.ratio:
            raise ConfigError(
                [flag_of(cls, "ratio"), flag_of(cls, "block_size")],
                f"ratio {self.ratio} must divide the block size {self.block_size}",
            )
        if self.ef_beta is not None:
            if not 0.0 <= self.ef_beta <= 1.0:
                raise ConfigError(flag_of(cls, "ef_beta"), f"must be in [0, 1], got {self.ef_beta}")
            if self.ef_beta >= 2.0 / self.ratio:
                raise ConfigError(
                    [flag_of(cls, "ef_beta"), flag_of(cls, "ratio")],
                    f"beta {self.ef_beta} >= 2/ratio = {2.0 / self.ratio:.4g}: the error "
                    "feedback of an unbiased projection grows without bound (it diverged "
                    "to NaN in our runs); use a smaller beta, e.g. the default 1/ratio. This "
                    "flag is the paper's 1 - beta: its beta 0.95 is --separate-ef-beta 0.05",
                )
        if self.adaptive:
            if not (1 <= self.min_ratio <= self.ratio <= self.max_ratio):
                raise ConfigError(
                    [flag_of(cls, "min_ratio"), flag_of(cls, "ratio"), flag_of(cls, "max_ratio")],
                    "need min ratio <= ratio <= max ratio",
                )
            if self.block_size % self.max_ratio:
                raise ConfigError(
                    [flag_of(cls, "max_ratio"), flag_of(cls, "block_size")],
                    "the largest ratio must divide the block size",
                )

    @property
    def beta_scale(self) -> float:
        """beta * ratio: the error-feedback factor relative to its stability bound 2/ratio."""
        return 1.0 if self.ef_beta is None else self.ef_beta * self.ratio
