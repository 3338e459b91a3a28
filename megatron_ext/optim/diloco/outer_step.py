"""DiLoCo's outer SGD step, eager: the reference of the fused outer-step kernel.

What it does:
    :func:`outer_sgd_step` applies one ``torch.optim.SGD`` step (momentum, Nesterov, no
    dampening, no weight decay) to the last synchronized parameters in place, given the
    averaged pseudo-gradient.

Why:
    The hook runs the fused op of ``megatron_ext/kernels/outer.py``; this eager form is the
    arithmetic it must match (the kernel tests and the A/B benchmark compare against it).

Constraints:
    torch only; never imports Megatron.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["outer_sgd_step"]


def outer_sgd_step(
    snapshot: torch.Tensor,
    buf: Optional[torch.Tensor],
    delta: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> Optional[torch.Tensor]:
    """One outer SGD step in place on ``snapshot`` (``torch.optim.SGD`` semantics).

    Args:
        snapshot: fp32 parameters of the last synchronization (updated in place).
        buf: the momentum buffer (updated in place), or None before the first step.
        delta: the averaged pseudo-gradient (snapshot - current, mean over sites).

    Returns:
        The momentum buffer (None when ``momentum`` is 0).
    """
    if momentum == 0:
        snapshot.add_(delta, alpha=-lr)
        return None
    if buf is None:
        buf = delta.clone()
    else:
        buf.mul_(momentum).add_(delta)
    update = delta.add(buf, alpha=momentum) if nesterov else buf
    snapshot.add_(update, alpha=-lr)
    return buf
