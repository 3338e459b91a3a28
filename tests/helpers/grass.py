"""Grass-projected layers with their optimizer hook and an optimizer view, outside Megatron.

Shared by the strict-device tests (meta tensors), the GPU tests (CUDA against CPU) and the cost
model (``benchmarks/gpu_cost.py``): by default a row-projected ``l0.weight`` (8 x 16) and a
column-projected ``l1.weight`` (16 x 8) with their virtual parameters of rank 2 on the device;
or any projected weights (:class:`GrassSpec`, e.g. from
:func:`megatron_ext.state_plan.grass_plan`: Q/K/V and gate/up parts included). With them the
:class:`GrassOptimizerHook` as ``megatron_ext.methods.grass`` builds it (sketches all-reduced
over the default process group), and an :class:`~megatron_ext.protocols.OptimizerView` over
device Adam moments (megatron's fp32 main parameters are the virtual parameters themselves
here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

GRASS_K = 3
"""Selection interval."""

SHAPES = (("l0.weight", (8, 16)), ("l1.weight", (16, 8)))


@dataclass(frozen=True)
class GrassSpec:
    """One projected weight (the fields :class:`~megatron_ext.autograd.grass.GrassLayer`
    takes from the model; :func:`spec_of_plan` reads them off a state plan)."""

    fqn: str
    shape: Tuple[int, int]
    mode: str
    rank: int
    part_rows: Optional[Tuple[torch.Tensor, ...]] = None
    num_col_parts: int = 1

    @property
    def virtual_shape(self) -> Tuple[int, int]:
        from megatron_ext.autograd.grass import virtual_shape

        parts = len(self.part_rows) if self.part_rows is not None else self.num_col_parts
        return virtual_shape(self.mode, self.shape, self.rank, parts)


def default_specs(rank: int = 2) -> Tuple[GrassSpec, ...]:
    """:data:`SHAPES`, each projected along its smaller dimension, at ``rank``."""
    from megatron_ext.autograd.grass import projected_dim

    return tuple(GrassSpec(fqn, shape, projected_dim(shape)[0], rank) for fqn, shape in SHAPES)


def spec_of_plan(w) -> GrassSpec:
    """The :class:`GrassSpec` of a :class:`megatron_ext.state_plan.GrassWeight`."""
    rows = None
    if w.part_rows is not None:
        rows = tuple(torch.cat([torch.arange(s, s + n) for s, n in b]) for b in w.part_rows)
    return GrassSpec(
        w.fqn,
        tuple(w.local_shape),
        w.mode,
        w.rank,
        part_rows=rows,
        num_col_parts=w.parts if w.mode == "col" else 1,
    )


def grass_setup(
    method: str,
    reset: bool,
    device: torch.device,
    weight: Callable[[int, Tuple[int, int]], torch.Tensor],
    *,
    specs: Optional[Sequence[GrassSpec]] = None,
    interval: int = GRASS_K,
    sketch_size: int = 4,
    main_grad: bool = False,
):
    """``(layers, hook)``; ``weight(i, shape)`` gives layer ``i``'s frozen weight on ``device``.

    Args:
        method: selection rule.
        reset: zero ``V``'s moments at a selection (``--grass-reset-state``).
        device: where ``V`` (and the selection) live.
        weight: layer ``i``'s frozen weight of ``shape``.
        specs: the projected weights (default :func:`default_specs`).
        interval: selection interval ``K``.
        sketch_size: columns of the sketch.
        main_grad: give each ``V`` an fp32 ``main_grad`` (megatron's DDP buffer, which
            Grass's backward accumulates into).
    """
    import torch.distributed as dist

    from megatron_ext.autograd.grass import GrassLayer
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule

    layers: Dict[str, GrassLayer] = {}
    for i, spec in enumerate(specs if specs is not None else default_specs()):
        param = torch.nn.Parameter(torch.zeros(spec.virtual_shape, device=device))
        if main_grad:
            param.main_grad = torch.zeros(spec.virtual_shape, device=device)
        layers[spec.fqn] = GrassLayer(
            fqn=spec.fqn,
            weight=weight(i, spec.shape),
            param=param,
            mode=spec.mode,
            rank=spec.rank,
            method=method,
            sketch_size=sketch_size,
            seed=0,
            part_rows=spec.part_rows,
            num_col_parts=spec.num_col_parts,
        )
    hook = GrassOptimizerHook(
        layers,
        GrassSchedule(interval, 1, 1.0),
        lambda flat: dist.all_reduce(flat),
        reset_state=reset,
        param_fqn=lambda fqn: f"{fqn}.grass_weight",
    )
    hook.initial_selection()
    return layers, hook


class GrassView:
    """An OptimizerView over device Adam moments of the virtual parameters."""

    def __init__(self, layers):
        from megatron_ext.protocols import ParamOptimState

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
