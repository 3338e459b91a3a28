"""The contracts between megatron-ext's layers: the optimizer-step seam and state objects.

A first-level module that imports no other megatron_ext module, so that every layer may
implement or call these contracts: the collectives (Radius's and QuantizedAdam's hooks, the
reducers' non-finite errors), the optimizer hooks (``megatron_ext.optim``) and the host
adapter (``megatron_ext.megatron.optimizer``, the view over megatron-core's optimizer).

The optimizer-step seam:

What it does:
    Some methods act at the optimizer step: Radius picks its top-k indices from the AdamW
    update direction computed from the optimizer's real moment estimates; subspace methods
    keep constrained weights and their optimizer state in a subspace; row-sparse training
    keeps state for selected rows only. An :class:`OptimizerHook` runs before and after the
    wrapped optimizer's ``step()`` and reads or edits per-parameter optimizer state through
    an :class:`OptimizerView`, which hides how megatron stores it (fp32 optimizer, fp16/bf16
    optimizer with fp32 main params, distributed optimizer with flat shards). A hook can
    also take over the parameter update of a step (:meth:`OptimizerHook.update_override`,
    QuantizedAdam after its warm-up): megatron's step still prepares the gradients (loss
    unscaling, the found-inf skip, clipping) and copies the parameters back, only the
    wrapped torch optimizer's ``step()`` is replaced.

State objects:
    Everything megatron-ext checkpoints (reducers, codecs, optimizer hooks, a method's further
    state) is a :class:`ElasticStateful`: ``state_dict`` / ``load_state_dict`` plus
    ``elastic_rules``, a class attribute declared in the class's own body that says, for each
    role of its state (the part of a key before the first ``/``), how the role carries over
    to another data-parallel size (:data:`SUM`, :data:`MEAN`, :data:`TOTAL`, :data:`PARTITION`,
    :data:`SAME`, :data:`RESET`; ``megatron_ext.elastic`` applies them). A class without its
    own rule cannot be registered for checkpointing (:func:`elastic_rules_of` raises), and a
    role without a rule stops an elastic resume: nothing is reset silently. A class whose
    saved state changed form also implements :class:`VersionedState`: it brings a state
    saved at an older format version (``megatron_ext.state.FORMAT_VERSION``) to today's.

Constraints:
    Pure torch; never imports Megatron. Hooks keep their own state keyed by FQN in
    ``state_dict`` (tensors and primitives only).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeGuard,
    runtime_checkable,
)

import torch

__all__ = [
    "ParamOptimState",
    "OptimizerView",
    "OptimizerHook",
    "PseudoGradientExchange",
    "AsynchronousPseudoGradientExchange",
    "is_asynchronous",
    "StagedPseudoGradientExchange",
    "SitesTransport",
    "NonFiniteError",
    "ElasticStateful",
    "VersionedState",
    "elastic_rules_of",
    "SUM",
    "MEAN",
    "TOTAL",
    "PARTITION",
    "SAME",
    "RESET",
    "ELASTIC_RULES",
]

SUM = "sum"
"""Error-feedback mass in the units of the rank's input to the gradient reduction."""

MEAN = "mean"
"""Error-feedback mass of an exchange that averages whatever the gradient op."""

TOTAL = "total"
"""Mass that a SUM all-reduce combines, whatever the gradient reduction's op."""

PARTITION = "partition"
"""State of the partition a rank owns (zero elsewhere); the sum is the whole state."""

SAME = "same"
"""Replicated across DP ranks: take old DP rank 0's."""

RESET = "reset"
"""Cannot be remapped: keep the new run's freshly built value."""

ELASTIC_RULES = (SUM, MEAN, TOTAL, PARTITION, SAME, RESET)
"""Every rule a role may declare."""


class ElasticStateful(Protocol):
    """A checkpointed state object: its state and how each role of it survives a change of
    the data-parallel size (see module docstring)."""

    elastic_rules: ClassVar[Mapping[str, str]]
    """Role -> rule (one of :data:`ELASTIC_RULES`) for every role :meth:`state_dict` may
    hold; ``{}`` for an object without state."""

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


@runtime_checkable
class VersionedState(Protocol):
    """A state object that reads states saved at older format versions."""

    def upgrade_state(self, state: Dict[str, Any], version: int) -> Dict[str, Any]:
        """``state``, saved at megatron_ext state format ``version`` (older than the current
        one), in the current form (its keys then complete: ``load_state_dict`` is strict)."""


def elastic_rules_of(obj: Any) -> Mapping[str, str]:
    """``obj``'s elastic-resume rules, declared in its own class's body (a subclass does not
    inherit its parent's: its state may have other roles).

    Raises:
        TypeError: the class declares no ``elastic_rules``, or a rule is unknown.
    """
    cls = type(obj)
    rules = cls.__dict__.get("elastic_rules")
    if rules is None:
        raise TypeError(
            f"megatron-ext: {cls.__module__}.{cls.__qualname__} is checkpointed but declares "
            "no elastic_rules (role -> sum/total/partition/same/reset; {} without state) in "
            "its class body (megatron_ext.protocols.ElasticStateful)"
        )
    bad = {role: rule for role, rule in rules.items() if rule not in ELASTIC_RULES}
    if bad:
        raise TypeError(
            f"megatron-ext: {cls.__qualname__}.elastic_rules has unknown rules {bad} "
            f"(known: {', '.join(ELASTIC_RULES)})"
        )
    return rules


class NonFiniteError(RuntimeError):
    """A NaN or Inf was about to be applied to the weights or kept in a method's state, and
    nothing could skip it (no loss scaling): training stops before anything is written.
    The message says where (method, iteration, ranks or sites); the driver prints it as
    one line and exits with status 1."""


@dataclass
class ParamOptimState:
    """Optimizer-side view of one model parameter on this rank."""

    fqn: str
    """Global parameter FQN."""

    model_param: torch.Tensor
    """The model parameter (bf16/fp16/fp32, full shape)."""

    main_param: torch.Tensor
    """The tensor the optimizer updates: the fp32 main parameter, or with the distributed
    optimizer this rank's flat fp32 shard of it."""

    state: Dict[str, torch.Tensor]
    """The optimizer's state for ``main_param`` (e.g. ``exp_avg``, ``exp_avg_sq``); empty
    before the first step."""

    param_range: Optional[Tuple[int, int]] = None
    """With the distributed optimizer: [start, end) of the flattened model parameter this
    rank owns; None when the rank holds the whole parameter."""

    group: Dict[str, Any] = field(default_factory=dict)
    """The optimizer param group (lr, weight_decay, betas, eps, ...)."""

    decoupled_weight_decay: bool = True
    """AdamW-style (decoupled) weight decay, as opposed to L2 added to the gradient."""

    @property
    def adam_step(self) -> Optional[int]:
        """Number of Adam steps taken (torch keeps it per parameter, TE/Apex per group)."""
        step = self.state.get("step", self.group.get("step"))
        return None if step is None else int(step)


class OptimizerView(abc.ABC):
    """Access to per-parameter optimizer state, independent of megatron's optimizer type."""

    @abc.abstractmethod
    def fqns(self) -> List[str]:
        """FQNs of parameters with optimizer state on this rank."""

    @abc.abstractmethod
    def param_state(self, fqn: str) -> Optional[ParamOptimState]:
        """State of ``fqn`` on this rank, or None if another rank owns all of it."""

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Training iteration being stepped."""

    def owned_state(self, fqn: str) -> ParamOptimState:
        """:meth:`param_state` of a parameter this rank holds state for (one of
        :meth:`fqns`).

        Raises:
            KeyError: naming ``fqn``, when this rank holds none of its optimizer state.
        """
        state = self.param_state(fqn)
        if state is None:
            raise KeyError(f"megatron-ext: this rank holds no optimizer state of {fqn!r}")
        return state

    def param_numels(self) -> Dict[str, int]:
        """Element count of every parameter the optimizer updates (whole parameters, also
        those whose shards are on other ranks): the same on every data-parallel rank.
        Default: the parameters of :meth:`fqns`, whole on this rank."""
        return {f: self.owned_state(f).model_param.numel() for f in self.fqns()}

    def write_param(self, fqn: str, value: torch.Tensor) -> None:
        """Set ``fqn``'s optimizer copy (``main_param``, shaped as it) to ``value`` and this
        rank's part of the model parameter to match; other ranks' parts of a sharded
        parameter become current at :meth:`sync_params`."""
        ps = self.owned_state(fqn)
        with torch.no_grad():
            ps.main_param.copy_(value.view_as(ps.main_param))
            if ps.model_param is ps.main_param:
                return
            target = ps.model_param.data
            if ps.param_range is not None:
                target = target.view(-1)[ps.param_range[0] : ps.param_range[1]]
            target.copy_(value.reshape(target.shape))

    def write_params(self, fqns: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """:meth:`write_param` of several parameters (``values[i]`` for ``fqns[i]``). With
        this class's own :meth:`write_param`, two multi-tensor copies (the optimizer copies,
        then the model parameters) instead of one or two copies per parameter: the same
        values (a copy, and one fp32-to-model-dtype rounding, as ``copy_`` does); a view
        that overrides :meth:`write_param` gets it called per parameter."""
        if type(self).write_param is not OptimizerView.write_param:
            for fqn, value in zip(fqns, values):
                self.write_param(fqn, value)
            return
        mains, main_values, models, model_values = [], [], [], []
        for fqn, value in zip(fqns, values):
            ps = self.owned_state(fqn)
            mains.append(ps.main_param)
            main_values.append(value.view_as(ps.main_param))
            if ps.model_param is ps.main_param:
                continue
            target = ps.model_param.data
            if ps.param_range is not None:
                target = target.view(-1)[ps.param_range[0] : ps.param_range[1]]
            models.append(target)
            model_values.append(value.reshape(target.shape))
        with torch.no_grad():
            if mains:
                torch._foreach_copy_(mains, main_values)
            if models:
                torch._foreach_copy_(models, model_values)

    def model_param(self, fqn: str) -> Optional[torch.Tensor]:
        """The model parameter ``fqn`` (full shape), also where this rank holds none of its
        optimizer state (the distributed optimizer's other shards); None if unknown."""
        state = self.param_state(fqn)
        return None if state is None else state.model_param

    def sync_params(self) -> None:
        """Make every rank's model parameters current after :meth:`write_param` (the
        distributed optimizer's parameter gather; default: nothing to do). Collective over
        the ranks that share the optimizer's shards."""

    def loss_scale(self) -> Optional[torch.Tensor]:
        """The optimizer's current loss scale (a device tensor) when it scales the loss
        (fp16), None otherwise. Under loss scaling the optimizer skips a step whose gradient
        is not finite instead of applying it."""
        return None

    # -- what a view that wraps another keeps of its own (an outer step's view) ----------------

    def anchor(self) -> None:
        """Take what this view keeps of its own from the weights as they are now (after a
        load that wrote the weights but not the outer state; default: nothing kept)."""

    def site_state(self) -> Dict[str, torch.Tensor]:
        """What this view keeps of its own that a rank saves (default: nothing)."""
        return {}

    def load_site_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Restore :meth:`site_state`; ValueError when ``state`` does not fit."""
        if state:
            raise ValueError(
                f"a view's saved state ({sorted(state)[:3]}) that this run has no use for "
                "(saved with another method wrapping the view, e.g. Grass?)"
            )


@runtime_checkable
class PseudoGradientExchange(Protocol):
    """What DiLoCo's outer step needs of an exchange of one fragment's pseudo-gradient over
    the outer group (``megatron_ext.optim.diloco.exchange.DenseOuterExchange``, and the
    compressed ``megatron_ext.collectives.outer_exchange.OuterExchange``).

    ``asynchronous``: the exchange is an :class:`AsynchronousPseudoGradientExchange` (it
    declares so; :func:`is_asynchronous` reads it): an overlapped exchange
    (``--outer-delay``) then starts on the calling thread; otherwise ``average`` runs on the
    exchange thread.
    """

    asynchronous: ClassVar[bool]
    group: Any
    size: int

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean over the outer group of ``flat`` (this rank's fp32 pseudo-gradient)."""
        ...

    def wire_bytes(self) -> int:
        """Bytes this rank sent in the last exchange."""
        ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

    def shared_state_dict(self) -> Dict[str, Any]:
        """The state every rank of the group holds alike (a joining site's share)."""
        ...


@runtime_checkable
class AsynchronousPseudoGradientExchange(PseudoGradientExchange, Protocol):
    """A :class:`PseudoGradientExchange` that starts on the calling thread without waiting
    (the dense all-reduce, ``megatron_ext.optim.diloco.exchange.DenseOuterExchange``); it
    declares ``asynchronous = True``. An overlapped outer step calls :meth:`start` on the
    training thread instead of running ``average`` on the exchange thread."""

    def start(self, flat: torch.Tensor) -> Any:
        """Start :meth:`average` of ``flat`` (consumed) and return at once: a handle whose
        ``wait()`` gives the mean."""
        ...


def is_asynchronous(
    exchange: PseudoGradientExchange,
) -> TypeGuard[AsynchronousPseudoGradientExchange]:
    """The exchange declares itself an :class:`AsynchronousPseudoGradientExchange`."""
    return bool(exchange.asynchronous)


@runtime_checkable
class StagedPseudoGradientExchange(PseudoGradientExchange, Protocol):
    """A :class:`PseudoGradientExchange` whose error feedback waits for a vote: the outer step
    of sites that are separate jobs (``megatron_ext.optim.diloco_ft``) exchanges with
    ``average(flat, commit=False)``, which stages the new error feedback, and keeps it with
    ``end(True)`` only once every site's exchange has succeeded (``end(False)``: as it was).
    ``regroup(group)`` is the same exchange, its state kept, over another group (a new
    quorum: another size, another position). The compressed
    ``megatron_ext.collectives.outer_exchange.OuterExchange`` is one."""

    def average(self, flat: torch.Tensor, *, commit: bool = True) -> torch.Tensor:
        """The mean (or, built to sum, the sum) over the group of ``flat``; with
        ``commit=False`` the new error feedback is staged for :meth:`end`."""
        ...

    def end(self, applied: bool) -> None:
        """Keep the staged error feedback (``applied``) or drop it."""
        ...

    def regroup(self, group: Any) -> "StagedPseudoGradientExchange":
        """This exchange over ``group``."""
        ...


@runtime_checkable
class SitesTransport(Protocol):
    """How DiLoCo's outer step reaches the other sites when each site is its own job
    (``megatron_ext.optim.diloco_ft.TorchftTransport`` over torchft; tests use stand-ins).
    One outer step: :meth:`quorum`, then the exchange (:meth:`sum_and_commit`, or
    :meth:`start_sum` and later :meth:`commit`; a compressed exchange runs its own
    collectives on :meth:`group`, reporting failures with :meth:`report_error`)."""

    def quorum(self) -> None:
        """The sites of this outer step (a site behind heals inside it)."""
        ...

    def sum_and_commit(self, buf: torch.Tensor) -> bool:
        """All-reduce (SUM) ``buf`` in place, then the commit vote (True: applied)."""
        ...

    def start_sum(self, buf: torch.Tensor) -> Any:
        """Start the all-reduce (SUM) of ``buf``; the handle's ``wait()`` never raises."""
        ...

    def commit(self) -> bool:
        """The commit vote of this outer step."""
        ...

    def group(self) -> "torch.distributed.ProcessGroup":
        """The quorum's process group, for a compressed exchange's collectives."""
        ...

    def report_error(self, exc: BaseException) -> None:
        """A collective of this outer step failed: the vote says no."""
        ...

    def num_participants(self) -> int: ...

    def step(self) -> int:
        """Outer steps committed."""
        ...

    def shutdown(self) -> None: ...


class OptimizerHook:
    """Runs around the optimizer step (override what you need)."""

    name: str = "base"
    #: Role -> elastic-resume rule, declared by each concrete class in its own body
    #: (:func:`~megatron_ext.protocols.elastic_rules_of` reads only the class's own).
    elastic_rules: ClassVar[Mapping[str, str]]

    def pre_step(self, view: OptimizerView) -> None:
        """After gradients are final, before the update (default: nothing)."""

    def update_override(self, view: OptimizerView) -> Optional[Callable[[Sequence[str]], None]]:
        """A replacement of this step's parameter update, or None to keep the optimizer's.

        Called after :meth:`pre_step`. The returned function is called in place of each
        wrapped optimizer's ``step()`` with the FQNs that optimizer updates (their gradients
        final: unscaled, clipped), and only when the step is applied: a step megatron skips
        (fp16 overflow) never calls it. At most one hook may override a step.
        """
        return None

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        """After the update (default: nothing)."""

    def finish(self) -> None:
        """End of training, on every rank (collective): finish work still in flight, e.g. an
        overlapped exchange, before the report is written and the process groups go away
        (default: nothing)."""

    def state_dict(self) -> Dict[str, Any]:
        """Rank-local state (tensors and primitives only)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raise ValueError on missing / unexpected keys."""
        if state:
            raise ValueError(f"{self.name} optimizer hook has no state, got {sorted(state)}")
