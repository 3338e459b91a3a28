"""QuantizedAdam: frozen Adam variance and a k-bit momentum exchange with error compensation.

What it does (the AQ-SGD authors' data-parallel compression, ``DS3Lab/AC-SGD``
``data_parallel/dist_dp_sharded_ps_compressed.py``; Tang et al. 2021, "1-bit Adam", at
``bits`` bits):

    * Warm-up (the first ``warmup_steps`` applied optimizer steps; an fp16 step skipped
      for overflow does not count, so the frozen variance is always one Adam computed):
      megatron-core's dense gradient all-reduce (:class:`QuantizedAdamReducer` issues
      megatron's collectives) and megatron's own Adam.
    * Afterwards, per iteration, with ``m`` the momentum every rank holds (identical on all),
      ``v`` Adam's variance as the warm-up left it (frozen) and ``g_i`` rank ``i``'s own
      gradient (not all-reduced: the reducer only exchanges a 4-byte non-finite flag and
      rescales the local buffer so that the ranks' mean is the dense reduction):

        1. ``u_i = beta1 * m + (1 - beta1) * g_i`` (rank-local momentum);
        2. ``m' = Q(u_i)``: the quantized collective of
           :mod:`megatron_ext.collectives.quantized` on a flat fp32 buffer of the momenta
           (one buffer for all parameters, as the authors flatten theirs; a parameter tied
           across pipeline stages, the shared word embedding, gets a buffer of its own so
           both stages quantize it identically): worker error ``e_i``, ``W`` partitions of
           ``block_size``-value rows with one fp16 scale each, all-to-all, the partition
           owner's mean of the ``W`` dequantized copies, server error ``s``, re-quantized,
           all-gather. ``m <- m'`` on every rank (bit-identical);
        3. ``step += 1``; ``p <- p - lr * sqrt(1 - beta2^step) / (1 - beta1^step) * m /
           (sqrt(v) + eps)``, then ``p <- p - lr * wd * p`` (decoupled weight decay after
           the update, bias correction with the running step: the authors' ``step_update``
           with ``freeze=True``). ``lr``, ``wd``, betas and eps come from the parameter's
           optimizer group, so megatron's schedule and no-decay groups apply.

    Invariant (error compensation is exact): with ``e_i`` the worker errors and ``s`` the
    server errors (each owner's partition, concatenated), zero at the end of the warm-up,
    after ``T`` compressed steps

        ``sum_t m'_t = sum_t mean_i(u_i,t) + (mean_i e_i,0 + s_0) - (mean_i e_i,T + s_T)``

    so the cumulative applied momentum equals the cumulative true mean momentum (of the
    momentum the ranks computed) up to the current residuals (tests/distributed/
    test_quantized_adam.py checks it in float64).

How it reaches megatron's optimizer:
    The :class:`QuantizedAdamHook` owns the post-warm-up update through
    :meth:`OptimizerHook.update_override`: megatron's optimizer step runs as usual (fp16
    unscaling and the found-inf check, gradient clipping, copying fp32 main parameters back
    to the model), and only the wrapped torch optimizer's ``step()`` is replaced by the
    update above. Momentum and variance stay in that optimizer's state (``exp_avg``,
    ``exp_avg_sq``, ``step``), so megatron checkpoints them; the hook's own state is the
    error residuals, keyed by parameter FQN (``worker_error/<fqn>``, ``server_error/<fqn>``),
    and the count of applied steps (``applied_steps``).

Skipped steps:
    After the warm-up gradients are rank-local, so a rank's overflow is not every rank's:
    the reducer all-reduces each rank's non-finite flag and makes every rank's gradient
    non-finite when any rank's is (:meth:`CompressedReduction.poison`). megatron's loss
    scaler then skips the step on every rank, the torch optimizer's ``step()`` is not
    called and nothing of QuantizedAdam's state (momentum, variance, step, residuals) is
    touched, and the step does not count toward the warm-up. Without loss scaling training
    stops (``ReducerStepHook``).

Distributed optimizer:
    The warm-up reduce-scatters as megatron does. Afterwards each rank still needs the whole
    ``m`` and its whole local gradient to form ``u_i``; the exchange already ends with every
    rank holding the whole ``m'`` (its all-gather), so the exchange buffer is kept between
    steps as the whole momentum (it exists without the distributed optimizer too) and the
    local gradient is read from megatron's full gradient buffer (``main_grad``, unscaled by
    the loss scale as megatron unscales its shards). Each rank then copies its part of
    ``m'`` into its ``exp_avg`` shard and applies step 3 to its shards of the parameter and
    the frozen ``v``; megatron's parameter all-gather does the rest. Sharded per rank: the
    fp32 main parameters, ``exp_avg`` and ``exp_avg_sq`` (what a checkpoint stores and an
    elastic resume reshards); whole per rank, as without it: the exchange buffer and the
    worker error. The buffer is filled once from the ``exp_avg`` shards (a SUM all-reduce,
    metered) at the first compressed step and after each load. Gradient clipping is refused
    (``methods.quantized_adam``): megatron would clip by a norm of shards of different
    ranks' local gradients, which the full local gradient used here does not see.

Constraints:
    torch.distributed only; never imports Megatron. One data-parallel group for every
    parameter; with the distributed optimizer one ``beta1`` for all parameter groups.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.collectives.grad_reducer import (
    BoundReduction,
    BucketGroupSpec,
    BucketView,
    CompressedReduction,
    DenseGradReducer,
    GradReducer,
    ParamSlice,
    check_state_keys,
)
from megatron_ext.collectives.quantized import _QuantizedReduction
from megatron_ext.options.base import ConfigError
from megatron_ext.options.quantized import QuantizedConfig
from megatron_ext.options.quantized_adam import QuantizedAdamConfig
from megatron_ext.protocols import (
    MEAN,
    PARTITION,
    SAME,
    OptimizerHook,
    OptimizerView,
    ParamOptimState,
)

__all__ = ["QuantizedAdamReducer", "QuantizedAdamHook", "MomentumExchange"]


class QuantizedAdamReducer(GradReducer[BoundReduction]):
    """Dense all-reduce during the warm-up; afterwards gradients stay local.

    Args:
        cfg: a :class:`~megatron_ext.options.quantized_adam.QuantizedAdamConfig`.
    """

    name = "quantized-adam"
    elastic_rules: ClassVar[Mapping[str, str]] = {}
    supports = ("all_reduce", "reduce_scatter")
    reduces_gradient = False

    def __init__(self, cfg: QuantizedAdamConfig):
        super().__init__()
        self.cfg = cfg
        self.applied_steps = 0
        """Optimizer steps applied so far (counted by :class:`QuantizedAdamHook`)."""

    def compressing(self, step: Optional[int] = None) -> bool:
        """Past the warm-up: gradients stay local, the momentum is exchanged.

        Args:
            step: the training iteration; when given, a step inside another method's
                uncompressed warm-up (:meth:`GradReducer.dense_at`, AQ-SGD's
                ``--aqsgd-warmup-epochs``) is not compressed either: its gradient was
                all-reduced densely, so megatron's own Adam applies it.
        """
        if step is not None and self.dense_at(step):
            return False
        return self.applied_steps >= self.cfg.warmup_steps

    def _bind(self, spec: BucketGroupSpec) -> BoundReduction:
        return _LocalAfterWarmup(self, spec)

    def slices(self) -> List[ParamSlice]:
        """Every bound parameter (FQN and shape), in bucket order."""
        return [s for b in self.bound for view in b.spec.buckets for s in view.params]


class _LocalAfterWarmup(CompressedReduction):
    """One bucket group: megatron's dense collective in the warm-up, then local gradients."""

    def __init__(self, owner: QuantizedAdamReducer, spec: BucketGroupSpec):
        super().__init__(spec)
        self.owner = owner
        self.dense = DenseGradReducer()._bind(spec)

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        if not self.owner.compressing(step):
            return self.dense.launch(step, force_all_reduce)
        spec = self.spec
        device = spec.buckets[0].grad.device
        flag = self.input_flag(device, *[view.grad for view in spec.buckets])
        work = self.all_reduce(flag, dense=0)

        def then():
            for view in spec.buckets:
                # The rank's own gradient in the units of the reduced one: megatron
                # pre-scaled it by its 1/W share under SUM.
                if spec.share != 1.0:
                    view.grad.mul_(1.0 / spec.share)
                self.poison(view, flag, False)

        return self.finish([work], then)


class MomentumExchange:
    """The quantized exchange of one flat fp32 momentum buffer (step 2, module docstring).

    Reuses the quantized gradient collective on the buffer as one bucket under AVG: worker
    error, all-to-all, mean, server error, all-gather.

    Args:
        params: the parameters laid out in the buffer.
        bits: bits per value.
        block_size: values per fp16 scale.
        group: data-parallel process group.
        meter: byte meter (category ``dp-grad``), or None.
        device: where the buffer lives.
    """

    def __init__(
        self,
        params: Sequence[ParamSlice],
        *,
        bits: int,
        block_size: int,
        group: Any,
        meter: Any,
        device: torch.device,
    ):
        numel = params[-1].end if params else 0
        self.buffer = torch.zeros(numel, dtype=torch.float32, device=device)
        self.params = tuple(params)
        view = BucketView(
            grad=self.buffer,
            params=self.params,
            key=f"{params[0].fqn}..{params[-1].fqn}" if params else "empty",
        )
        spec = BucketGroupSpec(
            buckets=(view,),
            group=group,
            group_size=torch.distributed.get_world_size(group),
            group_rank=torch.distributed.get_rank(group),
            op=torch.distributed.ReduceOp.AVG,
            meter=meter,
        )
        qcfg = QuantizedConfig(bits=bits, block_size=block_size, error_feedback=True)
        self.reduction = _QuantizedReduction(qcfg, spec)

    def exchange(self, step: int) -> None:
        """Replace :attr:`buffer` (this rank's momenta) by the quantized mean, committing
        the new residuals (only called for a step that is applied)."""
        self.reduction.launch(step)
        self.reduction.end_step(True)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """``worker_error/<fqn>`` and ``server_error/<fqn>`` (flat)."""
        return self.reduction.state_dict()

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        self.reduction.load_state_dict(state)


def _layout(params: Sequence[Tuple[str, torch.Tensor]]) -> List[List[ParamSlice]]:
    """Buffers of the parameters ``(fqn, model parameter)``: the tied ones
    (``shared_embedding``) one each, the rest together, back to back in the given order."""

    def slices(group):
        out, pos = [], 0
        for fqn, p in group:
            n = p.numel()
            out.append(ParamSlice(fqn, pos, pos + n, tuple(p.shape)))
            pos += n
        return out

    tied = [fp for fp in params if getattr(fp[1], "shared_embedding", False)]
    rest = [fp for fp in params if not getattr(fp[1], "shared_embedding", False)]
    return [slices(g) for g in ([rest] if rest else []) + [[t] for t in tied]]


class QuantizedAdamHook(OptimizerHook):
    """Owns the optimizer update after the warm-up (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.options.quantized_adam.QuantizedAdamConfig`.
        reducer: the run's :class:`QuantizedAdamReducer` (its bucket groups give the
            data-parallel group, the byte meter and the parameter names).
    """

    name = "quantized_adam"
    # On another DP size: the warm-up is not run again; the worker error is the mean of the
    # old ranks' (the momentum exchange averages), the server error the partition each rank
    # owns.
    elastic_rules: ClassVar[Mapping[str, str]] = {
        "applied_steps": SAME,
        "worker_error": MEAN,
        "server_error": PARTITION,
    }

    def __init__(self, cfg: QuantizedAdamConfig, reducer: QuantizedAdamReducer):
        self.cfg = cfg
        self.reducer = reducer
        # Per optimizer leaf (its FQNs, in order): the momentum buffers.
        self.exchanges: Dict[Tuple[str, ...], List[MomentumExchange]] = {}
        self._pending: Dict[str, torch.Tensor] = {}
        # Exchanges whose buffer holds the whole momentum (distributed optimizer).
        self._replicas: set = set()

    def _spec(self) -> BucketGroupSpec:
        if not self.reducer.bound:
            raise RuntimeError("quantized-adam: the reducer is bound to no bucket group")
        return self.reducer.bound[0].spec

    def check_groups(self) -> None:
        """Refuse parameters reduced over different data-parallel groups (expert data
        parallelism): one exchange group per run."""
        groups = {id(b.spec.group) for b in self.reducer.bound}
        if len(groups) > 1:
            raise ConfigError(
                ["--grad-compression"],
                "'quantized-adam' exchanges the momentum over one data-parallel group; "
                "this model reduces gradients over several (expert data parallelism)",
            )

    # -- the update -------------------------------------------------------------------------

    def update_override(self, view: OptimizerView) -> Optional[Callable[[Sequence[str]], None]]:
        if not self.reducer.compressing(view.step):
            return None
        return lambda fqns: self.update(view, fqns)

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        if update_successful:
            self.reducer.applied_steps += 1

    def _exchanges(self, params: Sequence[Tuple[str, torch.Tensor]]) -> List[MomentumExchange]:
        key = tuple(fqn for fqn, _ in params)
        if key not in self.exchanges:
            spec = self._spec()
            built = [
                MomentumExchange(
                    layout,
                    bits=self.cfg.bits,
                    block_size=self.cfg.block_size,
                    group=spec.group,
                    meter=spec.meter,
                    device=params[0][1].device,
                )
                for layout in _layout(params)
            ]
            for ex in built:
                keys = set(ex.state_dict())
                if keys & set(self._pending):
                    ex.load_state_dict({k: self._pending.pop(k) for k in keys})
            self.exchanges[key] = built
        return self.exchanges[key]

    @torch.no_grad()
    def update(self, view: OptimizerView, fqns: Sequence[str]) -> None:
        """QuantizedAdam's update of the parameters ``fqns`` (one optimizer's), in place of
        that optimizer's ``step()``.

        With the distributed optimizer ``fqns`` are every parameter the optimizer steps over
        the data-parallel group and this rank holds a shard of some (module docstring,
        "Distributed optimizer"); otherwise this rank holds every one whole.
        """
        states = {f: view.param_state(f) for f in fqns}
        sharded = any(st is not None and st.param_range is not None for st in states.values())
        if not sharded and any(st is None for st in states.values()):
            raise RuntimeError("quantized-adam needs every parameter's whole optimizer state")
        params = []
        for f in fqns:
            p = view.model_param(f) if sharded else states[f].model_param
            if p is None:
                raise RuntimeError(f"quantized-adam: no model parameter {f}")
            params.append((f, p))
        mine = [st for st in states.values() if st is not None]
        for st in mine:
            if "exp_avg" not in st.state or "exp_avg_sq" not in st.state:
                raise RuntimeError(f"quantized-adam: {st.fqn} has no Adam state after the warm-up")
            if "step" not in st.state and "step" not in st.group:
                raise RuntimeError(f"quantized-adam: {st.fqn} has no Adam step count")
            if not sharded and st.main_param.grad is None:
                raise RuntimeError(f"quantized-adam: {st.fqn} has no gradient")
        if sharded:
            self._sharded_momenta(view, params, states, mine)
        else:
            for ex in self._exchanges(params):
                for s in ex.params:
                    st = states[s.fqn]
                    beta1 = st.group["betas"][0]
                    m = st.state["exp_avg"]
                    u = ex.buffer[s.start : s.end].view_as(m)
                    torch.add(m.float() * beta1, st.main_param.grad.float(), alpha=1 - beta1, out=u)
                ex.exchange(view.step)
                for s in ex.params:
                    m = states[s.fqn].state["exp_avg"]
                    m.copy_(ex.buffer[s.start : s.end].view_as(m))
        # Adam's step count: per parameter (torch), or per param group (Apex, Transformer
        # Engine), counted once per group.
        counted = set()
        for st in mine:
            if "step" not in st.state and "step" in st.group and id(st.group) not in counted:
                st.group["step"] += 1
                counted.add(id(st.group))
        for st in mine:
            _apply(st)

    def _sharded_momenta(
        self,
        view: OptimizerView,
        params: Sequence[Tuple[str, torch.Tensor]],
        states: Dict[str, Optional[ParamOptimState]],
        mine: Sequence[ParamOptimState],
    ) -> None:
        """Steps 1 and 2 with the distributed optimizer: ``u_i`` from the exchange buffer
        (the whole ``m`` of the last exchange) and this rank's whole local gradient
        (``main_grad``, unscaled as megatron unscales its shards); afterwards this rank's
        shards of ``exp_avg`` take their part of ``m'``."""
        betas = {tuple(st.group["betas"]) for st in mine}
        if not betas:
            raise RuntimeError(
                "quantized-adam: this rank holds no shard of an optimizer's parameters, so it "
                "has no beta1 to form its momentum with"
            )
        if len(betas) != 1:
            raise RuntimeError(
                f"quantized-adam with the distributed optimizer needs one beta1 for every "
                f"parameter group; this rank's groups have {sorted(betas)}"
            )
        beta1 = next(iter(betas))[0]
        scale = view.loss_scale()
        inv = None if scale is None else scale.double().reciprocal().float()
        model = dict(params)
        for ex in self._exchanges(params):
            if id(ex) not in self._replicas:
                self._gather_momentum(ex, states)
            for s in ex.params:
                u = ex.buffer[s.start : s.end]
                grad = getattr(model[s.fqn], "main_grad", None)
                if grad is None:
                    raise RuntimeError(f"quantized-adam: {s.fqn} has no gradient buffer")
                g = grad.view(-1).float()
                if inv is not None:
                    g = g * inv
                torch.add(u * beta1, g, alpha=1 - beta1, out=u)
            ex.exchange(view.step)
            for s in ex.params:
                st = states.get(s.fqn)
                if st is None:
                    continue
                lo, hi = st.param_range
                m = st.state["exp_avg"]
                m.copy_(ex.buffer[s.start + lo : s.start + hi].view_as(m))

    def _gather_momentum(
        self, ex: MomentumExchange, states: Dict[str, Optional[ParamOptimState]]
    ) -> None:
        """The whole ``m`` into ``ex.buffer`` from every rank's ``exp_avg`` shards: once at
        the first compressed step and after each load (a SUM all-reduce of the buffer with
        zeros outside this rank's shards, metered as ``dp-grad`` with no dense
        counterpart)."""
        ex.buffer.zero_()
        for s in ex.params:
            st = states.get(s.fqn)
            if st is None:
                continue
            lo, hi = st.param_range
            ex.buffer[s.start + lo : s.start + hi].copy_(st.state["exp_avg"].reshape(-1))
        reduction = ex.reduction
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            torch.distributed.all_reduce(
                ex.buffer, op=torch.distributed.ReduceOp.SUM, group=reduction.spec.group
            )
        reduction.record("all_reduce", ex.buffer, 0)
        self._replicas.add(id(ex))

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"applied_steps": self.reducer.applied_steps}
        for exchanges in self.exchanges.values():
            for ex in exchanges:
                out.update(ex.state_dict())
        for s in self.reducer.slices():
            for kind in ("worker_error", "server_error"):
                key = f"{kind}/{s.fqn}"
                if key not in out:
                    pending = self._pending.get(key)
                    out[key] = pending if pending is not None else torch.zeros(s.numel)
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        check_state_keys(self.state_dict(), state, "quantized-adam")
        remaining = dict(state)
        self.reducer.applied_steps = int(remaining.pop("applied_steps"))
        for exchanges in self.exchanges.values():
            for ex in exchanges:
                ex.load_state_dict({k: remaining.pop(k) for k in set(ex.state_dict())})
        # Parameters whose buffers are not built yet (before the first compressed step).
        self._pending = remaining
        # The loaded exp_avg shards are the momentum now (distributed optimizer).
        self._replicas = set()


def _apply(st: ParamOptimState) -> None:
    """Step 3 of the module docstring on one parameter (frozen variance); advances the
    parameter's own step count (torch) or reads its group's (Apex, Transformer Engine)."""
    group, state = st.group, st.state
    beta1, beta2 = group["betas"]
    if "step" in state:
        step = state["step"]
        if isinstance(step, torch.Tensor):
            step.add_(1)
        else:
            state["step"] = step + 1
        t = float(state["step"])
    else:  # the group's count, already advanced for this step
        t = float(group["step"])
    lr = group["lr"]
    size = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
    p = st.main_param
    denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
    p.addcdiv_(state["exp_avg"].to(p.dtype), denom.to(p.dtype), value=-size)
    wd = group.get("weight_decay", 0.0)
    if wd > 0.0:
        p.mul_(1.0 - lr * wd)
