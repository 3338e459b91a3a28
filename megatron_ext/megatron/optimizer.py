"""Optimizer-step seam: hooks around a megatron-core optimizer's ``step()``.

What it does:
    :func:`install_optimizer_hooks` overrides ``step`` on the optimizer *instance* (the
    ``ChainedOptimizer`` megatron-core returns) so that every
    :class:`~megatron_ext.protocols.OptimizerHook` runs ``pre_step`` once gradients are
    final and ``post_step`` after the update; a hook's ``update_override`` replaces the
    wrapped torch optimizer's ``step()`` (each leaf's, with that leaf's FQNs) for the step,
    so megatron's own gradient preparation, skip and parameter copy stay in force.
    :class:`MegatronOptimizerView` gives hooks
    per-parameter optimizer state keyed by global FQN for every megatron optimizer type:
    ``FP32Optimizer`` (state on the model parameter), ``Float16OptimizerWithFloat16Params``
    (state on the fp32 main parameter) and ``DistributedOptimizer`` (state on this rank's
    flat fp32 shard, with the shard's range in the flattened parameter).

Why instance patching:
    Megatron-LM's training loop and checkpointing test ``isinstance`` on the optimizer; a
    wrapper object would break those checks, an instance attribute does not.

Constraints:
    Uses megatron-core internals that are stable from 0.13 to 0.19
    (``chained_optimizers``, ``float16_groups`` / ``fp32_from_float16_groups``,
    ``model_param_group_index_map``, ``_get_model_param_range_map``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_ext.megatron.naming import global_param_names
from megatron_ext.protocols import OptimizerHook, OptimizerView, ParamOptimState
from megatron_ext.state import StepClock

__all__ = [
    "MegatronOptimizerView",
    "OptimizerHooksHandle",
    "install_optimizer_hooks",
    "not_decoupled_adamw",
]


def _leaf_optimizers(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _decoupled(inner: Any) -> bool:
    """AdamW mode of the torch / TE / Apex optimizer inside a megatron optimizer."""
    if isinstance(inner, torch.optim.AdamW):
        return True
    if hasattr(inner, "adam_w_mode"):
        return bool(inner.adam_w_mode)
    return False


def not_decoupled_adamw(optimizer: Any) -> List[str]:
    """What in a megatron-core optimizer is not decoupled AdamW with fp32 state.

    Decoupled AdamW is megatron's ``adam`` with ``decoupled_weight_decay`` (its default):
    ``torch.optim.AdamW`` (or ``torch.optim.Adam`` with ``decoupled_weight_decay=True``)
    without AMSGrad, or Transformer Engine's / Apex's ``FusedAdam`` in ``adam_w_mode`` with
    fp32 moments and megatron's own fp32 main parameters (not TE's precision-aware mode).

    Args:
        optimizer: megatron-core optimizer (usually a ``ChainedOptimizer``).

    Returns:
        One description per leaf optimizer that is something else (empty: all are).
    """
    found = []
    for leaf in _leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if getattr(leaf, "is_stub_optimizer", False) or inner is None:
            continue
        name = f"{type(inner).__module__}.{type(inner).__qualname__}"
        groups = getattr(inner, "param_groups", [])
        amsgrad = any(g.get("amsgrad", False) for g in groups)
        if isinstance(inner, torch.optim.AdamW) or (
            isinstance(inner, torch.optim.Adam)
            and all(g.get("decoupled_weight_decay", False) for g in groups)
        ):
            if amsgrad:
                found.append(f"{name} with amsgrad=True")
            continue
        if isinstance(inner, torch.optim.Adam):
            found.append(f"{name} with L2 weight decay (decoupled_weight_decay=False)")
        elif type(inner).__name__ == "FusedAdam" and hasattr(inner, "adam_w_mode"):
            if not inner.adam_w_mode:
                found.append(f"{name} with L2 weight decay (adam_w_mode=False)")
            elif getattr(inner, "master_weights", False) or any(
                getattr(inner, key, torch.float32) != torch.float32
                for key in ("exp_avg_dtype", "exp_avg_sq_dtype")
            ):
                found.append(f"{name} in precision-aware mode (master weights or moments not fp32)")
        else:
            found.append(name)
    return found


class MegatronOptimizerView(OptimizerView):
    """Per-parameter optimizer state of a megatron-core optimizer, keyed by global FQN.

    Args:
        optimizer: megatron-core optimizer (usually a ``ChainedOptimizer``).
        model_chunks: the model chunks it optimizes.
        clock: the training iteration.
    """

    def __init__(self, optimizer: Any, model_chunks: Sequence[torch.nn.Module], clock: StepClock):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self._clock = clock
        self._chunks = list(model_chunks)
        self._leaves = _leaf_optimizers(optimizer)
        self._by_fqn: Dict[str, tuple] = {}
        self._leaf_fqns: List[tuple] = []
        self._model_params: Dict[str, torch.Tensor] = {}
        # Per distributed-optimizer leaf: every parameter it steps over its DP group.
        self._group_fqns: Dict[int, List[str]] = {}
        self._sharded = False
        names: Dict[Any, str] = {}
        for chunk in model_chunks:
            names.update(global_param_names(chunk))
        self._numels = {n: p.numel() for p, n in names.items() if p.requires_grad}
        for leaf in _leaf_optimizers(optimizer):
            if getattr(leaf, "is_stub_optimizer", False) or leaf.optimizer is None:
                continue
            if isinstance(leaf, DistributedOptimizer):
                self._sharded = True
                whole = []
                for buffer in leaf.buffers:
                    for model_param in buffer.params:
                        self._model_params[names[model_param]] = model_param
                        whole.append(names[model_param])
                self._group_fqns[id(leaf)] = sorted(whole)
                for model_param, (gi, go) in leaf.model_param_group_index_map.items():
                    self._by_fqn[names[model_param]] = ("dist", leaf, model_param, gi, go)
            else:
                if hasattr(leaf, "float16_groups"):
                    for gi, group in enumerate(leaf.float16_groups):
                        for j, model_param in enumerate(group):
                            main = leaf.fp32_from_float16_groups[gi][j]
                            self._by_fqn[names[model_param]] = ("main", leaf, model_param, main, gi)
                    # fp32 parameters: the model parameter is its own main parameter.
                    own_main = leaf.fp32_from_fp32_groups
                else:
                    own_main = [group["params"] for group in leaf.optimizer.param_groups]
                for gi, group in enumerate(own_main):
                    for model_param in group:
                        entry = ("main", leaf, model_param, model_param, gi)
                        self._by_fqn[names[model_param]] = entry

        for leaf in self._leaves:
            mine = sorted(f for f, entry in self._by_fqn.items() if entry[1] is leaf)
            if id(leaf) in self._group_fqns:
                mine = self._group_fqns[id(leaf)]
            if mine:
                self._leaf_fqns.append((leaf, mine))

    def fqns(self) -> List[str]:
        return sorted(self._by_fqn)

    def param_numels(self) -> Dict[str, int]:
        return dict(self._numels)

    def sync_params(self) -> None:
        """The distributed optimizer's parameter gather, synchronous (within its instance)."""
        if not self._sharded:
            return
        for chunk in self._chunks:
            groups = list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)
            if any(g.param_gather_handle is not None for g in groups):
                # A gather in flight (of the values before the write): force_sync only
                # waits for it, the next call gathers the written values.
                chunk.start_param_sync(force_sync=True)
            chunk.start_param_sync(force_sync=True)

    def leaf_fqns(self) -> List[tuple]:
        """``(leaf, fqns)`` of every megatron optimizer leaf with parameters on this rank.

        For a distributed-optimizer leaf ``fqns`` are every parameter it steps over its
        data-parallel group (the same list on every DP rank; :meth:`param_state` is None
        for those of which this rank holds no shard)."""
        return list(self._leaf_fqns)

    def model_param(self, fqn: str) -> Optional[torch.Tensor]:
        entry = self._by_fqn.get(fqn)
        if entry is not None:
            return entry[2]
        return self._model_params.get(fqn)

    def param_state(self, fqn: str) -> Optional[ParamOptimState]:
        entry = self._by_fqn.get(fqn)
        if entry is None:
            return None
        if entry[0] == "dist":
            _, leaf, model_param, gi, go = entry
            group = leaf.optimizer.param_groups[gi]
            main = group["params"][go]
            rng = leaf._get_model_param_range_map(model_param)["param"]
            return ParamOptimState(
                fqn=fqn,
                model_param=model_param,
                main_param=main,
                state=leaf.optimizer.state.get(main, {}),
                param_range=(rng.start, rng.end),
                group=group,
                decoupled_weight_decay=_decoupled(leaf.optimizer),
            )
        _, leaf, model_param, main, gi = entry
        return ParamOptimState(
            fqn=fqn,
            model_param=model_param,
            main_param=main,
            state=leaf.optimizer.state.get(main, {}),
            param_range=None,
            group=leaf.optimizer.param_groups[gi],
            decoupled_weight_decay=_decoupled(leaf.optimizer),
        )

    @property
    def step(self) -> int:
        return self._clock.step

    def loss_scale(self) -> Optional[torch.Tensor]:
        # Every leaf of a ChainedOptimizer shares one grad scaler (megatron builds one).
        for leaf in self._leaves:
            scaler = getattr(leaf, "grad_scaler", None)
            if scaler is not None:
                return scaler.scale
        return None


@dataclass
class OptimizerHooksHandle:
    """Installed hooks; ``remove()`` restores the optimizer's own ``step``."""

    optimizer: Any
    hooks: List[OptimizerHook] = field(default_factory=list)
    view: Optional[MegatronOptimizerView] = None

    def remove(self) -> None:
        """Drop the instance-level ``step`` override."""
        if "step" in vars(self.optimizer):
            del self.optimizer.step
        self.hooks.clear()


def install_optimizer_hooks(
    optimizer: Any,
    model_chunks: Sequence[torch.nn.Module],
    hooks: Sequence[OptimizerHook],
    *,
    clock: StepClock,
) -> OptimizerHooksHandle:
    """Run ``hooks`` around ``optimizer.step()``.

    Args:
        optimizer: megatron-core optimizer returned by ``get_megatron_optimizer``.
        model_chunks: its model chunks.
        hooks: hooks, run in order (``post_step`` in reverse order).
        clock: training iteration.

    Returns:
        Handle with ``remove()``.
    """
    view = MegatronOptimizerView(optimizer, model_chunks, clock)
    handle = OptimizerHooksHandle(optimizer=optimizer, hooks=list(hooks), view=view)
    original_step = optimizer.step

    def step(self):
        for hook in handle.hooks:
            hook.pre_step(view)
        overrides = [(h, h.update_override(view)) for h in handle.hooks]
        overrides = [(h, fn) for h, fn in overrides if fn is not None]
        if len(overrides) > 1:
            names = ", ".join(h.name for h, _ in overrides)
            raise RuntimeError(f"megatron-ext: several hooks replace the optimizer update: {names}")
        patched = []
        if overrides:
            update = overrides[0][1]
            for leaf, fqns in view.leaf_fqns():
                inner = leaf.optimizer

                def inner_step(closure=None, _fqns=fqns):
                    update(_fqns)

                inner.step = inner_step
                patched.append(inner)
        try:
            result = original_step()
        finally:
            for inner in patched:
                del inner.step
        update_successful = bool(result[0]) if isinstance(result, tuple) else bool(result)
        for hook in reversed(handle.hooks):
            hook.post_step(view, update_successful)
        return result

    optimizer.step = types.MethodType(step, optimizer)
    return handle
