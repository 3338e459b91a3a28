"""SEPARATE's math: block-wise common Gaussian projection, reconstruction, error feedback.

What it does:
    A gradient vector ``h`` of ``R * c`` entries is viewed as ``R`` rows of length ``c``
    (the block size). One Gaussian matrix ``Omega`` of shape ``(c, k)`` with ``k = c /
    ratio``, the same for every row and every rank, projects the rows:
    ``P = H @ Omega`` (``R x k`` numbers travel instead of ``R x c``), and
    ``H_hat = P @ Omega^T / k`` reconstructs them. Since ``E[Omega Omega^T] = k I`` the
    estimate is unbiased; its variance, ``E|H_hat - H|^2 = (c + 1) / k |H|^2 ~= ratio
    |H|^2``, depends on the ratio, not on the block size, while the cost is ``c / ratio``
    multiply-adds per entry and per matmul (docs/methods/separate.md, "Block size").

    ``Omega`` is a pure function of ``(seed, step, key, c, k)`` (:func:`projection_block`),
    generated on CPU with a seeded ``torch.Generator`` and then moved, so every rank and
    every restart builds it bit-identically without communicating.

    The error feedback of the paper (``e <- (1 - beta) e + beta (h - Omega Omega^T h / k)``,
    reset to zero every ``T`` steps) is :func:`update_error`.

Constraints:
    Pure torch; no torch.distributed, no Megatron.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_ext.compressors.seeding import device_generator

# The reconstruction is the eager reference of the fused decompression; it lives beside it
# (megatron_ext.kernels.separate), and is part of this module's API.
from megatron_ext.kernels.separate import reconstruct

__all__ = [
    "projection_block",
    "project",
    "reconstruct",
    "update_error",
    "random_projection_cosine",
]


def projection_block(
    seed: int,
    step: int,
    key: str,
    block_size: int,
    num_projections: int,
    *,
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float32,
    orthonormal: bool = True,
) -> torch.Tensor:
    """The common random block ``Omega`` of shape ``(block_size, num_projections)``.

    Args:
        seed: user seed (``--separate-seed``).
        step: training step (a fresh matrix every step).
        key: stable name of what is projected (bucket and segment).
        block_size: ``c``.
        num_projections: ``k = c / ratio``.
        device: where the block is drawn and orthonormalized (a generator on that device:
            no host-to-device copy per step). Ranks on the same kind of device draw the same
            block; a CPU block and a CUDA block differ (the reducer checks at install that
            the ranks agree).
        dtype: result dtype.
        orthonormal: orthonormalize the Gaussian columns (QR) and scale them by
            ``sqrt(k)``; otherwise plain i.i.d. N(0, 1) entries.

    Returns:
        ``Omega`` with ``E[Omega Omega^T] = k I``.
    """
    device = torch.device(device or "cpu")
    gen = device_generator(device, "separate", seed, step, key, block_size, num_projections)
    omega = torch.randn(
        block_size, num_projections, generator=gen, dtype=torch.float64, device=device
    )
    if orthonormal:
        # Orthonormal columns scaled by sqrt(c): Omega Omega^T / k = (c/k) Q Q^T. Still
        # unbiased (E[Q Q^T] = k/c I), exact at ratio 1, and its variance is (ratio - 1)
        # |h|^2 instead of the Gaussian's (c + 1) / k |h|^2. QR in float64 (a c x k matrix).
        omega = torch.linalg.qr(omega, mode="reduced")[0] * math.sqrt(block_size)
    return omega.to(dtype=dtype)


def project(h: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``P = H @ Omega``: ``(R, c) x (c, k) -> (R, k)``."""
    return h @ omega


def update_error(
    error: torch.Tensor, h: torch.Tensor, local_estimate: torch.Tensor, beta: float, reset: bool
) -> None:
    """In place: ``e <- (1 - beta) e + beta (h - local_estimate)``, or ``e <- 0`` on reset."""
    if reset:
        error.zero_()
        return
    error.mul_(1.0 - beta).add_(h - local_estimate, alpha=beta)


def random_projection_cosine(ratio: float) -> float:
    """Expected cosine between ``h`` and its unbiased projection estimate, ``1/sqrt(1+ratio)``.

    ``|H_hat|^2 ~= (1 + ratio) |h|^2`` while ``<H_hat, h> ~= |h|^2``; G-SEPARATE compares
    measured cosines against this reference (what a projection achieves with no error
    feedback at all).
    """
    return 1.0 / math.sqrt(1.0 + ratio)
