"""Protocol Models' optimizer side: constrained weights stay in the subspace ``S``.

What it does:
    :class:`SubspaceOptimizerHook` keeps every constrained parameter (the residual
    stream's writers and ``T_S``; the dimension of size ``d`` given per parameter) in
    ``S = span(U)`` through training:

    * ``pre_step``: project the (data-parallel reduced) gradient onto ``S`` along ``d``
      (in place), so gradient clipping, Adam's first moment and every update see the
      projected gradient; keep the ``k`` coordinates of the fp32 parameter before the
      step (``k / d`` of its size: no copy of the ``vocab x d`` embedding).
    * ``post_step``: the modified AdamW. The fp32 first moment is projected (a bf16
      gradient buffer rounds the projected gradient out of ``S`` by its precision), and
      Adam's second moment is made constant along ``d``:
      megatron's optimizer (torch, TE or Apex Adam, unchanged) has just computed
      ``v = b2 v_old + (1 - b2) g^2`` elementwise; with ``v_old`` constant along ``d`` the
      mean of ``v`` along ``d`` is exactly ``b2 v_old + (1 - b2) mean_d(g^2)``, which is
      stored back. The step is then redone from the saved parameter with that ``v``:
      ``p = p_0 (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)``. Each column of the update is
      the projected first moment scaled by one number, so it stays in ``S``; decoupled
      weight decay scales the parameter and keeps ``S`` too. So the step is taken on the
      coordinates (``c = c_0 (1 - lr wd) - lr c_m / ...``, ``c_m`` those of the first
      moment) and written back into the parameter in place: ``p_0`` enters as its
      projection, which it is up to fp32 rounding (a re-projection each step).
    * every ``reproject_interval`` steps: hard re-projection of the parameters and their
      first moments (rounding drift);
    * every ``update_interval`` steps: ``update_basis()`` (communication, in the adapter)
      returns the new ``U`` from the Grassmann step, identical on every rank; parameters
      and first moments are re-projected onto it. All ranks switch at the same step.

Launches:
    Each parameter's matmuls (its projections and coordinates) and its reductions along
    ``d`` run per parameter; the elementwise part that does not broadcast (the
    denominators, the decay of the kept coordinates, the model-parameter copies) runs as
    foreach ops over all constrained parameters: 9 launches a weight instead of 13-16
    (gpt2-345m's first stage: 454 a step instead of 722). Matmuls of same-shape parameters
    are not batched: a batched or stacked product is not bit for bit the per-matrix one
    (BLAS picks other kernels for other shapes) and stacking copies the weights.

Constraints:
    Pure torch; never imports Megatron. Decoupled (AdamW-style) weight decay only; not for
    the distributed optimizer (its flat shards cut a weight's ``d`` axis; refused by the
    method).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional

import torch

from megatron_ext.compressors.subspace import (
    Subspace,
    SubspaceUser,
    coordinates,
    from_coordinates,
    project_,
)
from megatron_ext.protocols import OptimizerHook, OptimizerView

__all__ = ["SubspaceOptimizerHook"]


def _lr(st: Any) -> float:
    return float(st.group["lr"])


def _wd(st: Any) -> float:
    return float(st.group.get("weight_decay", 0.0))


def _grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient megatron's optimizer will read: ``main_grad`` (DDP buffer) or ``grad``."""
    g = getattr(param, "main_grad", None)
    return param.grad if g is None else g


class SubspaceOptimizerHook(SubspaceUser, OptimizerHook):
    """See module docstring.

    Args:
        subspace: the run's subspace.
        constrained: FQN -> the parameter's dimension of size ``d``.
        update_interval: steps between Grassmann updates (0: fixed subspace).
        reproject_interval: steps between hard re-projections (0: never).
        update_basis: collective; returns the new ``U`` (every rank calls it at once).
    """

    name = "protocol"
    elastic_rules: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        subspace: Optional[Subspace],
        constrained: Dict[str, int],
        *,
        update_interval: int,
        reproject_interval: int,
        update_basis: Optional[Callable[[], torch.Tensor]] = None,
    ):
        SubspaceUser.__init__(self, subspace)
        self.constrained = constrained
        self.update_interval = update_interval
        self.reproject_interval = reproject_interval
        self.update_basis = update_basis
        self._before: Dict[str, torch.Tensor] = {}

    # -- the step ------------------------------------------------------------------------

    def pre_step(self, view: OptimizerView) -> None:
        self._before = {}
        for fqn, axis in self.constrained.items():
            st = view.param_state(fqn)
            if st is None:
                continue
            if st.param_range is not None:
                raise RuntimeError(f"{fqn}: the subspace optimizer needs whole parameters")
            if not st.decoupled_weight_decay and float(st.group.get("weight_decay", 0.0)):
                raise RuntimeError(
                    f"{fqn}: the subspace optimizer needs decoupled (AdamW) weight decay"
                )
            g = _grad(st.model_param)
            u = self.subspace.on(st.main_param.device).u
            with torch.no_grad():
                if g is not None:
                    project_(g, u, axis)
                self._before[fqn] = coordinates(st.main_param.detach(), u, axis)

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        step = view.step
        # The step's boundary gradients enter the Grassmann objective only if it was applied.
        self.subspace.end_step(update_successful)
        if update_successful:
            self._adamw(view)
        self._before = {}
        if self.update_interval > 0 and (step + 1) % self.update_interval == 0:
            if self.update_basis is None:
                raise RuntimeError("subspace updates need an update_basis collective")
            self.subspace.set_basis(self.update_basis())
            self.reproject(view)
        elif self.reproject_interval > 0 and (step + 1) % self.reproject_interval == 0:
            self.reproject(view)

    def _adamw(self, view: OptimizerView) -> None:
        """Redo Adam's step of every constrained parameter with the second moment constant
        along ``d`` (module docstring), from the coordinates kept by :meth:`pre_step`.

        Per parameter: the first moment's projection, the mean of the second moment and its
        write back, the update of the coordinates and the parameter written from them. The
        denominators ``sqrt(v_d / bc2) + eps`` and the decay of the kept coordinates run as
        foreach ops over all parameters of a device and dtype (the same operations on each
        tensor, in the same order: the same bits as a loop).
        """
        todo = []
        with torch.no_grad():
            for fqn, axis in self.constrained.items():
                st = view.param_state(fqn)
                if st is None or fqn not in self._before:
                    continue
                m = st.state.get("exp_avg")
                v = st.state.get("exp_avg_sq")
                t = st.adam_step
                if m is None or v is None or t is None:
                    # No Adam moments (megatron's SGD): its step of the projected gradient,
                    # with momentum of projected gradients, already stays in S.
                    continue
                group = st.group
                b1, b2 = group.get("betas", (0.9, 0.999))
                if group.get("bias_correction", True):
                    bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
                else:
                    bc1 = bc2 = 1.0
                u = self.subspace.on(st.main_param.device).u
                # The gradient was projected in its own dtype; a bf16 gradient buffer rounds
                # it out of S again. Projecting the fp32 first moment keeps every update in S.
                m_coords = coordinates(m, u, axis)
                from_coordinates(m_coords, u, axis, m)
                v_d = v.float().mean(dim=axis, keepdim=True)  # one value per column / row
                v.copy_(v_d.expand_as(v))
                todo.append((st, axis, u, self._before[fqn], m_coords, v_d, bc1, bc2))
            groups: Dict[Any, List[Any]] = {}
            for item in todo:
                groups.setdefault((item[5].device, item[5].dtype), []).append(item)
            for items in groups.values():
                denoms = torch._foreach_div([i[5] for i in items], [i[7] for i in items])
                torch._foreach_sqrt_(denoms)
                torch._foreach_add_(denoms, [float(i[0].group.get("eps", 1e-8)) for i in items])
                befores = [i[3] for i in items]
                decay = [1.0 - _lr(i[0]) * _wd(i[0]) for i in items]
                torch._foreach_mul_(befores, decay)
                for (st, axis, u, before, m_coords, _, bc1, _), denom in zip(items, denoms):
                    # the step on the coordinates: the denominator is constant along d
                    coords = before.addcdiv_(m_coords, denom, value=-_lr(st) / bc1)
                    from_coordinates(coords, u, axis, st.main_param)
            copies: Dict[Any, List[Any]] = {}
            for st, *_ in todo:
                main, model = st.main_param, st.model_param
                if main is not model:
                    key = (model.device, model.dtype, main.dtype)
                    copies.setdefault(key, []).append((model.data, main))
            for pairs in copies.values():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def reproject(self, view: OptimizerView) -> None:
        """Project every constrained parameter and its first moment onto the current S."""
        with torch.no_grad():
            for fqn, axis in self.constrained.items():
                st = view.param_state(fqn)
                if st is None:
                    continue
                main = st.main_param
                u = self.subspace.on(main.device).u
                project_(main, u, axis)
                if main is not st.model_param:
                    st.model_param.data.copy_(main)
                m = st.state.get("exp_avg")
                if m is not None:
                    project_(m, u, axis)
