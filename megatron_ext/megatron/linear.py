"""Linear-layer seam: route megatron-core local-spec linear layers through a LinearHook.

What it does:
    :func:`install_linear_hooks` finds the ``ColumnParallelLinear`` / ``RowParallelLinear``
    modules whose global FQN matches a regular expression (``--grass-layers``) and sets an
    instance-level ``_forward_impl`` that calls the hook with a
    :class:`~megatron_ext.autograd.linear.LinearContext`. Since megatron-core 0.14,
    ``_forward_impl`` is a method of both classes and the only place their matmul and its
    backward are chosen, so overriding it per instance changes nothing else (bias
    handling, TP gathers and scatters around it stay megatron's).

Constraints:
    * Local spec only: Transformer Engine layers (``--transformer-impl
      transformer_engine``) have their own autograd and are refused when a hook other than
      the pass-through is requested.
    * Requires ``_forward_impl`` to be a method (megatron-core >= 0.14).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import torch

from megatron_ext.autograd.linear import (
    LinearContext,
    LinearHook,
    PassThroughLinearHook,
)
from megatron_ext.config import ConfigError
from megatron_ext.logging import get_logger, log_rank_0
from megatron_ext.megatron.naming import global_module_names

__all__ = ["LinearHooksHandle", "install_linear_hooks"]

logger = get_logger(__name__)


@dataclass
class LinearHooksHandle:
    """Installed hooks; ``remove()`` restores megatron's ``_forward_impl``."""

    modules: List[Tuple[str, torch.nn.Module]] = field(default_factory=list)

    @property
    def fqns(self) -> List[str]:
        """FQNs of the hooked layers."""
        return [name for name, _ in self.modules]

    def remove(self) -> None:
        """Drop the instance-level ``_forward_impl`` overrides."""
        for _, module in self.modules:
            if "_forward_impl" in vars(module):
                del module._forward_impl
        self.modules.clear()


def _make_forward_impl(hook: LinearHook, ctx: LinearContext):
    # The context is immutable: built once per layer, not per call.
    def _forward_impl(input, weight, *args, **kwargs):
        if args:
            raise TypeError("megatron_ext linear hook expects keyword arguments after weight")
        return hook.forward(ctx, input, weight, **kwargs)

    return _forward_impl


def compile_layers_pattern(pattern: str) -> "re.Pattern[str]":
    """``--grass-layers`` compiled; ConfigError naming the flag if it is not a regex."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigError("--grass-layers", f"invalid regular expression: {exc}") from exc


def install_linear_hooks(
    model_chunks: Sequence[torch.nn.Module], hook: LinearHook, pattern: str
) -> LinearHooksHandle:
    """Route matching local-spec linear layers of ``model_chunks`` through ``hook``.

    Args:
        model_chunks: model chunks (wrapped or not).
        hook: the forward/backward to use.
        pattern: regular expression searched in each module's global FQN.

    Returns:
        Handle listing the hooked layers.

    Raises:
        ConfigError: the pattern is invalid, or a matching layer is not a megatron-core
            local linear layer while ``hook`` is not the pass-through.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    regex = compile_layers_pattern(pattern)
    handle = LinearHooksHandle()
    for chunk in model_chunks:
        for name, module in global_module_names(chunk):
            if not regex.search(name):
                continue
            if isinstance(module, ColumnParallelLinear):
                mode = "column"
            elif isinstance(module, RowParallelLinear):
                mode = "row"
            else:
                if isinstance(hook, PassThroughLinearHook):
                    continue
                raise ConfigError(
                    ["--grass-layers", "--transformer-impl"],
                    f"{name} is a {type(module).__name__}, not a megatron-core local linear "
                    "layer; use the local spec (--transformer-impl local)",
                )
            original = module._forward_impl
            module._forward_impl = _make_forward_impl(
                hook,
                LinearContext(fqn=name, parallel_mode=mode, module=module, original=original),
            )
            handle.modules.append((name, module))
    log_rank_0(
        logger,
        20,
        f"megatron_ext: {len(handle.modules)} linear layer(s) use the '{hook.name}' "
        "forward/backward",
    )
    return handle
