"""QuantizedAdam (``--grad-compression quantized-adam``): factory, refusals, registration.

QuantizedAdam is the data-parallel half of the AQ-SGD authors' end-to-end compression
(AQ-SGD paper, section 4.3; Tang et al. 2021, "1-bit Adam", with k-bit quantization): Adam
runs densely for ``--quantized-adam-warmup-steps``, then its variance is frozen, gradients
stay local, and each rank's locally updated momentum is exchanged quantized with worker
and server error compensation. The algorithm is ``megatron_ext.collectives.quantized_adam``
(on the quantized collective of ``megatron_ext.collectives.quantized``).

Constraints (refused before training, naming the flag): with ``--use-distributed-optimizer``
no gradient clipping (``--clip-grad 0``: megatron would clip by a norm over shards of
different ranks' local gradients), an Adam optimizer with decoupled weight
decay (``--optimizer adam``, AdamW mode), one data-parallel group for every parameter (no
expert data parallelism). One ``--grad-compression`` method runs at a time, so no other
data-parallel method can be combined with it.

Its options: :class:`~megatron_ext.options.quantized_adam.QuantizedAdamConfig`.
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_ext.methods.registry import (
    BenchContext,
    Components,
    Method,
    MethodContext,
    register,
)
from megatron_ext.options.base import ConfigError
from megatron_ext.options.quantized_adam import QuantizedAdamConfig

__all__ = ["QuantizedAdamConfig", "METHOD"]

_FLAG = "--grad-compression"


def check_adam(optimizer: Any) -> None:
    """Refuse an optimizer QuantizedAdam cannot take over (not Adam, or L2 weight decay).

    Args:
        optimizer: megatron-core optimizer (a ``ChainedOptimizer`` or one leaf).

    Raises:
        ConfigError: naming ``--optimizer``.
    """
    import torch

    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:
            continue
        groups = inner.param_groups
        if not all("betas" in g and "eps" in g for g in groups):
            raise ConfigError(
                [_FLAG, "--optimizer"],
                f"'quantized-adam' replaces Adam's update after warm-up; the optimizer is "
                f"{type(inner).__name__}. Use --optimizer adam",
            )
        decoupled = (
            isinstance(inner, torch.optim.AdamW)
            or bool(getattr(inner, "adam_w_mode", False))
            or all(g.get("decoupled_weight_decay", False) for g in groups)
        )
        if not decoupled:
            raise ConfigError(
                [_FLAG, "--optimizer"],
                f"'quantized-adam' applies decoupled (AdamW) weight decay as the authors do; "
                f"the optimizer {type(inner).__name__} adds L2 decay to the gradient",
            )
        if any(g.get("amsgrad", False) or g.get("maximize", False) for g in groups):
            raise ConfigError(
                [_FLAG, "--optimizer"], "'quantized-adam' supports neither amsgrad nor maximize"
            )
        clip = float(getattr(getattr(leaf, "config", None), "clip_grad", 0.0) or 0.0)
        if clip > 0 and hasattr(leaf, "model_param_group_index_map"):
            raise ConfigError(
                [_FLAG, "--use-distributed-optimizer", "--clip-grad"],
                "after its warm-up 'quantized-adam' steps each rank's own gradient, while "
                "the distributed optimizer would clip by one norm over shards of different "
                "ranks' gradients; pass --clip-grad 0 (or leave the distributed optimizer off)",
            )


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.quantized_adam import (
        QuantizedAdamHook,
        QuantizedAdamReducer,
    )

    reducer = QuantizedAdamReducer(ctx.options)
    hook = QuantizedAdamHook(ctx.options, reducer)

    def on_install() -> None:
        check_adam(ctx.handles.optimizer)
        hook.check_groups()

    return Components(reducer=reducer, optimizer_hooks=[hook], on_install=on_install)


def _bench_defaults(bench: BenchContext) -> Dict[str, Any]:
    # The authors' warm-up: one epoch of ten, 10% of training.
    return {"warmup_steps": max(1, int(round(0.1 * bench.iters)))}


METHOD = register(
    Method(
        name="quantized-adam",
        family="grad",
        build=_build,
        options=QuantizedAdamConfig,
        summary="QuantizedAdam: dense Adam warm-up, then frozen variance and k-bit momentum "
        "with worker and server error compensation",
        bench_defaults=_bench_defaults,
        bench_label=lambda o: f"quantized-adam-{o.bits}bit",
    )
)
