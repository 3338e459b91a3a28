"""The method registry: every compression method declares itself here, once.

What it does:
    A method is a :class:`Method`: its name (the value of its family's selector flag), its
    family, its options dataclass (``--<prefix>-*`` flags), and a factory that builds its
    :class:`Components` (gradient reducer, P2P codec, linear hook, optimizer hooks, model
    transform) from a :class:`MethodContext`. A *family* (:class:`Family`) is one selector
    flag (``--grad-compression``, ``--p2p-compression``, ``--grass-method``,
    ``--subspace-method``); one method per family is active in a run, ``none`` being the
    pass-through. Everything else reads the registry: the flags, their choices and help
    (``megatron_ext.config``), the settings fingerprint of checkpointed state, the runtime
    that builds and installs components (``megatron_ext.megatron.runtime``), the benchmarks'
    method lists and option defaults, and the tests' parametrization.

    Adding a method is one module (its options dataclass, its factory, a :class:`Method`)
    plus one line in ``megatron_ext.methods.BUILTIN``; a plugin or a test can also call
    :func:`register` directly.

Why components built together:
    Methods span seams: Radius pairs a reducer with an optimizer hook that picks its
    indices; Grass needs a linear backward, an optimizer hook and a model transform that
    share the selected rows; Protocol Models a model transform, a P2P codec and an
    optimizer. One factory call returns all of them, sharing whatever state they need.

Lifecycle (the runtime's):
    1. :func:`Method.build` once per run, after the process groups exist and before the
       model is wrapped in DDP; ``ctx.handles`` is still empty.
    2. ``Components.model_transform(model_chunks)`` on the unwrapped model chunks, before
       megatron-core's DDP wrapper and optimizer allocate gradient buffers and state.
    3. After DDP and the optimizer exist, ``ctx.handles`` holds them and the runtime binds
       the reducer to the bucket groups, passes the codec to the P2P communicator, hooks the
       linear layers and the optimizer step.

Constraints:
    This module is pure Python/torch and imports no Megatron. Factories import their heavy
    parts lazily, and two of them build Megatron adapters: Grass's and Protocol Models'
    (``methods/grass.py``, ``methods/protocol.py`` import ``megatron_ext.megatron.grass``,
    ``.subspace`` and ``.optimizer`` inside their factories), the one cycle edge between
    packages that ``tests/unit/test_layers.py`` still allows. The other methods reach the
    host only through ``MethodContext.handles`` (e.g. :meth:`TrainingHandles.new_optimizer_view`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_ext.options.base import ConfigError

if TYPE_CHECKING:  # the contracts' types; importing them at run time would pull in torch.
    # (ExtConfig and ParallelLayout stay Any here: megatron_ext.config imports this module.)
    import torch
    from torch.distributed import ProcessGroup

    from megatron_ext.accounting import CommMeter
    from megatron_ext.autograd.linear import LinearHook
    from megatron_ext.collectives.grad_reducer import GradReducer
    from megatron_ext.collectives.p2p import P2PCodec
    from megatron_ext.protocols import ElasticStateful, OptimizerHook, OptimizerView
    from megatron_ext.state import StepClock

__all__ = [
    "Family",
    "Method",
    "MethodContext",
    "Components",
    "TrainingHandles",
    "SampleSpace",
    "ProcessGroups",
    "BenchContext",
    "register",
    "unregister",
    "families",
    "family",
    "methods",
    "choices",
    "get",
    "find",
    "option_classes",
    "build_components",
    "refuse_families",
]


@dataclass(frozen=True)
class Family:
    """One selector flag; exactly one of its methods is active in a run."""

    name: str
    """Short name used in code (``ExtConfig.methods[name]``)."""

    flag: str
    """The selector flag, e.g. ``--grad-compression``."""

    title: str
    """Title of the flag's argument group in ``--help``."""

    help: str
    """What the selector chooses (the flag's help text)."""

    options: Optional[type] = None
    """Options shared by every method of the family (e.g. which linear layers are hooked)."""

    spans_sites: bool = False
    """The family synchronizes sites of data-parallel ranks (the outer synchronization):
    its method is built first and its ``Components.grad_group`` (the ranks of this site)
    becomes the data-parallel group of every other family's method; its optimizer hooks
    run first, so their ``post_step`` runs last (the outer step's weights are the step's
    last word). It also lets several distributed-optimizer instances be its sites."""

    fingerprint_none: bool = True
    """Whether selecting ``none`` enters the state fingerprint
    (``ExtConfig.state_settings``). False for a family added after checkpoints existed:
    its default leaves their fingerprint as it was."""

    @property
    def dest(self) -> str:
        """argparse destination of the selector (``grad_compression``)."""
        return self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class SampleSpace:
    """The training samples as the data pipeline hands them to this rank."""

    fixed: bool
    """Fixed-sample mode: a sample id means the same tokens in every epoch and always
    comes to the same data-parallel rank (``--fixed-samples``)."""

    num_samples: int
    """Fixed samples over all data-parallel ranks (0 when not fixed)."""

    dp_rank: int
    """This rank's data-parallel rank."""

    dp_size: int
    """Data-parallel size."""

    micro_batch_size: int
    """Samples per microbatch on a rank."""

    num_microbatches: int
    """Microbatches per step on a rank."""

    seq_length: int
    """Tokens per sample."""

    train_iters: Optional[int] = None
    """Training iterations of the run (None where the caller does not know them)."""

    @property
    def num_slots(self) -> int:
        """Fixed samples this rank owns (ids ``dp_rank + dp_size * slot``)."""
        return self.num_samples // self.dp_size if self.fixed else 0

    def slots(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """This rank's slot of each fixed sample id (an int64 tensor)."""
        return sample_ids // self.dp_size


@dataclass
class TrainingHandles:
    """What exists only once the model is wrapped and the optimizer built (filled at install)."""

    model_chunks: Sequence[torch.nn.Module] = ()
    """The DDP-wrapped model chunks."""

    optimizer: Any = None
    """megatron-core optimizer (usually a ``ChainedOptimizer``)."""

    scheduler: Any = None
    """megatron-core ``OptimizerParamScheduler`` (None where the caller has none)."""

    model_config: Any = None
    """The model's ``TransformerConfig``."""

    samples: Optional[SampleSpace] = None
    """The training samples (None where the caller does not describe them)."""

    optimizer_view: Optional[Callable[[], OptimizerView]] = None
    """Builds a new ``megatron_ext.protocols.OptimizerView`` of ``optimizer`` over
    ``model_chunks``: the host adapter's (``megatron_ext.megatron.optimizer``), set by the
    runtime at install, so that methods reach the optimizer without importing Megatron."""

    def new_optimizer_view(self) -> OptimizerView:
        """A new view from :attr:`optimizer_view`; raises where the runtime set none."""
        if self.optimizer_view is None:
            raise RuntimeError(
                "megatron-ext: no optimizer view: the runtime sets TrainingHandles."
                "optimizer_view at install, before on_install runs"
            )
        return self.optimizer_view()


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of the run (torch ``ProcessGroup`` objects, None when absent)."""

    dp: Optional[ProcessGroup] = None
    """Data-parallel group (without context parallelism)."""

    dp_cp: Optional[ProcessGroup] = None
    """Data-parallel group with context parallelism."""

    tp: Optional[ProcessGroup] = None
    """Tensor-parallel group."""

    pp: Optional[ProcessGroup] = None
    """Pipeline-parallel group."""

    embd: Optional[ProcessGroup] = None
    """Embedding group (first and last pipeline stage)."""


@dataclass
class MethodContext:
    """What a method's factory receives."""

    name: str
    """The selected method name (a family's choice; variants of one method share a factory)."""

    options: Any
    """The method's options dataclass instance (None for a method without options)."""

    family_options: Any
    """The family's shared options instance (None if the family has none)."""

    config: Any
    """The whole :class:`~megatron_ext.config.ExtConfig`."""

    layout: Any
    """The :class:`~megatron_ext.config.ParallelLayout` of the run."""

    clock: StepClock
    """The :class:`~megatron_ext.state.StepClock` (current 0-based iteration)."""

    meter: Optional[CommMeter] = None
    """The :class:`~megatron_ext.accounting.CommMeter` of the seams."""

    groups: ProcessGroups = field(default_factory=ProcessGroups)
    """Process groups."""

    handles: TrainingHandles = field(default_factory=TrainingHandles)
    """Model chunks, optimizer, scheduler: empty until the runtime installs (step 3)."""

    peers: Mapping[str, "Components"] = field(default_factory=dict)
    """Every family's components of the run, by family name (complete once every method is
    built: read it from ``on_install`` or later, e.g. the outer synchronization collects
    the other methods' :attr:`Components.outer_view`)."""


@dataclass
class Components:
    """What a method contributes to a run (any subset)."""

    reducer: Optional[GradReducer] = None
    """A :class:`~megatron_ext.collectives.grad_reducer.GradReducer` (family ``grad``)."""

    codec: Optional[P2PCodec] = None
    """A :class:`~megatron_ext.collectives.p2p.P2PCodec` for pipeline transfers."""

    linear_hook: Optional[LinearHook] = None
    """A :class:`~megatron_ext.autograd.linear.LinearHook` for the hooked linear layers."""

    linear_layers: Optional[str] = None
    """Regular expression of the layers ``linear_hook`` applies to."""

    optimizer_hooks: Sequence[OptimizerHook] = ()
    """:class:`~megatron_ext.protocols.OptimizerHook` objects run around the step."""

    model_transform: Optional[Callable[[Sequence[torch.nn.Module]], None]] = None
    """Called with the unwrapped model chunks before DDP wraps them."""

    state: Mapping[str, ElasticStateful] = field(default_factory=dict)
    """Further stateful objects to checkpoint, by name (reducer, codec and hooks are
    registered automatically). Each, like those, is a
    :class:`~megatron_ext.protocols.ElasticStateful`: its class declares ``elastic_rules``."""

    on_install: Optional[Callable[[], None]] = None
    """Called once every seam is installed and ``ctx.handles`` is filled (allocate what
    needs the model, the optimizer or the sample space; check it fits)."""

    on_step: Optional[Callable[[int], None]] = None
    """Called with the 0-based iteration before each training step's forward and backward
    (not before evaluation)."""

    grad_group: Optional[ProcessGroup] = None
    """The process group the data-parallel gradient seam reduces over instead of
    megatron-core's data-parallel group (family ``outer``: this rank's site); None keeps
    megatron's."""

    describe: Optional[Callable[[], str]] = None
    """One line for the log once installed: what the method changed on this rank (e.g.
    Grass's parameter counts)."""

    outer_view: Optional[Callable[[OptimizerView], OptimizerView]] = None
    """How the outer synchronization (family ``outer``) sees the weights this method trains
    outside the optimizer's parameters: wraps an
    :class:`~megatron_ext.protocols.OptimizerView` into one whose parameters are the
    model's weights as the outer step should read and write them (Grass: its frozen
    projected weights in place of its virtual parameters)."""


@dataclass(frozen=True)
class BenchContext:
    """What a benchmark tells a method when it asks for option defaults."""

    iters: int
    """Training iterations of the benchmark run."""

    matrix_shapes: Sequence[Tuple[int, int]] = ()
    """The model's weight-matrix shapes (for settings matched by bytes)."""

    resolve: Callable[[str, str], Any] = lambda method, option: None
    """``resolve(method, option)``: another method's option as this benchmark runs it."""


@dataclass(frozen=True)
class Method:
    """A compression method (see module docstring)."""

    name: str
    """Selector value, e.g. ``separate``."""

    family: str
    """Family name (``grad``, ``p2p``, ``linear``, ``subspace``, ``outer``)."""

    build: Callable[[MethodContext], Components]
    """Factory of the run's components."""

    options: Optional[type] = None
    """Options dataclass, declared with :func:`megatron_ext.options.base.options_dataclass`
    (its ``ARG_GROUP`` and ``ARG_PREFIX``; frozen, keyword-only), a docstring per field."""

    summary: str = ""
    """One line for ``--help`` and reports."""

    validate: Optional[Callable[[Any, Any], None]] = None
    """``validate(ext_config, layout)``: raise ConfigError for unsupported combinations."""

    bench_defaults: Optional[Callable[[BenchContext], Dict[str, Any]]] = None
    """Option values the benchmarks use unless given (field name -> value)."""

    bench_label: Optional[Callable[[Any], str]] = None
    """Short label of a configured run from its options instance (default: the name)."""

    def label(self, options: Any) -> str:
        """Short label of this method with ``options``, e.g. ``separate-16``."""
        if self.bench_label is None or options is None:
            return self.name
        return self.bench_label(options)


_FAMILIES: Tuple[Family, ...] = ()
_METHODS: Dict[str, Dict[str, Method]] = {}
_loaded = False


def _define_families() -> Tuple[Family, ...]:
    from megatron_ext.options.linear import LinearLayersConfig

    return (
        Family(
            "grad",
            "--grad-compression",
            "megatron-ext: data-parallel gradient compression",
            "Compressor applied to every data-parallel gradient bucket before it is reduced; "
            "'none' reduces dense gradients exactly as megatron-core does.",
        ),
        Family(
            "p2p",
            "--p2p-compression",
            "megatron-ext: pipeline-parallel activation compression",
            "Codec for tensors sent between pipeline stages; 'none' sends them as "
            "megatron-core does.",
        ),
        Family(
            "linear",
            "--grass-method",
            "megatron-ext: row-sparse linear backward (Grass)",
            "Row-selection rule of the row-sparse linear backward; 'none' keeps "
            "megatron-core's dense backward.",
            options=LinearLayersConfig,
        ),
        Family(
            "subspace",
            "--subspace-method",
            "megatron-ext: subspace-confined activations (Protocol Models)",
            "Subspace method for pipeline activations; 'none' leaves the residual stream "
            "unconstrained.",
        ),
        Family(
            "outer",
            "--outer-method",
            "megatron-ext: outer synchronization across sites (DiLoCo)",
            "Outer synchronization of data-parallel sites; 'none' synchronizes every step "
            "(ordinary data parallelism).",
            spans_sites=True,
            fingerprint_none=False,
        ),
    )


def _ensure_loaded() -> None:
    global _loaded, _FAMILIES
    if _loaded:
        return
    _loaded = True
    _FAMILIES = _define_families()
    for fam in _FAMILIES:
        _METHODS.setdefault(fam.name, {})
    from megatron_ext.methods import BUILTIN

    for module in BUILTIN:
        importlib.import_module(module)


def register(method: Method) -> Method:
    """Add ``method`` to its family; returns it (so a module can write ``METHOD = register(...)``).

    Raises:
        ValueError: unknown family, or the name is taken in the family.
    """
    _ensure_loaded()
    if method.family not in _METHODS:
        raise ValueError(f"unknown method family {method.family!r} (of method {method.name!r})")
    if method.name in _METHODS[method.family]:
        raise ValueError(f"method {method.name!r} is registered twice in {method.family!r}")
    from megatron_ext.methods import BUILTIN

    # Kept in BUILTIN's order: a method module imported before the registry registers its
    # method while the registry loads the others, which would otherwise put it last.
    rank = {module: i for i, module in enumerate(BUILTIN)}
    members = [*_METHODS[method.family].values(), method]
    members.sort(key=lambda m: rank.get(getattr(m.build, "__module__", ""), len(BUILTIN)))
    _METHODS[method.family] = {m.name: m for m in members}
    return method


def unregister(family_name: str, name: str) -> None:
    """Remove a method (tests that register toy methods clean up with it)."""
    _ensure_loaded()
    del _METHODS[family_name][name]


def families() -> Tuple[Family, ...]:
    """Every family, in flag order."""
    _ensure_loaded()
    return _FAMILIES


def family(name: str) -> Family:
    """The family called ``name``."""
    for fam in families():
        if fam.name == name:
            return fam
    raise KeyError(f"unknown method family {name!r}")


def methods(family_name: str) -> Dict[str, Method]:
    """The family's methods by name: the built-in ones in :data:`BUILTIN`'s order (``none``
    first), whichever module was imported first, then the others in registration order."""
    _ensure_loaded()
    return dict(_METHODS[family_name])


def choices(family_name: str) -> Tuple[str, ...]:
    """The selector's allowed values."""
    return tuple(methods(family_name))


def get(family_name: str, name: str) -> Method:
    """The method ``name`` of a family (KeyError if absent)."""
    return methods(family_name)[name]


def find(name: str) -> List[Method]:
    """Every registered method called ``name`` (across families)."""
    return [m for fam in families() for m in methods(fam.name).values() if m.name == name]


def refuse_families(config: Any, flag: str, reasons: Mapping[str, str]) -> None:
    """Refuse the first family of ``reasons`` that ``config`` (an ExtConfig) enables.

    For a method's ``validate``: the families it cannot run beside, in order, each with why.

    Raises:
        ConfigError: naming ``flag`` (the method's selector) and that family's selector.
    """
    for name, reason in reasons.items():
        if config.enabled(name):
            raise ConfigError([flag, family(name).flag], reason)


def option_classes() -> Tuple[type, ...]:
    """Every options dataclass: the families' shared ones, then the methods', deduplicated."""
    out: List[type] = []
    for fam in families():
        if fam.options is not None and fam.options not in out:
            out.append(fam.options)
    for fam in families():
        for method in methods(fam.name).values():
            if method.options is not None and method.options not in out:
                out.append(method.options)
    return tuple(out)


def build_components(
    config: Any,
    layout: Any,
    *,
    clock: StepClock,
    meter: Optional[CommMeter] = None,
    groups: Optional[ProcessGroups] = None,
    handles: Optional[TrainingHandles] = None,
) -> Dict[str, Components]:
    """Build every family's selected method of ``config`` (an ExtConfig); family -> components.

    The runtime calls this once per run; the contexts share ``clock``, ``meter``, ``groups``,
    ``handles`` (which the runtime fills at install) and ``peers`` (the returned mapping).

    The ``outer`` family is built first: when it sets a :attr:`Components.grad_group` (this
    rank's site), that group is the data-parallel group (``dp`` and ``dp_cp``) every other
    family's method sees, since inside a site training is ordinary data parallelism (Grass
    reduces its selection sketches over the site, not across sites). The mapping keeps the
    families' order.
    """
    import dataclasses

    groups = groups if groups is not None else ProcessGroups()
    handles = handles if handles is not None else TrainingHandles()
    selected = list(config.selected())
    built: Dict[str, Components] = {}

    def build(fam: Family, method: Method, seen: ProcessGroups) -> None:
        ctx = MethodContext(
            name=method.name,
            options=None if method.options is None else config.options_for(method.options),
            family_options=None if fam.options is None else config.options_for(fam.options),
            config=config,
            layout=layout,
            clock=clock,
            meter=meter,
            groups=seen,
            handles=handles,
            peers=built,
        )
        built[fam.name] = method.build(ctx)

    site = None
    for fam, method in selected:
        if fam.spans_sites:
            build(fam, method, groups)
            site = built[fam.name].grad_group
    inner = groups if site is None else dataclasses.replace(groups, dp=site, dp_cp=site)
    for fam, method in selected:
        if not fam.spans_sites:
            build(fam, method, inner)
    order = [fam.name for fam, _ in selected]
    ordered = {name: built[name] for name in order}
    built.clear()
    built.update(ordered)
    return built
