"""DiLoCo's outer step as fused kernels, each with its finiteness check inside.

What it does:
    Two ops of the outer step (``megatron_ext/optim/diloco/hook.py``), each a pass that
    already reads the tensors whose finiteness DiLoCo checks, returning the check's answer
    as a 0-d bool device tensor (no host synchronization) next to its result:

    * ``pseudo_gradient(snap, current)``: ``snap - current`` and whether it is finite (this
      site's flag, read only when an outer update turns out non-finite);
    * ``outer_sgd_step_(snap, buf, delta, ...)``: the outer SGD step in place on the
      snapshot and the momentum buffer (``torch.optim.SGD`` semantics, the arithmetic of
      :func:`megatron_ext.optim.diloco.outer_sgd_step`, the eager reference) and whether
      both results are finite (the check made before anything is written).

Why:
    The check (:func:`megatron_ext.kernels.finite.nonfinite`: one ``aminmax`` pass per
    tensor) read the pseudo-gradient, the new snapshot and the new momentum once more
    after the passes that wrote them: 1.5 copies of the fragment's fp32 parameters of the
    outer step's 16.75 (``docs/performance/cost/report.md``). Inside one op it is a
    reduction over values the op computes anyway (compiled: fused with them; eager: the
    same ``aminmax`` as before, so the eager flags and values are exactly the old ones).
    The fused step also reads and writes the snapshot and the momentum once each, where the
    eager chain (``mul_``, ``add_``, the Nesterov ``add``, ``add_``) passes over them
    several times.

Constraints:
    Pure torch (no Megatron, no ``torch.distributed``). fp32 tensors of one fragment, all on
    one device. Eager, values and flags equal the old chain bit for bit; compiled, the
    flags and the pseudo-gradient are identical, and the new snapshot and momentum may
    differ by a few roundings (inductor contracts and orders the step's multiply-adds its
    own way: up to 2 ulp measured on the CPU; tests/unit/test_kernels_outer.py). Sites
    that run the same mode on the same kind of device compute the same snapshot.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_ext.kernels import define_op
from megatron_ext.kernels.finite import nonfinite

__all__ = ["pseudo_gradient", "outer_sgd_step_"]


def _finite(*tensors: torch.Tensor) -> torch.Tensor:
    """0-d bool: every element of ``tensors`` is finite (True when all are empty)."""
    bad = nonfinite(*tensors)
    if bad is None:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device)
    return bad.logical_not()


def _pseudo_gradient(
    snap: torch.Tensor, current: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``snap - current`` (a site's pseudo-gradient, flat) and whether it is finite (0-d
    bool)."""
    g = snap - current
    return g, _finite(g)


def _outer_sgd_step(
    snap: torch.Tensor,
    buf: Optional[torch.Tensor],
    delta: torch.Tensor,
    lr: float,
    momentum: float,
    nesterov: bool,
    first: bool,
) -> torch.Tensor:
    """One outer SGD step in place on ``snap`` and, with ``momentum``, on the momentum buffer
    ``buf`` (``first``: the first step, ``buf`` is written with ``delta``, not read; None
    when ``momentum`` is 0); returns whether the new ``snap`` and ``buf`` are finite (0-d
    bool). The arithmetic of :func:`megatron_ext.optim.diloco.outer_sgd_step`."""
    if momentum == 0:
        snap.add_(delta, alpha=-lr)
        return _finite(snap)
    if first:
        buf.copy_(delta)  # torch.optim.SGD: the first buffer is the gradient itself
    else:
        buf.mul_(momentum).add_(delta)
    update = delta.add(buf, alpha=momentum) if nesterov else buf
    snap.add_(update, alpha=-lr)
    return _finite(snap, buf)


def _check_buffer(snap, buf, delta, lr, momentum, *_) -> None:
    """:func:`outer_sgd_step_`'s arguments: a buffer exactly when there is a momentum."""
    if (buf is None) != (momentum == 0):
        raise ValueError("outer_sgd_step_: a momentum buffer goes with a momentum, and only then")


pseudo_gradient = define_op("megatron_ext::pseudo_gradient", _pseudo_gradient)


@pseudo_gradient.register_fake
def _(snap, current):
    dtype = torch.promote_types(snap.dtype, current.dtype)
    return snap.new_empty(snap.shape, dtype=dtype), snap.new_empty((), dtype=torch.bool)


outer_sgd_step_ = define_op(
    "megatron_ext::outer_sgd_step_",
    _outer_sgd_step,
    mutates_args=("snap", "buf"),
    check=_check_buffer,
)


@outer_sgd_step_.register_fake
def _(snap, buf, delta, lr, momentum, nesterov, first):
    return snap.new_empty((), dtype=torch.bool)
