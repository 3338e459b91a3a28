"""Grass in megatron-core: virtual parameters before DDP, the row-sparse linear hook, sketch sums.

What it does:
    :func:`add_virtual_params` runs on the unwrapped model chunks (the runtime's model
    transform, before megatron-core's DDP wrapper and ``get_megatron_optimizer`` exist). For
    every local ``ColumnParallelLinear`` / ``RowParallelLinear`` matching ``--grass-layers``
    it freezes the weight (``requires_grad = False``: DDP allocates no ``main_grad`` slot for
    it and the optimizer no fp32 copy or Adam state) and registers a trainable
    ``grass_weight`` (:func:`~megatron_ext.autograd.grass.virtual_shape`), tensor-parallel
    along the weight's own partition dimension, also in dist-checkpointing. It returns the
    :class:`~megatron_ext.autograd.grass.GrassLayer` of each, keyed by global FQN.

    As in the paper, where ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj``
    are separate layers, a fused weight is selected part by part: ``linear_qkv`` as Q, K
    and V (megatron-core interleaves them per query group; with grouped-query attention K
    and V are narrower than Q) and a SwiGLU ``linear_fc1`` as gate and up. Each part gets
    the same ``r`` (the paper's one rank for every projected layer), chosen by the rule from
    its own norms. The projected dimension (the smaller one) is chosen from each part's
    unsharded shape, so that every tensor-parallel size projects the same dimension. Where
    that dimension is split over the tensor-parallel ranks (rows of a column-parallel
    layer, columns of a row-parallel one), each rank selects ``r / TP`` of its own shard;
    where it is not, the ranks sum their sketches and choose the same ``r`` indices as an
    unsharded layer would.

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

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.autograd.grass import GrassLayer, grass_linear, projected_dim, virtual_shape
from megatron_ext.autograd.linear import LinearHook
from megatron_ext.config import ConfigError
from megatron_ext.megatron.linear import compile_layers_pattern
from megatron_ext.megatron.naming import global_module_names

__all__ = ["VIRTUAL_PARAM", "add_virtual_params", "GrassLinearHook", "sketch_reducer"]

VIRTUAL_PARAM = "grass_weight"
"""Attribute name of the virtual parameter on a projected linear layer."""


def _shard_virtual_param(module: torch.nn.Module, tp_axis: int) -> None:
    """Make the layer's dist-checkpoint entry of ``grass_weight`` sharded over TP (along the
    weight's own partition dimension): megatron-core's linear layers treat unknown
    parameters as replicated, but ``V`` differs on every tensor-parallel rank."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    original = module.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = original(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        key = f"{prefix}{VIRTUAL_PARAM}"
        if key in out:
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                getattr(module, VIRTUAL_PARAM),
                key,
                tp_axis=tp_axis,
                prepend_offsets=sharded_offsets,
            )
        return out

    module.sharded_state_dict = sharded_state_dict


@dataclass
class _Plan:
    """How one local weight is projected (see :class:`GrassLayer`)."""

    mode: str
    parts: List[Tuple[str, Tuple[int, int], int]]
    """Each part: its name, its unsharded shape, and its number of units on this rank."""
    part_rows: Optional[Tuple[torch.Tensor, ...]] = None
    num_col_parts: int = 1


def _qkv_rows(name: str, module: Any, m: int, tp: int) -> Dict[str, torch.Tensor]:
    """Rows of Q, K and V in this rank's shard of megatron-core's fused ``linear_qkv``:
    per local query group, ``np/ng`` query heads, then one key and one value head
    (``SelfAttention.get_query_key_value_tensors`` in megatron-core 0.16 and 0.19)."""
    cfg = module.config
    if getattr(cfg, "attention_output_gate", False):
        raise ConfigError(
            "--grass-layers",
            f"{name}: the attention output gate adds a fourth part to the fused QKV weight, "
            "which Grass does not split; leave linear_qkv out of --grass-layers",
        )
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    hn = cfg.kv_channels or cfg.hidden_size // heads
    if groups < tp or groups % tp or heads % groups:
        raise ConfigError(
            ["--grass-layers", "--num-query-groups"],
            f"{name}: {groups} query groups over tensor-parallel size {tp} do not give each "
            "rank whole groups (Grass splits Q, K and V per query group)",
        )
    local_groups = groups // tp
    q = heads // groups * hn
    stride = q + 2 * hn
    if m != local_groups * stride:
        raise ConfigError(
            "--grass-layers",
            f"{name}: {m} local rows are not {local_groups} query groups of {q} + {hn} + {hn} "
            "rows (an unknown fused QKV layout)",
        )
    start = torch.arange(local_groups)[:, None] * stride
    return {
        "query": (start + torch.arange(q)).reshape(-1),
        "key": (start + q + torch.arange(hn)).reshape(-1),
        "value": (start + q + hn + torch.arange(hn)).reshape(-1),
    }


def _plan(name: str, module: Any, column: bool, tp: int) -> _Plan:
    """The projected dimension of each part, chosen from its unsharded shape, so that every
    tensor-parallel size projects the same dimension."""
    m, n = module.weight.shape
    cfg = getattr(module, "config", None)
    if column and name.endswith("linear_qkv"):
        rows = _qkv_rows(name, module, m, tp)
        parts = [(k, (v.numel() * tp, n), v.numel()) for k, v in rows.items()]
        modes = {projected_dim(shape)[0] for _, shape, _ in parts}
        if modes != {"row"}:
            raise ConfigError(
                "--grass-layers",
                f"{name}: Q, K or V has more rows than columns (heads x kv channels > "
                "hidden size), so the paper would project their shared input columns; "
                "Grass does not split a fused QKV weight by columns",
            )
        return _Plan("row", parts, part_rows=tuple(rows.values()))
    if column and name.endswith("linear_fc1") and getattr(cfg, "gated_linear_unit", False):
        if m % 2:
            raise ConfigError("--grass-layers", f"{name}: {m} rows are not gate + up halves")
        f = m // 2
        mode, _ = projected_dim((f * tp, n))
        units = f if mode == "row" else n
        parts = [(k, (f * tp, n), units) for k in ("gate", "up")]
        if mode == "row":
            return _Plan("row", parts, part_rows=(torch.arange(f), torch.arange(f, m)))
        return _Plan("col", parts, num_col_parts=2)
    shape = (m * tp, n) if column else (m, n * tp)
    mode, _ = projected_dim(shape)
    return _Plan(mode, [("weight", shape, m if mode == "row" else n)])


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
        ConfigError: the pattern matches no layer or a non-local layer, ``rank`` exceeds
            the projected dimension of a part, or does not split over the tensor-parallel
            ranks that share a projected dimension (names ``--grass-rank``).
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
            column = isinstance(module, ColumnParallelLinear)
            group = getattr(module, "tp_group", None)
            distributed = torch.distributed.is_initialized()
            tp = torch.distributed.get_world_size(group) if distributed else 1
            tp_rank = torch.distributed.get_rank(group) if distributed else 0
            plan = _plan(name, module, column, tp)
            # The projected dimension is split over TP for rows of a column-parallel layer
            # and columns of a row-parallel one: each rank then selects r / TP of its shard.
            split = column == (plan.mode == "row")
            local_rank = rank
            if split and tp > 1:
                if rank % tp:
                    raise ConfigError(
                        ["--grass-rank", "--tensor-model-parallel-size"],
                        f"{rank} does not split over {tp} tensor-parallel ranks, which hold "
                        f"disjoint {plan.mode}s of {name} (each selects r / TP of its own)",
                    )
                local_rank = rank // tp
            for part, shape, units in plan.parts:
                if local_rank > units:
                    raise ConfigError(
                        "--grass-rank",
                        f"{rank} exceeds the projected dimension of {name} ({part}: "
                        f"{shape[0]} x {shape[1]} unsharded, Grass projects its "
                        f"{plan.mode}s: {units * (tp if split else 1)})",
                    )
            weight = module.weight
            shape = virtual_shape(plan.mode, tuple(weight.shape), local_rank, len(plan.parts))
            param = torch.nn.Parameter(torch.zeros(shape, dtype=weight.dtype, device=weight.device))
            axis = 0 if column else 1
            set_tensor_model_parallel_attributes(param, True, axis, 1)
            weight.requires_grad_(False)
            module.register_parameter(VIRTUAL_PARAM, param)
            _shard_virtual_param(module, axis)
            layers[name] = GrassLayer(
                fqn=name,
                weight=weight,
                param=param,
                mode=plan.mode,
                rank=local_rank,
                method=method,
                sketch_size=sketch_size,
                seed=seed,
                part_rows=plan.part_rows,
                num_col_parts=plan.num_col_parts,
                tp_group=group,
                tp_size=tp,
                tp_rank=tp_rank,
                tp_shared=not split,
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
