"""DiLoCo's outer-step kernels (megatron_ext/kernels/outer.py): the old chain, eager, compiled.

* eager, ``pseudo_gradient`` and ``outer_sgd_step_`` give the values of the chain they
  replace (``snap - current``; :func:`megatron_ext.optim.diloco.outer_sgd_step`, every
  momentum variant and the first step) bit for bit, and the flags of its separate check
  (:func:`megatron_ext.kernels.finite.nonfinite`): a NaN or an Inf in the pseudo-gradient,
  in the averaged one, in the momentum, or a NaN learning rate each turn the flag False;
* compiled (``on``: C++ on this CPU) against eager: flags identical, the pseudo-gradient bit
  for bit, the new snapshot and momentum within 1e-6 (values of order 1: a few float32
  roundings; inductor evaluates the step's chain of multiply-adds contracted and in its own
  order, measured here up to 2 ulp apart), on an odd size (1001 values) with and without a
  non-finite value. fp32 only: DiLoCo's
  outer state is fp32 whatever the training dtype.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext import kernels
from megatron_ext.kernels.finite import nonfinite
from megatron_ext.kernels.outer import outer_sgd_step_, pseudo_gradient
from megatron_ext.optim.diloco import outer_sgd_step

N = 1001


pytestmark = pytest.mark.usefixtures("fresh_kernel_mode")


def _randn(seed, scale=1.0):
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)) * scale


def _bits(t):
    return t.view(torch.int32)


def _old(snap, buf, delta, lr, momentum, nesterov):
    """The chain before the kernel: outer_sgd_step, then nonfinite of its results."""
    snap = snap.clone()
    buf = outer_sgd_step(
        snap,
        None if buf is None else buf.clone(),
        delta,
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
    )
    ok = nonfinite(snap, *([buf] if buf is not None else [])).logical_not()
    return snap, buf, ok


def _new(snap, buf, delta, lr, momentum, nesterov):
    snap = snap.clone()
    first = momentum != 0 and buf is None
    if momentum != 0:
        buf = torch.empty_like(delta) if first else buf.clone()
    ok = outer_sgd_step_(snap, buf, delta, lr, momentum, nesterov, first)
    return snap, buf, ok


def _same(a, b, what, tol=0.0):
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, (what, i)
        elif x.dtype == torch.bool or tol == 0.0:
            assert torch.equal(
                x.view(torch.uint8) if x.dtype == torch.bool else _bits(x),
                y.view(torch.uint8) if y.dtype == torch.bool else _bits(y),
            ), (what, i)
        else:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol, equal_nan=True, msg=what)


@pytest.mark.parametrize(
    "momentum, nesterov, first",
    [(0.9, True, False), (0.9, True, True), (0.5, False, False), (0.0, False, False)],
)
def test_eager_kernels_equal_the_old_chain(momentum, nesterov, first):
    snap, current, buf = _randn(1), _randn(2), _randn(3, 0.1)
    g, ok = pseudo_gradient(snap, current)
    assert torch.equal(_bits(g), _bits(snap - current)) and ok.dtype == torch.bool and bool(ok)
    buf = None if (first or momentum == 0) else buf
    _same(
        _old(snap, buf, g, 0.7, momentum, nesterov),
        _new(snap, buf, g, 0.7, momentum, nesterov),
        "finite",
    )
    # every way the outer step turns non-finite gives the old check's answer
    bad_delta = g.clone()
    bad_delta[500] = float("inf")
    cases = {"delta": (snap, buf, bad_delta, 0.7), "lr": (snap, buf, g, float("nan"))}
    if buf is not None:
        bad_buf = buf.clone()
        bad_buf[3] = float("nan")
        cases["momentum"] = (snap, bad_buf, g, 0.7)
    for what, (s, b, d, lr) in cases.items():
        old, new = _old(s, b, d, lr, momentum, nesterov), _new(s, b, d, lr, momentum, nesterov)
        _same(old, new, what)
        assert not bool(new[2]), what
    bad = current.clone()
    bad[7] = float("nan")
    g, ok = pseudo_gradient(snap, bad)
    assert not bool(ok) and bool(nonfinite(g))


def test_compiled_equals_eager():
    snap, current, buf = _randn(4), _randn(5), _randn(6, 0.1)
    for poison in (False, True):
        if poison:
            current = current.clone()
            current[N - 1] = float("-inf")
        runs = []
        for mode in ("off", "on"):
            kernels.set_mode(mode)
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                g, ok = pseudo_gradient(snap, current)
                runs.append((g, ok) + _new(snap, buf, g, 0.7, 0.9, True))
        kernels.set_mode(None)
        _same(runs[0][:2], runs[1][:2], f"pseudo-gradient, poisoned {poison}")
        _same(runs[0][2:], runs[1][2:], f"outer step, poisoned {poison}", tol=1e-6)
        assert bool(runs[1][1]) is not poison and bool(runs[1][4]) is not poison
