"""SEPARATE as a data-parallel gradient reducer (optionally G-SEPARATE).

What it does, per bucket and step (methods.md section 1):
    1. ``h = g + e`` for the bucket's weight matrices, packed as rows of ``block_size``;
    2. ``P = H Omega`` with the step's common Gaussian block (one matmul);
    3. error feedback on the *local* estimate, ``e <- (1-beta) e + beta (h - P Omega^T/k)``,
       or ``e <- 0`` every ``reset_interval`` steps;
    4. one all-reduce of ``P`` together with the bucket's 1-D parameters (biases, norms),
       which travel densely;
    5. ``H_hat = P_avg Omega^T / k`` written back as the gradient. With the distributed
       optimizer only the rows that cover this rank's shard are reconstructed: the
       projection is linear, so the all-reduced coefficients determine every shard.

    With ``overlap_grad_reduce`` steps 1-4 run when megatron marks the bucket ready (inside
    backward) and step 5 when megatron waits on the handle, so communication overlaps the
    rest of the backward pass.

    The projection block is an orthonormalized common Gaussian block scaled by
    ``sqrt(block_size)`` (:func:`~megatron_ext.compressors.separate.projection_block`): the
    estimate stays unbiased, has variance ``(ratio - 1)|h|^2`` instead of the plain
    Gaussian's ``(c + 1)/k |h|^2``, and is exact at ratio 1. Error feedback uses
    ``beta = scale / ratio`` (``scale`` = 1 unless ``--separate-ef-beta`` is given): the
    local estimate misses ``h`` by about ``sqrt(ratio - 1)|h|``, so the recursion only stays
    bounded for ``beta < 2/ratio`` (config.py refuses larger values; the paper's 0.95
    diverged to NaN in our runs).

    G-SEPARATE (``--separate-adaptive``): every ``adapt_interval`` steps the packed ``h`` is
    also all-reduced densely, and per parameter the cosine between the compressed estimate
    and that dense average decides the next ratio and beta: above twice the cosine of a
    plain projection at that ratio (``1/sqrt(1+ratio)``: error feedback is working well)
    the ratio doubles and the beta scale grows by 2%; below the plain cosine the ratio
    halves and the scale shrinks by 2%; ratio within [min_ratio, max_ratio], scale within
    [0.5, 1.5] (so beta stays below 2/ratio). Our decision where the paper's Algorithm 3
    (step 6) is not legible; all ranks compute it from all-reduced values, so they agree
    without extra communication.

State (rank-local, keyed by parameter FQN): ``residual/<fqn>`` error buffers and, with
G-SEPARATE, ``ratio/<fqn>`` and ``beta_scale/<fqn>``.

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.collectives.grad_reducer import (
    BucketGroupView,
    BucketView,
    DeferredHandle,
    GradReducer,
    GradSyncContext,
    ParamSlice,
)
from megatron_ext.compressors.separate import (
    projection_block,
    random_projection_cosine,
    reconstruct,
    update_error,
)

__all__ = ["SeparateReducer"]


@dataclass
class _Segment:
    """Weight matrices of one bucket compressed with the same ratio and beta."""

    index: int
    ratio: int
    beta: float
    slices: List[ParamSlice]
    pack_offsets: List[int]
    numel: int
    rows: int
    error: torch.Tensor  # [rows, block] fp32, zero past numel
    work: torch.Tensor  # [rows, block] fp32


@dataclass
class _BucketPlan:
    view: BucketView
    segments: List[_Segment] = field(default_factory=list)
    dense: List[ParamSlice] = field(default_factory=list)


class SeparateReducer(GradReducer):
    """SEPARATE gradient reduction (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.config.SeparateConfig`.
    """

    name = "separate"
    supports = ("all_reduce", "reduce_scatter")

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.block = cfg.block_size
        self._plans: Dict[int, _BucketPlan] = {}
        self._ratio: Dict[str, int] = {}
        self._beta_scale: Dict[str, float] = {}

    # -- setup -------------------------------------------------------------------------------

    def bind(self, groups: List[BucketGroupView]) -> None:
        for group_view in groups:
            for view in group_view.buckets:
                plan = _BucketPlan(view=view)
                for s in view.params:
                    if len(s.shape) >= 2:
                        self._ratio.setdefault(s.fqn, self.cfg.ratio)
                        self._beta_scale.setdefault(s.fqn, self.cfg.beta_scale)
                    else:
                        plan.dense.append(s)
                self._build_segments(plan)
                self._plans[id(view)] = plan
        self._check_projections_agree(groups)

    def _build_segments(
        self, plan: _BucketPlan, residuals: Optional[Dict[str, torch.Tensor]] = None
    ):
        device = plan.view.grad.device
        by_setting: Dict[Tuple[int, float], List[ParamSlice]] = {}
        for s in plan.view.params:
            if len(s.shape) >= 2:
                ratio = self._ratio[s.fqn]
                by_setting.setdefault((ratio, self._beta_scale[s.fqn] / ratio), []).append(s)
        plan.segments = []
        for i, ((ratio, beta), slices) in enumerate(sorted(by_setting.items())):
            offsets, total = [], 0
            for s in slices:
                offsets.append(total)
                total += s.end - s.start
            rows = math.ceil(total / self.block)
            seg = _Segment(
                index=i,
                ratio=ratio,
                beta=beta,
                slices=slices,
                pack_offsets=offsets,
                numel=total,
                rows=rows,
                error=torch.zeros(rows, self.block, dtype=torch.float32, device=device),
                work=torch.zeros(rows, self.block, dtype=torch.float32, device=device),
            )
            if residuals:
                flat = seg.error.view(-1)
                for s, off in zip(slices, offsets):
                    if s.fqn in residuals:
                        flat[off : off + s.end - s.start].copy_(residuals[s.fqn])
            plan.segments.append(seg)

    def _omega(self, plan: _BucketPlan, seg: _Segment, step: int) -> torch.Tensor:
        k = self.block // seg.ratio
        return projection_block(
            self.cfg.seed,
            step,
            f"{plan.view.key}#{seg.index}/r{seg.ratio}",
            self.block,
            k,
            device=plan.view.grad.device,
        )

    def _check_projections_agree(self, groups: List[BucketGroupView]) -> None:
        """One cheap all-reduce: every rank must generate bit-identical projections."""
        for group_view in groups:
            sums = []
            for view in group_view.buckets:
                plan = self._plans[id(view)]
                for seg in plan.segments:
                    sums.append(self._omega(plan, seg, 0).double().sum())
            if not sums:
                continue
            local = torch.stack(sums)
            lo, hi = local.clone(), local.clone()
            with ProcessGroupTrafficMeter.untracked():
                torch.distributed.all_reduce(lo, torch.distributed.ReduceOp.MIN, group_view.group)
                torch.distributed.all_reduce(hi, torch.distributed.ReduceOp.MAX, group_view.group)
            if not torch.equal(lo, hi) or not torch.equal(lo, local):
                raise RuntimeError(
                    "SEPARATE: data-parallel ranks generated different random projections "
                    "(different --separate-seed, torch version or bucket layout?)"
                )

    # -- the reduction ---------------------------------------------------------------------

    def _is_adapt_step(self, step: int) -> bool:
        return self.cfg.adaptive and step > 0 and step % self.cfg.adapt_interval == 0

    def launch(self, ctx: GradSyncContext) -> Optional[Any]:
        step = ctx.step
        reset = step % self.cfg.reset_interval == 0
        adapt = self._is_adapt_step(step)
        group_size = torch.distributed.get_world_size(ctx.group)
        pending = []
        for view in ctx.buckets:
            plan = self._plans[id(view)]
            grad = view.grad
            payloads = []
            omegas = []
            dense_h = []
            for seg in plan.segments:
                flat = seg.work.view(-1)
                for s, off in zip(seg.slices, seg.pack_offsets):
                    flat[off : off + s.end - s.start].copy_(grad[s.start : s.end])
                h = seg.work.add_(seg.error)
                omega = self._omega(plan, seg, step)
                p = h @ omega
                if adapt:
                    dense_h.append(h.reshape(-1)[: seg.numel].clone())
                if reset or seg.beta == 0.0:
                    seg.error.zero_()
                else:
                    update_error(seg.error, h, reconstruct(p, omega), seg.beta, reset=False)
                    seg.error.view(-1)[seg.numel :].zero_()
                payloads.append(p.reshape(-1))
                omegas.append(omega)
            if plan.dense:
                payloads.append(torch.cat([grad[s.start : s.end].float() for s in plan.dense]))
            flat_payload = torch.cat(payloads) if payloads else None
            work = None
            if flat_payload is not None:
                with ProcessGroupTrafficMeter.tagged("dp-grad"):
                    work = torch.distributed.all_reduce(
                        flat_payload, op=ctx.op, group=ctx.group, async_op=ctx.async_op
                    )
            dense_kind = "reduce_scatter" if ctx.reduce_scatter else "all_reduce"
            if ctx.meter is not None:
                nbytes = 0 if flat_payload is None else flat_payload.numel() * 4
                wire = collective_wire_bytes("all_reduce", nbytes, group_size)
                dense = collective_wire_bytes(
                    dense_kind, grad.numel() * grad.element_size(), group_size
                )
                ctx.meter.record(
                    "dp-grad", sent=wire, recv=wire, dense_sent=dense, dense_recv=dense
                )
            pending.append((plan, view, flat_payload, omegas, dense_h, work))

        def finish():
            for plan, view, flat_payload, omegas, dense_h, work in pending:
                if work is not None and ctx.async_op:
                    work.wait()
                self._decompress(plan, view, flat_payload, omegas)
                if adapt:
                    self._adapt(plan, ctx, flat_payload, omegas, dense_h, group_size)

        if ctx.async_op:
            return DeferredHandle(finish)
        finish()
        return None

    def _decompress(self, plan, view, flat_payload, omegas) -> None:
        grad = view.grad
        lo, hi = view.shard if view.shard is not None else (0, grad.numel())
        offset = 0
        for seg, omega in zip(plan.segments, omegas):
            k = self.block // seg.ratio
            p = flat_payload[offset : offset + seg.rows * k].view(seg.rows, k)
            offset += seg.rows * k
            # Pack-space interval of this segment that falls inside [lo, hi).
            first = last = None
            for s, off in zip(seg.slices, seg.pack_offsets):
                a, b = max(s.start, lo), min(s.end, hi)
                if a < b:
                    first = off + (a - s.start) if first is None else first
                    last = off + (b - s.start)
            if first is None:
                continue
            r0, r1 = first // self.block, math.ceil(last / self.block)
            recon = reconstruct(p[r0:r1], omega).view(-1)
            base = r0 * self.block
            for s, off in zip(seg.slices, seg.pack_offsets):
                a, b = max(s.start, lo), min(s.end, hi)
                if a < b:
                    src = off + (a - s.start) - base
                    grad[a:b].copy_(recon[src : src + (b - a)])
        if plan.dense:
            dense = flat_payload[offset:]
            pos = 0
            for s in plan.dense:
                n = s.end - s.start
                grad[s.start : s.end].copy_(dense[pos : pos + n])
                pos += n

    # -- G-SEPARATE ------------------------------------------------------------------------

    def _adapt(self, plan, ctx, flat_payload, omegas, dense_h, group_size) -> None:
        """Cosine of estimate vs dense average per parameter -> next ratio and beta."""
        if not dense_h:
            return
        reference = torch.cat(dense_h)
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            torch.distributed.all_reduce(reference, op=ctx.op, group=ctx.group)
        if ctx.meter is not None:
            wire = collective_wire_bytes("all_reduce", reference.numel() * 4, group_size)
            ctx.meter.record("dp-grad", sent=wire, recv=wire, dense_sent=0, dense_recv=0)
        offset = ref_offset = 0
        residuals: Dict[str, torch.Tensor] = {}
        changed = False
        allowed = [r for r in range(1, self.block + 1) if self.block % r == 0]
        for seg, omega in zip(plan.segments, omegas):
            k = self.block // seg.ratio
            p = flat_payload[offset : offset + seg.rows * k].view(seg.rows, k)
            offset += seg.rows * k
            estimate = reconstruct(p, omega).view(-1)
            flat_err = seg.error.view(-1)
            cosines = [
                torch.nn.functional.cosine_similarity(
                    estimate[off : off + s.end - s.start],
                    reference[ref_offset + off : ref_offset + off + s.end - s.start],
                    dim=0,
                    eps=1e-30,
                )
                for s, off in zip(seg.slices, seg.pack_offsets)
            ]
            # One host sync per segment, not per parameter.
            for s, off, cos in zip(seg.slices, seg.pack_offsets, torch.stack(cosines).tolist()):
                n = s.end - s.start
                ratio, scale = self._ratio[s.fqn], self._beta_scale[s.fqn]
                if cos >= 2.0 * random_projection_cosine(ratio):
                    new_ratio, new_scale = ratio * 2, min(scale * 1.02, 1.5)
                elif cos < random_projection_cosine(ratio):
                    new_ratio, new_scale = max(ratio // 2, 1), max(scale * 0.98, 0.5)
                else:
                    new_ratio, new_scale = ratio, scale
                new_ratio = min(max(new_ratio, self.cfg.min_ratio), self.cfg.max_ratio)
                new_ratio = max(r for r in allowed if r <= new_ratio)
                if (new_ratio, new_scale) != (ratio, scale):
                    changed = True
                self._ratio[s.fqn], self._beta_scale[s.fqn] = new_ratio, new_scale
                residuals[s.fqn] = flat_err[off : off + n].clone()
            ref_offset += seg.numel
        if changed:
            self._build_segments(plan, residuals)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for plan in self._plans.values():
            for seg in plan.segments:
                flat = seg.error.view(-1)
                for s, off in zip(seg.slices, seg.pack_offsets):
                    out[f"residual/{s.fqn}"] = flat[off : off + s.end - s.start].clone()
                    if self.cfg.adaptive:
                        out[f"ratio/{s.fqn}"] = self._ratio[s.fqn]
                        out[f"beta_scale/{s.fqn}"] = self._beta_scale[s.fqn]
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            missing = sorted(expected - set(state))[:5]
            unexpected = sorted(set(state) - expected)[:5]
            raise ValueError(
                f"SEPARATE state keys differ: missing {missing}, unexpected {unexpected}"
            )
        residuals = {
            k[len("residual/") :]: v for k, v in state.items() if k.startswith("residual/")
        }
        for key, value in state.items():
            if key.startswith("ratio/"):
                self._ratio[key[len("ratio/") :]] = int(value)
            elif key.startswith("beta_scale/"):
                self._beta_scale[key[len("beta_scale/") :]] = float(value)
        for plan in self._plans.values():
            self._build_segments(plan, residuals)
