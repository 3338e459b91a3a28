"""Radius's math: the AdamW-corrected gradient and per-layer top-k selection.

What it does:
    Radius (the paper's Algorithm 2; ``docs/methods/radius.md``) picks the entries to
    communicate by the magnitude of the *update direction* AdamW would apply, not of the
    raw gradient:
    ``G_c = m_hat / (sqrt(v_hat) + eps) + lambda * w`` with bias-corrected moments. Here
    the moments are the optimizer's own state after the selection step's update, so
    :func:`adamw_corrected_gradient` also undoes that update to recover the weight ``w_t``
    the formula refers to: AdamW computed ``w_{t+1} = w_t (1 - lr lambda) - lr d`` with
    ``d = m_hat / (sqrt(v_hat) + eps)``, hence ``w_t = (w_{t+1} + lr d) / (1 - lr lambda)``.
    With L2-style (non-decoupled) weight decay the decay is already inside the moments and
    ``G_c = d``.

    :func:`topk_mask` keeps exactly ``ceil(density * n)`` entries per weight.

Constraints:
    Pure torch; no torch.distributed, no Megatron. Identical inputs give identical masks,
    which is what keeps data-parallel ranks in agreement.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_corrected_gradient", "topk_mask", "num_selected"]


def adamw_corrected_gradient(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_after: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
) -> torch.Tensor:
    """Radius's corrected gradient at the step whose update produced ``param_after``.

    Args:
        exp_avg: AdamW first moment after the step.
        exp_avg_sq: second moment after the step.
        param_after: the (fp32 main) parameter after the step, same shape.
        step: number of Adam steps taken (for the bias correction).
        lr: learning rate used by that step.
        betas: (beta1, beta2).
        eps: AdamW epsilon.
        weight_decay: lambda.
        decoupled: AdamW (True) or Adam with L2 decay (False).

    Returns:
        ``G_c`` (fp32, shape of ``exp_avg``).
    """
    beta1, beta2 = betas
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    m = exp_avg.float()
    v = exp_avg_sq.float()
    direction = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + eps)
    if not decoupled or weight_decay == 0.0:
        return direction
    w_before = (param_after.float() + lr * direction) / (1.0 - lr * weight_decay)
    return direction + weight_decay * w_before


def num_selected(numel: int, density: float) -> int:
    """Entries kept out of ``numel``: ``ceil(density * numel)``, at least 1."""
    return max(1, min(numel, math.ceil(density * numel)))


def topk_mask(scores: torch.Tensor, density: float) -> torch.Tensor:
    """Boolean mask of the ``ceil(density * n)`` largest ``|scores|`` (flattened)."""
    flat = scores.reshape(-1)
    k = num_selected(flat.numel(), density)
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k >= flat.numel():
        mask.fill_(True)
        return mask
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    mask[idx] = True
    return mask
