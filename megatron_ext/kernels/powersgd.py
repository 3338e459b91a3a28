"""PowerSGD's fused kernels around its batched matmuls: ``M = G + E`` and ``P = M Q``;
``M_hat = P Q^T``, ``E = M - M_hat`` and the write-back.

What it does:
    For a bucket's compressed weight matrices, grouped by shape into batches of ``B``
    matrices ``rows x cols`` and packed batch after batch (their places in the bucket as
    :class:`~megatron_ext.kernels.packing.Runs`; ``M`` and the error are one flat fp32
    buffer of the bucket, viewed ``[B, rows, cols]`` per batch):

    * ``megatron_ext::powersgd_compress`` returns ``M = pack(G) + E`` (``E`` the error, or
      no error), ``P = M Q`` per batch (``[B, rows, r]``) and whether ``M`` holds a NaN
      or an Inf (0-d bool, the payload's input flag);
    * ``megatron_ext::powersgd_decompress`` computes ``M_hat = P Q^T`` (``P`` orthogonalized
      and ``Q`` all-reduced by the caller), writes it into the bucket's matrices with the
      bucket's dtype and, with error feedback, turns ``M`` into the new error in place:
      ``M <- M - share * M_hat`` (``share`` is 1/W under SUM, 1 under AVG:
      ``megatron_ext/collectives/powersgd.py``).

    The second round's ``Q = M^T P`` and the QR factorizations stay with the reducer, between
    its two all-reduces. One op per bucket (not per batch) reads the bucket once: the
    number of batches (shapes) is a loop inside the kernel. Both ops are ``torch.library`` custom ops whose bodies run the
    pure functions below compiled or eager (:func:`megatron_ext.kernels.run`).

Numerics:
    Eager, the same ops in the same order as the reducer ran before (bit-identical).
    Compiled, inductor may contract ``M - share * M_hat`` into one rounding (a few ulps
    of fp32; ``tests/unit/test_kernels_dp.py``).

Constraints:
    Pure torch; no torch.distributed, no Megatron.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_ext.kernels import define_op
from megatron_ext.kernels.finite import nonfinite
from megatron_ext.kernels.packing import gather, scatter_

__all__ = ["powersgd_compress", "powersgd_decompress"]


def _total(dims: List[int]) -> int:
    """Elements of a bucket's packed matrices: the sum of ``B * rows * cols`` over batches."""
    return sum(dims[i] * dims[i + 1] * dims[i + 2] for i in range(0, len(dims), 3))


def _views(flat: torch.Tensor, dims: List[int]) -> List[torch.Tensor]:
    """``[B, rows, cols]`` views of each batch of a bucket's packed buffer."""
    out, offset = [], 0
    for i in range(0, len(dims), 3):
        batch, rows, cols = dims[i], dims[i + 1], dims[i + 2]
        out.append(flat[offset : offset + batch * rows * cols].view(batch, rows, cols))
        offset += batch * rows * cols
    return out


def _compress(
    grad: torch.Tensor,
    error: torch.Tensor,
    qs: List[torch.Tensor],
    table: torch.Tensor,
    chunk: int,
    starts: List[int],
    offsets: List[int],
    numels: List[int],
    dims: List[int],
) -> Tuple[torch.Tensor, List[torch.Tensor], torch.Tensor]:
    """``(M, [P per batch], non-finite)`` of a bucket's matrices (module docstring).

    Args:
        grad: the flat bucket (any float dtype).
        error: the packed error (fp32, ``M``'s size), or an empty tensor without error
            feedback.
        qs: ``[B, cols, r]`` fp32 per batch.
        table, chunk, starts, offsets, numels: the matrices'
            :class:`~megatron_ext.kernels.packing.Runs`, batch after batch.
        dims: ``(B, rows, cols)`` of each batch, flattened.
    """
    total = _total(dims)
    m = gather(grad, total, total, table, chunk, starts, offsets, numels)
    if error.numel():
        m.add_(error)
    ps = [torch.bmm(mv, q) for mv, q in zip(_views(m, dims), qs)]
    return m, ps, nonfinite(m)


powersgd_compress = define_op("megatron_ext::powersgd_compress", _compress)


@powersgd_compress.register_fake
def _(grad, error, qs, table, chunk, starts, offsets, numels, dims):
    m = grad.new_empty(_total(dims), dtype=torch.float32)
    ps = [q.new_empty(dims[3 * i], dims[3 * i + 1], q.shape[2]) for i, q in enumerate(qs)]
    return m, ps, grad.new_empty((), dtype=torch.bool)


def _decompress(
    m: torch.Tensor,
    ps: List[torch.Tensor],
    qs: List[torch.Tensor],
    share: float,
    error_feedback: bool,
    grad: torch.Tensor,
    table: torch.Tensor,
    chunk: int,
    starts: List[int],
    offsets: List[int],
    numels: List[int],
    dims: List[int],
) -> None:
    """Write ``P Q^T`` into the bucket; with ``error_feedback`` ``M -= share * P Q^T``.

    Args:
        m: the packed ``M`` from :func:`powersgd_compress` (becomes the new error in place).
        ps: ``[B, rows, r]`` orthogonalized, per batch.
        qs: ``[B, cols, r]`` all-reduced, per batch.
        share: a rank's share of the reduced value (1/W under SUM, 1 under AVG).
        error_feedback: update ``m`` (False: ``m`` is left as it is).
        grad: the flat bucket, written in place.
        table, chunk, starts, offsets, numels, dims: as :func:`powersgd_compress`'s.
    """
    approx = torch.empty_like(m)
    for out, p, q in zip(_views(approx, dims), ps, qs):
        torch.bmm(p, q.transpose(1, 2), out=out)
    if error_feedback:
        m.sub_(share * approx)
    scatter_(grad, approx, 0, 0, m.numel(), table, chunk, (starts, offsets, numels))


powersgd_decompress = define_op(
    "megatron_ext::powersgd_decompress", _decompress, mutates_args=("m", "grad")
)


@powersgd_decompress.register_fake
def _(m, ps, qs, share, error_feedback, grad, table, chunk, starts, offsets, numels, dims):
    return None
