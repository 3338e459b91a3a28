"""PowerSGD's math: orthogonalization and the common initial ``Q``.

What it does:
    One step of PowerSGD (Vogels et al., 2019) on a matrix ``M`` (``n x m``) with a rank-``r``
    starting point ``Q`` (``m x r``): ``P = M Q``, ``P <- orthogonalize(P)``, ``Q = M^T P``,
    ``M_hat = P Q^T``. The two products are all-reduced between the steps by the collective
    (``megatron_ext.collectives.powersgd``); this module holds the local pieces:
    :func:`orthogonalize` (reduced QR) and :func:`initial_q`, the random orthonormal ``Q``
    every rank derives from ``(seed, fqn, step)`` without communicating.

Shapes:
    ``M``: ``(n, m)``; ``P``: ``(n, r)``; ``Q``: ``(m, r)``.

Constraints:
    Pure torch; no torch.distributed, no Megatron. Identical inputs give identical outputs,
    which keeps data-parallel ranks in agreement.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.compressors.seeding import device_generator

__all__ = ["orthogonalize", "initial_q", "compressible", "equal_bytes_rank"]


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR; deterministic for identical input)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


def initial_q(
    seed: int, fqn: str, step: int, cols: int, approx_rank: int, device: Optional[torch.device]
) -> torch.Tensor:
    """The random orthonormal ``Q`` (``cols x approx_rank``) of parameter ``fqn`` at ``step``."""
    # Drawn and orthonormalized on ``device`` (no host-to-device copy when Q is drawn
    # afresh every step, as without warm start); identical to a CPU draw on the CPU.
    device = torch.device(device or "cpu")
    gen = device_generator(device, "powersgd", seed, fqn, step)
    q = torch.randn(cols, approx_rank, generator=gen, device=device)
    return orthogonalize(q)


def compressible(rows: int, cols: int, approx_rank: int, min_compression_rate: float) -> bool:
    """Whether the rank-``approx_rank`` factors are ``min_compression_rate`` times smaller."""
    return (rows + cols) * approx_rank * min_compression_rate <= rows * cols


def equal_bytes_rank(shapes, ratio: float) -> int:
    """One rank for several ``(n, m)`` matrices whose factors send as many numbers as a
    ``ratio``-fold compression: ``sum(n m) / (ratio sum(n + m))``, rounded, at least 1."""
    shapes = list(shapes)
    if not shapes:
        raise ValueError("no matrices")
    numel = sum(n * m for n, m in shapes)
    edges = sum(n + m for n, m in shapes)
    return max(1, int(round(numel / (ratio * edges))))
