"""Protocol Models' boundary codec as fused kernels (``megatron_ext.collectives.subspace``).

What it does:
    Four ops, each one pass through the activation (policy: ``megatron_ext.kernels``):

    * ``megatron_ext::subspace_encode``: forward send, ``C = (X - T_fixed[ids]) U`` with the
      token ids packed behind it, as one payload in the activation's dtype;
    * ``megatron_ext::subspace_decode``: forward receive, ``X = C U^T + T_fixed[ids]`` in
      the activation's dtype, and the ids (int64);
    * ``megatron_ext::subspace_coords``: backward send, ``G U`` in ``G``'s dtype;
    * ``megatron_ext::subspace_lift``: backward receive, ``C U^T`` in the activation's dtype.

    The arithmetic is fp32 in between, as the eager code always did: each function below is
    that code, the reference (``--fused-kernels off``, and the default on the CPU) and what
    ``torch.compile`` compiles (``on``, and ``auto`` on a GPU). Unfused, the fp32 casts,
    the gather, the subtraction and the addition are each a pass of their own (16 copies of
    a bf16 activation per forward send and receive in the cost model, 5 backward).

Traffic (``tests/helpers/strict_device.py``'s rules, ``benchmarks/gpu_cost.py``):
    The encode and the decode read only the rows of ``T_fixed`` their tokens address,
    which :data:`megatron_ext.kernels.ROW_GATHERS` tells the cost model (a custom op's
    tensor arguments otherwise count whole). A forward direction then moves ``X`` and the
    rows of ``T_fixed`` on the sender, the rows and ``X`` again on the receiver, plus the
    payload (``k`` of ``d`` values and the ids): ``2 + (4k + 24) / (4d)`` copies of a bf16
    activation (2.04 at gpt2-345m's ``k = 32, d = 1024``), the least any kernel reading
    ``T_fixed[ids]`` on both sides can move. Backward: ``1 + k / d`` copies.

Compiled:
    Inductor keeps each matmul an external BLAS call and fuses the rest around it (its
    generated code, inspected on the CPU): the encode is one kernel (gather, casts,
    subtraction) writing the fp32 difference, the matmul, one kernel (cast, packing); the
    decode the matmul writing the fp32 ``C U^T``, then one kernel (gather, addition, cast,
    ids). So compiled code still moves the fp32 intermediate: about 6 copies of a bf16
    activation per forward direction (16 eager) and 5 backward (5 eager: the backward's
    passes are the casts around the matmul); fp32 activations need no casts (2.04 and 1.04).
    The cost model's figures are those of kernels that fuse the matmul too (with ``k`` of a
    few dozen columns the product is a memory-bound reduction per token): written as
    ``(v[..., None] * u).sum(-2)`` inductor makes each op one kernel (measured on the CPU,
    8192 tokens x 1024, bf16: encode 47 ms against 96 with the matmul and 184 eager; but
    fp32 encode 156 against 115), which changes the summation order and so is not the
    eager chain. Which one a GPU should run (or a hand-written Triton kernel behind the same
    ops) is for a GPU measurement to decide.

Constraints:
    Pure torch. ``fixed`` is ``vocab x d`` in the model's dtype, ``u`` ``d x k`` fp32, ids
    int64 (or int32) on the same device.
"""

from __future__ import annotations

import math
import sys
from typing import List, Tuple

import torch

from megatron_ext.kernels import ROW_GATHERS, define_op

__all__ = ["id_elems", "encode", "decode", "coords", "lift"]


def id_elems(dtype: torch.dtype) -> int:
    """Payload elements of ``dtype`` that carry one int32 token id (bit for bit)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in (1, 2, 4):
        raise ValueError(f"token ids cannot be packed into a {dtype} payload")
    return 4 // size


# -- the pure functions (the eager chains) ---------------------------------------------------


def _encode(
    x: torch.Tensor, ids: torch.Tensor, fixed: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Payload ``[tokens * (k + id_elems)]`` in ``x``'s dtype: ``C = (X - T_fixed[ids]) U``
    (fp32 in between) followed by the int32 ids reinterpreted as that dtype.

    Args:
        x: activation ``[..., d]``.
        ids: token ids ``x.shape[:-1]``.
        fixed: ``T_fixed`` (``vocab x d``).
        u: the basis (``d x k``, fp32).
    """
    v = x.float() - fixed[ids].float()
    c = v @ u
    packed = ids.to(torch.int32).contiguous().view(x.dtype).reshape(-1)
    return torch.cat([c.to(x.dtype).reshape(-1), packed])


def _decode(
    payload: torch.Tensor, fixed: torch.Tensor, u: torch.Tensor, lead: List[int], dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(X, ids)`` from :func:`encode`'s payload: ``X = C U^T + T_fixed[ids]`` (``[*lead,
    d]``, ``dtype``; fp32 in between) and the ids (int64 ``lead``)."""
    k = u.shape[1]
    tokens = math.prod(lead)
    c = payload[: tokens * k].float().reshape(*lead, k)
    ids = _unpack_ids(payload[tokens * k :]).reshape(lead)
    return (c @ u.t() + fixed[ids].float()).to(dtype), ids


def _unpack_ids(tail: torch.Tensor) -> torch.Tensor:
    """The int64 ids packed by :func:`_encode` into ``tail``: its elements' bits as
    integers of their own size (a view that any offset allows: the ids follow ``tokens * k``
    values, an odd count of 16-bit ones, or a symbolic one when compiled, where an int32 view
    of them is refused), joined in the machine's byte order as the int32 view made them."""
    size = tail.element_size()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[size]
    parts = tail.view(bits).reshape(-1, 4 // size)
    order = list(range(parts.shape[1]))  # least significant first
    if sys.byteorder == "big":
        order.reverse()
    ids = parts[:, order[-1]].long()  # the most significant part: its sign is the id's
    for j in reversed(order[:-1]):
        ids = (ids << (8 * size)) | (parts[:, j].long() & ((1 << (8 * size)) - 1))
    return ids


def _coords(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``G U`` flattened (``[tokens * k]``) in ``g``'s dtype, fp32 in between (``g``:
    ``[..., d]``)."""
    return (g.reshape(-1, u.shape[0]).float() @ u).to(g.dtype).reshape(-1)


def _lift(
    payload: torch.Tensor, u: torch.Tensor, lead: List[int], dtype: torch.dtype
) -> torch.Tensor:
    """``C U^T`` (``[*lead, d]``, ``dtype``) from :func:`coords`'s payload, fp32 in
    between."""
    k = u.shape[1]
    c = payload[: math.prod(lead) * k].float().reshape(*lead, k)
    return (c @ u.t()).to(dtype)


# -- the ops -----------------------------------------------------------------------------------


encode = define_op("megatron_ext::subspace_encode", _encode)


@encode.register_fake
def _(x, ids, fixed, u):
    tokens = x.numel() // x.shape[-1]
    return x.new_empty(tokens * (u.shape[1] + id_elems(x.dtype)))


decode = define_op("megatron_ext::subspace_decode", _decode)


@decode.register_fake
def _(payload, fixed, u, lead, dtype):
    x = payload.new_empty((*lead, u.shape[0]), dtype=dtype)
    return x, payload.new_empty(tuple(lead), dtype=torch.int64)


coords = define_op("megatron_ext::subspace_coords", _coords)


@coords.register_fake
def _(g, u):
    return g.new_empty(g.numel() // u.shape[0] * u.shape[1])


lift = define_op("megatron_ext::subspace_lift", _lift)


@lift.register_fake
def _(payload, u, lead, dtype):
    return payload.new_empty((*lead, u.shape[0]), dtype=dtype)


# The cost model: the encode reads the rows of ``fixed`` that ``ids`` address, the decode
# those of its ``lead`` tokens (one row each), not the whole table.
ROW_GATHERS["megatron_ext::subspace_encode"] = ("fixed", "ids")
ROW_GATHERS["megatron_ext::subspace_decode"] = ("fixed", "lead")
