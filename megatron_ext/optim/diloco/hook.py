"""DiLoCo's outer step: the optimizer hook that synchronizes data-parallel sites (pure torch).

What it does:
    The data-parallel ranks form G *sites* of consecutive ranks. Inside a site training is
    ordinary data parallelism every step (the gradient seam reduces over the site's ranks,
    :func:`~megatron_ext.optim.diloco.exchange.site_groups` builds those groups); the inner
    optimizer (megatron's AdamW) and its state stay local to the site. Every H steps the
    sites synchronize through an *outer* step (Douillard et al., 2023, "DiLoCo"): with
    ``snapshot`` the fp32 parameters of the last synchronization and ``current`` the fp32
    main parameters now,

        delta  = mean over sites of (snapshot - current)   (the pseudo-gradient)
        buf    = mu * buf + delta
        update = delta + mu * buf   if nesterov else   buf
        snapshot -= lr * update
        parameters := snapshot

    (``torch.optim.SGD`` semantics, no dampening, no weight decay; the first step's
    ``buf`` is ``delta``, as torch's). The mean is taken by an *outer exchange* over the
    group of the ranks holding the same position in each site; the exchange is built by
    :func:`~megatron_ext.optim.diloco.exchange.make_outer_exchange`: the dense all-reduce
    (``none``) or a compressed exchange behind the same interface.

    Streaming DiLoCo (Douillard et al., 2025): the parameters are split into F *fragments*
    (contiguous runs of parameters in FQN order, balanced by element count; every parameter
    in exactly one; ``exchange.py``); fragment i is synchronized after the steps ``t``
    (1-based count of steps taken) with ``t % H == (i * H) // F``. Each fragment has its
    own snapshot, momentum and exchange. With a delay ``tau`` > 0 (Streaming DiLoCo's
    overlap, torchft's ``fragment_sync_delay``) the fragment's pseudo-gradient is computed
    and its exchange started after step ``t``, and the outer step applied after step
    ``t + tau``: the exchange runs while the next ``tau`` inner steps compute. The dense
    exchange is an asynchronous all-reduce; a compressed one (several dependent collectives
    and its codec) runs on the thread of
    :class:`~megatron_ext.optim.diloco.overlap.ExchangeWorker` (``overlap.py``), all of the
    hook's exchanges in one order, its bytes counted when it lands. The fragment's weights
    then become ``alpha * local + (1 - alpha) * global`` (``alpha``: Streaming DiLoCo's
    merge, torchft's ``fragment_update_alpha``; 0, the default, takes the global weights and
    drops the fragment's local progress of the ``tau`` steps, as torchft does).

    :class:`DiLoCoHook` is the optimizer hook that runs the outer step after the inner
    optimizer's step of a synchronizing iteration, and writes the result into both the fp32
    main parameters the optimizer updates and the (bf16/fp16) model parameters.

    Weights another method trains outside the optimizer's parameters (Grass's frozen
    projected weights, whose optimizer parameters are virtual row offsets) are read and
    written through a wrapped optimizer view (``view_wrappers``;
    :class:`~megatron_ext.optim.grass.GrassOuterView`): the outer step sees them as whole
    fp32 parameters.

    With a sharded optimizer (megatron's distributed optimizer inside a site) the hook holds
    this rank's shards: snapshot, momentum and exchange follow the optimizer's main shard,
    the ranks at one position in every site hold the same shards and exchange them;
    fragments are of whole parameters (``OptimizerView.param_numels``), and after an outer
    step the site gathers its parameters (``OptimizerView.sync_params``, scheduled by step so
    every rank of the site joins it).

Why:
    This module is the outer step itself (what is written, when, and what a checkpoint
    keeps); the exchange across sites (its groups, the fragment schedule and the exchanges:
    ``exchange.py``), the exchanges' overlap (``overlap.py``) and the eager outer SGD step
    (``outer_step.py``) live beside it.

Non-finite values:
    The outer update of a fragment is computed into fresh tensors and checked before
    anything is written (one host read per fragment sync: whether the new snapshot and
    momentum are finite). When it is not finite because the averaged pseudo-gradient is
    not (a site whose weights hold a NaN or Inf, a diverged or broken site; or a compressed
    exchange's residual), the ranks of the outer group all-gather one flag per site, each
    saying whether that site's own pseudo-gradient was finite (taken when it was sent; only
    on this path, through the exchange thread when there is one), and then:

    * under loss scaling (fp16) the outer step is skipped: snapshot, momentum and the
      exchange's error feedback stay as they were, the sites keep their own weights, and
      one line naming the sites is printed (by the outer group's first rank);
    * otherwise training stops (:class:`~megatron_ext.protocols.NonFiniteError`) with a
      message naming the site(s), before anything is written or saved.

    An update that is not finite although the averaged pseudo-gradient is (a non-finite
    outer learning rate or momentum state) stops training even under loss scaling: it would
    recur at every sync, and the exchange has already committed its error feedback. The
    decision is the same on every rank of an outer group (they hold the same averaged
    pseudo-gradient, snapshot and momentum); outer groups holding other parameters (other
    shards, stages) decide for their own parameters. An exchange in flight at a save whose
    result is not finite is left out of the saved state under loss scaling (the skip it
    will get), and stops training otherwise (nothing is saved).

Constraints:
    Pure torch; never imports Megatron. State is keyed by parameter FQN. Synchronizations
    are scheduled by iteration number, identical on every site, whether or not a site's
    inner step was skipped (fp16 overflow).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.distributed import ProcessGroup

from megatron_ext.accounting import (
    CommMeter,
    ProcessGroupTrafficMeter,
    collective_device,
    collective_wire_bytes,
)
from megatron_ext.kernels.finite import nonfinite
from megatron_ext.kernels.outer import outer_sgd_step_, pseudo_gradient
from megatron_ext.optim.diloco.exchange import (
    ExchangeFactory,
    fragment_due,
    make_outer_exchange,
    split_fragments,
)
from megatron_ext.optim.diloco.overlap import (
    ExchangeWorker,
    PendingAverage,
    ThreadedAverage,
    _blocking_average,
)
from megatron_ext.options.outer import OuterConfig
from megatron_ext.protocols import (
    RESET,
    NonFiniteError,
    OptimizerHook,
    OptimizerView,
    PseudoGradientExchange,
    is_asynchronous,
)

__all__ = ["DiLoCoHook"]


def _copy_all(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``: one multi-tensor copy where both sides are on
    one device, else one copy each (``--outer-state-device cpu``: host state, device values)."""
    if dst and all(d.device == s.device for d, s in zip(dst, src)):
        torch._foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s)


class DiLoCoHook(OptimizerHook):
    """Runs DiLoCo's outer step after the inner optimizer step of a synchronizing iteration.

    Args:
        options: the ``--outer-*`` options (interval, lr, momentum, nesterov, fragments,
            state_device, compression).
        outer_group: the process group of this rank's position in every site.
        meter: byte accounting (category ``outer``).
        exchange_factory: ``(method, options, numel, group, device, name=, shapes=)`` ->
            exchange, called once per fragment (default :func:`make_outer_exchange`).
        view_wrappers: functions wrapping the optimizer's view into the one the outer step
            reads and writes (another method's weights trained outside the optimizer's
            parameters, e.g. :class:`~megatron_ext.optim.grass.GrassOuterView`), applied
            in order. A wrapped view's ``site_state()`` / ``load_site_state()`` /
            ``anchor()`` (:class:`~megatron_ext.protocols.OptimizerView`) are what a rank
            keeps of its own beyond the optimizer's parameters and state.
    """

    name = "diloco"
    # Every role reset on another DP size: the fresh state's ``anchored`` is False, so the first
    # step takes its snapshots from the loaded weights (every rank resumes from the loaded
    # replica; the outer momentum starts at zero).
    elastic_rules: ClassVar[Mapping[str, str]] = dict.fromkeys(
        ("snapshot", "momentum", "exchanges", "fragments", "syncs", "pending", "view")
        + ("anchored", "site"),
        RESET,
    )

    def __init__(
        self,
        options: OuterConfig,
        outer_group: Optional[ProcessGroup],
        *,
        meter: Optional[CommMeter] = None,
        exchange_factory: Optional[ExchangeFactory] = None,
        view_wrappers: Sequence[Callable[[OptimizerView], OptimizerView]] = (),
    ):
        self.options = options
        self.view_wrappers = list(view_wrappers)
        self.outer_group = outer_group
        self.meter = meter
        self.exchange_factory = exchange_factory or make_outer_exchange
        self.fragments: List[List[str]] = []
        # whether each fragment holds parameters anywhere (this rank may hold none of them)
        self._nonempty: List[bool] = []
        self.snapshot: Dict[str, torch.Tensor] = {}
        self.momentum: Dict[str, torch.Tensor] = {}
        self.exchanges: List[Optional[PseudoGradientExchange]] = []
        self.num_sites = (
            torch.distributed.get_world_size(outer_group) if outer_group is not None else 1
        )
        self.syncs = 0
        # fragment -> (step count after which it is applied, its exchange in flight)
        self.pending: Dict[int, Tuple[int, Union[PendingAverage, ThreadedAverage]]] = {}
        self._pending_load: Optional[Dict[str, Any]] = None
        # The snapshots hold the weights training starts from: False until the first step
        # (or a load of a saved state) confirms it. State allocated at install is taken from
        # the weights before any checkpoint load; a load that writes the model's weights but
        # not this state (--finetune, a release checkpoint, --ext-state-on-mismatch reset, an
        # elastic resume, which resets it) leaves it False, and the first step takes the
        # snapshots (and the outer view's copies) from the loaded weights (:meth:`anchor`).
        self.anchored = False
        # the optimizer's view (the inner state: a site's own parameters and moments) and the
        # outer step's (view_wrappers applied)
        self._raw: Optional[OptimizerView] = None
        self._view: Optional[OptimizerView] = None
        # --outer-delay with a compressed exchange: the thread that runs the exchanges
        self.worker: Optional[ExchangeWorker] = None
        # fragment -> whether this site's pseudo-gradient sent for it was finite (a device
        # bool, read only when the outer update is not finite)
        self._sent_finite: Dict[int, torch.Tensor] = {}
        self.skipped = 0
        """Outer steps skipped under loss scaling (non-finite averaged pseudo-gradient)."""

    # -- setup --------------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """The outer state is allocated (at install; at the latest at the first step)."""
        return bool(self.fragments)

    def _state_device(self, param: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.options.state_device == "cpu" else param.device

    def outer_view(self, view: OptimizerView) -> OptimizerView:
        """``view`` with :attr:`view_wrappers` applied (built once per optimizer view)."""
        if view is not self._raw or self._view is None:
            wrapped = view
            for wrap in self.view_wrappers:
                wrapped = wrap(wrapped)
            self._raw, self._view = view, wrapped
        return self._view

    def views(self) -> Tuple[OptimizerView, OptimizerView]:
        """The optimizer's view and the outer step's (:meth:`outer_view`), once the hook has
        seen the optimizer (at install's :meth:`setup`)."""
        if self._raw is None or self._view is None:
            raise RuntimeError("megatron-ext: DiLoCo's outer step has not seen the optimizer")
        return self._raw, self._view

    def setup(self, view: OptimizerView) -> None:
        """Allocate the outer state from the current parameters (identical on every site at
        the start of training): fragments, fp32 snapshots, exchanges."""
        o = self.options
        view = self.outer_view(view)
        sizes = [(f, view.owned_state(f).main_param.numel()) for f in view.fqns()]
        # Fragments are of whole parameters, split by whole sizes, the same on every rank.
        # With the distributed optimizer this rank holds shards of some of them and
        # exchanges those with the ranks holding the same shards in the other sites.
        sharded = any(view.owned_state(f).param_range is not None for f in view.fqns())
        whole = split_fragments(
            sorted(view.param_numels().items()) if sharded else sizes, o.fragments
        )
        mine = set(view.fqns())
        self.fragments = [[f for f in frag if f in mine] for frag in whole]
        self._nonempty = [bool(frag) for frag in whole]
        device = None
        for fqn in view.fqns():
            main = view.owned_state(fqn).main_param
            device = main.device
            self.snapshot[fqn] = main.detach().to(
                self._state_device(main), torch.float32, copy=True
            )
        numel = dict(sizes)
        shapes = {f: tuple(view.owned_state(f).main_param.shape) for f in numel}
        # options=None: an exchange's own defaults (the compressed exchanges take the options
        # dataclass of their data-parallel method, not the --outer-* options).
        self.exchanges = [
            (
                self.exchange_factory(
                    o.compression,
                    None,
                    sum(numel[f] for f in frag),
                    self.outer_group,
                    device,
                    name=f"outer/{i}",
                    shapes=[(f, shapes[f]) for f in frag],
                )
                if frag
                else None
            )  # an empty fragment (one parameter outweighs a fragment's share)
            for i, frag in enumerate(self.fragments)
        ]
        if self._pending_load is not None:
            self._apply_load(self._pending_load)
            self._pending_load = None

    # -- the outer step -----------------------------------------------------------------------

    def pre_step(self, view: OptimizerView) -> None:
        if not self.initialized:
            self.setup(view)
        if not self.anchored:
            self.anchor(view)

    def anchor(self, view: OptimizerView) -> None:
        """Take the snapshots from the weights as they are now (the first step of a run
        whose state was not loaded): the outer state starts afresh from the loaded weights,
        the same on every site (every rank loaded the same replica), with no momentum."""
        view = self.outer_view(view)
        view.anchor()
        for fqn in view.fqns():
            self.snapshot[fqn].copy_(view.owned_state(fqn).main_param.detach())
        self.momentum = {}
        self.anchored = True

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        # Scheduled by iteration, the same on every site (a skipped inner step included).
        view = self.outer_view(view)
        t = view.step + 1
        delay = self.options.delay
        for i in sorted(self.pending):
            if self.pending[i][0] == t:
                self.finish_fragment(view, i)
        due = fragment_due(t, self.options.interval, self.options.fragments)
        for i in due:
            if delay:
                self.start_fragment(view, i, apply_after=t + delay)
            else:
                self.sync_fragment(view, i)
        # Fragments written at this step by the schedule (not by what this rank holds: a
        # rank without a shard of one still joins its site's parameter gather).
        applied = due
        if delay:
            o = self.options
            applied = fragment_due(t - delay, o.interval, o.fragments) if t > delay else []
        if any(self._nonempty[i] for i in applied):
            view.sync_params()

    def sync_fragment(self, view: OptimizerView, index: int) -> None:
        """Outer step of fragment ``index``: exchange, SGD step, write parameters."""
        self.start_fragment(view, index, apply_after=None)
        self.finish_fragment(view, index)

    def _flat(self, view: OptimizerView, fqns: Sequence[str]) -> Tuple[Any, torch.Tensor]:
        states = [view.owned_state(f) for f in fqns]
        return states, torch.cat([s.main_param.detach().reshape(-1).float() for s in states])

    def start_fragment(
        self, view: OptimizerView, index: int, *, apply_after: Optional[int]
    ) -> None:
        """Send fragment ``index``'s pseudo-gradient (``apply_after`` None: blocking)."""
        fqns = self.fragments[index]
        if not fqns:
            return
        if index in self.pending:
            raise RuntimeError(f"megatron-ext: DiLoCo fragment {index} is already in flight")
        _, current = self._flat(view, fqns)
        snap = torch.cat([self.snapshot[f].reshape(-1).to(current.device) for f in fqns])
        # Read only if the outer update turns out non-finite (which site sent what); the
        # check is inside the subtraction's pass (megatron_ext/kernels/outer.py).
        pseudo_grad, self._sent_finite[index] = pseudo_gradient(snap, current)
        exchange = self._exchange(index)
        if apply_after is not None and not is_asynchronous(exchange):
            # A compressed exchange overlapped: on the worker thread, every one of the hook's
            # exchanges through it (the outer group's collectives in one order); its bytes
            # are recorded when it has landed (finish_fragment).
            if self.worker is None:
                self.worker = ExchangeWorker(current.device)
            self.pending[index] = (apply_after, self.worker.submit(exchange, pseudo_grad))
            return
        if self.worker is not None:
            raise RuntimeError("megatron-ext: DiLoCo mixes blocking and threaded exchanges")
        with ProcessGroupTrafficMeter.tagged("outer", force=True):
            if apply_after is not None and is_asynchronous(exchange):
                pending = exchange.start(pseudo_grad)
            else:
                pending = _blocking_average(exchange, pseudo_grad)
        if isinstance(pending, PendingAverage):  # not an exchange that refused its input
            self._record_bytes(exchange, current.numel())
        self.pending[index] = (-1 if apply_after is None else apply_after, pending)

    def _exchange(self, index: int) -> PseudoGradientExchange:
        """Fragment ``index``'s exchange (a fragment this rank holds part of)."""
        exchange = self.exchanges[index]
        if exchange is None:
            raise RuntimeError(f"megatron-ext: DiLoCo fragment {index} has no exchange here")
        return exchange

    def _record_bytes(self, exchange: PseudoGradientExchange, numel: int) -> None:
        if self.meter is not None:
            sent = exchange.wire_bytes()
            dense = collective_wire_bytes("all_reduce", 4 * numel, exchange.size)
            self.meter.record("outer", sent=sent, recv=sent, dense_sent=dense, dense_recv=dense)

    def finish_fragment(self, view: OptimizerView, index: int) -> None:
        """Wait for fragment ``index``'s exchange; outer SGD step into fresh tensors; check
        them (module docstring, "Non-finite values"); write its snapshot, momentum and
        parameters."""
        fqns = self.fragments[index]
        if not fqns:
            return
        o = self.options
        alpha = float(o.merge_alpha)
        _, pending = self.pending.pop(index)
        sent_finite = self._sent_finite.pop(index, None)
        try:
            delta = pending.wait()
        except NonFiniteError:  # a compressed exchange: some site's input was not finite
            delta = None
        states, current = self._flat(view, fqns)
        if isinstance(pending, ThreadedAverage) and delta is not None:
            self._record_bytes(self._exchange(index), current.numel())
        device = current.device
        finite = delta is not None
        if finite:
            delta = delta.to(device)
            snap = torch.cat([self.snapshot[f].reshape(-1).to(device) for f in fqns])
            buf, first = None, o.momentum != 0 and fqns[0] not in self.momentum
            if o.momentum != 0:
                buf = (
                    torch.empty_like(delta)
                    if first
                    else torch.cat([self.momentum[f].reshape(-1).to(device) for f in fqns])
                )
            # outer_sgd_step's arithmetic and the finiteness of the new snapshot and momentum
            # in one pass (megatron_ext/kernels/outer.py).
            ok = outer_sgd_step_(snap, buf, delta, o.lr, o.momentum, o.nesterov, first)
            finite = bool(ok)  # the one host read of a fragment sync
        if not finite:
            average_finite = delta is not None and bool(nonfinite(delta).logical_not())
            self._non_finite_update(view, index, sent_finite, average_finite)
            return
        weights = snap if alpha == 0 else torch.lerp(snap, current, alpha)
        # Whole-fragment writes: one multi-tensor copy each for the snapshots, the momentum
        # buffers and the parameters (OptimizerView.write_params), not one copy per
        # parameter and buffer (the same values: copies and one rounding to the model dtype).
        pieces = [s.main_param.numel() for s in states]
        snaps = [p.view_as(s.main_param) for p, s in zip(snap.split(pieces), states)]
        _copy_all([self.snapshot[f] for f in fqns], snaps)
        if buf is not None:
            moms = [p.view_as(s.main_param) for p, s in zip(buf.split(pieces), states)]
            kept = [(f, m) for f, m in zip(fqns, moms) if f in self.momentum]
            if kept:
                _copy_all([self.momentum[f] for f, _ in kept], [m for _, m in kept])
            if not kept:  # the first outer step: one copy, viewed per parameter
                device = self._state_device(states[0].main_param)
                flat = buf.to(device, copy=True)
                for fqn, piece, s in zip(fqns, flat.split(pieces), states):
                    self.momentum[fqn] = piece.view_as(s.main_param)
            else:
                for fqn, mom, s in zip(fqns, moms, states):
                    if fqn not in self.momentum:
                        self.momentum[fqn] = mom.to(self._state_device(s.main_param), copy=True)
        # The parameter gather of a sharded optimizer follows in post_step.
        view.write_params(fqns, list(weights.split(pieces)))
        self.syncs += 1

    def _site_flags(self, sent_finite: Optional[torch.Tensor]) -> List[float]:
        """Every site's flag over the outer group (collective): 1 its pseudo-gradient was
        not finite, 0 it was, -1 unknown (an exchange restored from a checkpoint)."""
        mine = -1.0 if sent_finite is None else float(not bool(sent_finite))
        if self.outer_group is None or self.num_sites == 1:
            return [mine]
        flag = torch.tensor([mine], dtype=torch.float32, device=collective_device(self.outer_group))

        def gather() -> List[float]:
            out = [torch.empty_like(flag) for _ in range(self.num_sites)]
            with ProcessGroupTrafficMeter.untracked():
                torch.distributed.all_gather(out, flag, group=self.outer_group)
            return [float(x.item()) for x in out]

        # The exchange thread owns the outer group while it exists (one collective order).
        return self.worker.call(gather) if self.worker is not None else gather()

    def _non_finite_update(
        self,
        view: OptimizerView,
        index: int,
        sent_finite: Optional[torch.Tensor],
        average_finite: bool,
    ) -> None:
        """Skip (loss scaling) or stop: nothing of fragment ``index``'s outer step is written
        (module docstring, "Non-finite values")."""
        o = self.options
        where = f"DiLoCo's outer step of fragment {index} after iteration {view.step + 1}"
        if average_finite:
            raise NonFiniteError(
                f"megatron-ext: {where}: the outer update is not finite although the averaged "
                f"pseudo-gradient is (--outer-lr {o.lr}, --outer-momentum {o.momentum}, or a "
                "non-finite outer momentum or snapshot); training stops before it is "
                "applied (nothing was written or saved)"
            )
        flags = self._site_flags(sent_finite)
        bad = [str(s) for s, f in enumerate(flags) if f > 0]
        if bad:
            what = (
                f"the pseudo-gradient of site{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
                f"(of {len(flags)}) is not finite: NaN or Inf in that site's weights "
                "(a diverged or broken site)"
            )
        else:
            unknown = " (some sites' exchanges were restored from a checkpoint)"
            what = (
                "the averaged pseudo-gradient is not finite although no site reported a "
                "non-finite one (a compressed exchange's error-feedback residual, or an "
                "overflow of the sum)" + (unknown if any(f < 0 for f in flags) else "")
            )
        if view.loss_scale() is not None:
            self.skipped += 1
            group_rank = (
                torch.distributed.get_rank(self.outer_group) if self.outer_group is not None else 0
            )
            if group_rank == 0:
                print(
                    f"megatron-ext: WARNING: {where}: {what}; skipped under loss scaling: "
                    "snapshot, outer momentum and exchange error feedback kept as they were, "
                    "each site keeps its own weights",
                    flush=True,
                )
            return
        raise NonFiniteError(
            f"megatron-ext: {where}: {what}; without loss scaling the outer step cannot be "
            "skipped, so training stops before it is applied (nothing was written or saved)"
        )

    def finish(self) -> None:
        """End of training: wait for the exchanges in flight (their results stay pending, so
        a later save still holds them) and stop the exchange thread, before the process
        groups go away."""
        for _, p in self.pending.values():
            try:
                p.wait()
            except NonFiniteError:  # kept in the handle: a later save decides (state_dict)
                pass
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Snapshots, momentum buffers (by FQN), exchanges' state (by fragment).

        With several sites also this rank's own weights (fp32 main parameters) and inner
        optimizer state tensors (``site``): between outer steps they differ from the other
        sites', and megatron-core's checkpoint keeps one data-parallel replica of them.
        ``view``: what the outer view keeps of its own (its ``site_state()``, e.g. Grass's
        frozen weights and their fp32 copies; empty without wrappers). ``anchored``: False
        while the snapshots are the weights taken at install, before any step (a load then
        takes nothing from this state: :meth:`anchor`).
        """
        if not self.initialized and self._pending_load is not None:
            return self._pending_load
        if not self.initialized:
            raise RuntimeError("megatron-ext: DiLoCo state is allocated at the first step")
        # Exchanges in flight (--outer-delay): waited for first (a threaded one updates its
        # exchange's error feedback until it lands), saved, applied after the resume.
        pending = {}
        for i, (due, p) in sorted(self.pending.items()):
            try:
                delta = p.wait().detach()
            except NonFiniteError:
                delta = None
            if delta is None or not bool(torch.isfinite(delta).all()):
                if self._view is None or self._view.loss_scale() is None:
                    raise NonFiniteError(
                        f"megatron-ext: DiLoCo's exchange of fragment {i} in flight (to be "
                        f"applied after step {due}) is not finite: a site's pseudo-gradient "
                        "held NaN or Inf; without loss scaling training stops, and this "
                        "state is not saved"
                    )
                continue  # skipped when it lands, as the resumed run then has nothing to apply
            pending[str(i)] = {"apply_after": due, "delta": delta.cpu().clone()}
        raw, view = self.views()
        out = {
            "snapshot": {f: t.detach().cpu().clone() for f, t in self.snapshot.items()},
            "momentum": {f: t.detach().cpu().clone() for f, t in self.momentum.items()},
            "exchanges": [{} if e is None else e.state_dict() for e in self.exchanges],
            "fragments": [list(f) for f in self.fragments],
            "syncs": self.syncs,
            "pending": pending,
            "view": view.site_state(),
            "anchored": self.anchored,
        }
        if self.num_sites > 1:
            params, optim = {}, {}
            for fqn in raw.fqns():
                ps = raw.owned_state(fqn)
                params[fqn] = ps.main_param.detach().cpu().clone()
                optim[fqn] = {
                    k: v.detach().cpu().clone()
                    for k, v in ps.state.items()
                    if isinstance(v, torch.Tensor)
                }
            out["site"] = {"params": params, "optim": optim}
        return out

    def upgrade_state(self, state: Dict[str, Any], version: int) -> Dict[str, Any]:
        """A state saved at megatron_ext state format ``version`` (older than the current one)
        in the current form: format 1 may predate ``--outer-delay`` (nothing in flight), the
        view wrappers (Grass: no site state) and ``anchored`` (saved after training steps)."""
        if version < 2:
            state = {"pending": {}, "view": {}, "anchored": True, **state}
        return state

    def _load_outer_state(self, state: Dict[str, Any]) -> None:
        """The outer state every site shares (snapshots, outer momentum, the exchanges' error
        feedback, the outer step count), from ``state`` in :meth:`state_dict`'s form."""
        for f, t in state["snapshot"].items():
            self.snapshot[f].copy_(t)
        self.momentum = {
            f: t.to(self.snapshot[f].device, copy=True) for f, t in state["momentum"].items()
        }
        for e, sd in zip(self.exchanges, state["exchanges"]):
            if e is not None:
                e.load_state_dict(sd)
        self.syncs = int(state["syncs"])

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; applied at the first step if the state is not yet
        allocated (a resume loads before training starts)."""
        expected = {
            "snapshot",
            "momentum",
            "exchanges",
            "fragments",
            "syncs",
            "pending",
            "view",
            "anchored",
        }
        if self.num_sites > 1:
            expected.add("site")
        if set(state) != expected:
            raise ValueError(f"diloco state keys {sorted(state)}, expected {sorted(expected)}")
        if self.initialized:
            self._apply_load(state)
        else:
            self._pending_load = state

    def _apply_load(self, state: Dict[str, Any]) -> None:
        if not state["anchored"]:
            # State taken before any step (a save at iteration 0, or an elastic resume's
            # reset, which keeps the freshly built state): nothing in it but the initial
            # weights; the first step takes the snapshots from the loaded ones.
            self.anchored = False
            return
        if [list(f) for f in state["fragments"]] != self.fragments:
            raise ValueError("diloco state was saved with other fragments (--outer-fragments)")
        if set(state["snapshot"]) != set(self.snapshot):
            raise ValueError("diloco state was saved for other parameters")
        raw, view = self.views()
        self._load_outer_state(state)
        self.pending = {}
        self._sent_finite = {}
        for i, p in state["pending"].items():
            i = int(i)
            if not 0 <= i < len(self.fragments) or not self.fragments[i]:
                raise ValueError(f"diloco state: no fragment {i} to apply an exchange to")
            device = view.owned_state(self.fragments[i][0]).main_param.device
            delta = p["delta"].to(device, torch.float32, copy=True)
            self.pending[i] = (int(p["apply_after"]), PendingAverage(delta))
        view.load_site_state(state["view"])
        if "site" in state:
            self._load_site(state["site"], raw)
        self.anchored = True

    def _load_site(self, site: Dict[str, Any], view: OptimizerView) -> None:
        """This rank's own weights and inner optimizer state over megatron's replica (then
        the site's parameter gather, with the distributed optimizer)."""
        if set(site["params"]) != set(view.fqns()):
            raise ValueError("diloco site state was saved for other parameters")
        for fqn, value in site["params"].items():
            ps = view.owned_state(fqn)
            if tuple(value.shape) != tuple(ps.main_param.shape):
                raise ValueError(f"diloco site state: {fqn} does not fit (another sharding)")
            for k, v in site["optim"][fqn].items():
                if k not in ps.state or ps.state[k].shape != v.shape:
                    raise ValueError(
                        f"diloco site state: optimizer state {k!r} of {fqn} does not fit"
                    )
        with torch.no_grad():
            for fqn, value in site["params"].items():
                ps = view.owned_state(fqn)
                view.write_param(fqn, value.to(ps.main_param.device))
                for k, v in site["optim"][fqn].items():
                    ps.state[k].copy_(v)
        view.sync_params()
