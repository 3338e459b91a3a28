"""Two Grass-projected layers with their optimizer hook and an optimizer view, outside Megatron.

Shared by the strict-device tests (meta tensors) and the GPU tests (CUDA against CPU): a
row-projected ``l0.weight`` (8 x 16) and a column-projected ``l1.weight`` (16 x 8) with their
virtual parameters of rank 2 on the device, the :class:`GrassOptimizerHook` as
``megatron_ext.methods.grass`` builds it (sketches all-reduced over the default process group),
and an :class:`~megatron_ext.optim.hooks.OptimizerView` over device Adam moments (megatron's fp32
main parameters are the virtual parameters themselves here).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

GRASS_K = 3
"""Selection interval."""

SHAPES = (("l0.weight", (8, 16)), ("l1.weight", (16, 8)))


def grass_setup(
    method: str,
    reset: bool,
    device: torch.device,
    weight: Callable[[int, Tuple[int, int]], torch.Tensor],
):
    """``(layers, hook)``; ``weight(i, shape)`` gives layer ``i``'s frozen weight on ``device``."""
    import torch.distributed as dist

    from megatron_ext.autograd.grass import GrassLayer, projected_dim
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule

    layers: Dict[str, GrassLayer] = {}
    for i, (fqn, shape) in enumerate(SHAPES):
        mode, _ = projected_dim(shape)
        pshape = (2, shape[1]) if mode == "row" else (shape[0], 2)
        layers[fqn] = GrassLayer(
            fqn=fqn,
            weight=weight(i, shape),
            param=torch.nn.Parameter(torch.zeros(pshape, device=device)),
            mode=mode,
            rank=2,
            method=method,
            sketch_size=4,
            seed=0,
        )
    hook = GrassOptimizerHook(
        layers,
        GrassSchedule(GRASS_K, 1, 1.0),
        lambda flat: dist.all_reduce(flat),
        reset_state=reset,
        param_fqn=lambda fqn: f"{fqn}.grass_weight",
    )
    hook.initial_selection()
    return layers, hook


class GrassView:
    """An OptimizerView over device Adam moments of the virtual parameters."""

    def __init__(self, layers):
        from megatron_ext.optim.hooks import ParamOptimState

        self.step = 0
        self.states = {
            f"{fqn}.grass_weight": ParamOptimState(
                fqn=f"{fqn}.grass_weight",
                model_param=layer.param,
                main_param=layer.param,
                state={
                    "exp_avg": torch.zeros_like(layer.param),
                    "exp_avg_sq": torch.zeros_like(layer.param),
                    "step": torch.tensor(0.0),  # torch's Adam keeps a host step count
                },
                group={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
            )
            for fqn, layer in layers.items()
        }

    def param_state(self, fqn):
        return self.states.get(fqn)
