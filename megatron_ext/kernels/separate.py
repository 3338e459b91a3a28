"""SEPARATE's fused kernels: compress (pack, add the error, project, stage the new error)
and decompress (reconstruct, write back into the bucket).

What it does:
    ``megatron_ext::separate_compress`` takes one segment of a bucket (its weight matrices
    as :class:`~megatron_ext.kernels.packing.Runs`) with the segment's error ``e``
    (``[rows, block]`` fp32) and projection ``Omega`` (``[block, k]``) and returns

    * ``P = H Omega`` (``[rows, k]`` fp32), ``H = pack(g) + e``;
    * whether ``H`` holds a NaN or an Inf (0-d bool; the payload's input flag);
    * with ``stage``: the error the step commits if it is applied,
      ``(1 - beta) e + beta (H - P Omega^T / k)``, zero past the packed elements (else an
      empty tensor: an error reset, or beta 0).

    ``megatron_ext::separate_decompress`` writes ``P Omega^T / k`` of the all-reduced
    coefficients into the bucket's matrices (those in a bucket range with the distributed
    optimizer), cast to the bucket's dtype.

    Both are ``torch.library`` custom ops (one op with its own inputs and outputs for the
    strict-device recorder and the cost model) whose bodies run the pure functions below
    compiled or eager (:func:`megatron_ext.kernels.run`, ``--fused-kernels``).

Why these boundaries:
    The error update needs this rank's own estimate ``P Omega^T / k``, which only the
    compress side has before the collective; computing the staged error there (instead of
    keeping ``H - estimate`` until ``end_step`` and averaging it then) lets the commit be a
    swap of buffers: per step the error is read once and written once. The matmuls stay
    matmuls (cuBLAS / the CPU BLAS inside the compiled code); the element-wise work around
    them (pack with the cast, ``+ e``, the non-finite reduction, the residual and its
    moving average, the write-back with its cast) is what inductor fuses. What a GPU moves
    is more than the ops' own inputs and outputs, which the cost model counts
    (``benchmarks/gpu_cost.py``): around each matmul its input or output goes through
    memory (compress: ``H`` written and read back, ``P Omega^T`` written and read back;
    decompress: the reconstruction written and read back), about 6 copies of an fp32
    bucket in all where the model counts 2.6 (a hand-written kernel that keeps a row
    block's ``H`` in registers through both small matmuls, ``k = 16``, would move what the
    model counts: the escape hatch of ``megatron_ext/kernels/__init__.py``, for a GPU
    session to measure).

Numerics:
    Eager, the chain is the one the reducer ran before (``megatron_ext/collectives/
    separate.py``): the same ops in the same order, so results are bit-identical to it.
    Compiled, inductor may contract a multiply and an add into one rounding; values agree
    within a few ulps of fp32 (``tests/unit/test_kernels_dp.py`` states the tolerance).

Constraints:
    Pure torch; no torch.distributed, no Megatron.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron_ext.kernels import define_op
from megatron_ext.kernels.finite import nonfinite
from megatron_ext.kernels.packing import gather, scatter_

__all__ = ["reconstruct", "separate_compress", "separate_decompress"]


def reconstruct(p: torch.Tensor, omega: torch.Tensor, out: Optional[torch.Tensor] = None):
    """``H_hat = P @ Omega^T / k``: ``(R, k) x (k, c) -> (R, c)``, written to ``out`` if given."""
    k = omega.shape[1]
    if out is None:
        return (p @ omega.t()).div_(k)
    torch.matmul(p, omega.t(), out=out)
    return out.div_(k)


def _compress(
    grad: torch.Tensor,
    error: torch.Tensor,
    omega: torch.Tensor,
    table: torch.Tensor,
    chunk: int,
    total: int,
    starts: List[int],
    offsets: List[int],
    numels: List[int],
    beta: float,
    stage: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P, non-finite, staged error)`` of one segment (module docstring).

    Args:
        grad: the flat bucket (any float dtype).
        error: ``[rows, block]`` fp32, zero past ``total``.
        omega: ``[block, k]`` fp32 projection.
        table, chunk, starts, offsets, numels: the segment's
            :class:`~megatron_ext.kernels.packing.Runs`; ``total`` its packed elements.
        beta: error-feedback moving-average factor.
        stage: compute the new error (False: an error reset or beta 0; an empty tensor).
    """
    rows, block = error.shape
    h = gather(grad, rows * block, total, table, chunk, starts, offsets, numels).view(rows, block)
    h.add_(error)
    p = h @ omega
    bad = nonfinite(h)
    if not stage:
        return p, bad, error.new_empty(0)
    # update_error's e <- (1 - beta) e + beta (h - H_hat_local), in the order the reducer
    # computed it before (residual at launch, average at end_step).
    residual = h.sub_(reconstruct(p, omega))
    new_error = error.mul(1.0 - beta).add_(residual, alpha=beta)
    new_error.view(-1)[total:].zero_()
    return p, bad, new_error


separate_compress = define_op("megatron_ext::separate_compress", _compress)


@separate_compress.register_fake
def _(grad, error, omega, table, chunk, total, starts, offsets, numels, beta, stage):
    rows = error.shape[0]
    p = omega.new_empty(rows, omega.shape[1])
    bad = grad.new_empty((), dtype=torch.bool)
    return p, bad, error.new_empty(error.shape if stage else (0,))


def _decompress(
    p: torch.Tensor,
    omega: torch.Tensor,
    grad: torch.Tensor,
    table: torch.Tensor,
    chunk: int,
    base: int,
    first: int,
    last: int,
    dst: List[int],
    src: List[int],
    lengths: List[int],
) -> None:
    """Write ``P Omega^T / k`` into ``grad``'s packed positions ``[first, last)``.

    Args:
        p: ``[r, k]`` reduced coefficients of packed rows from ``base / block`` on.
        omega: ``[block, k]`` projection.
        grad: the flat bucket, written in place.
        table, chunk: the segment's runs (:class:`~megatron_ext.kernels.packing.Runs`).
        base: packed position of ``p``'s first row.
        first, last, dst, src, lengths: the :class:`~megatron_ext.kernels.packing.Region`
            to write.
    """
    recon = reconstruct(p, omega).view(-1)
    scatter_(grad, recon, base, first, last, table, chunk, (dst, src, lengths))


separate_decompress = define_op(
    "megatron_ext::separate_decompress", _decompress, mutates_args=("grad",)
)


@separate_decompress.register_fake
def _(p, omega, grad, table, chunk, base, first, last, dst, src, lengths):
    return None
