"""Radius: top-k gradient sparsity with indices reused for T steps, all-reduced densely.

What it does (the Radius paper's Algorithm 1; docs/methods/radius.md), with ``D = --radius-dense-steps``
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

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.collectives.grad_reducer import (
    REDUCE_SCATTER,
    BucketGroupSpec,
    CompressedReduction,
    GradReducer,
    _DenseReduction,
    _Split,
    all_gather_flat,
    scale_state,
)
from megatron_ext.compressors.topk import adamw_corrected_gradient, topk_mask
from megatron_ext.kernels.radius import radius_compress, radius_decompress
from megatron_ext.logging import get_logger, log_rank_0
from megatron_ext.options.radius import RadiusConfig
from megatron_ext.protocols import SAME, SUM, OptimizerHook, OptimizerView

logger = get_logger(__name__)

__all__ = ["RadiusReducer", "RadiusOptimizerHook"]


@dataclass
class _Index:
    """Sent positions of one bucket for one set of masks (bucket coordinates)."""

    index: torch.Tensor  # selected + 1-D positions
    unselected: torch.Tensor  # bool, bucket-shaped
    # Distributed optimizer: positions grouped by owner shard, each group padded to the
    # largest, so one reduce-scatter delivers every rank the values of its own shard.
    padded_index: Optional[torch.Tensor] = None
    padded_valid: Optional[torch.Tensor] = None
    shard_index: Optional[torch.Tensor] = None  # this rank's positions
    shard_count: int = 0


class RadiusReducer(GradReducer["_RadiusReduction"]):
    """Radius gradient reduction (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.options.radius.RadiusConfig`.
    """

    name = "radius"
    elastic_rules: ClassVar[Mapping[str, str]] = {"residual": SUM, "mask": SAME, "selections": SAME}
    supports = ("all_reduce", "reduce_scatter")

    def __init__(self, cfg: RadiusConfig):
        super().__init__()
        self.cfg = cfg
        self.masks: Dict[str, torch.Tensor] = {}
        self.selections = 0
        self.mask_version = 0

    def due(self, step: int) -> int:
        """Selections due by ``step`` (one at the sparse phase's start and every ``T``)."""
        start = self.cfg.dense_steps
        return 0 if step < start else (step - start) // self.cfg.interval + 1

    def phase(self, step: int) -> str:
        """'dense' before the sparse phase, 'select' while a selection is due, else 'sparse'.

        A selection is due on every reselection step and stays due until one is made: a
        selection step whose optimizer step is skipped (an fp16 overflow) or that finds the
        optimizer without moments yet is followed by another dense selection step."""
        if step < self.cfg.dense_steps:
            return "dense"
        if self.selections < self.due(step):
            return "select"
        return "sparse"

    def _bind(self, spec: BucketGroupSpec) -> _RadiusReduction:
        return _RadiusReduction(self, spec)

    def set_masks(self, masks: Dict[str, torch.Tensor], step: int) -> None:
        """Replace the selected entries of the given weights (bool, flattened): the
        selection due at ``step`` is made."""
        self.masks.update(masks)
        self.mask_version += 1
        self.selections = self.due(step)
        self._prepare_indices()

    def _prepare_indices(self) -> None:
        """Build every group's send index now, in the selection step (it takes a host
        synchronization: ``nonzero`` has a data-dependent size), so that sparse steps run
        without one."""
        if all(s.fqn in self.masks for b in self.bound for sp in b.splits for s in sp.matrices):
            for bound in self.bound:
                for i in range(len(bound.splits)):
                    bound._ensure_index(i, bound.spec.distributed_optimizer)

    def select(self, view: OptimizerView) -> bool:
        """Choose each weight's top-k entries from the AdamW-corrected gradient.

        Returns:
            False (and nothing changes) when the optimizer has no moments yet for some
            weight of this rank: the selection stays due.
        """
        if not all(bound.has_moments(view) for bound in self.bound):
            return False
        new_masks: Dict[str, torch.Tensor] = {}
        for bound in self.bound:
            new_masks.update(bound.select(view))
        self.set_masks(new_masks, view.step)
        return True

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"selections": self.selections}
        out.update(super().state_dict())
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        residual_keys = {
            f"residual/{s.fqn}"
            for bound in self.bound
            for split in bound.splits
            for s in split.matrices
        }
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
        for bound in self.bound:
            bound.load_state_dict(state)
        device = self.bound[0].splits[0].view.grad.device if self.bound else None
        # A checkpoint may be loaded onto the CPU: the masks belong on the gradient's device.
        self.masks = {
            k[len("mask/") :]: v.to(device=device).clone()
            for k, v in state.items()
            if k in mask_keys
        }
        self.mask_version += 1
        self._prepare_indices()


class _RadiusReduction(CompressedReduction):
    """Radius on one bucket group (residuals of its weights, index caches)."""

    def __init__(self, reducer: RadiusReducer, spec: BucketGroupSpec):
        super().__init__(spec)
        self.reducer = reducer
        self._dense = _DenseReduction(spec)
        # Bucket-shaped fp32 residuals, zero outside the weights.
        self.residuals = [
            torch.zeros(split.view.grad.numel(), dtype=torch.float32, device=split.view.grad.device)
            for split in self.splits
        ]
        self._index: List[Optional[_Index]] = [None] * len(self.splits)
        self._index_key: List[Any] = [None] * len(self.splits)
        # The step in flight: "select" (residuals to zero) or the new residuals.
        self._staged: Any = None

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        self._staged = None  # a replayed step starts again from the committed state
        phase = self.reducer.phase(step)
        if phase == "sparse":
            return self._launch_sparse(force_all_reduce)
        if phase == "select":
            # The residuals travel with this dense step; they are zeroed when it is applied.
            for split, residual in zip(self.splits, self.residuals):
                split.view.grad.add_(residual.to(split.view.grad.dtype))
            grads = [split.view.grad for split in self.splits]
            # Dense: a non-finite value reaches every rank through the collective itself;
            # the flag only lets the optimizer hook stop a run without loss scaling.
            self.nonfinite = self.input_flag(grads[0].device, *grads)
            self._staged = "select"
        return self._dense.launch(step, force_all_reduce)

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        staged, self._staged = self._staged, None
        if applied and staged == "select":
            for residual in self.residuals:
                residual.zero_()
        elif applied and staged is not None:
            self.residuals = staged
        for residual in self.residuals:
            scale_state(residual, rescale)

    def has_moments(self, view: OptimizerView) -> bool:
        """Whether the optimizer holds moments for every weight of this group on this rank
        (a rank without any part of a weight under the distributed optimizer counts)."""
        for split in self.splits:
            for s in split.matrices:
                st = view.param_state(s.fqn)
                if st is not None and "exp_avg" not in st.state:
                    return False
        return True

    def _ensure_index(self, i: int, reduce_scatter: bool) -> _Index:
        key = (self.reducer.mask_version, reduce_scatter)
        if self._index_key[i] == key:
            return self._index[i]
        split = self.splits[i]
        grad = split.view.grad
        n = grad.numel()
        selected = torch.zeros(n, dtype=torch.bool, device=grad.device)
        unselected = torch.zeros_like(selected)
        for s in split.matrices:
            mask = self.reducer.masks.get(s.fqn)
            if mask is None:
                raise RuntimeError(
                    f"Radius: no top-k selection for {s.fqn}; the sparse phase needs a "
                    "selection step first"
                )
            selected[s.start : s.end] = mask
            unselected[s.start : s.end] = ~mask
        for s in split.dense:
            selected[s.start : s.end] = True
        out = _Index(index=torch.nonzero(selected, as_tuple=False).view(-1), unselected=unselected)
        if reduce_scatter:
            size, rank = self.spec.group_size, self.spec.group_rank
            lo, hi = split.view.shard
            shard = hi - lo
            owner = torch.div(out.index, shard, rounding_mode="floor")
            groups = [out.index[owner == r] for r in range(size)]
            width = max(int(g.numel()) for g in groups)
            padded = torch.zeros(size * width, dtype=torch.long, device=grad.device)
            valid = torch.zeros(size * width, dtype=torch.bool, device=grad.device)
            for r, g in enumerate(groups):
                padded[r * width : r * width + g.numel()] = g
                valid[r * width : r * width + g.numel()] = True
            out.padded_index, out.padded_valid = padded, valid
            out.shard_index, out.shard_count = groups[rank], int(groups[rank].numel())
        self._index[i], self._index_key[i] = out, key
        return out

    def _launch_sparse(self, force_all_reduce: bool) -> Optional[Any]:
        spec = self.spec
        reduce_scatter = spec.distributed_optimizer and not force_all_reduce
        kind = "reduce_scatter" if reduce_scatter else "all_reduce"
        works, pending, staged = [], [], []
        for i, (split, residual) in enumerate(zip(self.splits, self.residuals)):
            idx = self._ensure_index(i, reduce_scatter)
            grad = split.view.grad
            # One fused kernel: the values that travel; the unselected entries joining the
            # residual until the next selection step (staged: end_step keeps it only if the
            # step is applied); whether this rank's input (gradient and residual) is finite.
            if reduce_scatter:
                index, valid = idx.padded_index, idx.padded_valid
            else:
                index, valid = idx.index, grad.new_empty(0, dtype=torch.bool)
            values, new_residual, bad = radius_compress(
                grad, residual, idx.unselected, index, valid
            )
            staged.append(new_residual)
            # The flag of this rank's input rides in the payload.
            flag = self.input_flag(grad.device, known=[bad])
            with ProcessGroupTrafficMeter.tagged("dp-grad"):
                if reduce_scatter:
                    # One flag slot after each rank's group: each rank receives the sum.
                    size = spec.group_size
                    payload = torch.cat(
                        [values.view(size, -1), flag.expand(size).reshape(size, 1)], dim=1
                    ).reshape(-1)
                    out = torch.empty(
                        payload.numel() // size, dtype=payload.dtype, device=grad.device
                    )
                    work = REDUCE_SCATTER(
                        out, payload, op=spec.op, group=spec.group, async_op=spec.async_op
                    )
                else:
                    payload = out = torch.cat([values, flag])
                    work = torch.distributed.all_reduce(
                        payload, op=spec.op, group=spec.group, async_op=spec.async_op
                    )
            self.record(kind, payload, self.dense_wire_bytes(split.view, force_all_reduce))
            works.append(work)
            pending.append((split.view, idx, out))
        self._staged = staged

        def then():
            for view, idx, out in pending:
                # One fused kernel: unselected entries to zero, reduced values written back.
                if reduce_scatter:
                    index, values = idx.shard_index, out[: idx.shard_count]
                else:
                    index, values = idx.index, out[:-1]
                radius_decompress(view.grad, idx.unselected, index, values)
                self.poison(view, out[-1:], reduce_scatter)

        return self.finish(works, then)

    # -- selection (called by the optimizer hook through the reducer) -----------------------

    def select(self, view: OptimizerView) -> Dict[str, torch.Tensor]:
        """New masks of this group's weights from the AdamW-corrected gradient."""
        masks: Dict[str, torch.Tensor] = {}
        for split in self.splits:
            if split.matrices:
                masks.update(self._select_bucket(split, view))
        return masks

    def _select_bucket(self, split: _Split, view: OptimizerView) -> Dict[str, torch.Tensor]:
        spec = self.spec
        grad = split.view.grad
        scores = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        covered = torch.zeros(grad.numel(), dtype=torch.bool, device=grad.device)
        for s in split.matrices:
            st = view.param_state(s.fqn)
            if st is None or "exp_avg" not in st.state:
                continue
            lo, hi = st.param_range if st.param_range is not None else (0, s.numel)
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
        if spec.distributed_optimizer and spec.group_size > 1:
            # Distributed optimizer: each rank scored its own shard; share them. bf16 scores
            # halve the traffic; every rank then ranks identical values.
            lo, hi = split.view.shard
            local = scores[lo:hi].to(torch.bfloat16)
            gathered = torch.empty(
                (hi - lo) * spec.group_size, dtype=torch.bfloat16, device=grad.device
            )
            with ProcessGroupTrafficMeter.tagged("dp-grad"):
                all_gather_flat(gathered, local, spec.group)
            # Selection overhead: no dense counterpart.
            self.record("all_gather", gathered, 0)
            scores = gathered.float()
        else:
            region = torch.zeros_like(covered)
            for s in split.matrices:
                region[s.start : s.end] = True
            if not bool(covered[region].all()):
                raise RuntimeError("Radius: optimizer state missing for some weights")
        masks = {
            s.fqn: topk_mask(scores[s.start : s.end], self.reducer.cfg.density)
            for s in split.matrices
        }
        self._check_agreement(split, masks)
        return masks

    def _check_agreement(self, split: _Split, masks: Dict[str, torch.Tensor]) -> None:
        parts = []
        for s in split.matrices:
            idx = torch.nonzero(masks[s.fqn]).view(-1).double()
            parts.append(torch.stack([idx.sum(), (idx * idx).sum() % 1e12]))
        local = torch.cat(parts)
        lo, hi = local.clone(), local.clone()
        with ProcessGroupTrafficMeter.untracked():
            torch.distributed.all_reduce(lo, torch.distributed.ReduceOp.MIN, self.spec.group)
            torch.distributed.all_reduce(hi, torch.distributed.ReduceOp.MAX, self.spec.group)
        if not torch.equal(lo, hi):
            raise RuntimeError("Radius: data-parallel ranks selected different top-k indices")

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for split, residual in zip(self.splits, self.residuals):
            for s in split.matrices:
                out[f"residual/{s.fqn}"] = residual[s.start : s.end].clone()
                if s.fqn in self.reducer.masks:
                    out[f"mask/{s.fqn}"] = self.reducer.masks[s.fqn].clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for split, residual in zip(self.splits, self.residuals):
            for s in split.matrices:
                residual[s.start : s.end].copy_(state[f"residual/{s.fqn}"])


class RadiusOptimizerHook(OptimizerHook):
    """Runs Radius's top-k selection after the optimizer step of each selection step."""

    name = "radius"
    elastic_rules: ClassVar[Mapping[str, str]] = {}

    def __init__(self, reducer: RadiusReducer):
        self.reducer = reducer
        self._postponed = -1

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        # Only after an applied step: a skipped one (fp16 overflow) leaves the moments as
        # they were, possibly not yet allocated; the selection then stays due.
        if self.reducer.phase(view.step) != "select":
            return
        if update_successful and self.reducer.select(view):
            return
        due = self.reducer.due(view.step)
        if self._postponed != due:  # one line per postponed selection, not per step
            self._postponed = due
            log_rank_0(
                logger,
                20,
                f"megatron_ext: Radius selection due at iteration {view.step + 1} postponed "
                "(optimizer step skipped or no Adam moments yet); each next step reselects "
                "until one is applied",
            )
