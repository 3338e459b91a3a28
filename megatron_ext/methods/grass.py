"""Grass (``--grass-method topr|norm|norm2|norm-nr|norm2-nr|uniform|uniform-nr``): options, factory, registration.

The algorithm is ``megatron_ext.autograd.grass`` (selection, the row-sparse backward, the
fp32 rows) and ``megatron_ext.optim.grass`` (the subspace step, re-warm-up, reselection);
``megatron_ext.megatron.grass`` adds the virtual parameters before DDP wraps the model and
hooks the linear layers. One options class serves every selection rule.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from megatron_ext.methods.registry import (
    BenchContext,
    Components,
    Method,
    MethodContext,
    refuse_families,
    register,
)
from megatron_ext.options.base import ConfigError, check_positive, flag_of, options_dataclass

__all__ = ["GrassConfig", "METHODS"]


@options_dataclass(group="megatron-ext: row-sparse linear backward (Grass)", prefix="grass")
class GrassConfig:
    """Grass: row-sparse weight gradients, r x n optimizer state and data-parallel traffic."""

    rank: int = 128
    """Rows r of each projected matrix trained at a time, of its smaller dimension in the
    unsharded model (the same at every tensor-parallel size; where TP ranks hold disjoint
    rows of it, each selects r / TP of its own, so r must divide). Fused weights count as
    their parts: Q, K and V of linear_qkv and gate and up of a SwiGLU linear_fc1 each get r
    (paper: 128 for 60M/350M, 256 for 1B)."""

    update_interval: int = 200
    """Every this many steps K the rows are selected again from the gradient (paper: 200;
    0 keeps the first selection)."""

    scale: float = 0.25
    """alpha: factor on the learning rate of the projected weights (paper: 0.25 for
    pre-training)."""

    rewarmup_steps: int = 200
    """After each selection the learning rate of the projected weights rises linearly from
    1/N to alpha over this many steps (paper: 200; 0: no re-warm-up)."""

    reset_state: bool = True
    """Zero the Adam moments of the projected weights at each new selection (the paper does
    for 60M and 350M, not for 1B). Off (--no-grass-reset-state): the moments move with
    their rows; a row kept keeps its moments and bias-correction count, a new row starts
    at zero, a dropped row's are discarded."""

    sketch_size: int = 256
    """Columns of the Gaussian sketch G Omega from which row norms are estimated at a
    selection step (all-reduced over data parallelism: rows x this many fp32 values per
    weight); 0 uses the exact gradient (rows x columns, for small models and tests)."""

    seed: int = 0
    """Seed of the sketches and of the sampling rules (the same on every data-parallel
    rank)."""

    def __post_init__(self):
        cls = type(self)
        check_positive(cls, "rank", self.rank)
        check_positive(cls, "update_interval", self.update_interval, allow_zero=True)
        check_positive(cls, "rewarmup_steps", self.rewarmup_steps, allow_zero=True)
        check_positive(cls, "sketch_size", self.sketch_size, allow_zero=True)
        check_positive(cls, "seed", self.seed, allow_zero=True)
        if not self.scale > 0:
            raise ConfigError(flag_of(cls, "scale"), f"must be > 0, got {self.scale!r}")


def _validate(cfg: Any, layout: Any) -> None:
    if layout.use_distributed_optimizer:
        raise ConfigError(
            ["--grass-method", "--use-distributed-optimizer"],
            "after each step every data-parallel rank writes the selected rows into its "
            "frozen projected weights from the whole fp32 virtual parameter V, and a "
            "reselection folds, moves and zeroes V's rows and Adam moments; the distributed "
            "optimizer keeps V's fp32 copy and moments in flat shards (a rank may hold none "
            "of a V) and gathers only V, not the frozen weights. Use the regular optimizer "
            "(Grass's optimizer state per projected weight is already r x n)",
        )
    refuse_families(
        cfg,
        "--grass-method",
        {
            "grad": (
                "Grass already reduces only the selected rows of the projected weights; a "
                "gradient compressor on top would keep error-feedback state across "
                "reselections of different rows. Use one or the other"
            ),
        },
    )


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.megatron.grass import (
        VIRTUAL_PARAM,
        GrassLinearHook,
        add_virtual_params,
        sketch_reducer,
    )
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassOuterView, GrassSchedule

    opts = ctx.options
    layers: Dict[str, Any] = {}
    hook = GrassOptimizerHook(
        layers,
        GrassSchedule(opts.update_interval, opts.rewarmup_steps, opts.scale),
        sketch_reducer(ctx.groups.dp_cp, ctx.meter),
        reset_state=opts.reset_state,
        param_fqn=lambda fqn: f"{fqn}.{VIRTUAL_PARAM}",
    )

    def transform(model_chunks):
        new = add_virtual_params(
            model_chunks,
            ctx.family_options.layers,
            rank=opts.rank,
            method=ctx.name,
            sketch_size=opts.sketch_size,
            seed=opts.seed,
        )
        layers.update(new)
        hook.initial_selection(new)

    def check_optimizer() -> None:
        from megatron_ext.megatron.optimizer import not_decoupled_adamw

        other = not_decoupled_adamw(ctx.handles.optimizer)
        if other:
            raise ConfigError(
                ["--grass-method", "--optimizer"],
                "Grass's update is decoupled AdamW's (the paper's Adam; its rows decay and its "
                "bias correction are AdamW's, and a reselection moves or zeroes exactly Adam's "
                "two moments); the optimizer megatron-core built is "
                f"{'; '.join(other)}. Use --optimizer adam with decoupled weight decay",
            )

    def describe() -> str:
        full = sum(layer.weight.numel() for layer in layers.values())
        virtual = sum(layer.param.numel() for layer in layers.values())
        return (
            f"Grass ({ctx.name}, r={opts.rank}, K={opts.update_interval}): {len(layers)} "
            f"projected weights frozen; their gradient and optimizer state live in "
            f"{virtual / 1e6:.3f}M virtual-parameter elements instead of {full / 1e6:.3f}M "
            f"(x{virtual / max(1, full):.3f}) on this rank"
        )

    def outer_view(view):
        # An outer synchronization (DiLoCo) reads and writes the frozen projected weights,
        # not their virtual parameters.
        return GrassOuterView(
            view,
            layers,
            param_fqn=lambda fqn: f"{fqn}.{VIRTUAL_PARAM}",
            weight_fqn=lambda fqn: f"{fqn}.weight",
        )

    return Components(
        outer_view=outer_view,
        linear_hook=GrassLinearHook(layers),
        linear_layers=ctx.family_options.layers,
        optimizer_hooks=[hook],
        model_transform=transform,
        on_step=hook.begin_step,
        on_install=check_optimizer,
        describe=describe,
    )


def _bench_defaults(bench: BenchContext) -> Dict[str, Any]:
    # Reselect a few times within a benchmark run.
    interval = max(1, bench.iters // 4)
    return {"update_interval": interval, "rewarmup_steps": max(1, interval // 4)}


_SUMMARIES = {
    "topr": "rows with the largest gradient norms",
    "norm": "rows sampled by gradient norm, with replacement (unbiased)",
    "norm2": "rows sampled by squared gradient norm, with replacement (unbiased)",
    "norm-nr": "rows sampled by gradient norm, without replacement",
    "norm2-nr": "rows sampled by squared gradient norm, without replacement",
    "uniform": "rows sampled uniformly, with replacement (unbiased)",
    "uniform-nr": "rows sampled uniformly, without replacement",
}


def _label(name: str) -> Callable[[GrassConfig], str]:
    def label(o: GrassConfig) -> str:
        scale = "" if o.scale == GrassConfig.scale else f"-a{o.scale:g}"
        return f"grass-{name}-r{o.rank}{scale}"

    return label


METHODS = tuple(
    register(
        Method(
            name=name,
            family="linear",
            build=_build,
            options=GrassConfig,
            summary=f"Grass: {summary}, reselected every K steps",
            validate=_validate,
            bench_defaults=_bench_defaults,
            bench_label=_label(name),
        )
    )
    for name, summary in _SUMMARIES.items()
)
