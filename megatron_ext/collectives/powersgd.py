"""PowerSGD as a data-parallel gradient reducer: the peer baseline, PyTorch's algorithm.

What it does:
    The algorithm of PyTorch's ``powerSGD_hook`` (Vogels et al., 2019), on megatron-core's
    bucket groups and keyed by parameter FQN instead of bucket index. Per weight matrix
    ``M`` (``n x m``) whose rank-``r`` form is at least ``min_compression_rate`` times
    smaller, with ``M`` including the previous error when error feedback is on:

    1. ``P = M Q`` (with warm start ``Q`` is the previous step's, re-orthogonalized as
       PyTorch does); all-reduce all ``P`` together with the bucket's uncompressed tensors
       (1-D parameters, small matrices);
    2. orthogonalize each ``P`` (QR); ``Q = M^T P``; all-reduce all ``Q``;
    3. ``M_hat = P Q^T`` becomes the gradient; error ``e = M - M_hat / W`` under SUM
       (megatron pre-scales each rank's gradient by ``1/W``, so ``M_hat`` estimates the sum
       of the ranks' ``M``) and ``e = M - M_hat`` under AVG: either way the ranks' errors
       add up to the global residual, as in PyTorch's hook (which reduces unscaled
       gradients and averages).

    Before ``--powersgd-start-step`` the reduction is dense, as in PyTorch. Two collectives
    per bucket (a "multi-round" compressor): with ``overlap_grad_reduce`` the first one
    overlaps the backward pass and the rest runs when megatron waits on the handle. With
    the distributed optimizer the full ``M_hat`` is written (a superset of the shard).

State (rank-local, keyed by FQN): ``error/<fqn>`` and ``q/<fqn>`` (the warm start).

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from megatron_ext.collectives.grad_reducer import (
    BoundReduction,
    BucketGroupSpec,
    CompressedReduction,
    GradReducer,
    ParamSlice,
    _DenseReduction,
    scale_state,
)
from megatron_ext.compressors.lowrank import compressible, initial_q, orthogonalize

__all__ = ["PowerSGDReducer"]


@dataclass
class _Matrix:
    slice: ParamSlice
    rows: int
    cols: int
    q: torch.Tensor
    error: Optional[torch.Tensor]


class PowerSGDReducer(GradReducer):
    """PowerSGD gradient reduction (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.methods.powersgd.PowerSGDConfig`.
    """

    name = "powersgd"
    supports = ("all_reduce", "reduce_scatter")

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg

    def _bind(self, spec: BucketGroupSpec) -> BoundReduction:
        return _PowerSGDReduction(self.cfg, spec)


class _PowerSGDReduction(CompressedReduction):
    """PowerSGD on one bucket group: two all-reduces per bucket (P, then Q)."""

    def __init__(self, cfg: Any, spec: BucketGroupSpec):
        self.cfg = cfg
        super().__init__(spec)
        self._dense = _DenseReduction(spec)
        self._staged: Optional[list] = None
        self.matrices: List[List[_Matrix]] = []
        for split in self.splits:
            device = split.view.grad.device
            mats = []
            for s in split.matrices:
                rows, cols = s.shape[0], s.numel // s.shape[0]
                error = torch.zeros(rows, cols, device=device) if cfg.error_feedback else None
                q = initial_q(cfg.seed, s.fqn, 0, cols, cfg.approx_rank, device)
                mats.append(_Matrix(slice=s, rows=rows, cols=cols, q=q, error=error))
            self.matrices.append(mats)

    def compresses(self, s: ParamSlice) -> bool:
        if not s.is_matrix:
            return False
        rows = s.shape[0]
        return compressible(
            rows, s.numel // rows, self.cfg.approx_rank, self.cfg.min_compression_rate
        )

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        self._staged = None  # a replayed step starts again from the committed state
        if step < self.cfg.start_step:
            return self._dense.launch(step, force_all_reduce)
        reduce_scatter = self.spec.distributed_optimizer and not force_all_reduce
        works, pending = [], []
        self._staged = []
        for split, mats in zip(self.splits, self.matrices):
            grad = split.view.grad
            ms, ps, qs = [], [], []
            for mat in mats:
                m = grad[mat.slice.start : mat.slice.end].view(mat.rows, mat.cols).float()
                if mat.error is not None:
                    m = m + mat.error
                if self.cfg.warm_start:
                    # PyTorch re-orthogonalizes the previous step's (all-reduced) Q.
                    q = orthogonalize(mat.q)
                else:
                    q = initial_q(
                        self.cfg.seed,
                        mat.slice.fqn,
                        step,
                        mat.cols,
                        self.cfg.approx_rank,
                        grad.device,
                    )
                ms.append(m)
                ps.append(m @ q)
            flag = self.input_flag(grad.device, *ms, *[grad[s.start : s.end] for s in split.dense])
            payload = torch.cat([p.reshape(-1) for p in ps] + self.pack_dense(split) + [flag])
            dense = self.dense_wire_bytes(split.view, force_all_reduce)
            works.append(self.all_reduce(payload, dense=dense))
            pending.append((split, mats, ms, payload))

        def then():
            for split, mats, ms, payload in pending:
                self._second_round(split, mats, ms, payload[:-1])
                self.poison(split.view, payload[-1:], reduce_scatter)

        return self.finish(works, then)

    def _second_round(self, split, mats: List[_Matrix], ms, payload) -> None:
        grad = split.view.grad
        r = self.cfg.approx_rank
        offset = 0
        ps = []
        for mat in mats:
            p = payload[offset : offset + mat.rows * r].view(mat.rows, r)
            offset += mat.rows * r
            ps.append(orthogonalize(p))
        self.unpack_dense(split, payload[offset:])
        if not mats:
            return
        q_payload = torch.cat([(m.t() @ p).reshape(-1) for m, p in zip(ms, ps)])
        # The dense equivalent was recorded with the first round.
        self.all_reduce(q_payload, dense=0, async_op=False)
        # ``approx`` is in the units of the reduction's result: the sum of the ranks' shares
        # with SUM (megatron pre-scales each share by 1/W), their mean with AVG. A rank's
        # error must stay in the units of its own input, so that the ranks' errors add up
        # (SUM) or average (AVG) to the global residual ``reduce(m) - approx``.
        share = self.spec.share
        offset = 0
        for mat, m, p in zip(mats, ms, ps):
            q = q_payload[offset : offset + mat.cols * r].view(mat.cols, r)
            offset += mat.cols * r
            approx = p @ q.t()
            # Staged until end_step: the new error (in m's own buffer, a fresh tensor when
            # error feedback is on) and the warm start.
            error = m.sub_(share * approx) if mat.error is not None else None
            grad[mat.slice.start : mat.slice.end].view(mat.rows, mat.cols).copy_(approx)
            self._staged.append((mat, error, q.clone()))

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and applied:
            for mat, error, q in staged:
                if error is not None:
                    mat.error = error
                mat.q = q
        for mats in self.matrices:
            for mat in mats:
                scale_state(mat.error, rescale)

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for mats in self.matrices:
            for mat in mats:
                out[f"q/{mat.slice.fqn}"] = mat.q.clone()
                if mat.error is not None:
                    out[f"error/{mat.slice.fqn}"] = mat.error.clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for split, mats in zip(self.splits, self.matrices):
            device = split.view.grad.device
            for mat in mats:
                # A checkpoint may be loaded onto the CPU (map_location="cpu"): the warm start
                # belongs on the gradient's device.
                mat.q = state[f"q/{mat.slice.fqn}"].to(device=device, dtype=torch.float32).clone()
                if mat.error is not None:
                    mat.error.copy_(state[f"error/{mat.slice.fqn}"])
