"""The contract between the linear-layer seam and a custom linear forward/backward.

What it does:
    megatron-core's local-spec linear layers (attention ``linear_qkv`` / ``linear_proj``,
    MLP ``linear_fc1`` / ``linear_fc2``) compute ``y = x W^T (+ b)`` through one method,
    ``_forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
    sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)``. The adapter
    ``megatron_ext.megatron.linear`` routes that call through a :class:`LinearHook`, giving
    it a :class:`LinearContext` (the layer's FQN, whether it is column- or row-parallel,
    and megatron's own implementation). :class:`PassThroughLinearHook` calls megatron's
    implementation unchanged. A row-sparse backward (Grass) replaces it with its own
    ``torch.autograd.Function`` that keeps megatron's contract: the input gradient is exact
    and tensor-parallel reduced as megatron does; weight gradients go to
    ``weight.main_grad`` with ``weight.grad_added_to_main_grad = True`` and a dummy
    full-shape gradient is returned so DDP's backward hook still fires.

Shapes:
    input  ``[s, b, in]`` (or ``[tokens, in]``), weight ``[out, in]``, output ``[s, b, out]``.

Constraints:
    Pure torch; never imports Megatron.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["LinearContext", "LinearHook", "PassThroughLinearHook"]


@dataclass(frozen=True)
class LinearContext:
    """The layer a hooked linear call belongs to."""

    fqn: str
    """Module FQN with global layer numbering, e.g. ``decoder.layers.3.mlp.linear_fc1``."""

    parallel_mode: str
    """'column' (output dim split over TP) or 'row' (input dim split over TP)."""

    module: torch.nn.Module
    """The megatron layer itself."""

    original: Callable[..., torch.Tensor]
    """megatron-core's ``_forward_impl`` bound to the layer."""


class LinearHook(abc.ABC):
    """Custom forward/backward for hooked linear layers."""

    name: str = "base"

    @abc.abstractmethod
    def forward(
        self, ctx: LinearContext, input: torch.Tensor, weight: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """Compute the layer output; ``kwargs`` are megatron's ``_forward_impl`` arguments."""


class PassThroughLinearHook(LinearHook):
    """megatron-core's own forward/backward."""

    name = "none"

    def forward(self, ctx, input, weight, **kwargs):
        return ctx.original(input, weight, **kwargs)
