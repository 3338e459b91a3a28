"""Radius's fused kernels for a sparse step: gather the selected entries while the others
join the residual; scatter the reduced entries back.

What it does:
    With the selection fixed (a bucket-shaped boolean ``unselected`` and the int64
    positions ``index`` that travel: the selected entries and the 1-D parameters, in the
    order of the payload):

    * ``megatron_ext::radius_compress`` returns the values that travel,
      ``g[index]`` in fp32 (times ``valid`` with the distributed optimizer's padded
      index, else ``valid`` is empty), the residual the step commits if it is applied,
      ``r + g * unselected`` (fp32), and whether ``g`` or that residual holds a NaN or an
      Inf (0-d bool, the payload's input flag);
    * ``megatron_ext::radius_decompress`` zeroes the unselected entries of the bucket and
      writes the reduced values at ``index`` (cast to the bucket's dtype).

    Both are ``torch.library`` custom ops whose bodies run the pure functions below
    compiled or eager (:func:`megatron_ext.kernels.run`).

Numerics:
    Eager, the same ops in the same order as the reducer ran before (bit-identical);
    compiled, the same values (one multiply and one add per residual entry, a gather and
    a scatter: nothing to contract), checked bit for bit in ``tests/unit/test_kernels_dp.py``.

Constraints:
    Pure torch; no torch.distributed, no Megatron.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_ext.kernels import define_op
from megatron_ext.kernels.finite import nonfinite

__all__ = ["radius_compress", "radius_decompress"]


def _compress(
    grad: torch.Tensor,
    residual: torch.Tensor,
    unselected: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, staged residual, non-finite)`` of a sparse step (module docstring).

    Args:
        grad: the flat bucket (any float dtype).
        residual: bucket-shaped fp32.
        unselected: bucket-shaped bool.
        index: int64 positions that travel.
        valid: bool, ``index``'s shape (padding of the distributed optimizer's groups is
            False), or empty.
    """
    new_residual = residual + grad.float() * unselected
    bad = nonfinite(grad, new_residual)
    values = grad.index_select(0, index).float()
    if valid.numel():
        values.mul_(valid)
    return values, new_residual, bad


radius_compress = define_op("megatron_ext::radius_compress", _compress)


@radius_compress.register_fake
def _(grad, residual, unselected, index, valid):
    values = residual.new_empty(index.shape)
    return values, torch.empty_like(residual), grad.new_empty((), dtype=torch.bool)


def _decompress(
    grad: torch.Tensor, unselected: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> None:
    """``grad[unselected] = 0; grad[index] = values`` (cast to ``grad``'s dtype)."""
    grad.masked_fill_(unselected, 0.0)
    grad.index_copy_(0, index, values.to(grad.dtype))


radius_decompress = define_op(
    "megatron_ext::radius_decompress", _decompress, mutates_args=("grad",)
)


@radius_decompress.register_fake
def _(grad, unselected, index, values):
    return None
