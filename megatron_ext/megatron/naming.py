"""Stable, globally unique parameter and module names for megatron-core models.

What it does:
    megatron-core numbers transformer layers locally on each pipeline stage
    (``decoder.layers.0`` is the first layer *of this stage*) and wraps models in DDP and
    ``Float16Module``. megatron_ext keys all state by fully qualified name (FQN), so it
    needs names that do not depend on wrappers or on the pipeline layout:
    ``decoder.layers.<global index>.<rest>``, relative to the GPTModel.

Why:
    Bucket indices and local layer indices change with ``--ddp-bucket-size``, DP size or
    PP size; FQNs with global layer numbers do not (style rule: key state by FQN).
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Tuple

import torch

__all__ = ["unwrap", "global_module_names", "global_param_names"]

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (anything holding the model in ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def _layer_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """Local layer index -> global 0-based layer index for this stage."""
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return {}
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def _globalize(name: str, offsets: Dict[int, int]) -> str:
    m = _LAYER_RE.match(name)
    if not m or not offsets:
        return name
    local = int(m.group(1))
    return f"decoder.layers.{offsets.get(local, local)}." + name[m.end() :]


def global_module_names(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``named_modules()`` of the unwrapped model with global layer numbers."""
    inner = unwrap(model)
    offsets = _layer_offsets(inner)
    for name, module in inner.named_modules():
        yield _globalize(name, offsets), module


def global_param_names(model: torch.nn.Module) -> Dict[torch.nn.Parameter, str]:
    """Map each parameter of ``model`` to its global FQN."""
    inner = unwrap(model)
    offsets = _layer_offsets(inner)
    return {p: _globalize(n, offsets) for n, p in inner.named_parameters()}
