"""Optimizer state that a megatron-core optimizer will allocate at its first step.

What it does:
    :func:`pending_optimizer_state_nbytes` walks a megatron-core optimizer (a
    ``ChainedOptimizer`` of ``MegatronOptimizer`` wrappers, each around a torch optimizer)
    and adds up the state its torch optimizers will allocate at their first step for the
    parameters they step that have no state yet: two fp32 moments (4 B each per element)
    for Adam-like optimizers, one fp32 momentum for SGD with momentum, and an fp32 master
    copy (4 B per element) where the stepped parameters are not fp32 themselves (a
    precision-aware optimizer keeps the master weights in its state). The fp32 main
    parameters of megatron's mixed-precision and distributed optimizers are allocated when
    the optimizer is built and are therefore already in use, not pending. With the
    distributed optimizer the stepped parameters are this rank's shards, so the sum is
    this rank's share.

Why:
    Methods that allocate large device buffers at install time (AQ-SGD) run their fit
    check before the first step: without this, the check would see memory that Adam takes
    a moment later.

Constraints:
    Reads optimizer objects only (duck-typed on megatron-core's ``chained_optimizers`` /
    ``optimizer`` attributes); imports nothing from Megatron. Optimizers other than Adam
    and SGD variants are counted like Adam (two moments): an upper bound for the common
    ones.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["pending_optimizer_state_nbytes"]


def _torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    for sub in getattr(optimizer, "chained_optimizers", None) or ():
        yield from _torch_optimizers(sub)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and not hasattr(optimizer, "chained_optimizers"):
        yield from _torch_optimizers(inner)


def _state_bytes_per_element(opt: torch.optim.Optimizer) -> int:
    name = type(opt).__name__.lower()
    if "sgd" in name:
        return 4 if opt.defaults.get("momentum", 0) else 0
    return 8  # Adam, AdamW, fused variants: exp_avg and exp_avg_sq in fp32


def pending_optimizer_state_nbytes(optimizer: Any) -> int:
    """Bytes of optimizer state not allocated yet (see module docstring).

    Args:
        optimizer: a megatron-core optimizer (or a torch optimizer, or None).
    """
    total = 0
    for opt in _torch_optimizers(optimizer):
        per_element = _state_bytes_per_element(opt)
        for group in opt.param_groups:
            for param in group["params"]:
                if opt.state.get(param):
                    continue
                master = 4 if param.dtype != torch.float32 else 0
                total += param.numel() * (per_element + master)
    return total
