"""Grass's optimizer side: the subspace update, re-warm-up, state reset and reselection.

What it does:
    The optimizer (megatron-core's Adam(W), unchanged) steps each virtual parameter ``V``
    (``megatron_ext.autograd.grass``), so its moments live in the ``r x n`` subspace and only
    the selected rows move. :class:`GrassOptimizerHook` adapts that step to Grass:

    * ``pre_step``: keep the fp32 ``V`` before the step;
    * ``post_step``: scale the step taken by ``alpha * warm(t)`` — ``V <- V_0 + s (V_1 -
      V_0)``, which is AdamW with learning rate ``s * lr`` (the moments do not depend on the
      learning rate) — decay the fp32 ``base`` rows by the same ``s * lr * wd`` (so that the
      selected rows ``base + P V`` follow decoupled weight decay exactly), write the rows into
      the frozen weight and copy ``V`` to the model parameter;
    * on a selection step (``t % K == 0``): all-reduce every layer's gradient sketch over the
      data-parallel group in one buffer, choose the rows for steps ``t+1 .. t+K`` (identical
      on every data-parallel rank), fold ``V`` into the weight, zero ``V`` and either zero
      the Adam moments of ``V`` (``reset_state``, the paper's 60M/350M runs) or carry them
      with their rows (``--no-grass-reset-state``, the paper's 1B run): a row selected
      before and after keeps its moments (moved to its new slot; with sampling with
      replacement rescaled by ``rho_new / rho_old``, squared for the second moment, since
      the moments are those of ``rho G_row``), a newly selected row starts at zero, a
      dropped row's moments are discarded. The learning rate re-warms up over ``rewarmup``
      steps from there.

    Bias correction. Adam's bias correction undoes the zero start of the moments: with
    ``k`` updates accumulated since a moment was zero, the paper's Adam (its Algorithm 4,
    ``t`` the number of updates since ``opt.init``, 1 for the first) divides by
    ``1 - b^k``. torch's Adam counts one ``step`` per parameter, which here counts every
    optimizer step of ``V`` (including step 0, whose gradient is zero when the selection
    needs the sketch) and is never restarted: megatron-core requires one Adam step count
    shared by all parameters (its checkpoints refuse anything else). So each slot keeps the
    torch step count at which its moments were last zero (``since``: the selection that
    reset them or brought its row in; a kept row keeps its own), and ``post_step`` rescales
    the slot's step by ``c = (1 - b1^t) / (1 - b1^k) * sqrt((1 - b2^k) / (1 - b2^t))`` with
    ``k = t - since`` (exact up to Adam's ``eps``; the decoupled decay term is kept
    unscaled). The first update after a selection is then the paper's rule exactly: a new
    or reset row takes ``k = 1``, a kept row continues its own count.

    Step 0 takes the first sketch, so the projected weights first move at step 1 (unless
    the selection does not depend on the gradient: uniform sampling, or ``r`` covering the
    whole dimension, which select before step 0).

    A selection whose reduced sketch has a norm that is not finite (an fp16 overflow: the
    step that megatron skips also sketches infs and NaNs) is postponed: every layer keeps
    its selection, ``V`` and moments, one warning is logged, and the next step sketches and
    selects again, exactly as if the selection step had been the next one. Top-r would
    otherwise rank NaN rows first and train them for ``K`` steps. The sketch is all-reduced
    before the check, so every data-parallel replica postpones alike.

Constraints:
    Pure torch; never imports Megatron. The optimizer must be decoupled AdamW (megatron's
    ``adam`` with decoupled weight decay): the row decay and the bias correction above are
    AdamW's; other optimizers are refused before training (when the method is installed:
    ``megatron_ext.methods.grass``; in ``pretrain_gpt.py`` also from its flags). Not for the distributed optimizer (its ``V`` shards are
    flat slices; refused by the method's validation).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional

import torch

from megatron_ext.autograd.grass import GrassLayer, write_rows
from megatron_ext.logging import get_logger
from megatron_ext.protocols import SAME, OptimizerHook, OptimizerView, ParamOptimState

__all__ = ["GrassOptimizerHook", "GrassSchedule", "GrassOuterView"]

logger = get_logger(__name__)


class GrassSchedule:
    """When Grass selects and how its learning rate re-warms up.

    Args:
        update_interval: ``K`` (0: select once, never again).
        rewarmup: re-warm-up steps after each selection (0: none).
        scale: ``alpha``.
    """

    def __init__(self, update_interval: int, rewarmup: int, scale: float):
        self.update_interval = update_interval
        self.rewarmup = rewarmup
        self.scale = scale

    def is_selection_step(self, step: int) -> bool:
        """Whether the end of ``step`` chooses the rows of the next steps."""
        if step == 0:
            return True
        return self.update_interval > 0 and step % self.update_interval == 0

    def lr_scale(self, step: int, active_since: int) -> float:
        """``alpha * warm``: the factor on the learning rate of the projected weights."""
        if self.rewarmup <= 0:
            return self.scale
        return self.scale * min(1.0, (step - active_since + 1) / self.rewarmup)


class GrassOptimizerHook(OptimizerHook):
    """See module docstring.

    Args:
        layers: projected weights by FQN.
        schedule: selection interval, re-warm-up and scale.
        reduce_sketches: all-reduces one flat fp32 tensor over the data-parallel group in
            place (summing; the ranking does not depend on the scale).
        reset_state: zero ``V``'s Adam moments at each new selection (False: carry each
            kept row's moments to its new slot, zero those of new rows).
        param_fqn: FQN of a layer's virtual parameter.
    """

    name = "grass"
    elastic_rules: ClassVar[Mapping[str, str]] = {
        "active_since": SAME,
        "selections": SAME,
        "since": SAME,
        "pending": SAME,  # a postponed selection (the overflow check is all-reduced)
        "index": SAME,
        "rho": SAME,
        "base": SAME,
    }

    def __init__(
        self,
        layers: Dict[str, GrassLayer],
        schedule: GrassSchedule,
        reduce_sketches: Callable[[torch.Tensor], None],
        *,
        reset_state: bool,
        param_fqn: Callable[[str], str],
    ):
        self.layers = layers
        self.schedule = schedule
        self.reduce_sketches = reduce_sketches
        self.reset_state = reset_state
        self.param_fqn = param_fqn
        self.active_since = 0
        self.selections = 0
        self.since: Dict[str, torch.Tensor] = {}
        """Per layer, per slot (int64 ``[r]``, on the weight's device): torch Adam's step
        count when the slot's moments were last zero (module doc, bias correction)."""
        self._since_all: Dict[str, Optional[int]] = {}
        """The common value of ``since[fqn]`` when every slot shares it, else None (the
        steady step then needs no per-slot factor)."""
        self.pending = False
        """A selection was postponed (sketch not finite): the next step selects."""
        self._before: Dict[str, torch.Tensor] = {}
        self._selecting = False

    # -- selection ---------------------------------------------------------------------------

    def initial_selection(self, new: Optional[Dict[str, GrassLayer]] = None) -> None:
        """Select before step 0 where no layer needs the gradient to do so.

        Args:
            new: the layers added since the last call (default: all); Megatron-LM builds
                the chunks of a virtual pipeline one at a time.
        """
        if all(not layer.needs_sketch for layer in self.layers.values()):
            for fqn, layer in (self.layers if new is None else new).items():
                layer.reselect(0, layer.param.data)
                # no Adam step yet: the moments start at zero with step 0
                self.since[fqn] = torch.zeros_like(layer.index)
                self._since_all[fqn] = 0
            self.selections = 1
        else:
            # Step 0 then sketches and selects every layer (also any selected earlier).
            self.selections = 0

    def begin_step(self, step: int) -> None:
        """Before the step's backward: start the sketches of a selection step."""
        # A selection made before step 0 (initial_selection) serves until step K.
        self._selecting = self.pending or (
            self.schedule.is_selection_step(step) and (step > 0 or self.selections == 0)
        )
        if self._selecting:
            for layer in self.layers.values():
                layer.start_sketch(step)

    def _select(self, view: OptimizerView, step: int) -> None:
        layers = [layer for layer in self.layers.values() if layer.sketching]
        if layers:
            parts = [
                layer.sketch if layer.sketch is not None else layer.empty_sketch()
                for layer in layers
            ]
            flat = torch.cat([p.reshape(-1) for p in parts])
            self.reduce_sketches(flat)
            offset = 0
            for layer, part in zip(layers, parts):
                layer.sketch = flat[offset : offset + part.numel()].view_as(part)
                offset += part.numel()
            for layer in layers:  # tensor-parallel ranks sharing a projected dimension
                layer.reduce_sketch_over_tp()
        norms = {id(layer): layer.sketch_norms() for layer in layers}
        # One host synchronization on a selection step: is every norm finite?
        if norms and not bool(torch.isfinite(torch.cat(list(norms.values()))).all()):
            self._postpone(step)
            return
        self.pending = False
        for fqn, layer in self.layers.items():
            state = view.param_state(self.param_fqn(fqn))
            main = layer.param.data if state is None else state.main_param
            old_index, old_rho = layer.index, layer.rho
            layer.reselect(step, main, norms.get(id(layer)))
            if state is not None:
                if main is not layer.param:
                    layer.param.data.copy_(main)
                self._restart_moments(fqn, layer, state, old_index, old_rho)
        self.active_since = step + 1
        self.selections += 1

    def _restart_moments(
        self,
        fqn: str,
        layer: GrassLayer,
        state: Any,
        old_index: Optional[torch.Tensor],
        old_rho: Optional[torch.Tensor],
    ) -> None:
        """After ``layer`` took a new selection: zero ``V``'s moments, or move each kept
        row's moments to its new slot (module doc), and record each slot's ``since``."""
        now = state.adam_step or 0
        index = layer.index
        fresh = torch.full(index.shape, now, dtype=torch.int64, device=index.device)
        if self.reset_state or old_index is None or fqn not in self.since:
            # the first selection too: V's moments hold nothing yet (V had no gradient)
            _reset_moments(state.state)
            self.since[fqn], self._since_all[fqn] = fresh, now
            return
        # Each new slot's row among the old slots (the first old slot holding it).
        order = torch.sort(old_index, stable=True).indices
        old_sorted = old_index.index_select(0, order)
        pos = torch.searchsorted(old_sorted, index).clamp_max(old_index.numel() - 1)
        kept = old_sorted.index_select(0, pos).eq(index)
        src = order.index_select(0, pos)
        ratio = layer.rho.double() / old_rho.double().index_select(0, src)
        for key, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
            if key not in state.state:
                continue
            moments = state.state[key]
            rows = moments if layer.mode == "row" else moments.t()  # slots first
            scale = ratio.pow(power).to(rows.dtype)[:, None]
            moved = rows.index_select(0, src) * scale
            rows.copy_(torch.where(kept[:, None], moved, torch.zeros_like(moved)))
        since = torch.where(kept, self.since[fqn].index_select(0, src), fresh)
        self.since[fqn] = since
        # a selection step synchronizes with the host anyway
        first = int(since[0])
        self._since_all[fqn] = first if bool(since.eq(first).all()) else None

    def _postpone(self, step: int) -> None:
        """Keep every selection and retry at the next step (module doc)."""
        for layer in self.layers.values():
            layer.sketching, layer.sketch, layer.omega = False, None, None
        self.pending = True
        logger.warning(
            "Grass: the gradient sketch of step %d is not finite (an fp16 overflow?); the "
            "selection is postponed to step %d, the current rows stay selected",
            step,
            step + 1,
        )

    # -- the step ----------------------------------------------------------------------------

    def pre_step(self, view: OptimizerView) -> None:
        # One copy of every layer's V, a foreach op per device and dtype (not one per layer).
        self._before = {}
        groups: Dict[Any, List[Any]] = {}
        for fqn, layer in self.layers.items():
            if layer.index is None:
                continue
            state = view.param_state(self.param_fqn(fqn))
            if state is not None:
                main = state.main_param.detach()
                groups.setdefault((main.device, main.dtype), []).append((fqn, main))
        for members in groups.values():
            copies = [torch.empty_like(main) for _, main in members]
            torch._foreach_copy_(copies, [main for _, main in members])
            self._before.update((fqn, c) for (fqn, _), c in zip(members, copies))

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        """The rescaled step, the row decay and the row write of every layer (module doc).

        The per-layer work is gathered first and then run as foreach ops over the layers
        that share a device, a dtype and (for ``add_``'s ``alpha``) a scalar: each tensor
        sees the same operations in the same order as a loop over the layers would apply
        (the layers' tensors are distinct), so the results are the same bits.
        """
        step = view.step
        s = self.schedule.lr_scale(step, self.active_since)
        rescale: Dict[Any, List[Any]] = {}  # (device, dtype) -> [(main, before, factor)]
        decay: Dict[Any, List[Any]] = {}  # (device, dtype, alpha) -> [(main, before)]
        bases: Dict[Any, List[Any]] = {}  # (device, dtype) -> [(base, factor)]
        written: List[Any] = []  # (layer, main)
        for fqn, layer in self.layers.items():
            state = view.param_state(self.param_fqn(fqn))
            if state is None or fqn not in self._before:
                continue
            main = state.main_param
            before = self._before[fqn]
            lr = float(state.group["lr"])
            wd = float(state.group.get("weight_decay", 0.0))
            decoupled = bool(wd) and state.decoupled_weight_decay
            c = self._bias_correction(fqn, layer, state) if update_successful else 1.0
            key = (main.device, main.dtype)
            if isinstance(c, torch.Tensor):  # one factor per slot (rare: after a selection)
                with torch.no_grad():
                    c = c.to(main.dtype)
                    main.sub_(before).mul_(c * s).add_(before)
                    if decoupled:
                        # keep the decay term -lr*wd*V0 at scale s (only Adam's part gets c)
                        main.add_(before * ((c - 1.0) * (s * lr * wd)))
            else:
                if s * c != 1.0:
                    rescale.setdefault(key, []).append((main, before, s * c))
                if decoupled and c != 1.0:
                    decay.setdefault(key + (s * lr * wd * (c - 1.0),), []).append((main, before))
            if update_successful and decoupled:
                base = layer.base
                bases.setdefault((base.device, base.dtype), []).append((base, 1.0 - s * lr * wd))
            written.append((layer, main))
        with torch.no_grad():
            for members in rescale.values():
                mains, befores, factors = (list(t) for t in zip(*members))
                torch._foreach_sub_(mains, befores)
                torch._foreach_mul_(mains, factors)
                torch._foreach_add_(mains, befores)
            for (_, _, alpha), members in decay.items():
                mains, befores = (list(t) for t in zip(*members))
                torch._foreach_add_(mains, befores, alpha=alpha)
            for members in bases.values():
                tensors, factors = (list(t) for t in zip(*members))
                torch._foreach_mul_(tensors, factors)
            write_rows([layer for layer, _ in written], [main for _, main in written])
            copies: Dict[Any, List[Any]] = {}
            for layer, main in written:
                if main is not layer.param:
                    param = layer.param.data
                    copies.setdefault((param.device, param.dtype, main.dtype), []).append(
                        (param, main)
                    )
            for members in copies.values():
                params, mains = (list(t) for t in zip(*members))
                torch._foreach_copy_(params, mains)
        self._before = {}
        if self._selecting:
            self._select(view, step)
            self._selecting = False

    def _bias_correction(self, fqn: str, layer: GrassLayer, state: Any) -> Any:
        """``c`` of the module docstring: Adam's bias correction of the ``k = t - since``
        updates since each slot's moments were zero instead of the global count ``t``'s.

        Returns:
            a float when every slot shares ``since``, else a tensor broadcasting over ``V``
            (``[r, 1]`` for rows, ``[1, r]`` for columns) on ``V``'s device.
        """
        t = state.adam_step
        if t is None or fqn not in self.since:
            return 1.0
        b1, b2 = state.group.get("betas", (0.9, 0.999))
        common = self._since_all.get(fqn)
        if common is not None:
            k = t - common
            if common <= 0 or k <= 0:
                return 1.0
            return ((1 - b1**t) / (1 - b1**k)) * ((1 - b2**k) / (1 - b2**t)) ** 0.5
        k = (t - self.since[fqn]).clamp_min(1).to(torch.float64)
        c = ((1 - b1**t) / (1 - torch.pow(b1, k))) * torch.sqrt(
            (1 - torch.pow(b2, k)) / (1 - b2**t)
        )
        return c[:, None] if layer.mode == "row" else c[None, :]

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "active_since": self.active_since,
            "selections": self.selections,
            "pending": self.pending,
        }
        for fqn, layer in self.layers.items():
            for key, value in layer.state_dict().items():
                out[f"{key}/{fqn}"] = value
            if fqn in self.since:
                out[f"since/{fqn}"] = self.since[fqn].detach().cpu().clone()
        return out

    def upgrade_state(self, state: Dict[str, Any], version: int) -> Dict[str, Any]:
        """A state saved at megatron_ext state format ``version`` (older than the current one)
        in the current form: format 1 may predate the per-slot counts (``since/<fqn>``), with
        one count ``reset_at`` for every slot of every selection."""
        if version < 2 and "reset_at" in state:
            state = dict(state)
            count = int(state.pop("reset_at"))
            for key, value in list(state.items()):
                kind, _, fqn = key.partition("/")
                if kind == "index" and f"since/{fqn}" not in state:
                    state[f"since/{fqn}"] = torch.full_like(value, count, dtype=torch.int64)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        known = {"active_since", "selections", "pending"}
        missing = known - set(state)
        per_layer: Dict[str, Dict[str, Any]] = {fqn: {} for fqn in self.layers}
        since: Dict[str, torch.Tensor] = {}
        unexpected: List[str] = []
        for key, value in state.items():
            if key in known:
                continue
            kind, _, fqn = key.partition("/")
            if fqn in per_layer and kind == "since":
                since[fqn] = value
            elif fqn not in per_layer or kind not in ("index", "rho", "base"):
                unexpected.append(key)
            else:
                per_layer[fqn][kind] = value
        if missing or unexpected:
            raise ValueError(
                f"Grass state does not fit this model: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        self.active_since = int(state["active_since"])
        self.selections = int(state["selections"])
        self.pending = bool(state["pending"])
        self.since, self._since_all = {}, {}
        for fqn, layer in self.layers.items():
            layer.load_state_dict(per_layer[fqn])
            if layer.index is None:
                continue
            if fqn in since:
                value = since[fqn].to(layer.index.device, torch.int64)
                if value.shape != layer.index.shape:
                    raise ValueError(f"Grass state of {fqn}: 'since' does not fit its selection")
            else:
                raise ValueError(f"Grass state does not fit this model: missing since/{fqn}")
            self.since[fqn] = value
            first = int(value[0]) if value.numel() else 0
            self._since_all[fqn] = first if bool(value.eq(first).all()) else None


def _reset_moments(state: Dict[str, Any]) -> None:
    """Zero Adam's moments of one parameter (torch, TE and Apex use these keys)."""
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key].zero_()


class GrassOuterView(OptimizerView):
    """The optimizer view an outer synchronization (DiLoCo) works through when Grass trains
    some weights: each projected weight is one whole parameter, its virtual parameter is
    hidden.

    The outer step reads and writes a model's weights: with Grass those of a projected layer
    are the frozen weight ``W`` (its selected rows ``base + P V`` after every step), not the
    virtual parameter ``V`` (an offset, zeroed at every selection). So this view lists, in
    the place of ``V``'s FQN, the weight's FQN, whose ``main_param`` is ``W`` at full
    precision (:meth:`GrassLayer.effective_weight`: the weight itself when fp32, else an fp32
    master copy kept from now on, :meth:`GrassLayer.keep_master`). Writing it
    (:meth:`write_param`) sets every row of ``W`` (and the master copy), takes the selected
    rows as ``base`` and zeroes ``V`` through the wrapped view (main and model parameter):
    the effective weight is what was written, and Grass's next step moves it from there.
    ``V``'s Adam moments stay, as every other parameter's inner optimizer state does across
    an outer step. Every other parameter passes through.

    :meth:`site_state` is what a site must keep of its own beyond the optimizer's parameters
    and state (megatron's checkpoint holds one data-parallel replica of the frozen weights):
    the weights and their master copies.

    Args:
        inner: the optimizer's view (``V`` among its parameters).
        layers: projected weights by layer FQN.
        param_fqn: FQN of a layer's virtual parameter.
        weight_fqn: FQN of a layer's weight.
    """

    def __init__(
        self,
        inner: OptimizerView,
        layers: Dict[str, GrassLayer],
        *,
        param_fqn: Callable[[str], str],
        weight_fqn: Callable[[str], str],
    ):
        self.inner = inner
        self.layers = layers
        self.param_fqn = param_fqn
        self._by_virtual = {param_fqn(f): f for f in layers}
        self._by_weight = {weight_fqn(f): f for f in layers}
        self._weight_of = {f: w for w, f in self._by_weight.items()}
        for layer in layers.values():
            layer.keep_master()

    def fqns(self) -> List[str]:
        out = []
        for fqn in self.inner.fqns():
            layer = self._by_virtual.get(fqn)
            out.append(fqn if layer is None else self._weight_of[layer])
        return out

    def param_state(self, fqn: str) -> Optional[ParamOptimState]:
        layer_fqn = self._by_weight.get(fqn)
        if layer_fqn is None:
            return None if fqn in self._by_virtual else self.inner.param_state(fqn)
        layer = self.layers[layer_fqn]
        return ParamOptimState(
            fqn=fqn, model_param=layer.weight, main_param=layer.effective_weight(), state={}
        )

    @property
    def step(self) -> int:
        return self.inner.step

    def param_numels(self) -> Dict[str, int]:
        out = {}
        for fqn, n in self.inner.param_numels().items():
            layer = self._by_virtual.get(fqn)
            if layer is None:
                out[fqn] = n
            else:
                out[self._weight_of[layer]] = self.layers[layer].weight.numel()
        return out

    def write_param(self, fqn: str, value: torch.Tensor) -> None:
        layer_fqn = self._by_weight.get(fqn)
        if layer_fqn is None:
            self.inner.write_param(fqn, value)
            return
        layer = self.layers[layer_fqn]
        with torch.no_grad():
            if layer.master is not None:
                layer.master.copy_(value.view_as(layer.master))
            layer.weight.copy_(value.view_as(layer.weight))
            layer.rebase()
        v = self.inner.param_state(self.param_fqn(layer_fqn))
        if v is not None:
            self.inner.write_param(v.fqn, torch.zeros_like(v.main_param))

    def sync_params(self) -> None:
        self.inner.sync_params()

    def loss_scale(self) -> Optional[torch.Tensor]:
        return self.inner.loss_scale()

    def site_state(self) -> Dict[str, torch.Tensor]:
        """This rank's projected weights (and fp32 master copies), by weight FQN."""
        out = {}
        for fqn, layer_fqn in self._by_weight.items():
            layer = self.layers[layer_fqn]
            out[f"weight/{fqn}"] = layer.weight.detach().cpu().clone()
            if layer.master is not None:
                out[f"master/{fqn}"] = layer.master.detach().cpu().clone()
        return out

    def load_site_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Restore :meth:`site_state` (ValueError when it does not fit these weights)."""
        expected = set(self.site_state_keys())
        if set(state) != expected:
            raise ValueError(
                f"Grass site state does not fit this model: missing "
                f"{sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}"
            )
        with torch.no_grad():
            for key, value in state.items():
                kind, _, fqn = key.partition("/")
                layer = self.layers[self._by_weight[fqn]]
                target = layer.weight if kind == "weight" else layer.master
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"Grass site state: {key} does not fit its weight")
                target.copy_(value)

    def anchor(self) -> None:
        """Take the master copies from the weights as they are now: after a load that wrote
        the model's weights but not DiLoCo's state (``--finetune``, a release checkpoint,
        ``--ext-state-on-mismatch reset``, an elastic resume), the copies made at install
        hold the initial weights."""
        with torch.no_grad():
            for layer in self.layers.values():
                if layer.master is not None:
                    layer.master.copy_(layer.weight)

    def site_state_keys(self) -> List[str]:
        """The keys :meth:`site_state` returns."""
        keys = []
        for fqn, layer_fqn in self._by_weight.items():
            keys.append(f"weight/{fqn}")
            if self.layers[layer_fqn].master is not None:
                keys.append(f"master/{fqn}")
        return keys
