"""DiLoCo's outer step between sites that fail alone: each site its own job, torchft between.

What it does:
    With ``--outer-transport torchft`` every site is its own ``torchrun`` / Slurm job with its
    own torch.distributed world (its data, tensor and pipeline parallelism inside). Across
    sites only the outer step talks, through torchft (the existing engine for this, not a
    home-made quorum): one ``torchft.Manager`` per rank (replica id = the site), a lighthouse
    that forms a quorum of the sites present, and torchft's reconfigurable process group
    (gloo for CPU tensors, its NCCL group for CUDA ones) joining the ranks at one position in
    every site. :class:`FaultTolerantDiLoCoHook` is :class:`~megatron_ext.optim.diloco.DiLoCoHook`
    with that transport; its outer step after every H steps a site takes (with streaming
    fragments, of fragment i after the steps t with ``t % H == i * H // F``, as in one
    world; each fragment's outer step is the transaction below):

    1. quorum (``Manager.start_quorum``, synchronous): the sites that reached this outer
       step; a dead site is dropped once the lighthouse's heartbeat has expired, a site
       that is behind (just started, or restarted) *heals*: it receives the live peer's
       outer state (:meth:`FaultTolerantDiLoCoHook.outer_state`: the last synchronized
       weights, the outer momentum, the exchanges' error feedback, the outer step count)
       through torchft's checkpoint transport (HTTP from the peer, not a shared disk);
    2. one all-reduce (SUM) of ``[w * (snapshot - current), w]``, ``w`` the site's weight
       (tokens it trained on since the last outer step by default; 0 for a site that has
       just healed or joined: it has no pseudo-gradient of this cycle); the averaged
       pseudo-gradient is ``sum(w * delta) / sum(w)``: the average over the sites present,
       weighted by tokens;
    3. ``Manager.should_commit``: every site of the quorum agrees that the exchange
       succeeded. If not (a site died during the exchange, a collective timed out), the
       attempt is discarded and repeated at once with a new quorum over the sites still
       alive, until it commits or ``--outer-quorum-timeout`` has passed since the first
       attempt (then training stops with an error naming the flag);
    4. the outer SGD step, written as the one-world hook writes it (non-finite checks
       included): every site present, the healed one too, holds the same weights after it.

    With ``--outer-compression`` step 2 is the compressed exchange of
    ``megatron_ext/collectives/outer_exchange.py``, run over the quorum's group
    (:meth:`TorchftTransport.group`: torchft's current ``ProcessGroup``, which
    torch.distributed's collectives take unregistered) in its SUM mode: one all-reduce of
    ``w`` gives ``sum(w)``, each site sends ``w / sum(w) * delta``, the sum received is the
    weighted average. A collective's error (a peer killed mid-exchange) is reported to the
    Manager, whose vote then says no. The exchange stages its new error feedback and keeps it
    only when the step commits (a step is a transaction). The error feedback is each site's
    own residual, in the units of the applied update (the sites' residuals add up to the
    global one for any number of sites); at every new quorum the exchange is rebuilt over the
    new group carrying it (:meth:`OuterExchange.regroup`). A healing site receives the
    exchange's shared state (outer syncs, PowerSGD's warm-start Q) with a zero residual: it
    owes nothing of what was sent before, so what was applied plus the present sites'
    residuals stays what they sent. A site that leaves takes its residual with it.

    A site joins at its first step: before that step's forward pass (the runtime's
    ``on_step``; else before its first optimizer step) it takes part in one outer step with
    weight 0 (step 1 above heals it if the others are ahead; if every site starts together
    nothing is averaged and training starts from the common initial weights). Until an outer
    step has committed among the sites of a quorum (torchft's step is then 0 on every one of
    them after the quorum: the same answer on each), the dense exchange sums the weights
    first, one value, and sends the pseudo-gradients only when someone contributed: sites
    that start together send no model-sized all-reduce of zeros at their join (the
    compressed exchange always sums the weights first). A healed
    site takes its peer's step count and the fragment the peer synchronizes (the sites
    follow one schedule) and sets every parameter to the received global weights. With
    fragments a site weighs a fragment by the share of the cycle it trained it since the
    fragment's last outer step (less than a whole cycle only after a join). A rank that holds
    none of a fragment's parameters still takes part in its quorum and commit vote. Events (the
    quorum, each failed attempt, each commit with its wall time and the sites present) are
    printed by the site's first rank and kept in :attr:`FaultTolerantDiLoCoHook.events`.

Inner optimizer state of a site that heals: its own (fresh after a restart), not the
    peer's. The inner AdamW moments are a site's local state between outer steps (they
    follow its own data); copying a peer's would send twice the model's size more over the
    WAN at every recovery and give the site another site's statistics; AdamW re-estimates
    them within its bias-corrected warm-up (a few hundred steps, shorter than H in
    practice).

Constraints:
    Pure torch plus torchft (imported when a transport is built); never imports Megatron.
    With ``--outer-delay tau`` a fragment's outer step is split: quorum and exchange started
    after step t (the dense all-reduce asynchronous, a compressed exchange on the exchange
    thread), then after step t + tau the wait, the commit vote and the outer step (with
    ``--outer-merge-alpha``), as in one world. torchft takes one step at a time, so tau must
    be below the steps between two fragments' outer steps (refused otherwise by
    ``megatron_ext.methods.diloco``). An overlapped step that does not commit is not
    repeated: it is skipped on every site present (nothing applied, error feedback as it
    was, the snapshot unchanged), and the fragment's next outer step carries its progress
    (weighted by the cycles it spans). A save while one is in flight lands it first. The compressed exchanges are tested on gloo (CPU);
    on CUDA they run on the NCCL group torchft builds, without torchft's per-collective
    timeout wrapper (NCCL's own timeout applies). Every site must lay out the outer state
    alike (the same TP / PP / distributed-optimizer sharding): a healed state that does not
    fit is refused. The outer steps are scheduled by the sites' shared count of steps (a site's
    iteration for one that started with the others; its peer's count for one that healed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple, Union, cast

import torch
from torch.distributed import ProcessGroup

from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.kernels.outer import pseudo_gradient
from megatron_ext.optim.diloco import (
    DiLoCoHook,
    ExchangeWorker,
    PendingAverage,
    ThreadedAverage,
    make_outer_exchange,
)
from megatron_ext.optim.diloco.exchange import fragment_due
from megatron_ext.options.outer import OuterConfig
from megatron_ext.protocols import (
    NonFiniteError,
    OptimizerView,
    SitesTransport,
    StagedPseudoGradientExchange,
)

__all__ = ["TorchftTransport", "FaultTolerantDiLoCoHook", "torchft_missing"]


def torchft_missing() -> Optional[str]:
    """Why torchft cannot be used here (None: it imports)."""
    try:
        import torchft  # noqa: F401
    except Exception as exc:  # ImportError, or its native extension failing to load
        return f"torchft does not import ({type(exc).__name__}: {exc}); pip install torchft"
    return None


class TorchftTransport:
    """One rank's torchft ``Manager`` and reconfigurable process group.

    Args:
        site_id: this site (the replica id ``site_<id>``).
        lighthouse: the lighthouse address (``http://host:port``).
        min_sites: torchft's ``min_replica_size``: fewer sites never commit.
        quorum_timeout: seconds a quorum may take.
        timeout: seconds for collectives, commits and a recovery's transfer.
        device: where the exchanged tensors live (``cpu``: gloo; ``cuda``: NCCL).
        rank, world_size: this rank in its site's job and the job's size.
        store_addr, store_port: the site's TCPStore (torchrun's; MASTER_ADDR / MASTER_PORT).
        state_dict, load_state_dict: the outer state a healing site receives and loads.
    """

    def __init__(
        self,
        *,
        site_id: int,
        lighthouse: str,
        min_sites: int,
        quorum_timeout: float,
        timeout: float,
        device: torch.device,
        rank: int,
        world_size: int,
        store_addr: str,
        store_port: int,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
    ):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        device = torch.device(device)
        pg_timeout = timedelta(seconds=timeout)
        self.pg = (
            ProcessGroupNCCL(timeout=pg_timeout)
            if device.type == "cuda"
            else ProcessGroupGloo(timeout=pg_timeout)
        )
        self.site_id = int(site_id)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_sites,
            use_async_quorum=False,
            timeout=pg_timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=pg_timeout,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"site_{self.site_id}",
        )

    def quorum(self) -> None:
        """The sites of this outer step (heals this site when it is behind: the registered
        ``load_state_dict`` runs before this returns)."""
        self.manager.start_quorum()

    def sum_and_commit(self, buf: torch.Tensor) -> bool:
        """All-reduce (SUM) ``buf`` in place over the quorum, then torchft's commit vote:
        True when every site's exchange succeeded (``buf`` then holds the sum)."""
        self.start_sum(buf).wait()
        return self.commit()

    def start_sum(self, buf: torch.Tensor) -> Any:
        """Start the all-reduce (SUM) of ``buf`` in place over the quorum; its handle's
        ``wait()`` never raises (an error goes to the Manager, whose vote then says no)."""
        return self.manager.allreduce(buf, reduce_op=torch.distributed.ReduceOp.SUM)

    def group(self) -> ProcessGroup:
        """The quorum's process group as torch.distributed's collectives take it: torchft's
        current ``ProcessGroup`` (a new one after every reconfiguration; its rank and size
        are the site's position and the number of sites in the quorum). Collectives on it
        bypass the Manager: their errors go to :meth:`report_error`."""
        return self.pg.parent

    def report_error(self, exc: BaseException) -> None:
        """A collective of this outer step failed (a peer gone): the commit votes no."""
        self.manager.report_error(exc)

    def commit(self) -> bool:
        """torchft's commit vote: True when every site's exchange succeeded."""
        return bool(self.manager.should_commit())

    def num_participants(self) -> int:
        return int(self.manager.num_participants())

    def step(self) -> int:
        """Outer steps committed (torchft's step)."""
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class FaultTolerantDiLoCoHook(DiLoCoHook):
    """DiLoCo's outer step over torchft (module docstring).

    Args:
        options: the ``--outer-*`` options (transport fields included).
        make_transport: ``(state_dict, load_state_dict, device) ->``
            :class:`~megatron_ext.protocols.SitesTransport` (default:
            :class:`TorchftTransport` from the options and the site job's environment).
        weight: this site's weight in the average per outer step (tokens trained on between
            two outer steps; 1: the plain mean over the sites present).
        meter: byte accounting (category ``outer``).
        rank: this rank in its site (its first rank prints the events).
    """

    # The one-world hook's roles and rules (declared here: a subclass states its own). On
    # another DP size inside a site they reset as there; the outer state a site lacks comes
    # from a live peer when it heals.
    elastic_rules: ClassVar[Mapping[str, str]] = DiLoCoHook.elastic_rules

    def __init__(
        self,
        options: OuterConfig,
        *,
        make_transport: Optional[Callable[..., SitesTransport]] = None,
        weight: float = 1.0,
        meter: Optional[CommMeter] = None,
        rank: int = 0,
    ):
        self.compressed = options.compression != "none"
        factory = _local_exchange if self.compressed else None
        super().__init__(options, None, meter=meter, exchange_factory=factory)
        self.make_transport = make_transport or self._default_transport
        self.transport: Optional[SitesTransport] = None
        self.weight = float(weight)
        self.rank = rank
        self.events: List[Dict[str, Any]] = []
        self._joined = False
        self._healed = False
        # Inner steps counted on the schedule the sites share (a healed site takes its
        # peer's count), and per fragment the steps since its last outer step (or the join).
        self._count = 0
        self._since: List[int] = []
        self._iteration = 0
        # (count, fragment, count after which it is applied or None) of the outer step this
        # site is in: what a healing peer is told; the live peer's, once this site healed
        self._at: Tuple[int, int, Optional[int]] = (0, 0, None)
        self._peer_at: Tuple[int, int, Optional[int]] = (0, 0, None)
        # --outer-delay: the fragment's outer step in flight (started, not yet voted on)
        self._inflight: Optional[_Flight] = None
        # a live site's outer state that does not fit this site (raised by the outer step)
        self._heal_error: Optional[ValueError] = None
        self._device: Any = "cpu"

    def _default_transport(self, state_dict, load_state_dict, device):
        o = self.options
        lighthouse = o.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"]
        return TorchftTransport(
            site_id=o.site_id,
            lighthouse=lighthouse,
            min_sites=o.min_sites,
            quorum_timeout=o.quorum_timeout,
            timeout=o.timeout,
            device=device,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            state_dict=state_dict,
            load_state_dict=load_state_dict,
        )

    @property
    def sites(self) -> SitesTransport:
        """The transport to the other sites (built at :meth:`setup`, shut down at
        :meth:`finish`)."""
        if self.transport is None:
            raise RuntimeError(
                "megatron-ext: the outer step across sites has no transport (used before "
                "setup() or after finish())"
            )
        return self.transport

    # -- events ---------------------------------------------------------------------------------

    def _event(self, kind: str, **info: Any) -> None:
        info = {"event": kind, "time": time.time(), **info}
        self.events.append(info)
        if self.rank == 0:
            detail = " ".join(f"{k}={v}" for k, v in info.items() if k not in ("event", "time"))
            print(
                f"megatron-ext: torchft site {self.options.site_id}: {kind} {detail} "
                f"at {info['time']:.3f}",
                flush=True,
            )

    # -- the outer state a healing site receives ------------------------------------------------

    def outer_state(self) -> Dict[str, Any]:
        """The global state a live site sends to a healing one (on torchft's quorum thread,
        while this site's main thread waits for the quorum)."""
        return {
            "snapshot": {f: t.detach().cpu().clone() for f, t in self.snapshot.items()},
            "momentum": {f: t.detach().cpu().clone() for f, t in self.momentum.items()},
            # The error feedback is each site's own (its unsent share): a healing site starts
            # from none, with the peer's shared exchange state (outer syncs, PowerSGD's Q).
            "exchanges": [{} if e is None else e.shared_state_dict() for e in self.exchanges],
            "syncs": self.syncs,
            "iteration": self._iteration,
            "count": self._at[0],
            "fragment": self._at[1],
            "apply_after": self._at[2],
            "schedule": self._schedule(),
        }

    def _schedule(self) -> List[int]:
        o = self.options
        return [int(o.interval), int(o.fragments), int(o.delay)]

    def load_outer_state(self, state: Dict[str, Any]) -> None:
        """Take a live peer's :meth:`outer_state` (on this site's main thread, inside the
        quorum): this site then contributes nothing to the outer step at hand and ends it
        with the others' weights."""
        problem = None
        if set(state["snapshot"]) != set(self.snapshot) or any(
            tuple(t.shape) != tuple(self.snapshot[f].shape) for f, t in state["snapshot"].items()
        ):
            problem = (
                "megatron-ext: the outer state received from a live site does not fit this "
                "site's parameters (the sites need the same model and TP / PP / "
                "distributed-optimizer layout)"
            )
        elif list(state["schedule"]) != self._schedule():
            problem = (
                "megatron-ext: --outer-interval, --outer-fragments, --outer-delay: the live "
                f"site's schedule {state['schedule']} is not this site's {self._schedule()} "
                "(every site needs the same)"
            )
        if problem is not None:
            # kept: torchft may report it as its own error; the outer step raises it
            self._heal_error = ValueError(problem)
            raise self._heal_error
        self._load_outer_state(state)
        self.anchored = True
        self._healed = True
        self._peer_at = (int(state["count"]), int(state["fragment"]), state["apply_after"])
        self._event("healed", peer_iteration=state["iteration"], syncs=self.syncs)

    # -- schedule -------------------------------------------------------------------------------

    def setup(self, view: OptimizerView) -> None:
        super().setup(view)
        if self.compressed:  # once, before training: the outer steps then take them as such
            for index, exchange in enumerate(self.exchanges):
                if exchange is not None and not isinstance(exchange, StagedPseudoGradientExchange):
                    raise TypeError(
                        f"megatron-ext: the outer exchange of fragment {index} "
                        f"({type(exchange).__name__}) cannot stage its error feedback for the "
                        "sites' vote (megatron_ext.protocols.StagedPseudoGradientExchange)"
                    )
        self._since = [0] * len(self.fragments)
        if self.transport is None:
            self._device = next(iter(self.snapshot.values())).device if self.snapshot else "cpu"
            self.transport = self.make_transport(
                self.outer_state, self.load_outer_state, self._device
            )

    def on_step(self, iteration: int) -> None:
        """Before the first training step's forward pass (after a checkpoint load): join
        (the runtime's per-step callback; without one, :meth:`pre_step` joins)."""
        if self._joined or self._raw is None:
            return
        super().pre_step(self._raw)  # anchors the snapshots to the loaded weights
        self._join(self._raw)

    def pre_step(self, view: OptimizerView) -> None:
        super().pre_step(view)
        if not self._joined:
            self._join(view)

    def _join(self, view: OptimizerView) -> None:
        """One outer step with weight 0 before this site's first inner step: a late or
        restarted site heals here, takes the sites' schedule (their step count, the fragment
        they synchronize) and starts from the global weights."""
        self._joined = True
        if self.options.delay:
            self._start(self.outer_view(view), None, contribute=False)
        else:
            self._outer_step(self.outer_view(view), None, contribute=False)
        view.sync_params()

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        view = self.outer_view(view)
        self._count += 1
        self._iteration = view.step + 1
        self._since = [n + 1 for n in self._since]
        o = self.options
        if self._inflight is not None and self._inflight.apply_after == self._count:
            self._land(view)
            view.sync_params()
        for index in fragment_due(self._count, o.interval, o.fragments):
            if o.delay:
                self._start(view, index, contribute=True)
            else:
                self._outer_step(view, index, contribute=True)
            view.sync_params()

    # -- the outer step -------------------------------------------------------------------------

    def _weight(self, index: int) -> float:
        """This site's weight in fragment ``index``'s average: its tokens per outer cycle,
        times the cycles it trained that fragment since the fragment's last outer step
        (less than one only for a fragment's first outer step after a join, more after an
        overlapped outer step that did not commit)."""
        return self.weight * self._since[index] / self.options.interval

    def _quorum(self) -> None:
        try:
            self.sites.quorum()
        except Exception as exc:
            if self._heal_error is not None:
                raise self._heal_error from exc
            o = self.options
            raise RuntimeError(
                f"megatron-ext: --outer-quorum-timeout: no quorum of at least "
                f"--outer-min-sites {o.min_sites} site(s) for the outer step after "
                f"iteration {self._iteration} ({type(exc).__name__}: {exc})"
            ) from exc
        if self._heal_error is not None:
            raise self._heal_error

    def _outer_step(self, view: OptimizerView, index: Optional[int], *, contribute: bool) -> None:
        """The outer step of fragment ``index`` (None: the join, whose fragment is the one
        the sites present are at; fragment 0 when every site is joining)."""
        first = time.monotonic()
        failed_at: Optional[float] = None
        attempt = 0
        healed = False
        while True:
            attempt += 1
            self._healed = False
            self._at = (self._count, 0 if index is None else index, None)
            self._quorum()
            if self._healed:
                healed = True
                self._heal(view)
            if index is None or healed:  # the fragment the sites present synchronize
                index = self._at[1]
            fqns = self.fragments[index]
            weight = self._weight(index) if contribute and not healed else 0.0
            exchanged = bool(fqns)
            if not fqns:  # this rank holds none of the fragment: the weights' sum, the vote
                committed, total = self._empty_attempt(weight)
            elif not self.compressed and self._nobody_contributed(weight):
                committed, total, exchanged = self.sites.commit(), 0.0, False
            elif self.compressed:
                committed, total, result = self._compressed_attempt(view, index, weight)
            else:
                buf, sent_finite = self._dense_buffer(view, fqns, weight)
                with ProcessGroupTrafficMeter.tagged("outer", force=True):
                    committed = self.sites.sum_and_commit(buf)
            sites = self.sites.num_participants()
            if committed:
                break
            if failed_at is None:
                failed_at = time.time()
            self._event(
                "retry", attempt=attempt, sites=sites, iteration=self._iteration, fragment=index
            )
            self._check_deadline(first, attempt)
        if not exchanged:
            pass  # nothing of the fragment here to write, or nobody contributed
        elif self.compressed:
            self._apply_compressed(view, index, total, result)
        else:
            total = self._apply_dense(view, index, buf, sites, sent_finite)
        self._since[index] = 0
        self._event(
            "commit",
            step=self.sites.step(),
            sites=sites,
            attempts=attempt,
            iteration=self._iteration,
            fragment=index,
            weight=f"{weight:g}",
            total_weight=f"{total:g}",
            **({"failed_at": f"{failed_at:.3f}"} if failed_at is not None else {}),
        )

    def _heal(self, view: OptimizerView) -> None:
        """After a quorum that healed this site: the sites' schedule, and every parameter
        from the received global weights (this site has no progress of its own to keep)."""
        self._at = self._peer_at
        self._count = self._at[0]
        self._since = [0] * len(self.fragments)
        fqns = list(view.fqns())
        if fqns:
            device = view.owned_state(fqns[0]).main_param.device
            view.write_params(fqns, [self.snapshot[f].to(device) for f in fqns])

    # -- the overlapped outer step (--outer-delay) --------------------------------------------

    def _start(self, view: OptimizerView, index: Optional[int], *, contribute: bool) -> None:
        """Quorum, then fragment ``index``'s exchange started (None: the join's fragment, as
        :meth:`_outer_step`); it runs while the next ``--outer-delay`` inner steps compute,
        and :meth:`_land` votes on it and applies it."""
        o = self.options
        self._healed = False
        self._at = (self._count, 0 if index is None else index, self._count + o.delay)
        self._quorum()
        if self._healed:
            self._heal(view)
        if index is None or self._healed:
            index = self._at[1]
        fqns = self.fragments[index]
        weight = self._weight(index) if contribute and not self._healed else 0.0
        flight = _Flight(index, self._at[2], weight, self._since[index])
        self._since[index] = 0  # the steps from here on belong to the next outer step
        if not fqns:
            flight.buf = torch.tensor([weight], dtype=torch.float32, device=self._device)
            flight.work = self.sites.start_sum(flight.buf)
        elif not self.compressed and self._nobody_contributed(weight):
            flight.buf = torch.zeros(1)  # summed: the vote only, at the landing
        elif self.compressed:
            delta, self._sent_finite[index] = self._pseudo_gradient(view, fqns)
            if self.worker is None:
                self.worker = ExchangeWorker(delta.device)
            flight.share = _WeightedShare(self._exchange_for(index), weight)
            flight.handle = self.worker.submit(flight.share, delta)
        else:
            flight.buf, flight.sent_finite = self._dense_buffer(view, fqns, weight)
            with ProcessGroupTrafficMeter.tagged("outer", force=True):
                flight.work = self.sites.start_sum(flight.buf)
        self._inflight = flight

    def _land(self, view: OptimizerView) -> None:
        """The outer step in flight: wait for its exchange, torchft's commit vote, and apply
        it (the one-world hook's outer SGD step and merge). Not committed (a site died
        during the exchange): skipped on this site, nothing applied, the exchange's error
        feedback as it was; the fragment's progress is carried by its next outer step."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            raise RuntimeError("megatron-ext: DiLoCo over torchft: no outer step in flight")
        index = flight.index
        fqns = self.fragments[index]
        result: Union[None, torch.Tensor, NonFiniteError] = None
        if flight.handle is not None:
            try:
                result = flight.handle.wait()
            except NonFiniteError as exc:  # on every site alike (the same sum)
                result = exc
            except Exception as exc:  # a peer gone mid-exchange: the vote says no
                self.sites.report_error(exc)
        elif flight.work is not None:
            try:
                flight.work.wait()
            except Exception as exc:
                self.sites.report_error(exc)
        committed = self.sites.commit()
        sites = self.sites.num_participants()
        share = flight.share
        if share is not None:
            share.exchange.end(committed and torch.is_tensor(result) and share.total > 0)
            self.last_exchange = {
                "sent": share.sent,
                "received": result if share.total > 0 else None,
                "total_weight": share.total,
            }
        if not committed:
            self._since[index] += flight.since
            self._sent_finite.pop(index, None)
            self._event(
                "skipped", fragment=index, sites=sites, iteration=self._iteration, overlapped=1
            )
            return
        if share is not None:
            total = share.total
            self._apply_compressed(view, index, total, result)
        elif not fqns or flight.work is None:  # the weights' sum alone
            total = float(flight.buf[0])
        else:
            total = self._apply_dense(view, index, flight.buf, sites, flight.sent_finite)
        self._event(
            "commit",
            step=self.sites.step(),
            sites=sites,
            attempts=1,
            iteration=self._iteration,
            fragment=index,
            weight=f"{flight.weight:g}",
            total_weight=f"{total:g}",
        )

    def _land_in_flight(self) -> None:
        if self._inflight is not None:
            _, view = self.views()
            self._land(view)
            view.sync_params()

    def state_dict(self) -> Dict[str, Any]:
        """As the one-world hook's; an outer step in flight lands first (its vote, then its
        update applied at this save instead of ``--outer-delay`` steps after its start: the
        global state is the same, only this site's merge comes earlier)."""
        self._land_in_flight()
        return super().state_dict()

    def _empty_attempt(self, weight: float):
        """An outer step of a fragment this rank holds nothing of: the sum of the weights and
        the commit vote, so that its Manager keeps the others' steps."""
        buf = torch.tensor([weight], dtype=torch.float32, device=self._device)
        committed = self.sites.sum_and_commit(buf)
        return committed, float(buf[0])

    def _nobody_contributed(self, weight: float) -> bool:
        """Before any outer step has committed among this quorum's sites (torchft's step is
        0 on all of them after the quorum), the sum of the weights first, one value: True
        when it is 0 (every site joining), and the pseudo-gradients are then not sent. From
        the first commit on, False at once: the weights travel inside the dense exchange.
        A failed sum is reported to the Manager, whose vote then says no on every site."""
        if self.sites.step() != 0:
            return False
        buf = torch.tensor([weight], dtype=torch.float32, device=self._device)
        with ProcessGroupTrafficMeter.tagged("outer", force=True):
            self.sites.start_sum(buf).wait()
        self._record_sum(1, self.sites.num_participants())
        return float(buf[0]) <= 0

    def _record_sum(self, numel: int, sites: int) -> None:
        """The bytes of a dense all-reduce of ``numel`` fp32 values over ``sites`` sites."""
        if self.meter is not None:
            wire = collective_wire_bytes("all_reduce", 4 * numel, max(sites, 1))
            self.meter.record("outer", sent=wire, recv=wire, dense_sent=wire, dense_recv=wire)

    def _check_deadline(self, first: float, attempt: int) -> None:
        o = self.options
        if time.monotonic() - first > o.quorum_timeout:
            raise RuntimeError(
                f"megatron-ext: --outer-quorum-timeout: the outer step after iteration "
                f"{self._iteration} did not commit within {o.quorum_timeout:g} s "
                f"({attempt} attempts)"
            )

    def _apply_dense(self, view, index, buf, sites, sent_finite) -> float:
        """Fragment ``index``'s outer step from the committed dense sum
        ``[sum w * delta, sum w]`` (nothing when nobody contributed: every site joining)."""
        total = float(buf[-1])
        self._record_sum(buf.numel(), sites)
        if total > 0:
            delta = buf[:-1].div_(total)
            self.pending[index] = (-1, PendingAverage(delta))
            self._sent_finite[index] = sent_finite
            self.finish_fragment(view, index)  # the one-world hook's outer SGD step and writes
        return total

    # -- the compressed outer step --------------------------------------------------------------

    def _pseudo_gradient(self, view: OptimizerView, fqns: List[str]):
        """This site's pseudo-gradient of a fragment, ``snapshot - weights`` (flat fp32), and
        whether it is finite (the one-world hook's fused pass)."""
        _, current = self._flat(view, fqns)
        snap = torch.cat([self.snapshot[f].reshape(-1).to(current.device) for f in fqns])
        return pseudo_gradient(snap, current)

    def _dense_buffer(self, view: OptimizerView, fqns: List[str], weight: float):
        """``[w * delta, w]``, what the dense exchange sums, and whether delta is finite."""
        delta, finite = self._pseudo_gradient(view, fqns)
        buf = torch.empty(delta.numel() + 1, dtype=torch.float32, device=delta.device)
        torch.mul(delta, weight, out=buf[:-1])
        buf[-1] = weight
        return buf, finite

    def _exchange_for(self, index: int) -> StagedPseudoGradientExchange:
        """Fragment ``index``'s compressed exchange over the quorum's group (rebuilt after a
        new quorum: another size, another position)."""
        exchange = self._staged(index)
        group = self.sites.group()
        if exchange.group is not group:
            exchange = exchange.regroup(group)
            self.exchanges[index] = exchange
        return exchange

    def _staged(self, index: int) -> StagedPseudoGradientExchange:
        """Fragment ``index``'s compressed exchange (built by :func:`_local_exchange`, checked
        at :meth:`setup`; :meth:`_exchange_for` replaces it by its ``regroup``)."""
        return cast(StagedPseudoGradientExchange, self.exchanges[index])

    def _compressed_attempt(self, view: OptimizerView, index: int, weight: float):
        """One attempt of a compressed outer step over the quorum's group: the sum of the
        weights (a dense all-reduce of one value), this site's pseudo-gradient scaled by
        ``w / sum(w)``, the compressed exchange (SUM) with the new error feedback staged,
        torchft's vote, then the staged error feedback kept only if the step commits.
        Returns ``(committed, total weight, the sum received or the NonFiniteError)``."""
        delta, self._sent_finite[index] = self._pseudo_gradient(view, self.fragments[index])
        share: Optional[_WeightedShare] = None
        result: Any = None
        try:
            share = _WeightedShare(self._exchange_for(index), weight)
            with ProcessGroupTrafficMeter.tagged("outer", force=True):
                result = share.average(delta)
        except NonFiniteError as exc:  # on every site alike (the same sum)
            result = exc
        except Exception as exc:  # a peer gone mid-exchange, a timeout: the vote says no
            self.sites.report_error(exc)
        committed = self.sites.commit()
        total = share.total if share is not None else 0.0
        self._staged(index).end(committed and torch.is_tensor(result) and total > 0)
        # What this site sent and received in the last attempt (read by tests and tools).
        self.last_exchange = {
            "sent": share.sent if share is not None else None,
            "received": result if total > 0 else None,
            "total_weight": total,
        }
        return committed, total, result

    def _apply_compressed(self, view: OptimizerView, index: int, total: float, result):
        """Fragment ``index``'s outer step from a committed compressed exchange (the
        one-world hook's SGD step and non-finite handling; nothing when nobody contributed)."""
        if total > 0:
            if isinstance(result, NonFiniteError):
                pending: Any = ThreadedAverage()
                pending._finish(None, result)
            else:
                pending = PendingAverage(result)
                self._record_bytes(self._staged(index), result.numel())
            self.pending[index] = (-1, pending)
            self.finish_fragment(view, index)
        else:
            self._sent_finite.pop(index, None)

    def finish(self) -> None:
        self._land_in_flight()  # the peers wait for this site's part of it
        super().finish()
        if self.transport is not None:
            self.transport.shutdown()
            self.transport = None


@dataclass
class _Flight:
    """A fragment's outer step in flight (``--outer-delay``), started by
    :meth:`FaultTolerantDiLoCoHook._start` and landed by its ``_land``: one of the weights'
    sum alone (``buf`` of one value, ``work`` its all-reduce, or None when nobody
    contributed and only the vote remains), the compressed exchange (``share`` on the
    exchange thread, ``handle``) or the dense sum (``buf``, ``work``, ``sent_finite``)."""

    index: int
    apply_after: Optional[int]
    weight: float
    since: int
    buf: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    work: Any = None
    sent_finite: Optional[torch.Tensor] = None
    share: Optional["_WeightedShare"] = None
    handle: Optional[ThreadedAverage] = None


class _WeightedShare:
    """One compressed outer step (blocking, or overlapped on the exchange thread): the sum of
    the sites' weights (a dense all-reduce of one value), then this site's share
    ``w / sum(w)`` of its pseudo-gradient through the exchange (SUM), its new error feedback
    staged."""

    def __init__(self, exchange: StagedPseudoGradientExchange, weight: float):
        self.exchange = exchange
        self.weight = weight
        self.total = 0.0
        self.sent: Optional[torch.Tensor] = None

    def average(self, delta: torch.Tensor) -> torch.Tensor:
        weights = torch.tensor([self.weight], dtype=torch.float64, device=delta.device)
        torch.distributed.all_reduce(weights, torch.distributed.ReduceOp.SUM, self.exchange.group)
        self.total = float(weights)
        if self.total <= 0:
            return delta.new_empty(0)  # nobody contributed (every site joining)
        self.sent = delta.mul_(self.weight / self.total)
        return self.exchange.average(self.sent, commit=False)

    def wire_bytes(self) -> int:
        return self.exchange.wire_bytes()


def _local_group() -> ProcessGroup:
    """A gloo process group of this rank alone (no peer, no store server): what a compressed
    exchange is built over before the first quorum gives the sites' group."""
    from torch.distributed.distributed_c10d import ProcessGroup

    store = torch.distributed.HashStore()
    pg = ProcessGroup(store, 0, 1)
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend = torch.distributed.ProcessGroupGloo(store, 0, 1)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return pg


def _local_exchange(method, options, numel, group, device, **kwargs):
    """A compressed exchange that sums (each site sends its weighted share) over this rank
    alone; :meth:`FaultTolerantDiLoCoHook._compressed_attempt` regroups it over the
    quorum's group at every new quorum."""
    return make_outer_exchange(
        method, options, numel, _local_group(), device, reduce="sum", **kwargs
    )
