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

    Matrices of one shape are compressed as one batch (PyTorch's
    ``batch_tensors_with_same_shape``): a batched matmul and a batched QR per shape, so the
    device ops per bucket do not grow with the number of layers.

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
class _Shape:
    """The bucket's weight matrices of one shape, compressed as one batch (as PyTorch's hook
    does with ``batch_tensors_with_same_shape``): one batched matmul and one batched QR per
    shape instead of per matrix."""

    slices: List[ParamSlice]
    rows: int
    cols: int
    q: torch.Tensor  # [B, cols, r]: the warm start
    error: Optional[torch.Tensor]  # [B, rows, cols] fp32 with error feedback


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
        self.shapes: List[List[_Shape]] = []
        r = cfg.approx_rank
        for split in self.splits:
            device = split.view.grad.device
            by_shape: Dict[tuple, List[ParamSlice]] = {}
            for s in split.matrices:
                by_shape.setdefault((s.shape[0], s.numel // s.shape[0]), []).append(s)
            groups = []
            for (rows, cols), slices in by_shape.items():
                error = None
                if cfg.error_feedback:
                    error = torch.zeros(len(slices), rows, cols, device=device)
                q = torch.stack([initial_q(cfg.seed, s.fqn, 0, cols, r, device) for s in slices])
                groups.append(_Shape(slices=slices, rows=rows, cols=cols, q=q, error=error))
            self.shapes.append(groups)

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
        for split, groups in zip(self.splits, self.shapes):
            grad = split.view.grad
            ms, ps = [], []
            for group in groups:
                # [B, rows, cols] fp32, a fresh tensor (it becomes the new error in place).
                m = torch.stack(
                    [grad[s.start : s.end].view(group.rows, group.cols) for s in group.slices]
                ).float()
                if group.error is not None:
                    m.add_(group.error)
                if self.cfg.warm_start:
                    # PyTorch re-orthogonalizes the previous step's (all-reduced) Q.
                    q = orthogonalize(group.q)
                else:
                    q = torch.stack(
                        [
                            initial_q(
                                self.cfg.seed,
                                s.fqn,
                                step,
                                group.cols,
                                self.cfg.approx_rank,
                                grad.device,
                            )
                            for s in group.slices
                        ]
                    )
                ms.append(m)
                ps.append(torch.bmm(m, q))
            dense_part = self.pack_dense(split)
            flag = self.input_flag(grad.device, *ms, dense_part)
            payload = torch.cat([p.reshape(-1) for p in ps] + [dense_part, flag])
            dense = self.dense_wire_bytes(split.view, force_all_reduce)
            works.append(self.all_reduce(payload, dense=dense))
            pending.append((split, groups, ms, payload))

        def then():
            for split, groups, ms, payload in pending:
                self._second_round(split, groups, ms, payload[:-1])
                self.poison(split.view, payload[-1:], reduce_scatter)

        return self.finish(works, then)

    def _second_round(self, split, groups: List[_Shape], ms, payload) -> None:
        grad = split.view.grad
        r = self.cfg.approx_rank
        offset = 0
        ps = []
        for group in groups:
            count = len(group.slices) * group.rows * r
            p = payload[offset : offset + count].view(len(group.slices), group.rows, r)
            offset += count
            ps.append(orthogonalize(p))
        self.unpack_dense(split, payload[offset:])
        if not groups:
            return
        q_payload = torch.cat([torch.bmm(m.transpose(1, 2), p).reshape(-1) for m, p in zip(ms, ps)])
        # The dense equivalent was recorded with the first round.
        self.all_reduce(q_payload, dense=0, async_op=False)
        # ``approx`` is in the units of the reduction's result: the sum of the ranks' shares
        # with SUM (megatron pre-scales each share by 1/W), their mean with AVG. A rank's
        # error must stay in the units of its own input, so that the ranks' errors add up
        # (SUM) or average (AVG) to the global residual ``reduce(m) - approx``.
        share = self.spec.share
        offset = 0
        dst, src = [], []
        for group, m, p in zip(groups, ms, ps):
            count = len(group.slices) * group.cols * r
            q = q_payload[offset : offset + count].view(len(group.slices), group.cols, r)
            offset += count
            approx = torch.bmm(p, q.transpose(1, 2))
            # Staged until end_step: the new error (in m's own buffer) and the warm start.
            error = m.sub_(share * approx) if group.error is not None else None
            for s, a in zip(group.slices, approx.unbind(0)):
                dst.append(grad[s.start : s.end].view(group.rows, group.cols))
                src.append(a)
            self._staged.append((group, error, q.clone()))
        torch._foreach_copy_(dst, src)  # one fused copy of every approximation

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and applied:
            for group, error, q in staged:
                if error is not None:
                    group.error = error
                group.q = q
        for groups in self.shapes:
            for group in groups:
                scale_state(group.error, rescale)

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for groups in self.shapes:
            for group in groups:
                for i, s in enumerate(group.slices):
                    out[f"q/{s.fqn}"] = group.q[i].clone()
                    if group.error is not None:
                        out[f"error/{s.fqn}"] = group.error[i].clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for split, groups in zip(self.splits, self.shapes):
            device = split.view.grad.device
            for group in groups:
                # A checkpoint may be loaded onto the CPU (map_location="cpu"): the warm
                # start belongs on the gradient's device.
                group.q = torch.stack(
                    [
                        state[f"q/{s.fqn}"].to(device=device, dtype=torch.float32)
                        for s in group.slices
                    ]
                )
                if group.error is not None:
                    for i, s in enumerate(group.slices):
                        group.error[i].copy_(state[f"error/{s.fqn}"])
