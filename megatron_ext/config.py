"""Configuration dataclasses of megatron_ext and the command-line flags generated from them.

What it does:
    Every feature has one frozen, keyword-only ``*Config`` dataclass. Each field carries an
    attribute docstring; :func:`add_config_args` turns the fields into ``--kebab-case``
    argparse flags whose help text is that docstring (the way megatron-core 0.16 generates
    its own argument groups from ``TransformerConfig``), and :func:`config_from_args` goes
    the other way. So the dataclass is the single source of truth for names, defaults,
    types, choices and documentation.

    The methods' own options dataclasses live in their modules (``megatron_ext.methods``),
    or in the leaf package ``megatron_ext.options`` where other layers read them too (with
    the flag machinery: :class:`ConfigError`, :func:`arg`, :func:`add_config_args` ...,
    re-exported here); the family selectors (``--grad-compression`` ...) with their choices
    come from the method registry; :func:`add_args` adds all of them, :class:`ExtConfig` holds the
    selected method per family and every options instance, and
    :meth:`ExtConfig.state_settings` is the fingerprint of checkpointed state.

Why:
    Megatron-LM users add our flags to the command line they already have
    (``extra_args_provider``); our own driver uses the same groups. Invalid values and
    unsupported combinations must stop before training with a message naming the flag, so
    validation lives next to the fields and raises :class:`ConfigError` (a ``ValueError``)
    that carries the flag name.

Constraints:
    Pure Python and torch-free: this module never imports Megatron, and parsing flags
    (:func:`ext_config_from_flags`) imports no torch (``tests/unit/test_layers.py``). Flags
    use a family prefix per feature (``--grad-compression*``, ``--p2p-compression*``, ``--grass-*``,
    ``--subspace-*``, ``--comm-*``) and must not collide with Megatron-LM's own flags (a
    test parses both parsers together).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "ConfigError",
    "arg",
    "flag_of",
    "check_positive",
    "add_config_args",
    "config_from_args",
    "DEFAULT_LINEAR_LAYERS",
    "LinearLayersConfig",
    "CommAccountingConfig",
    "ExtCheckpointConfig",
    "KernelsConfig",
    "ParallelLayout",
    "ExtConfig",
    "ext_config_classes",
    "add_args",
    "ext_config_from_args",
    "ext_config_from_flags",
    "validate_ext_config",
]


# The flag machinery lives in a leaf module (the options dataclasses and the pure-torch
# packages import it); re-exported here, where callers have always found it.
from megatron_ext.options.base import (  # noqa: F401 (re-exported)
    ConfigError,
    _dest_of,
    _field_docstrings,
    add_config_args,
    arg,
    check_choice,
    check_positive,
    config_from_args,
    flag_of,
    shapes_state,
)
from megatron_ext.options.linear import DEFAULT_LINEAR_LAYERS, LinearLayersConfig  # noqa: F401

# --------------------------------------------------------------------------------------------
# The run-wide configs. The methods' own options live in their modules (megatron_ext.methods.*)
# or, where other layers read them too, in megatron_ext.options; the selectors come from the
# registry.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CommAccountingConfig:
    """Byte accounting of every collective and point-to-point transfer."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: communication accounting"
    ARG_PREFIX: ClassVar[str] = "comm"

    accounting: bool = True
    """Count the bytes each rank sends and receives per step, by category (dp-grad, dp-param,
    pp-act, pp-grad, subspace, tp, outer, other), as sent and as they would be uncompressed; shown in
    the iteration log line, written to TensorBoard and to the JSON report."""

    report: Optional[str] = None
    """Path of the JSON communication report written at the end of the run (default:
    comm_report.json in the run's save directory, else in a new run directory
    runs/<date>-<time> named at start-up). A resumed run adds its segment to the report."""


@dataclass(frozen=True, kw_only=True)
class ExtCheckpointConfig:
    """How megatron_ext state (compressor state, residuals) is kept in checkpoints."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: checkpointed state"
    ARG_PREFIX: ClassVar[str] = "ext-state"

    on_mismatch: str = field(default="error", metadata=arg(choices=("error", "reset")))
    """What to do when a checkpoint's megatron_ext state was saved with another TP/PP
    layout or other compression settings: 'error' stops before training; 'reset' starts
    the megatron_ext state (error-feedback residuals, warm starts, selected indices) from
    scratch with a warning. Model and optimizer load as usual either way. A change of the
    data-parallel size alone is no mismatch for ``megatron-ext train``: the state is
    remapped (megatron_ext.elastic). Megatron-LM's pretrain_gpt.py still treats it as one."""

    verify_checksums: bool = field(default=True, metadata=arg(flag="--verify-checkpoint-checksums"))
    """Before a load, check every file of the checkpoint against the checksums written when
    it was saved (megatron_ext_checksums.json in the iteration directory, crc32) and stop,
    naming the file, when one changed. A checkpoint without them (saved before megatron-ext
    wrote checksums, or by another program) loads unverified, saying so."""

    def __post_init__(self):
        check_choice(type(self), "on_mismatch", self.on_mismatch)


@dataclass(frozen=True, kw_only=True)
class KernelsConfig:
    """Fused kernels of the methods' tensor chains (megatron_ext.kernels)."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: fused kernels"
    ARG_PREFIX: ClassVar[str] = "kernels"

    fused: str = field(
        default="auto", metadata=arg(flag="--fused-kernels", choices=("auto", "on", "off"))
    )
    """Run each method's chains of tensor operations as kernels compiled by torch.compile
    (one pass through memory each) instead of one torch operation at a time: 'auto' on GPUs
    and eagerly on the CPU (where the compile time would dominate small runs), 'on' on
    every device, 'off' never (the eager reference). Results agree as each kernel's test
    states (integer codes bit for bit)."""

    def __post_init__(self):
        check_choice(type(self), "fused", self.fused)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The run that flag combinations are validated against: Megatron's parallel setup, and
    the few settings outside it that a method's refusals read. Host-neutral: the driver
    (``megatron_ext.train_config.driver_layout``) and the Megatron-LM session
    (``megatron_ext.megatron.lm.arguments.layout_from_args``) both build it, so each refusal
    is written once, in the method's module; at run time (``parallel_state``) the settings
    outside parallelism keep their defaults (they were checked before)."""

    tensor_model_parallel_size: int = 1
    """TP size."""

    pipeline_model_parallel_size: int = 1
    """PP size."""

    data_parallel_size: int = 1
    """DP size."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved-schedule chunks per stage, or None."""

    use_distributed_optimizer: bool = False
    """Whether the distributed optimizer (reduce-scatter of gradients) is used."""

    overlap_grad_reduce: bool = False
    """Whether gradient reduction overlaps the backward pass."""

    num_distributed_optimizer_instances: int = 1
    """Number of distributed-optimizer instances."""

    transformer_impl: str = "local"
    """'local' or 'transformer_engine'."""

    replica_hash_interval: int = 0
    """``--check-weight-hash-across-dp-replicas-interval`` (0: off)."""

    fixed_samples: Optional[int] = None
    """``--fixed-samples`` (None: one pass over the data)."""

    per_token_loss: bool = False
    """Megatron-LM's ``--calculate-per-token-loss``."""

    dataloader_type: Optional[str] = None
    """Megatron-LM's ``--dataloader-type`` (None: the driver's own loader)."""


def _registry():
    from megatron_ext.methods import registry

    return registry


def ext_config_classes() -> Tuple[type, ...]:
    """Every options dataclass behind megatron_ext's flags (families', methods', run-wide)."""
    return _registry().option_classes() + (CommAccountingConfig, ExtCheckpointConfig, KernelsConfig)


def _default_methods() -> Dict[str, str]:
    return {fam.name: "none" for fam in _registry().families()}


@dataclass(frozen=True, kw_only=True)
class ExtConfig:
    """All megatron_ext settings: one method per family and every options dataclass."""

    methods: Mapping[str, str] = field(default_factory=_default_methods)
    """Family name -> selected method (families left out select 'none')."""

    options: Mapping[type, Any] = field(default_factory=dict)
    """Options dataclass -> instance; classes left out take their defaults."""

    comm: CommAccountingConfig = field(default_factory=CommAccountingConfig)
    """Byte accounting."""

    checkpoint: ExtCheckpointConfig = field(default_factory=ExtCheckpointConfig)
    """Checkpointed state."""

    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Fused kernels."""

    def __post_init__(self):
        registry = _registry()
        methods = _default_methods()
        for name, value in self.methods.items():
            try:
                fam = registry.family(name)
            except KeyError:
                raise ConfigError("megatron-ext", f"unknown method family {name!r}") from None
            allowed = registry.choices(name)
            if value not in allowed:
                raise ConfigError(
                    fam.flag, f"invalid choice {value!r} (choose from {', '.join(allowed)})"
                )
            methods[name] = value
        known = set(registry.option_classes())
        for cls, value in self.options.items():
            if cls not in known or not isinstance(value, cls):
                raise ConfigError("megatron-ext", f"not a registered options class: {cls!r}")
        options = {cls: self.options.get(cls) or cls() for cls in registry.option_classes()}
        object.__setattr__(self, "methods", methods)
        object.__setattr__(self, "options", options)

    @classmethod
    def of(cls, **kwargs: Any) -> "ExtConfig":
        """Build from keyword arguments: family names select methods (``grad="separate"``),
        options instances are passed positionally by class through ``options=[...]``."""
        opts = {type(o): o for o in kwargs.pop("options", ())}
        extra = {k: kwargs.pop(k) for k in ("comm", "checkpoint", "kernels") if k in kwargs}
        return cls(methods=kwargs, options=opts, **extra)

    def method(self, family: str) -> str:
        """The method selected in ``family``."""
        return self.methods[family]

    def enabled(self, family: str) -> bool:
        """Whether ``family`` selects a method other than 'none'."""
        return self.methods[family] != "none"

    def options_for(self, cls: type) -> Any:
        """The instance of options dataclass ``cls``."""
        return self.options[cls]

    def selected(self) -> List[Tuple[Any, Any]]:
        """``(family, method)`` registry entries of the selected methods, in family order."""
        registry = _registry()
        return [
            (fam, registry.get(fam.name, self.methods[fam.name])) for fam in registry.families()
        ]

    def summary(self) -> Dict[str, Any]:
        """Flat ``{dest: value}`` view, e.g. for logs and reports."""
        out: Dict[str, Any] = {}
        for fam, method in self.selected():
            out[fam.dest] = method.name
        for sub in list(self.options.values()) + [self.comm, self.checkpoint, self.kernels]:
            for sf in dataclasses.fields(sub):
                out[_dest_of(type(sub), sf)] = getattr(sub, sf.name)
        return out

    def state_settings(self) -> Dict[str, Any]:
        """The settings that shape megatron_ext's checkpointed state (for its fingerprint):
        each family's method and the options of the selected methods only, but for those
        marked :data:`~megatron_ext.options.base.RUN_ONLY` (see :meth:`run_only_settings`)."""
        out: Dict[str, Any] = {}
        selected = self.selected()
        for fam, method in selected:
            if method.name == "none" and not fam.fingerprint_none:
                continue
            out[fam.dest] = method.name
        for _, method in selected:
            if method.options is not None:
                sub = self.options[method.options]
                for sf in dataclasses.fields(sub):
                    if shapes_state(sf):
                        out[_dest_of(type(sub), sf)] = getattr(sub, sf.name)
        return out

    def run_only_settings(self) -> List[str]:
        """The settings of every method's options that do not shape checkpointed state (an
        address, a timeout): a checkpoint whose fingerprint differs from this run's in these
        only (saved before they were marked) still fits."""
        return sorted(
            _dest_of(cls, sf)
            for cls, sub in self.options.items()
            for sf in dataclasses.fields(sub)
            if not shapes_state(sf)
        )


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every megatron_ext flag; fits Megatron-LM's ``extra_args_provider``.

    The family selectors (``--grad-compression``, ...) and their choices come from the
    method registry; each options dataclass becomes a group of ``--<prefix>-*`` flags.

    Returns:
        The same parser (Megatron-LM requires the provider to return it).
    """
    registry = _registry()
    for fam in registry.families():
        group = parser.add_argument_group(title=fam.title)
        methods = registry.methods(fam.name)
        listing = "; ".join(
            f"{m.name}: {m.summary}" if m.summary else m.name for m in methods.values()
        )
        group.add_argument(
            fam.flag,
            dest=fam.dest,
            default="none",
            choices=list(methods),
            help=f"{fam.help} Choices: {', '.join(methods)} ({listing}). Default: none.".replace(
                "%", "%%"
            ),
        )
    for cls in ext_config_classes():
        add_config_args(parser, cls)
    return parser


def ext_config_from_args(args: argparse.Namespace) -> ExtConfig:
    """Build :class:`ExtConfig` from parsed arguments; raises :class:`ConfigError`."""
    registry = _registry()
    methods = {
        fam.name: getattr(args, fam.dest) for fam in registry.families() if hasattr(args, fam.dest)
    }
    return ExtConfig(
        methods=methods,
        options={cls: config_from_args(cls, args) for cls in registry.option_classes()},
        comm=config_from_args(CommAccountingConfig, args),
        checkpoint=config_from_args(ExtCheckpointConfig, args),
        kernels=config_from_args(KernelsConfig, args),
    )


def ext_config_from_flags(flags: Sequence[str]) -> ExtConfig:
    """:class:`ExtConfig` of a megatron_ext command line (unknown flags are an error)."""
    parser = add_args(argparse.ArgumentParser(prog="megatron-ext", allow_abbrev=False))
    return ext_config_from_args(parser.parse_args(list(flags)))


def validate_ext_config(cfg: ExtConfig, layout: ParallelLayout) -> None:
    """Check that the selected features fit the parallel layout; raises :class:`ConfigError`.

    Args:
        cfg: the feature configs.
        layout: the Megatron parallel setup of this run.
    """
    if cfg.kernels.fused == "on":
        from megatron_ext.kernels import fused_unavailable

        why = fused_unavailable("cpu")
        if why:
            raise ConfigError("--fused-kernels", f"'on' compiles CPU kernels too: {why}")
    sites = [fam for fam, method in cfg.selected() if fam.spans_sites and method.name != "none"]
    if layout.num_distributed_optimizer_instances != 1 and not sites:
        # megatron-ext's gradient seam reduces inside one instance; with DiLoCo the instances
        # are its sites (methods.diloco validates that), otherwise megatron's all-reduce
        # across instances would be missing.
        raise ConfigError(
            "--num-distributed-optimizer-instances",
            "megatron-ext supports several distributed-optimizer instances only as DiLoCo's "
            "sites (--outer-method diloco --outer-groups, the same number)",
        )
    if cfg.enabled("p2p") and layout.pipeline_model_parallel_size == 1:
        raise ConfigError(
            ["--p2p-compression", "--pipeline-model-parallel-size"],
            "pipeline compression needs --pipeline-model-parallel-size > 1",
        )
    for fam_name in ("linear", "subspace"):
        if cfg.enabled(fam_name) and layout.transformer_impl != "local":
            flag = _registry().family(fam_name).flag
            raise ConfigError(
                [flag, "--transformer-impl"],
                "works on the local layer spec only; pass --transformer-impl local",
            )
    for _, method in cfg.selected():
        if method.validate is not None:
            method.validate(cfg, layout)
