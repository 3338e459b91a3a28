"""Radius: top-k gradient sparsity with indices reused for T steps, all-reduced densely.

What it does (radius.txt, Algorithm 1; methods.md section 2), with ``D = --radius-dense-steps``
and ``T = --radius-interval``:

* steps ``t < D``: dense reduction (megatron's own collective);
* *selection* steps ``t = D + i T``: add the residual to the local gradient, zero the
  residual, reduce densely; after the optimizer step, :class:`RadiusOptimizerHook`
  computes the AdamW-corrected gradient from the optimizer's real moment estimates
  (:func:`~megatron_ext.compressors.topk.adamw_corrected_gradient`) and keeps the top
  ``density`` fraction of each weight matrix;
* other steps: only the selected entries travel, gathered into one dense vector (the
  indices are identical on every rank, so no index travels) together with the 1-D
  parameters (biases, norms), which stay dense; the unselected local values are added to
  the residual and their gradient is zero for this step.

Distributed optimizer:
    Selection steps reduce-scatter densely (as megatron would); each rank then knows the
    corrected gradient only for its optimizer shard, so the shards' scores are all-gathered
    (in bf16) once per selection before the top-k. Sparse steps *reduce-scatter* the
    selected values: they are grouped by the shard that owns them, each group padded to
    the largest, so every rank receives exactly the sums of its own shard's entries
    (``density`` times megatron's reduce-scatter, plus padding).

Agreement:
    After every selection the ranks compare a checksum of their masks (one small
    all-reduce); a mismatch raises instead of silently training diverging replicas.

State (rank-local, keyed by parameter FQN): ``residual/<fqn>`` and ``mask/<fqn>`` (bool),
plus the number of selections done.

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
from megatron_ext.compressors.topk import adamw_corrected_gradient, topk_mask
from megatron_ext.optim.hooks import OptimizerHook, OptimizerView

__all__ = ["RadiusReducer", "RadiusOptimizerHook"]


@dataclass
class _Plan:
    view: BucketView
    group: Any
    sparse: List[ParamSlice] = field(default_factory=list)
    dense: List[ParamSlice] = field(default_factory=list)
    residual: Optional[torch.Tensor] = None  # bucket-shaped fp32, zero outside `sparse`
    index: Optional[torch.Tensor] = None  # sent positions: selected + 1-D (bucket coords)
    unselected: Optional[torch.Tensor] = None  # bool, bucket-shaped
    index_version: int = -1
    # Distributed optimizer: positions grouped by owner shard, each group padded to the
    # largest, so one reduce-scatter delivers every rank the values of its own shard.
    padded_index: Optional[torch.Tensor] = None
    padded_valid: Optional[torch.Tensor] = None
    shard_index: Optional[torch.Tensor] = None  # this rank's positions
    shard_count: int = 0


class RadiusReducer(GradReducer):
    """Radius gradient reduction (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.config.RadiusConfig`.
    """

    name = "radius"
    supports = ("all_reduce", "reduce_scatter")

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._plans: Dict[int, _Plan] = {}
        self.masks: Dict[str, torch.Tensor] = {}
        self.selections = 0
        self._mask_version = 0
        self._reduce_scatter = False
        self._meter = None
        self._dense = DenseGradReducer()

    # -- phases ----------------------------------------------------------------------------

    def phase(self, step: int) -> str:
        """'dense' before the sparse phase, 'select' on reselection steps, else 'sparse'."""
        start = self.cfg.dense_steps
        if step < start:
            return "dense"
        if (step - start) % self.cfg.interval == 0:
            return "select"
        return "sparse"

    # -- setup -------------------------------------------------------------------------------

    def bind(self, groups: List[BucketGroupView]) -> None:
        for group_view in groups:
            for view in group_view.buckets:
                plan = _Plan(view=view, group=group_view.group)
                for s in view.params:
                    (plan.sparse if len(s.shape) >= 2 else plan.dense).append(s)
                plan.residual = torch.zeros(
                    view.grad.numel(), dtype=torch.float32, device=view.grad.device
                )
                self._plans[id(view)] = plan

    def _ensure_index(self, plan: _Plan, reduce_scatter: bool) -> None:
        if plan.index_version == self._mask_version and (plan.padded_index is not None) == (
            reduce_scatter
        ):
            return
        grad = plan.view.grad
        n = grad.numel()
        selected = torch.zeros(n, dtype=torch.bool, device=grad.device)
        unselected = torch.zeros_like(selected)
        for s in plan.sparse:
            mask = self.masks.get(s.fqn)
            if mask is None:
                raise RuntimeError(
                    f"Radius: no top-k selection for {s.fqn}; the sparse phase needs a "
                    "selection step first"
                )
            selected[s.start : s.end] = mask
            unselected[s.start : s.end] = ~mask
        for s in plan.dense:
            selected[s.start : s.end] = True
        plan.index = torch.nonzero(selected, as_tuple=False).view(-1)
        plan.unselected = unselected
        plan.padded_index = plan.padded_valid = plan.shard_index = None
        if reduce_scatter:
            size = torch.distributed.get_world_size(plan.group)
            rank = torch.distributed.get_rank(plan.group)
            shard = n // size
            owner = torch.div(plan.index, shard, rounding_mode="floor")
            groups = [plan.index[owner == r] for r in range(size)]
            width = max(int(g.numel()) for g in groups)
            padded = torch.zeros(size * width, dtype=torch.long, device=grad.device)
            valid = torch.zeros(size * width, dtype=torch.bool, device=grad.device)
            for r, g in enumerate(groups):
                padded[r * width : r * width + g.numel()] = g
                valid[r * width : r * width + g.numel()] = True
            plan.padded_index, plan.padded_valid = padded, valid
            plan.shard_index, plan.shard_count = groups[rank], int(groups[rank].numel())
        plan.index_version = self._mask_version

    # -- the reduction ---------------------------------------------------------------------

    def launch(self, ctx: GradSyncContext) -> Optional[Any]:
        self._reduce_scatter = ctx.reduce_scatter
        self._meter = ctx.meter
        phase = self.phase(ctx.step)
        if phase == "sparse":
            return self._launch_sparse(ctx)
        if phase == "select":
            for view in ctx.buckets:
                plan = self._plans[id(view)]
                view.grad.add_(plan.residual.to(view.grad.dtype))
                plan.residual.zero_()
        return self._dense.launch(ctx)

    def _launch_sparse(self, ctx: GradSyncContext) -> Optional[Any]:
        group_size = torch.distributed.get_world_size(ctx.group)
        pending = []
        for view in ctx.buckets:
            plan = self._plans[id(view)]
            self._ensure_index(plan, ctx.reduce_scatter)
            grad = view.grad
            # Unselected entries wait in the residual until the next selection step.
            plan.residual.add_(grad.float() * plan.unselected)
            kind = "reduce_scatter" if ctx.reduce_scatter else "all_reduce"
            with ProcessGroupTrafficMeter.tagged("dp-grad"):
                if ctx.reduce_scatter:
                    payload = grad.index_select(0, plan.padded_index).float()
                    payload.mul_(plan.padded_valid)
                    out = torch.empty(
                        payload.numel() // group_size, dtype=payload.dtype, device=grad.device
                    )
                    work = torch.distributed.reduce_scatter_tensor(
                        out, payload, op=ctx.op, group=ctx.group, async_op=ctx.async_op
                    )
                else:
                    payload = grad.index_select(0, plan.index).float()
                    out = payload
                    work = torch.distributed.all_reduce(
                        payload, op=ctx.op, group=ctx.group, async_op=ctx.async_op
                    )
            if ctx.meter is not None:
                wire = collective_wire_bytes(kind, payload.numel() * 4, group_size)
                dense_wire = collective_wire_bytes(
                    kind, grad.numel() * grad.element_size(), group_size
                )
                ctx.meter.record(
                    "dp-grad", sent=wire, recv=wire, dense_sent=dense_wire, dense_recv=dense_wire
                )
            pending.append((plan, out, work, ctx.reduce_scatter))

        def finish():
            for plan, out, work, reduce_scatter in pending:
                if work is not None and ctx.async_op:
                    work.wait()
                grad = plan.view.grad
                grad.masked_fill_(plan.unselected, 0.0)
                if reduce_scatter:
                    values = out[: plan.shard_count]
                    grad.index_copy_(0, plan.shard_index, values.to(grad.dtype))
                else:
                    grad.index_copy_(0, plan.index, out.to(grad.dtype))

        if ctx.async_op:
            return DeferredHandle(finish)
        finish()
        return None

    # -- selection (called by the optimizer hook) -------------------------------------------

    def select(self, view: OptimizerView) -> None:
        """Choose each weight's top-k entries from the AdamW-corrected gradient."""
        new_masks: Dict[str, torch.Tensor] = {}
        for plan in self._plans.values():
            if not plan.sparse:
                continue
            grad = plan.view.grad
            scores = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
            covered = torch.zeros(grad.numel(), dtype=torch.bool, device=grad.device)
            for s in plan.sparse:
                st = view.param_state(s.fqn)
                if st is None or "exp_avg" not in st.state:
                    continue
                lo, hi = st.param_range if st.param_range is not None else (0, s.end - s.start)
                main = st.main_param.detach().reshape(-1)
                if st.param_range is None:
                    main = main[lo:hi]
                g = st.group
                corrected = adamw_corrected_gradient(
                    st.state["exp_avg"].reshape(-1),
                    st.state["exp_avg_sq"].reshape(-1),
                    main,
                    step=st.adam_step,
                    lr=g["lr"],
                    betas=g["betas"],
                    eps=g["eps"],
                    weight_decay=g.get("weight_decay", 0.0),
                    decoupled=st.decoupled_weight_decay,
                )
                scores[s.start + lo : s.start + hi] = corrected.abs()
                covered[s.start + lo : s.start + hi] = True
            size = torch.distributed.get_world_size(plan.group)
            if self._reduce_scatter and size > 1:
                # Distributed optimizer: each rank scored its own shard; share them.
                shard = grad.numel() // size
                rank = torch.distributed.get_rank(plan.group)
                # bf16 scores halve the traffic; every rank then ranks identical values.
                local = scores[rank * shard : (rank + 1) * shard].to(torch.bfloat16)
                gathered = torch.empty(scores.numel(), dtype=torch.bfloat16, device=grad.device)
                with ProcessGroupTrafficMeter.tagged("dp-grad"):
                    torch.distributed.all_gather_into_tensor(gathered, local, group=plan.group)
                scores = gathered.float()
                if self._meter is not None:
                    # Selection overhead: no dense counterpart.
                    wire = collective_wire_bytes("all_gather", scores.numel() * 2, size)
                    self._meter.record("dp-grad", sent=wire, recv=wire, dense_sent=0, dense_recv=0)
            elif not bool(covered[_sparse_region(plan)].all()):
                raise RuntimeError("Radius: optimizer state missing for some weights")
            for s in plan.sparse:
                new_masks[s.fqn] = topk_mask(scores[s.start : s.end], self.cfg.density)
            self._check_agreement(plan, new_masks)
        self.masks.update(new_masks)
        self.selections += 1
        self._mask_version += 1

    def _check_agreement(self, plan: _Plan, masks: Dict[str, torch.Tensor]) -> None:
        parts = []
        for s in plan.sparse:
            idx = torch.nonzero(masks[s.fqn]).view(-1).double()
            parts.append(torch.stack([idx.sum(), (idx * idx).sum() % 1e12]))
        local = torch.cat(parts)
        lo, hi = local.clone(), local.clone()
        with ProcessGroupTrafficMeter.untracked():
            torch.distributed.all_reduce(lo, torch.distributed.ReduceOp.MIN, plan.group)
            torch.distributed.all_reduce(hi, torch.distributed.ReduceOp.MAX, plan.group)
        if not torch.equal(lo, hi):
            raise RuntimeError("Radius: data-parallel ranks selected different top-k indices")

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"selections": self.selections}
        for plan in self._plans.values():
            for s in plan.sparse:
                out[f"residual/{s.fqn}"] = plan.residual[s.start : s.end].clone()
                if s.fqn in self.masks:
                    out[f"mask/{s.fqn}"] = self.masks[s.fqn].clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        residual_keys = {f"residual/{s.fqn}" for plan in self._plans.values() for s in plan.sparse}
        mask_keys = {k for k in state if k.startswith("mask/")}
        expected_masks = {"mask/" + k[len("residual/") :] for k in residual_keys}
        if set(state) - mask_keys != residual_keys | {"selections"} or (
            mask_keys and mask_keys != expected_masks
        ):
            raise ValueError(
                "Radius state keys differ from this model's parameters: "
                f"{sorted(set(state) ^ (residual_keys | mask_keys | {'selections'}))[:5]}"
            )
        self.selections = int(state["selections"])
        for plan in self._plans.values():
            for s in plan.sparse:
                plan.residual[s.start : s.end].copy_(state[f"residual/{s.fqn}"])
        self.masks = {k[len("mask/") :]: v.clone() for k, v in state.items() if k in mask_keys}
        self._mask_version += 1


def _sparse_region(plan: _Plan) -> torch.Tensor:
    region = torch.zeros(plan.view.grad.numel(), dtype=torch.bool, device=plan.view.grad.device)
    for s in plan.sparse:
        region[s.start : s.end] = True
    return region


class RadiusOptimizerHook(OptimizerHook):
    """Runs Radius's top-k selection after the optimizer step of each selection step."""

    name = "radius"

    def __init__(self, reducer: RadiusReducer):
        self.reducer = reducer

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        if self.reducer.phase(view.step) == "select":
            self.reducer.select(view)
