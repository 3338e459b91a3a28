"""Protocol Models' pipeline codec: ``k`` coordinates per token instead of ``d``.

What it does:
    In a subspace-confined model (``megatron_ext.megatron.subspace``) the residual stream
    at a stage boundary is ``X = T_fixed[tokens] + V`` with ``V`` in ``S = span(U)``.
    :class:`SubspaceCodec` sends

    * forward: ``C = (X - T_fixed[tokens]) U`` (``s x b x k``) and the token ids; the
      receiver rebuilds ``X = C U^T + T_fixed[tokens]``;
    * backward: ``G U``; the receiver uses ``G U U^T`` (every parameter upstream sees the
      boundary only through ``S``, so no parameter gradient changes).

    Lossless in fp32. In a 16-bit pipeline dtype the coordinates and the rebuilt tensor are
    rounded to it (computed in fp32 in between): in bf16 a round trip's error is about 1.4x
    that of one bf16 rounding (``tests/unit/test_subspace.py``).

    The last stage's backward sends also accumulate the Grassmann objective (``A += G^T G``,
    :meth:`~megatron_ext.compressors.subspace.Subspace.accumulate`) when the subspace moves.

Token ids on the wire:
    megatron-core sends one tensor of one dtype per transfer, so the ids travel packed
    behind ``C``: int32 ids reinterpreted (bit for bit) as the payload dtype, two elements
    per id in bf16/fp16, one in fp32. The first stage takes them from its embedding (which
    calls :meth:`SubspaceCodec.push_token_ids`); a middle stage keeps the ids of each
    received microbatch until it sends that microbatch on. Both happen in microbatch order
    in every megatron schedule that is not interleaved, so a FIFO matches them.

Kernels:
    Each of the four transforms is one fused op (``megatron_ext.kernels.subspace``: the
    gather, the fp32 casts, the subtraction or addition and the matmul in one pass, compiled
    on a GPU, eager on the CPU by default), so a forward direction moves about two copies
    of the activation, a backward one about one.

Constraints:
    torch only; never imports Megatron or torch.distributed. Not for the interleaved
    schedule (refused by the method).
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar, Deque, Mapping, Optional, Tuple

import torch

from megatron_ext.collectives.p2p import P2PCodec, P2PContext
from megatron_ext.compressors.subspace import Subspace, SubspaceUser
from megatron_ext.kernels import subspace as kernels

__all__ = ["SubspaceCodec"]


class SubspaceCodec(SubspaceUser, P2PCodec):
    """See module docstring.

    Args:
        subspace: the run's shared subspace (``U``, ``T_fixed``, ``A``).
        sends_forward: this stage sends activations on (not the last stage).
        accumulate: accumulate the Grassmann objective from the gradients this stage sends
            backward (the stage after the last compressed boundary, when ``U`` moves).
    """

    name = "protocol"
    elastic_rules: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        subspace: Optional[Subspace] = None,
        *,
        sends_forward: bool = True,
        accumulate: bool = False,
    ):
        SubspaceUser.__init__(self, subspace)
        self.sends_forward = sends_forward
        self.accumulate = accumulate
        self._ids: Deque[torch.Tensor] = deque()
        self.check_residual = False
        """Measure ``|X - T_fixed - C U^T| / |X - T_fixed|`` of every forward send (tests)."""
        self.max_residual = 0.0

    # -- token ids -----------------------------------------------------------------------

    def push_token_ids(self, ids: torch.Tensor) -> None:
        """Token ids ``[s, b]`` of the next activation this stage will send (sequence-first,
        this rank's sequence shard under sequence parallelism)."""
        if self.sends_forward:
            self._ids.append(ids)

    def begin_step(self, sample_ids_fn: Optional[Any]) -> None:
        self._ids.clear()

    # -- the codec -----------------------------------------------------------------------

    def payload_spec(
        self, shape: Tuple[int, ...], dtype: torch.dtype, ctx: P2PContext
    ) -> Tuple[Tuple[int, ...], torch.dtype]:
        if shape[-1] != self.subspace.d:
            raise ValueError(f"expected hidden size {self.subspace.d}, got shape {shape}")
        tokens = int(torch.Size(shape[:-1]).numel())
        numel = tokens * self.subspace.k
        if ctx.direction == "forward":
            numel += tokens * kernels.id_elems(dtype)
        return (numel,), dtype

    def encode(self, tensor: torch.Tensor, ctx: P2PContext) -> torch.Tensor:
        u = self.subspace.on(tensor.device).u
        if ctx.direction == "backward":
            if self.accumulate and not ctx.forward_only:
                self.subspace.accumulate(tensor)
            return kernels.coords(tensor, u)
        if not self._ids:
            raise RuntimeError(
                "protocol codec: no token ids for the activation being sent (the embedding "
                "or the previous stage did not provide them)"
            )
        ids = self._ids.popleft()
        if tuple(ids.shape) != tuple(tensor.shape[:-1]):
            raise RuntimeError(
                f"protocol codec: token ids of shape {tuple(ids.shape)} for an activation of "
                f"shape {tuple(tensor.shape)}"
            )
        fixed = self.subspace.fixed
        if fixed is None:
            raise RuntimeError(
                "protocol codec: the subspace has no T_fixed (the model transform builds it)"
            )
        if self.check_residual:
            v = tensor.float() - fixed[ids].float()
            err = (v - (v @ u) @ u.t()).norm() / v.norm().clamp_min(1e-30)
            self.max_residual = max(self.max_residual, float(err))
        return kernels.encode(tensor, ids, fixed, u)

    def decode(
        self, payload: torch.Tensor, ctx: P2PContext, shape: Tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        u = self.subspace.on(payload.device).u
        lead = list(shape[:-1])
        if ctx.direction == "backward":
            return kernels.lift(payload, u, lead, dtype)
        x, ids = kernels.decode(payload, self.subspace.fixed, u, lead, dtype)
        self.push_token_ids(ids)
        return x
