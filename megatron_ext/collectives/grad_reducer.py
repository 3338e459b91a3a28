"""The contract between the data-parallel gradient seam and a (compressed) reduction.

What it does:
    megatron-core reduces gradients per *bucket group*: flat, contiguous gradient buffers
    that are all-reduced, or reduce-scattered into shards with the distributed optimizer.
    At install time the adapter (``megatron_ext.megatron.ddp``) describes each bucket group
    once, as a frozen :class:`BucketGroupSpec` (buffers, per-parameter slices keyed by fully
    qualified name, this rank's shard, process group, reduction op, whether it runs
    asynchronously, the reduce-scatter function, the byte meter), and calls
    :meth:`GradReducer.bind`, which returns a :class:`BoundReduction` owning that group's
    plan and state. Megatron's ``start_grad_sync`` then only calls
    :meth:`BoundReduction.launch` with the step. :class:`DenseGradReducer` is the
    pass-through: the collectives megatron-core issues, so training is bit-identical to stock.

    :class:`CompressedReduction` is the skeleton the compressed reducers share: weight
    matrices versus the 1-D leftovers (biases, norms) that travel densely, packing and
    unpacking those leftovers, an all-reduce that is tagged and metered with its dense
    equivalent, and a deferred handle whose ``wait()`` finishes the reduction.

Why:
    PyTorch's DDP has comm hooks; megatron-core has none. This file is our hook contract,
    independent of Megatron so reducers are testable on plain process groups.

Contract (what a bound reduction must guarantee):
    * When the handle returned by ``launch`` is waited on (or at once, if ``launch``
      returns None), each bucket's ``grad`` holds the reduced gradient: the whole buffer
      for all-reduce; at least ``grad[shard[0]:shard[1]]`` for reduce-scatter.
    * Gradients arrive already multiplied by megatron's ``gradient_scaling_factor``; the
      reduction uses ``spec.op`` (SUM, or AVG with ``average_in_collective``). Rank-local
      state (error feedback) is kept in the units of the rank's own input, so that the
      ranks' residuals add up (SUM) or average (AVG) to the global one.
    * Padding elements of the buffer are zero on input and must stay zero.
    * Every transfer is recorded in ``spec.meter`` (category ``dp-grad``) with its dense
      equivalent, and issued inside ``ProcessGroupTrafficMeter.tagged("dp-grad")``.
    * State (residuals, counters) is keyed by parameter FQN, never by bucket index.
    * **A step is a transaction.** ``launch`` and ``wait`` only *stage* the state a step
      computes (new residuals, warm starts, selections); :meth:`GradReducer.end_step`, called
      once the optimizer has decided (megatron's ``update_successful``), commits it when the
      update was applied and drops it when the step was skipped (an fp16 overflow), so a
      skipped step leaves every residual as it was before the step. ``end_step`` also
      rescales loss-scaled state (residuals are in the units of the loss-scaled gradient)
      when the loss scale changes. A ``launch`` with a step still staged drops it (megatron
      may replay a step's backward before its optimizer step).
    * **Non-finite inputs reach every rank.** A compressed reduction appends one flag to its
      payload: whether this rank's input (gradient plus residual) holds a NaN or Inf. After
      the collective every rank knows whether any rank's did, and makes its applied gradient
      non-finite if so (:meth:`CompressedReduction.poison`), so megatron's loss scaler skips
      the step on every rank even when the compressed values themselves stayed finite (a
      Radius entry waiting in the residual). No host synchronization: the flag stays on the
      device; :meth:`GradReducer.nonfinite` gives it to the optimizer hook, which stops
      training when no loss scaler can skip the step.
    * **Dense warm-up.** Launches of steps before :attr:`GradReducer.dense_before_step`
      (set by the runtime from AQ-SGD's ``--aqsgd-warmup-epochs``) run megatron-core's own
      collectives (:class:`DenseGradReducer`'s), whatever the reducer: the compressed
      reduction is not launched, stages nothing and its state stays as initialised.

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _coalescing_manager

from megatron_ext.accounting import (
    CommMeter,
    ProcessGroupTrafficMeter,
    collective_wire_bytes,
)
from megatron_ext.kernels.finite import nonfinite_flag
from megatron_ext.protocols import NonFiniteError, OptimizerHook, OptimizerView

__all__ = [
    "ParamSlice",
    "BucketView",
    "BucketGroupSpec",
    "DeferredHandle",
    "BoundReduction",
    "CompressedReduction",
    "GradReducer",
    "DenseGradReducer",
    "group_rank",
    "group_size",
    "shard_bounds",
    "all_gather_flat",
    "ReducerStepHook",
    "check_state_keys",
]


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter's gradient lives inside a flat bucket buffer."""

    fqn: str
    """Fully qualified parameter name (global layer numbering)."""

    start: int
    """First element in the bucket buffer."""

    end: int
    """One past the last element."""

    shape: Tuple[int, ...]
    """The parameter's shape."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.end - self.start

    @property
    def is_matrix(self) -> bool:
        """Two or more dimensions (compressible); 1-D parameters travel densely."""
        return len(self.shape) >= 2


@dataclass(frozen=True)
class BucketView:
    """One flat gradient bucket as seen by a reducer."""

    grad: torch.Tensor
    """The flat gradient buffer (a view into megatron's grad buffer); reduced in place."""

    params: Tuple[ParamSlice, ...]
    """Parameter slices in buffer order."""

    key: str
    """Stable name of the bucket (first and last parameter FQN)."""

    shard: Optional[Tuple[int, int]] = None
    """This rank's [start, end) slice of ``grad`` with the distributed optimizer, else None."""

    def region(self, reduce_scatter: bool) -> Tuple[int, int]:
        """The elements a reduction must deliver: the shard, or the whole buffer."""
        if reduce_scatter and self.shard is not None:
            return self.shard
        return 0, self.grad.numel()


REDUCE_SCATTER = getattr(torch.distributed, "reduce_scatter_single", None) or (
    torch.distributed.reduce_scatter_tensor
)
"""``reduce_scatter_single`` (torch >= 2.13, which deprecates ``reduce_scatter_tensor`` with a
FutureWarning at every call site), else ``reduce_scatter_tensor``; same arguments."""


def all_gather_flat(
    output: torch.Tensor, local: torch.Tensor, group: Optional[ProcessGroup]
) -> None:
    """``output = cat(local of every rank)`` (torch >= 2.13 names it ``all_gather_single``
    and deprecates ``all_gather_into_tensor``, which older releases only have)."""
    gather = getattr(torch.distributed, "all_gather_single", None)
    if gather is None:
        gather = torch.distributed.all_gather_into_tensor
    gather(output, local, group=group)


def _known_to_torch(group: Optional[ProcessGroup]) -> bool:
    """``group`` is None, the world, a group torch.distributed registered, or the marker of a
    group this rank is not in (torch.distributed answers for all of these)."""
    from torch.distributed.distributed_c10d import GroupMember, _world

    return group is None or group is GroupMember.NON_GROUP_MEMBER or group in _world.pg_group_ranks


def group_size(group: Optional[ProcessGroup]) -> int:
    """Ranks in ``group``: torch.distributed's count for a group it knows; the group's own
    ``size()`` for a ``ProcessGroup`` it does not (a reconfigurable one built outside
    ``new_group``, e.g. torchft's current group of the sites: torch.distributed's collectives
    accept it, ``get_rank`` does not)."""
    if _known_to_torch(group):
        return torch.distributed.get_world_size(group)
    return int(group.size())


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This rank's index in ``group`` (see :func:`group_size`)."""
    if _known_to_torch(group):
        return torch.distributed.get_rank(group)
    return int(group.rank())


def shard_bounds(numel: int, group_size: int, group_rank: int) -> Tuple[int, int]:
    """megatron's shard of a bucket under the distributed optimizer (equal chunks)."""
    size = numel // group_size
    return group_rank * size, (group_rank + 1) * size


@dataclass(frozen=True)
class BucketGroupSpec:
    """Fixed description of one bucket group, built once when the seam is installed."""

    buckets: Tuple[BucketView, ...]
    """The group's buckets (usually one), with their shards when reduce-scattering."""

    group: Optional[ProcessGroup]
    """Process group the bucket group reduces over (None: the world)."""

    group_size: int
    """Ranks in ``group``."""

    group_rank: int
    """This rank's index in ``group``."""

    op: Any
    """torch.distributed.ReduceOp.SUM or AVG."""

    distributed_optimizer: bool = False
    """Reduce-scatter into shards (unless a launch forces an all-reduce)."""

    async_op: bool = False
    """Launch asynchronously (overlap with backward); the handle is waited on later."""

    reduce_scatter_fn: Callable[..., Any] = REDUCE_SCATTER
    """The reduce-scatter function megatron would call (it may use fp32 accumulation)."""

    reduce_scatter_own_handle: bool = False
    """Wait on ``reduce_scatter_fn``'s own handle rather than the coalescing manager's
    (megatron's fp32-accumulating reduce-scatter; one bucket per group)."""

    meter: Optional[CommMeter] = None
    """Byte accounting; None disables recording."""

    @classmethod
    def create(
        cls,
        grads_and_params: Sequence[Tuple[torch.Tensor, Sequence[ParamSlice], str]],
        group: Optional[ProcessGroup],
        *,
        op: Any = torch.distributed.ReduceOp.SUM,
        distributed_optimizer: bool = False,
        **kwargs: Any,
    ) -> "BucketGroupSpec":
        """Build a spec from ``(grad, params, key)`` per bucket, computing the shards."""
        size, rank = group_size(group), group_rank(group)
        buckets = tuple(
            BucketView(
                grad=grad,
                params=tuple(params),
                key=key,
                shard=shard_bounds(grad.numel(), size, rank) if distributed_optimizer else None,
            )
            for grad, params, key in grads_and_params
        )
        return cls(
            buckets=buckets,
            group=group,
            group_size=size,
            group_rank=rank,
            op=op,
            distributed_optimizer=distributed_optimizer,
            **kwargs,
        )

    @property
    def share(self) -> float:
        """A rank's share of the reduced value: ``1/W`` under SUM, 1 under AVG."""
        return 1.0 / self.group_size if self.op == torch.distributed.ReduceOp.SUM else 1.0


class DeferredHandle:
    """A handle whose ``wait()`` runs ``finish`` once (waiting on collectives, decompressing).

    Compressed reductions return it with ``async_op``: megatron's ``finish_grad_sync`` calls
    ``wait()`` when it needs the bucket, so decompression happens after communication.
    """

    def __init__(self, finish: Callable[[], None]):
        self._finish: Optional[Callable[[], None]] = finish

    def wait(self) -> None:
        """Finish the reduction (idempotent)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class BoundReduction(abc.ABC):
    """One bucket group's reduction, bound to its :class:`BucketGroupSpec`."""

    def __init__(self, spec: BucketGroupSpec):
        self.spec = spec

    @abc.abstractmethod
    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        """Start the reduction of the group's buckets for ``step``.

        Args:
            step: 0-based training iteration.
            force_all_reduce: all-reduce even with the distributed optimizer (megatron's
                ``force_all_reduce``).

        Returns:
            A handle with ``wait()``, or None if the reduction already finished.
        """

    #: Device flag of the last launch: > 0 when a rank's input was not finite (None: no
    #: compressed launch yet, or a dense one megatron's own checks cover).
    nonfinite: Optional[torch.Tensor] = None

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        """Close the step: commit the staged state if ``applied``, else drop it.

        Args:
            applied: the optimizer applied this step's gradient (megatron's
                ``update_successful``).
            rescale: new loss scale over the scale this step's gradients carry (a 0-d
                device tensor; None when there is no loss scaling). Loss-scaled state is
                multiplied by it so that it stays in the units of the next gradient.
        """

    def state_dict(self) -> Dict[str, Any]:
        """Rank-local state of this group's parameters, keyed by role and FQN."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the keys of :meth:`state_dict` (the reducer checks the key set)."""


def scale_state(tensor: Optional[torch.Tensor], rescale: Optional[torch.Tensor]) -> None:
    """Multiply loss-scaled state by ``rescale`` in place (nothing without loss scaling)."""
    if tensor is not None and rescale is not None:
        tensor.mul_(rescale.to(tensor.dtype))


@dataclass
class _Split:
    """A bucket's parameters: compressed matrices and densely reduced leftovers."""

    view: BucketView
    matrices: List[ParamSlice] = field(default_factory=list)
    dense: List[ParamSlice] = field(default_factory=list)
    dense_index: Optional[torch.Tensor] = None
    """Bucket positions of the leftovers (int64, on the gradient's device; None when there
    are none): one gather packs them and one scatter writes them back, however many
    1-D parameters the bucket holds."""


class CompressedReduction(BoundReduction):
    """Shared skeleton of compressed reductions (see module docstring).

    Subclasses choose which parameters they compress (:meth:`compresses`) and implement
    ``launch`` with the helpers below.
    """

    def __init__(self, spec: BucketGroupSpec):
        super().__init__(spec)
        self.splits: List[_Split] = []
        for view in spec.buckets:
            split = _Split(view=view)
            for s in view.params:
                (split.matrices if self.compresses(s) else split.dense).append(s)
            if split.dense:
                # Built on the host once, at install (the one host-to-device copy).
                positions = torch.cat([torch.arange(s.start, s.end) for s in split.dense])
                split.dense_index = positions.to(view.grad.device)
            self.splits.append(split)

    def compresses(self, s: ParamSlice) -> bool:
        """Whether parameter ``s`` is compressed (default: every matrix)."""
        return s.is_matrix

    # -- dense leftovers -------------------------------------------------------------------

    @staticmethod
    def pack_dense(split: _Split) -> torch.Tensor:
        """The leftovers' gradients in fp32, in bucket order, to concatenate into a payload
        (one gather, and a cast for a non-fp32 bucket)."""
        grad = split.view.grad
        if split.dense_index is None:
            return grad.new_empty(0, dtype=torch.float32)
        return grad.index_select(0, split.dense_index).float()

    @staticmethod
    def unpack_dense(split: _Split, flat: torch.Tensor) -> None:
        """Write the reduced leftovers from ``flat`` (in :meth:`pack_dense` order) with one
        scatter."""
        if split.dense_index is None:
            return
        grad = split.view.grad
        grad.index_copy_(0, split.dense_index, flat[: split.dense_index.numel()].to(grad.dtype))

    # -- non-finite inputs ------------------------------------------------------------------

    @staticmethod
    def input_flag(
        device: torch.device, *tensors: torch.Tensor, known: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:
        """``[1]`` fp32 on the device: 1 if any of ``tensors`` (this rank's input to the
        compressor: gradient plus residual) holds a NaN or Inf, or any of ``known`` (0-d
        bool flags a fused kernel computed over such an input) is True, else 0. Appended to
        the payload, it is summed by the collective, so every rank learns whether any rank's
        input was not finite (no extra collective, no host synchronization). One pass per
        tensor (:func:`megatron_ext.kernels.finite.nonfinite`): callers pass whole buffers
        (a bucket, a packed segment, the packed leftovers), never one tensor per parameter."""
        return nonfinite_flag(device, *tensors, known=known)

    def poison(self, view: BucketView, flag: torch.Tensor, reduce_scatter: bool) -> None:
        """Make the applied gradient non-finite when ``flag`` (the reduced input flags) says
        some rank's input was: megatron's loss scaler then skips the step on every rank, and
        without loss scaling :class:`ReducerStepHook` stops training. Device-side only."""
        flag = flag.reshape(1)
        self.nonfinite = flag if self.nonfinite is None else torch.maximum(self.nonfinite, flag)
        lo, hi = view.region(reduce_scatter)
        if hi <= lo:
            return
        inf = torch.full_like(flag, float("inf"))
        view.grad[lo : lo + 1].add_(
            torch.where(flag > 0, inf, torch.zeros_like(flag)).to(view.grad.dtype)
        )

    # -- collectives -----------------------------------------------------------------------

    def dense_wire_bytes(self, view: BucketView, force_all_reduce: bool) -> int:
        """What megatron's own collective for ``view`` would put on the wire."""
        kind = (
            "reduce_scatter"
            if self.spec.distributed_optimizer and not force_all_reduce
            else "all_reduce"
        )
        nbytes = view.grad.numel() * view.grad.element_size()
        return collective_wire_bytes(kind, nbytes, self.spec.group_size)

    def record(self, kind: str, payload: torch.Tensor, dense: int) -> None:
        """Meter one collective of ``payload`` against ``dense`` bytes of megatron's."""
        if self.spec.meter is None:
            return
        nbytes = payload.numel() * payload.element_size()
        wire = collective_wire_bytes(kind, nbytes, self.spec.group_size)
        self.spec.meter.record("dp-grad", sent=wire, recv=wire, dense_sent=dense, dense_recv=dense)

    def all_reduce(
        self, payload: torch.Tensor, *, dense: int, async_op: Optional[bool] = None
    ) -> Optional[Any]:
        """All-reduce ``payload`` in place with the spec's op; meter it against ``dense``."""
        spec = self.spec
        async_op = spec.async_op if async_op is None else async_op
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            work = torch.distributed.all_reduce(
                payload, op=spec.op, group=spec.group, async_op=async_op
            )
        self.record("all_reduce", payload, dense)
        return work

    def finish(self, works: Sequence[Optional[Any]], then: Callable[[], None]) -> Optional[Any]:
        """Wait on ``works`` and run ``then``: deferred to ``wait()`` when asynchronous."""

        def run():
            for work in works:
                if work is not None and self.spec.async_op:
                    work.wait()
            then()

        if self.spec.async_op:
            return DeferredHandle(run)
        run()
        return None


def check_state_keys(expected: Dict[str, Any], state: Dict[str, Any], what: str) -> None:
    """Raise ValueError when ``state``'s keys are not ``expected``'s, listing up to five
    missing and unexpected keys (a checkpoint of another model or method setting)."""
    if set(state) != set(expected):
        missing = sorted(set(expected) - set(state))[:5]
        unexpected = sorted(set(state) - set(expected))[:5]
        raise ValueError(
            f"{what} state keys differ from this model's parameters: "
            f"missing {missing}, unexpected {unexpected}"
        )


B = TypeVar("B", bound=BoundReduction)


class GradReducer(abc.ABC, Generic[B]):
    """A data-parallel gradient reduction method (see module docstring).

    Subclasses set ``name`` and ``supports`` and implement :meth:`_bind`, which returns
    their :class:`BoundReduction` (``B``). The reducer keeps every reduction it bound, so its
    state (keyed by parameter FQN) spans all groups.
    """

    name: str = "base"
    supports: Tuple[str, ...] = ("all_reduce", "reduce_scatter")
    #: Role -> elastic-resume rule, declared by each concrete class in its own body
    #: (:func:`~megatron_ext.protocols.elastic_rules_of` reads only the class's own).
    elastic_rules: ClassVar[Mapping[str, str]]
    #: Whether the reduced gradient is (an estimate of) the mean gradient; False for a
    #: method that leaves gradients local and exchanges something else at the optimizer
    #: step (QuantizedAdam's momentum).
    reduces_gradient: bool = True

    def __init__(self) -> None:
        self.bound: List[B] = []
        self.dense_before_step = 0
        """Steps before this one are reduced densely (megatron-core's collectives): the
        uncompressed warm-up of ``--aqsgd-warmup-epochs``. Set by the runtime at install;
        0: compress from the first step."""

    def dense_at(self, step: int) -> bool:
        """Step ``step`` is reduced densely (the warm-up is still running)."""
        return step < self.dense_before_step

    def bind(self, spec: BucketGroupSpec) -> B:
        """Bind one bucket group (at install, before any checkpoint load); may check
        cross-rank agreement and raise.

        The returned reduction's ``launch`` is gated on this instance: during the warm-up
        (:attr:`dense_before_step`) it launches megatron-core's dense collectives instead, and
        the compressed reduction stages nothing."""
        bound = self._bind(spec)
        self.bound.append(bound)
        if not isinstance(bound, _DenseReduction):
            self._gate(bound)
        return bound

    def _gate(self, bound: B) -> None:
        """Route ``bound.launch`` to the dense collectives for warm-up steps (the instance's
        attribute; the class and its other methods stay as they are)."""
        compressed = bound.launch
        dense = _DenseReduction(bound.spec)

        def launch(step: int, force_all_reduce: bool = False) -> Optional[Any]:
            if self.dense_at(step):
                return dense.launch(step, force_all_reduce)
            return compressed(step, force_all_reduce)

        bound.launch = launch  # type: ignore[method-assign]

    @abc.abstractmethod
    def _bind(self, spec: BucketGroupSpec) -> B:
        """The bound reduction of ``spec``."""

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        """Commit (``applied``) or drop every bound group's staged state; see
        :meth:`BoundReduction.end_step`."""
        for bound in self.bound:
            bound.end_step(applied, rescale)
            bound.nonfinite = None

    def nonfinite(self) -> Optional[torch.Tensor]:
        """Device flag of the step: > 0 when some rank's input to a compressed reduction
        held a NaN or Inf (None when no compressed reduction ran)."""
        flags = [b.nonfinite for b in self.bound if b.nonfinite is not None]
        if not flags:
            return None
        return torch.stack([f.reshape(()) for f in flags]).amax()

    def state_dict(self) -> Dict[str, Any]:
        """Rank-local state of every bound group (tensors and primitives only)."""
        out: Dict[str, Any] = {}
        for bound in self.bound:
            out.update(bound.state_dict())
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError listing missing / unexpected keys."""
        check_state_keys(self.state_dict(), state, f"{self.name} reducer")
        for bound in self.bound:
            keys = set(bound.state_dict())
            bound.load_state_dict({k: v for k, v in state.items() if k in keys})


class _DenseReduction(BoundReduction):
    """megatron-core's collectives for one bucket group (0.16 and 0.19 alike), plus
    accounting."""

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        spec = self.spec
        reduce_scatter = spec.distributed_optimizer and not force_all_reduce
        handle = None
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            # One coalescing manager over the group's buckets, as megatron does.
            with _coalescing_manager(spec.group, async_ops=spec.async_op) as cm:
                for bucket in spec.buckets:
                    if reduce_scatter:
                        lo, hi = bucket.shard
                        handle = spec.reduce_scatter_fn(
                            bucket.grad[lo:hi],
                            bucket.grad,
                            op=spec.op,
                            group=spec.group,
                            async_op=spec.async_op,
                        )
                    else:
                        torch.distributed.all_reduce(
                            bucket.grad, op=spec.op, group=spec.group, async_op=spec.async_op
                        )
        if spec.meter is not None:
            kind = "reduce_scatter" if reduce_scatter else "all_reduce"
            for bucket in spec.buckets:
                nbytes = bucket.grad.numel() * bucket.grad.element_size()
                wire = collective_wire_bytes(kind, nbytes, spec.group_size)
                spec.meter.record("dp-grad", sent=wire, recv=wire)
        if not spec.async_op:
            return None
        if reduce_scatter and spec.reduce_scatter_own_handle:
            # megatron's fp32-accumulating reduce-scatter returns a handle of its own that
            # the coalescing manager does not wait on.
            return handle
        return cm


class DenseGradReducer(GradReducer[BoundReduction]):
    """Pass-through: exactly the collectives megatron-core issues, plus accounting."""

    name = "none"
    elastic_rules: ClassVar[Mapping[str, str]] = {}

    def _bind(self, spec: BucketGroupSpec) -> BoundReduction:
        return _DenseReduction(spec)


class ReducerStepHook(OptimizerHook):
    """Ties a reducer's step transaction to the optimizer step (installed with every reducer).

    ``pre_step`` reads the loss scale the step's gradients carry; without loss scaling it
    stops training when a rank's input was not finite (the one host synchronization, at the
    optimizer step, where megatron synchronizes for the gradient norm anyway): nothing
    could skip the step, and the gradient must not be applied. ``post_step`` commits or
    drops the reducer's staged state and rescales it by the loss scale's change.
    """

    name = "grad_reducer_step"

    def __init__(self, reducer: GradReducer):
        self.reducer = reducer
        self._scale: Optional[torch.Tensor] = None

    def pre_step(self, view: OptimizerView) -> None:
        scale = view.loss_scale()
        self._scale = None if scale is None else scale.detach().clone()
        if scale is None:
            flag = self.reducer.nonfinite()
            if flag is not None and bool(flag > 0):
                self.reducer.end_step(applied=False)
                raise NonFiniteError(
                    f"megatron-ext: found NaN or Inf in the gradient rebuilt by the "
                    f"'{self.reducer.name}' reduction (a rank's local gradient plus its "
                    f"error-feedback residual) at iteration {view.step + 1}; without loss "
                    "scaling the step cannot be skipped, so training stops before applying it"
                )

    def post_step(self, view: OptimizerView, update_successful: bool) -> None:
        rescale = None
        if self._scale is not None:
            new = view.loss_scale()
            if new is not None:
                rescale = (new.detach().float() / self._scale.float()).reshape(())
        self.reducer.end_step(bool(update_successful), rescale)
