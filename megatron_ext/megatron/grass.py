"""Grass in megatron-core: virtual parameters before DDP, the row-sparse linear hook, sketch sums.

What it does:
    :func:`add_virtual_params` runs on the unwrapped model chunks (the runtime's model
    transform, before megatron-core's DDP wrapper and ``get_megatron_optimizer`` exist). For
    every local ``ColumnParallelLinear`` / ``RowParallelLinear`` matching ``--grass-layers``
    it freezes the weight (``requires_grad = False``: DDP allocates no ``main_grad`` slot for
    it and the optimizer no fp32 copy or Adam state) and registers a trainable
    ``grass_weight`` of ``r x n`` (or ``m x r``) on the layer, tensor-parallel like the
    weight (each TP rank selects rows of its own shard), and sharded along dim 0 in
    dist-checkpointing. It returns the :class:`~megatron_ext.autograd.grass.GrassLayer` of
    each, keyed by global FQN.

    :class:`GrassLinearHook` is the linear seam's forward/backward for those layers:
    :func:`~megatron_ext.autograd.grass.grass_linear` with the layer's tensor-parallel group
    and megatron's ``allreduce_dgrad`` / ``sequence_parallel`` arguments.

    :func:`sketch_reducer` all-reduces the selection sketches over the data-parallel group,
    counted as ``dp-grad`` traffic.

Constraints:
    Local spec only (``--transformer-impl local``), as the linear seam. The distributed
    optimizer is refused by the method (see ``megatron_ext.methods.grass``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.autograd.grass import GrassLayer, grass_linear, projected_dim
from megatron_ext.autograd.linear import LinearHook
from megatron_ext.config import ConfigError
from megatron_ext.megatron.linear import compile_layers_pattern
from megatron_ext.megatron.naming import global_module_names

__all__ = ["VIRTUAL_PARAM", "add_virtual_params", "GrassLinearHook", "sketch_reducer"]

VIRTUAL_PARAM = "grass_weight"
"""Attribute name of the virtual parameter on a projected linear layer."""


def _shard_virtual_param(module: torch.nn.Module) -> None:
    """Make the layer's dist-checkpoint entry of ``grass_weight`` sharded over TP (dim 0):
    megatron-core's linear layers treat unknown parameters as replicated, but ``V`` differs
    on every tensor-parallel rank."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    original = module.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = original(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        key = f"{prefix}{VIRTUAL_PARAM}"
        if key in out:
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                getattr(module, VIRTUAL_PARAM), key, tp_axis=0, prepend_offsets=sharded_offsets
            )
        return out

    module.sharded_state_dict = sharded_state_dict


def add_virtual_params(
    model_chunks: Sequence[torch.nn.Module],
    pattern: str,
    *,
    rank: int,
    method: str,
    sketch_size: int,
    seed: int,
) -> Dict[str, GrassLayer]:
    """Freeze the matching linear weights and give each a virtual parameter (module doc).

    Raises:
        ConfigError: the pattern matches no layer or a non-local layer, or ``rank`` exceeds
            the projected dimension of a layer (names ``--grass-rank``).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    regex = compile_layers_pattern(pattern)
    layers: Dict[str, GrassLayer] = {}
    for chunk in model_chunks:
        for name, module in global_module_names(chunk):
            if not regex.search(name):
                continue
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                raise ConfigError(
                    ["--grass-layers", "--transformer-impl"],
                    f"{name} is a {type(module).__name__}, not a megatron-core local linear "
                    "layer; use the local spec (--transformer-impl local)",
                )
            weight = module.weight
            mode, size = projected_dim(tuple(weight.shape))
            if rank > size:
                raise ConfigError(
                    "--grass-rank",
                    f"{rank} exceeds the projected dimension of {name} (weight "
                    f"{tuple(weight.shape)} on this tensor-parallel rank; Grass projects the "
                    f"smaller dimension, {size})",
                )
            m, n = weight.shape
            shape = (rank, n) if mode == "row" else (m, rank)
            param = torch.nn.Parameter(torch.zeros(shape, dtype=weight.dtype, device=weight.device))
            set_tensor_model_parallel_attributes(param, True, 0, 1)
            weight.requires_grad_(False)
            module.register_parameter(VIRTUAL_PARAM, param)
            _shard_virtual_param(module)
            layers[name] = GrassLayer(
                fqn=name,
                weight=weight,
                param=param,
                mode=mode,
                rank=rank,
                method=method,
                sketch_size=sketch_size,
                seed=seed,
            )
    if not layers:
        raise ConfigError("--grass-layers", f"{pattern!r} matches no linear layer of the model")
    return layers


class GrassLinearHook(LinearHook):
    """The linear seam's forward/backward for Grass's projected layers."""

    name = "grass"

    def __init__(self, layers: Dict[str, GrassLayer]):
        self.layers = layers

    def forward(self, ctx, input, weight, **kwargs):
        layer = self.layers.get(ctx.fqn)
        if layer is None:
            raise RuntimeError(f"{ctx.fqn} is hooked for Grass but has no virtual parameter")
        group = kwargs.get("tp_group") or getattr(ctx.module, "tp_group", None)
        return grass_linear(
            input,
            weight,
            kwargs.get("bias"),
            layer,
            allreduce_dgrad=bool(kwargs.get("allreduce_dgrad")),
            sequence_parallel=bool(kwargs.get("sequence_parallel")),
            group=group,
        )


def sketch_reducer(group: Any, meter: Any) -> Callable[[torch.Tensor], None]:
    """All-reduce (sum) a flat sketch over ``group`` in place, metered as ``dp-grad``."""

    def reduce(flat: torch.Tensor) -> None:
        size = torch.distributed.get_world_size(group)
        if size == 1:
            return
        if meter is not None:
            wire = collective_wire_bytes("all_reduce", flat.numel() * flat.element_size(), size)
            meter.record("dp-grad", sent=wire, recv=wire)
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            torch.distributed.all_reduce(flat, group=group)

    return reduce
