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

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.collectives.grad_reducer import (
    BucketGroupView,
    BucketView,
    DeferredHandle,
    DenseGradReducer,
    GradReducer,
    GradSyncContext,
    ParamSlice,
)
from megatron_ext.compressors.separate import stable_seed

__all__ = ["PowerSGDReducer", "orthogonalize"]


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR; deterministic for identical input)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


@dataclass
class _Matrix:
    fqn: str
    slice: ParamSlice
    rows: int
    cols: int
    q: torch.Tensor
    error: Optional[torch.Tensor]


@dataclass
class _Plan:
    view: BucketView
    matrices: List[_Matrix] = field(default_factory=list)
    dense: List[ParamSlice] = field(default_factory=list)


class PowerSGDReducer(GradReducer):
    """PowerSGD gradient reduction (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.config.PowerSGDConfig`.
    """

    name = "powersgd"
    supports = ("all_reduce", "reduce_scatter")

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._plans: Dict[int, _Plan] = {}
        self._dense = DenseGradReducer()

    def bind(self, groups: List[BucketGroupView]) -> None:
        r = self.cfg.approx_rank
        for group_view in groups:
            for view in group_view.buckets:
                plan = _Plan(view=view)
                for s in view.params:
                    if len(s.shape) >= 2:
                        n = s.shape[0]
                        m = (s.end - s.start) // n
                        if (n + m) * r * self.cfg.min_compression_rate <= n * m:
                            plan.matrices.append(
                                _Matrix(
                                    fqn=s.fqn,
                                    slice=s,
                                    rows=n,
                                    cols=m,
                                    q=self._initial_q(s.fqn, m, 0, view.grad.device),
                                    error=(
                                        torch.zeros(n, m, device=view.grad.device)
                                        if self.cfg.error_feedback
                                        else None
                                    ),
                                )
                            )
                            continue
                    plan.dense.append(s)
                self._plans[id(view)] = plan

    def _initial_q(self, fqn: str, cols: int, step: int, device) -> torch.Tensor:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed("powersgd", self.cfg.seed, fqn, step))
        q = torch.randn(cols, self.cfg.approx_rank, generator=gen)
        return orthogonalize(q).to(device)

    def launch(self, ctx: GradSyncContext) -> Optional[Any]:
        if ctx.step < self.cfg.start_step:
            return self._dense.launch(ctx)
        group_size = torch.distributed.get_world_size(ctx.group)
        kind = "reduce_scatter" if ctx.reduce_scatter else "all_reduce"
        pending = []
        for view in ctx.buckets:
            plan = self._plans[id(view)]
            grad = view.grad
            ms, ps = [], []
            for mat in plan.matrices:
                m = grad[mat.slice.start : mat.slice.end].view(mat.rows, mat.cols).float()
                if mat.error is not None:
                    m = m + mat.error
                if self.cfg.warm_start:
                    # PyTorch re-orthogonalizes the previous step's (all-reduced) Q.
                    mat.q = orthogonalize(mat.q)
                else:
                    mat.q = self._initial_q(mat.fqn, mat.cols, ctx.step, grad.device)
                ms.append(m)
                ps.append(m @ mat.q)
            dense = [grad[s.start : s.end].float() for s in plan.dense]
            payload = torch.cat([p.reshape(-1) for p in ps] + dense)
            with ProcessGroupTrafficMeter.tagged("dp-grad"):
                work = torch.distributed.all_reduce(
                    payload, op=ctx.op, group=ctx.group, async_op=ctx.async_op
                )
            if ctx.meter is not None:
                wire = collective_wire_bytes("all_reduce", payload.numel() * 4, group_size)
                dense_wire = collective_wire_bytes(
                    kind, grad.numel() * grad.element_size(), group_size
                )
                ctx.meter.record(
                    "dp-grad", sent=wire, recv=wire, dense_sent=dense_wire, dense_recv=dense_wire
                )
            pending.append((plan, ms, payload, work))

        def finish():
            for plan, ms, payload, work in pending:
                if work is not None and ctx.async_op:
                    work.wait()
                self._second_round(plan, ms, payload, ctx, group_size)

        if ctx.async_op:
            return DeferredHandle(finish)
        finish()
        return None

    def _second_round(self, plan: _Plan, ms, payload, ctx, group_size) -> None:
        grad = plan.view.grad
        r = self.cfg.approx_rank
        offset = 0
        ps = []
        for mat in plan.matrices:
            p = payload[offset : offset + mat.rows * r].view(mat.rows, r)
            offset += mat.rows * r
            ps.append(orthogonalize(p))
        pos = offset
        for s in plan.dense:
            k = s.end - s.start
            grad[s.start : s.end].copy_(payload[pos : pos + k])
            pos += k
        if not plan.matrices:
            return
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        q_payload = torch.cat([q.reshape(-1) for q in qs])
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            torch.distributed.all_reduce(q_payload, op=ctx.op, group=ctx.group)
        if ctx.meter is not None:
            wire = collective_wire_bytes("all_reduce", q_payload.numel() * 4, group_size)
            # The dense equivalent was recorded with the first round.
            ctx.meter.record("dp-grad", sent=wire, recv=wire, dense_sent=0, dense_recv=0)
        # ``approx`` is in the units of the reduction's result: the sum of the ranks' shares
        # with SUM (megatron pre-scales each share by 1/W), their mean with AVG. A rank's
        # error must stay in the units of its own input, so that the ranks' errors add up
        # (SUM) or average (AVG) to the global residual ``reduce(m) - approx``.
        share = 1.0 / group_size if ctx.op == torch.distributed.ReduceOp.SUM else 1.0
        offset = 0
        for mat, m, p in zip(plan.matrices, ms, ps):
            q = q_payload[offset : offset + mat.cols * r].view(mat.cols, r)
            offset += mat.cols * r
            approx = p @ q.t()
            if mat.error is not None:
                mat.error.copy_(m - share * approx)
            grad[mat.slice.start : mat.slice.end].view(mat.rows, mat.cols).copy_(approx)
            mat.q = q.clone()

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for plan in self._plans.values():
            for mat in plan.matrices:
                out[f"q/{mat.fqn}"] = mat.q.clone()
                if mat.error is not None:
                    out[f"error/{mat.fqn}"] = mat.error.clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(
                "PowerSGD state keys differ from this model's parameters: "
                f"{sorted(set(state) ^ expected)[:5]}"
            )
        for plan in self._plans.values():
            for mat in plan.matrices:
                mat.q = state[f"q/{mat.fqn}"].clone()
                if mat.error is not None:
                    mat.error.copy_(state[f"error/{mat.fqn}"])
