"""Protocol Models (``--subspace-method protocol``): options, factory, registration.

The algorithm is ``megatron_ext.compressors.subspace`` (``U``, ``T_fixed``, the Grassmann
step), ``megatron_ext.collectives.subspace`` (the pipeline codec: ``k`` coordinates and the
token id per token) and ``megatron_ext.optim.subspace`` (projected gradients, AdamW with a
second moment constant along ``d``, re-projection, subspace updates);
``megatron_ext.megatron.subspace`` confines the model's residual writers before DDP wraps it
and exchanges the new ``U``. The method implies its own pipeline codec, so
``--p2p-compression`` stays ``none``.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Dict

from megatron_ext.methods.registry import (
    Components,
    Method,
    MethodContext,
    refuse_families,
    register,
)
from megatron_ext.options.base import ConfigError, arg, check_positive, flag_of, options_dataclass

__all__ = ["SubspaceConfig", "METHOD"]

_FLAG = "--subspace-method"
HEADS = ("untied", "tied")


@options_dataclass(
    group="megatron-ext: Protocol Models (--subspace-method protocol)", prefix="subspace"
)
class SubspaceConfig:
    """Protocol Models: a subspace-confined residual stream, k of d numbers per token."""

    rank: int = 0
    """k, the dimension of the shared subspace S (0: hidden size / compression rate, but at
    least --subspace-min-rank)."""

    compression_rate: float = 100.0
    """d / k when --subspace-rank is 0 (paper: 100; 4096 -> 41, Node0 sets k = 40)."""

    min_rank: int = 32
    """The smallest k the compression rate may give, capped at a quarter of the hidden size
    (at least 4x compression): d / 100 is what the paper runs at d = 4096 (k = 41), but it
    leaves a small model 1 to 10 dimensions (d 256 -> 3), a setting with no counterpart in
    the paper or the reference code (k 160 at d 1024). 32 keeps d >= 3200 at the paper's
    rate and gives d 256 k 32 (x8), d 1024 k 32 (x32); 0 applies the rate alone."""

    seed: int = 0
    """Seed of the initial basis U and of the frozen token embedding T_fixed (the same on
    every stage and data-parallel replica)."""

    update_interval: int = 0
    """Every this many steps the subspace moves along the Grassmann manifold, from the
    boundary gradients accumulated on the last stage (paper: about 500; 0 keeps the first
    subspace, as the public code does; needs pipeline parallelism)."""

    lr: float = 0.1
    """Step size of the Grassmann update (on the objective normalized by its largest
    eigenvalue: 0.5 is about one subspace-iteration step towards the gradients' top-k
    directions)."""

    uncompressed_last_layers: int = -1
    """Transformer layers before the head left unconstrained. -1 (default): every layer on the
    last pipeline stage, whose outputs never cross a boundary (as the reference code, one layer
    a stage, leaves its last stage free); N >= 0: the last N layers, which must be on the last
    stage (1 constrains the rest of the last stage, as this option's former default)."""

    head: str = field(default="untied", metadata=arg(choices=HEADS))
    """The LM head of a model with tied embeddings. untied (default, as the reference code):
    the head becomes its own full-rank weight, initialized to T_fixed + T_S; tied: the head
    stays T_fixed + T_S, whose trainable part T_S is only rank k. A model with untied
    embeddings is unaffected. The pipeline bytes are the same either way."""

    reproject_interval: int = 100
    """Every this many steps the constrained weights and their first moments are projected
    onto S again, against rounding drift (0: never)."""

    def __post_init__(self):
        cls = type(self)
        for name in ("rank", "min_rank", "seed", "update_interval"):
            check_positive(cls, name, getattr(self, name), allow_zero=True)
        if self.uncompressed_last_layers < -1:
            raise ConfigError(
                flag_of(cls, "uncompressed_last_layers"),
                f"must be -1 (the last stage's layers) or >= 0, got {self.uncompressed_last_layers!r}",
            )
        check_positive(cls, "reproject_interval", self.reproject_interval, allow_zero=True)
        if not self.compression_rate >= 1:
            raise ConfigError(
                flag_of(cls, "compression_rate"), f"must be >= 1, got {self.compression_rate!r}"
            )
        if self.head not in HEADS:
            raise ConfigError(
                flag_of(cls, "head"), f"must be one of {', '.join(HEADS)}, got {self.head!r}"
            )
        if not self.lr > 0:
            raise ConfigError(flag_of(cls, "lr"), f"must be > 0, got {self.lr!r}")

    def rank_for(self, hidden_size: int) -> int:
        """k for a model of ``hidden_size``: ``--subspace-rank``, else ``d / rate`` raised to
        ``min(--subspace-min-rank, d // 4)`` (at least 1)."""
        if self.rank:
            return self.rank
        k = round(hidden_size / self.compression_rate)
        return max(1, k, min(self.min_rank, hidden_size // 4))


def _validate(cfg: Any, layout: Any) -> None:
    opts = cfg.options_for(SubspaceConfig)
    if layout.use_distributed_optimizer:
        raise ConfigError(
            [_FLAG, "--use-distributed-optimizer"],
            "the subspace optimizer projects each constrained weight's reduced gradient "
            "and first moment onto S and averages Adam's second moment along the hidden "
            "dimension, which needs whole rows or columns of d values; the distributed "
            "optimizer reduces each gradient only into its rank's flat shard and keeps the "
            "moments in such shards, which cut them (every split weight would need its "
            "gradient, moments and parameter gathered each step). Use the regular optimizer",
        )
    if layout.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError(
            [_FLAG, "--num-layers-per-virtual-pipeline-stage"],
            "token ids travel with the microbatches in schedule order, which the interleaved "
            "schedule does not determine; use the non-interleaved 1F1B schedule",
        )
    refuse_families(
        cfg,
        _FLAG,
        {
            "p2p": "Protocol Models already compresses the pipeline transfers with its own codec",
            "linear": (
                "Grass freezes the projected weights and trains rows of them outside the "
                "subspace; use one or the other"
            ),
        },
    )
    if opts.update_interval and layout.pipeline_model_parallel_size == 1:
        raise ConfigError(
            ["--subspace-update-interval", "--pipeline-model-parallel-size"],
            "the subspace moves along the gradients at a pipeline boundary; without pipeline "
            "parallelism there is none (pass --subspace-update-interval 0)",
        )


def _build(ctx: MethodContext) -> Components:
    import torch

    from megatron_ext.collectives.subspace import SubspaceCodec
    from megatron_ext.compressors.subspace import Subspace
    from megatron_ext.megatron.subspace import (
        basis_exchange,
        check_config,
        check_fixed_agrees,
        constrain_model,
    )
    from megatron_ext.optim.subspace import SubspaceOptimizerHook

    opts = ctx.options
    pp = ctx.groups.pp
    stage = torch.distributed.get_rank(pp) if pp is not None else 0
    stages = torch.distributed.get_world_size(pp) if pp is not None else 1
    last = stage == stages - 1
    # Both work in the subspace the model transform makes (it knows the hidden size).
    codec = SubspaceCodec(sends_forward=not last, accumulate=last and opts.update_interval > 0)
    hook = SubspaceOptimizerHook(
        None,
        {},
        update_interval=opts.update_interval,
        reproject_interval=opts.reproject_interval,
    )
    state: Dict[str, Any] = {}

    def transform(model_chunks):
        config = model_chunks[0].config
        rank = opts.rank_for(config.hidden_size)
        check_config(config, rank, opts.uncompressed_last_layers)
        subspace = Subspace(config.hidden_size, rank, opts.seed)
        constrained = constrain_model(
            model_chunks,
            subspace,
            codec,
            uncompressed_last_layers=opts.uncompressed_last_layers,
            untie_head=opts.head == "untied",
        )
        codec.subspace = hook.subspace = subspace
        hook.constrained.update(constrained)
        hook.update_basis = basis_exchange(
            subspace,
            opts.lr,
            owner=last,
            sequence_parallel=bool(config.sequence_parallel),
            meter=ctx.meter,
        )
        state["subspace"] = subspace

    def describe() -> str:
        sub = hook.subspace
        return (
            f"Protocol Models: residual stream in a {sub.k}-dimensional subspace of "
            f"{sub.d} ({sub.k} of {sub.d} numbers per token between stages, plus its id), "
            f"{len(hook.constrained)} constrained parameters on this rank, subspace "
            + (f"updated every {opts.update_interval} steps" if opts.update_interval else "fixed")
        )

    def on_install() -> None:
        # The model was projected in its own dtype; a bf16 model rounds it out of S by its
        # precision, and megatron's fp32 main parameters copied that. Project those once
        # (a checkpoint loaded afterwards overwrites them with what it holds).
        hook.reproject(ctx.handles.new_optimizer_view())
        check_fixed_agrees(hook.subspace)

    return Components(
        codec=codec,
        optimizer_hooks=[hook],
        model_transform=transform,
        state=state,
        on_install=on_install,
        describe=describe,
    )


METHOD = register(
    Method(
        name="protocol",
        family="subspace",
        build=_build,
        options=SubspaceConfig,
        summary="residual stream confined to a shared k-dimensional subspace: k of d numbers "
        "per token between pipeline stages, lossless in fp32 (bf16: one rounding a hop)",
        validate=_validate,
        bench_label=lambda o: "protocol-"
        + (f"k{o.rank}" if o.rank else f"x{o.compression_rate:g}")
        + (f"-u{o.update_interval}" if o.update_interval else ""),
    )
)
