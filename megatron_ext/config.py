"""Configuration dataclasses of megatron_ext and the command-line flags generated from them.

What it does:
    Every feature has one frozen, keyword-only ``*Config`` dataclass. Each field carries an
    attribute docstring; :func:`add_config_args` turns the fields into ``--kebab-case``
    argparse flags whose help text is that docstring (the way megatron-core 0.16 generates
    its own argument groups from ``TransformerConfig``), and :func:`config_from_args` goes
    the other way. So the dataclass is the single source of truth for names, defaults,
    types, choices and documentation.

Why:
    Megatron-LM users add our flags to the command line they already have
    (``extra_args_provider``); our own driver uses the same groups. Invalid values and
    unsupported combinations must stop before training with a message naming the flag, so
    validation lives next to the fields and raises :class:`ConfigError` (a ``ValueError``)
    that carries the flag name.

Constraints:
    Pure Python and torch-free: this module never imports Megatron. Flags use a family
    prefix per feature (``--grad-compression*``, ``--p2p-compression*``, ``--grass-*``,
    ``--subspace-*``, ``--comm-*``) and must not collide with Megatron-LM's own flags (a
    test parses both parsers together).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Tuple

__all__ = [
    "ConfigError",
    "arg",
    "flag_of",
    "add_config_args",
    "config_from_args",
    "GradCompressionConfig",
    "SeparateConfig",
    "RadiusConfig",
    "PowerSGDConfig",
    "P2PCompressionConfig",
    "GrassConfig",
    "SubspaceConfig",
    "CommAccountingConfig",
    "ExtCheckpointConfig",
    "ParallelLayout",
    "ExtConfig",
    "EXT_CONFIG_CLASSES",
    "add_args",
    "ext_config_from_args",
    "validate_ext_config",
]


class ConfigError(ValueError):
    """A bad flag value or an unsupported flag combination.

    The message always starts with the flag(s) at fault, e.g.
    ``--grad-compression: 'separate' needs --use-distributed-optimizer off``.
    """

    def __init__(self, flags: Iterable[str] | str, message: str):
        if isinstance(flags, str):
            flags = [flags]
        self.flags = tuple(flags)
        super().__init__(f"{', '.join(self.flags)}: {message}")


def arg(
    *,
    flag: Optional[str] = None,
    choices: Optional[Tuple[Any, ...]] = None,
    metavar: Optional[str] = None,
    nargs: Optional[str] = None,
) -> Dict[str, Any]:
    """Field metadata for argparse generation (use as ``field(metadata=arg(...))``).

    Args:
        flag: the flag, overriding ``--<prefix>-<field-name>``.
        choices: allowed values; argparse reports anything else naming the flag.
        metavar: argparse metavar.
        nargs: argparse nargs (for list-valued fields).
    """
    return {"argparse": {"flag": flag, "choices": choices, "metavar": metavar, "nargs": nargs}}


@lru_cache(maxsize=None)
def _field_docstrings(cls: type) -> Dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _dest_of(cls: type, f: dataclasses.Field) -> str:
    return flag_of(cls, f.name)[2:].replace("-", "_")


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of field ``name`` of config class ``cls``."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    meta = f.metadata.get("argparse", {})
    if meta.get("flag"):
        return meta["flag"]
    prefix = getattr(cls, "ARG_PREFIX", "")
    stem = name.replace("_", "-")
    return f"--{prefix}-{stem}" if prefix else f"--{stem}"


def _resolved_type(cls: type, f: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[f.name]


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Add one argument group with a flag per field of ``cls``; returns ``parser``."""
    group = parser.add_argument_group(title=getattr(cls, "ARG_GROUP", cls.__name__))
    docs = _field_docstrings(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        meta = f.metadata.get("argparse", {})
        flag = flag_of(cls, f.name)
        dest = _dest_of(cls, f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        # argparse %-formats help strings.
        help_text = docs.get(f.name, "").replace("%", "%%")
        tp, _ = _unwrap_optional(_resolved_type(cls, f))
        if tp is bool:
            if default:
                neg = "--no-" + flag[2:]
                group.add_argument(
                    neg, dest=dest, action="store_false", help=f"Disable: {help_text}"
                )
            else:
                group.add_argument(flag, dest=dest, action="store_true", help=help_text)
            continue
        kwargs: Dict[str, Any] = {"dest": dest, "default": default}
        if typing.get_origin(tp) in (list, tuple, List, Tuple):
            inner, *_ = typing.get_args(tp) or (str,)
            kwargs["type"] = inner
            kwargs["nargs"] = meta.get("nargs") or "+"
            if isinstance(default, tuple):
                kwargs["default"] = list(default)
        else:
            kwargs["type"] = tp
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
            help_text = f"{help_text} Choices: {', '.join(map(str, meta['choices']))}."
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if default is not None and tp is not bool:
            help_text = f"{help_text} Default: {default}."
        group.add_argument(flag, help=help_text, **kwargs)
    return parser


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build config ``cls`` from parsed ``args`` (fields missing on ``args`` keep defaults)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        dest = _dest_of(cls, f)
        if hasattr(args, dest):
            value = getattr(args, dest)
            tp, _ = _unwrap_optional(_resolved_type(cls, f))
            if typing.get_origin(tp) is tuple and isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def _check_choice(cls: type, name: str, value: Any) -> None:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    choices = f.metadata.get("argparse", {}).get("choices")
    if choices and value not in choices:
        raise ConfigError(
            flag_of(cls, name), f"invalid value {value!r} (choose from {', '.join(choices)})"
        )


def _check_positive(cls: type, name: str, value: Any, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(flag_of(cls, name), f"must be {bound}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Feature configs. Methods are added to the *_METHODS tuples as they land; until then only
# "none" is accepted, and anything else is refused naming the flag.
# --------------------------------------------------------------------------------------------

GRAD_COMPRESSION_METHODS: Tuple[str, ...] = ("none", "separate", "radius", "powersgd")
P2P_COMPRESSION_METHODS: Tuple[str, ...] = ("none",)
GRASS_METHODS: Tuple[str, ...] = ("none",)
SUBSPACE_METHODS: Tuple[str, ...] = ("none",)


@dataclass(frozen=True, kw_only=True)
class GradCompressionConfig:
    """Compression of the data-parallel gradient reduction (DDP bucket groups)."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: data-parallel gradient compression"
    ARG_PREFIX: ClassVar[str] = "grad-compression"

    method: str = field(
        default="none", metadata=arg(flag="--grad-compression", choices=GRAD_COMPRESSION_METHODS)
    )
    """Compressor applied to every data-parallel gradient bucket before it is reduced;
    'none' reduces dense gradients exactly as megatron-core does."""

    def __post_init__(self):
        _check_choice(type(self), "method", self.method)

    @property
    def enabled(self) -> bool:
        """Whether a compressor other than 'none' is selected."""
        return self.method != "none"


@dataclass(frozen=True, kw_only=True)
class SeparateConfig:
    """SEPARATE: common random projection of gradients with moving-average error feedback."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: SEPARATE (--grad-compression separate)"
    ARG_PREFIX: ClassVar[str] = "separate"

    ratio: int = 16
    """Compression ratio: each block of --separate-block-size gradient entries is sent as
    block-size / ratio random projections (paper: 16; 8-128 tested). Must divide the block
    size."""

    block_size: int = 256
    """Entries per projection block. The flat gradient bucket is viewed as rows of this
    length, all projected by one shared Gaussian block; the estimator's variance depends on
    the ratio only, while the cost per entry grows with block_size / ratio (see the kernel
    benchmark)."""

    ef_beta: Optional[float] = None
    """Moving-average factor of the error feedback, e <- (1-beta) e + beta (h - local
    estimate of h), reset to zero every --separate-reset-interval steps; 0 disables it.
    Default 1/ratio. The paper's 0.95 diverges with an unbiased projection: the local
    estimate misses h by about sqrt(ratio) |h|, so the recursion grows unless beta <
    2/ratio (measured, gpt-tiny ratio 16, 300 steps: 0.95 -> NaN at step ~40, 0.1 -> loss
    6.19, 1/16 -> 6.06, 0 -> 6.21; dense 5.52). Values >= 2/ratio are refused."""

    reset_interval: int = 128
    """Reset the error-feedback buffer to zero every this many steps (paper: 128)."""

    seed: int = 42
    """Seed of the common random projections (derived with the step and the bucket name, so
    every rank builds the same matrix without communicating and a restart reproduces it)."""

    adaptive: bool = False
    """G-SEPARATE: adapt the compression ratio and beta per parameter every
    --separate-adapt-interval steps from the cosine similarity between the compressed and
    the dense averaged gradient (measured with one dense all-reduce at those steps); beta
    stays within [0.5, 1.5] / ratio."""

    adapt_interval: int = 2000
    """Steps between G-SEPARATE adaptations (paper: 2000)."""

    min_ratio: int = 4
    """Smallest compression ratio G-SEPARATE may choose."""

    max_ratio: int = 64
    """Largest compression ratio G-SEPARATE may choose."""

    def __post_init__(self):
        cls = type(self)
        for name in ("ratio", "block_size", "reset_interval", "adapt_interval"):
            _check_positive(cls, name, getattr(self, name))
        if self.block_size % self.ratio:
            raise ConfigError(
                [flag_of(cls, "ratio"), flag_of(cls, "block_size")],
                f"ratio {self.ratio} must divide the block size {self.block_size}",
            )
        if self.ef_beta is not None:
            if not 0.0 <= self.ef_beta <= 1.0:
                raise ConfigError(flag_of(cls, "ef_beta"), f"must be in [0, 1], got {self.ef_beta}")
            if self.ef_beta >= 2.0 / self.ratio:
                raise ConfigError(
                    [flag_of(cls, "ef_beta"), flag_of(cls, "ratio")],
                    f"beta {self.ef_beta} >= 2/ratio = {2.0 / self.ratio:.4g}: the error "
                    "feedback of an unbiased projection grows without bound (it diverged "
                    "to NaN in our runs); use a smaller beta, e.g. the default 1/ratio",
                )
        if self.adaptive:
            if not (1 <= self.min_ratio <= self.ratio <= self.max_ratio):
                raise ConfigError(
                    [flag_of(cls, "min_ratio"), flag_of(cls, "ratio"), flag_of(cls, "max_ratio")],
                    "need min ratio <= ratio <= max ratio",
                )
            if self.block_size % self.max_ratio:
                raise ConfigError(
                    [flag_of(cls, "max_ratio"), flag_of(cls, "block_size")],
                    "the largest ratio must divide the block size",
                )

    @property
    def beta_scale(self) -> float:
        """beta * ratio: the error-feedback factor relative to its stability bound 2/ratio."""
        return 1.0 if self.ef_beta is None else self.ef_beta * self.ratio


@dataclass(frozen=True, kw_only=True)
class RadiusConfig:
    """Radius: top-k gradient sparsity with indices reused for T steps, all-reduced densely."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: Radius (--grad-compression radius)"
    ARG_PREFIX: ClassVar[str] = "radius"

    density: float = 0.4
    """Fraction of each weight's entries kept (paper: 0.4-0.5); biases and other 1-D
    parameters are always reduced densely."""

    interval: int = 200
    """Every this many steps (T) the residual is added back, the gradient is all-reduced
    densely and the top-k indices are chosen again (paper: 200)."""

    dense_steps: int = 0
    """Dense all-reduce for the first this many steps (paper: 15-20% of training); the
    sparse phase starts at this step with a dense reselection step."""

    def __post_init__(self):
        cls = type(self)
        if not 0.0 < self.density <= 1.0:
            raise ConfigError(flag_of(cls, "density"), f"must be in (0, 1], got {self.density}")
        _check_positive(cls, "interval", self.interval)
        _check_positive(cls, "dense_steps", self.dense_steps, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """PowerSGD (PyTorch's powerSGD_hook algorithm), the standard peer baseline."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: PowerSGD (--grad-compression powersgd)"
    ARG_PREFIX: ClassVar[str] = "powersgd"

    approx_rank: int = 4
    """Rank of the low-rank approximation of each weight gradient (PyTorch's
    matrix_approximation_rank)."""

    start_step: int = 10
    """Dense all-reduce before this step (PyTorch's start_powerSGD_iter)."""

    min_compression_rate: float = 2.0
    """Compress a matrix only if (rows + cols) * rank is at least this many times smaller
    than rows * cols; others are reduced densely."""

    warm_start: bool = True
    """Reuse the previous step's Q as the starting point of the power iteration."""

    error_feedback: bool = True
    """Add the previous step's approximation error to the gradient before compressing."""

    seed: int = 0
    """Seed of the initial random Q (identical on every rank)."""

    def __post_init__(self):
        cls = type(self)
        _check_positive(cls, "approx_rank", self.approx_rank)
        _check_positive(cls, "start_step", self.start_step, allow_zero=True)
        if self.min_compression_rate < 1.0:
            raise ConfigError(flag_of(cls, "min_compression_rate"), "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class P2PCompressionConfig:
    """Compression of pipeline-parallel activations and activation gradients."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: pipeline-parallel activation compression"
    ARG_PREFIX: ClassVar[str] = "p2p-compression"

    method: str = field(
        default="none", metadata=arg(flag="--p2p-compression", choices=P2P_COMPRESSION_METHODS)
    )
    """Codec for tensors sent between pipeline stages; 'none' sends them as megatron-core
    does."""

    def __post_init__(self):
        _check_choice(type(self), "method", self.method)

    @property
    def enabled(self) -> bool:
        """Whether a codec other than 'none' is selected."""
        return self.method != "none"


@dataclass(frozen=True, kw_only=True)
class GrassConfig:
    """Row-sparse weight gradients of the local-spec linear layers (Grass)."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: row-sparse linear backward (Grass)"
    ARG_PREFIX: ClassVar[str] = "grass"

    method: str = field(default="none", metadata=arg(choices=GRASS_METHODS))
    """Row-selection rule of the row-sparse linear backward; 'none' keeps megatron-core's
    dense backward."""

    layers: str = (
        r"decoder\.layers\.\d+\.(self_attention\.(linear_qkv|linear_proj)|mlp\.(linear_fc1|linear_fc2))$"
    )
    """Regular expression matched (re.search) against the module names of the linear layers
    that get the megatron_ext forward/backward."""

    def __post_init__(self):
        _check_choice(type(self), "method", self.method)

    @property
    def enabled(self) -> bool:
        """Whether a row-selection rule other than 'none' is selected."""
        return self.method != "none"


@dataclass(frozen=True, kw_only=True)
class SubspaceConfig:
    """Subspace-confined pipeline activations (Protocol Models)."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: subspace-confined activations (Protocol Models)"
    ARG_PREFIX: ClassVar[str] = "subspace"

    method: str = field(default="none", metadata=arg(choices=SUBSPACE_METHODS))
    """Subspace method for pipeline activations; 'none' leaves the residual stream
    unconstrained."""

    def __post_init__(self):
        _check_choice(type(self), "method", self.method)

    @property
    def enabled(self) -> bool:
        """Whether a subspace method other than 'none' is selected."""
        return self.method != "none"


@dataclass(frozen=True, kw_only=True)
class CommAccountingConfig:
    """Byte accounting of every collective and point-to-point transfer."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: communication accounting"
    ARG_PREFIX: ClassVar[str] = "comm"

    accounting: bool = True
    """Count the bytes each rank sends and receives per step, by category (dp-grad, dp-param,
    pp-act, pp-grad, tp, other), as sent and as they would be uncompressed; shown in the
    iteration log line, written to TensorBoard and to the JSON report."""

    report: Optional[str] = None
    """Path of the JSON communication report written at the end of the run (default: the
    run's save directory, else ./comm_report.json)."""


@dataclass(frozen=True, kw_only=True)
class ExtCheckpointConfig:
    """How megatron_ext state (compressor state, residuals) is kept in checkpoints."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: checkpointed state"
    ARG_PREFIX: ClassVar[str] = "ext-state"

    on_mismatch: str = field(default="error", metadata=arg(choices=("error", "reset")))
    """What to do when a checkpoint's megatron_ext state was saved with another TP/PP/DP
    layout or other compression settings: 'error' stops before training; 'reset' starts
    the megatron_ext state (error-feedback residuals, warm starts, selected indices) from
    scratch with a warning. Model and optimizer load as usual either way."""

    def __post_init__(self):
        _check_choice(type(self), "on_mismatch", self.on_mismatch)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The Megatron parallel setup that flag combinations are validated against."""

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


EXT_CONFIG_CLASSES: Tuple[type, ...] = (
    GradCompressionConfig,
    SeparateConfig,
    RadiusConfig,
    PowerSGDConfig,
    P2PCompressionConfig,
    GrassConfig,
    SubspaceConfig,
    CommAccountingConfig,
    ExtCheckpointConfig,
)


@dataclass(frozen=True, kw_only=True)
class ExtConfig:
    """All megatron_ext feature configs together."""

    grad: GradCompressionConfig = field(default_factory=GradCompressionConfig)
    """Data-parallel gradient compression."""

    separate: SeparateConfig = field(default_factory=SeparateConfig)
    """SEPARATE settings."""

    radius: RadiusConfig = field(default_factory=RadiusConfig)
    """Radius settings."""

    powersgd: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    """PowerSGD settings."""

    p2p: P2PCompressionConfig = field(default_factory=P2PCompressionConfig)
    """Pipeline activation compression."""

    grass: GrassConfig = field(default_factory=GrassConfig)
    """Row-sparse linear backward."""

    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)
    """Subspace-confined activations."""

    comm: CommAccountingConfig = field(default_factory=CommAccountingConfig)
    """Byte accounting."""

    checkpoint: ExtCheckpointConfig = field(default_factory=ExtCheckpointConfig)
    """Checkpointed state."""

    def summary(self) -> Dict[str, Any]:
        """Flat ``{dest: value}`` view, e.g. for logs and reports."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            for sf in dataclasses.fields(sub):
                out[_dest_of(type(sub), sf)] = getattr(sub, sf.name)
        return out

    def state_settings(self) -> Dict[str, Any]:
        """The settings that shape megatron_ext's checkpointed state (for its fingerprint):
        each family's method and the options of the selected methods only."""
        out: Dict[str, Any] = {
            "grad_compression": self.grad.method,
            "p2p_compression": self.p2p.method,
            "grass_method": self.grass.method,
            "subspace_method": self.subspace.method,
        }
        method_cfg = {"separate": self.separate, "radius": self.radius, "powersgd": self.powersgd}
        sub = method_cfg.get(self.grad.method)
        if sub is not None:
            for sf in dataclasses.fields(sub):
                out[_dest_of(type(sub), sf)] = getattr(sub, sf.name)
        return out


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every megatron_ext flag; fits Megatron-LM's ``extra_args_provider``.

    Returns:
        The same parser (Megatron-LM requires the provider to return it).
    """
    for cls in EXT_CONFIG_CLASSES:
        add_config_args(parser, cls)
    return parser


def ext_config_from_args(args: argparse.Namespace) -> ExtConfig:
    """Build :class:`ExtConfig` from parsed arguments; raises :class:`ConfigError`."""
    by_cls = {cls: config_from_args(cls, args) for cls in EXT_CONFIG_CLASSES}
    return ExtConfig(
        grad=by_cls[GradCompressionConfig],
        separate=by_cls[SeparateConfig],
        radius=by_cls[RadiusConfig],
        powersgd=by_cls[PowerSGDConfig],
        p2p=by_cls[P2PCompressionConfig],
        grass=by_cls[GrassConfig],
        subspace=by_cls[SubspaceConfig],
        comm=by_cls[CommAccountingConfig],
        checkpoint=by_cls[ExtCheckpointConfig],
    )


def validate_ext_config(cfg: ExtConfig, layout: ParallelLayout) -> None:
    """Check that the selected features fit the parallel layout; raises :class:`ConfigError`.

    Args:
        cfg: the feature configs.
        layout: the Megatron parallel setup of this run.
    """
    if cfg.grad.enabled and layout.num_distributed_optimizer_instances != 1:
        raise ConfigError(
            ["--grad-compression", "--num-distributed-optimizer-instances"],
            "compressed gradient reduction supports one distributed-optimizer instance only",
        )
    if cfg.p2p.enabled and layout.pipeline_model_parallel_size == 1:
        raise ConfigError(
            ["--p2p-compression", "--pipeline-model-parallel-size"],
            "pipeline compression needs --pipeline-model-parallel-size > 1",
        )
    if (cfg.grass.enabled or cfg.subspace.enabled) and layout.transformer_impl != "local":
        flag = "--grass-method" if cfg.grass.enabled else "--subspace-method"
        raise ConfigError(
            [flag, "--transformer-impl"],
            "works on the local layer spec only; pass --transformer-impl local",
        )
