"""The DP reducers' fused kernels on the device under test: compiled against eager there.

``tests/unit/test_kernels_dp.py`` compares each kernel compiled by inductor's C++ backend
against its eager reference on the CPU; here the same comparison runs on the device (Triton
kernels on CUDA): every kernel alone (the unit test's inputs, moved to the device) and the
whole reducers (SEPARATE, PowerSGD, Radius; fp32 and bf16 buckets), whose steady steps with
``--fused-kernels on`` must show no synchronization from megatron_ext code either. And the
whole-buffer non-finite check on the device (``torch.aminmax`` propagates NaN there too).

Dry run on the CPU: ``MEGATRON_EXT_GPU_TESTS_DEVICE=cpu`` (inductor's C++ kernels then).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext import kernels
from tests.gpu.test_kernels_cuda import (  # noqa: F401 (cpu_draws is a fixture)
    _dp_run,
    assert_close,
    check_syncs,
    cpu_draws,
    dp_run_against,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def mode(monkeypatch):
    """Set ``--fused-kernels`` for the test (restored after it)."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    yield kernels.set_mode
    kernels.set_mode(None)


def _to(dev, value):
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(dev, v) for v in value)
    return value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["separate", "powersgd", "radius"])
def test_dp_reducer_fused_equals_eager_on_device(method, dtype, dev, pg, cpu_draws, mode):
    mode("off")
    reference = _dp_run(method, dev, dtype)
    mode("on")
    state, ref_state, recorder = dp_run_against(method, dev, dtype, reference, " fused")
    for key, value in state.items():
        ref = ref_state[key]
        if ref.is_floating_point():
            assert_close(value, ref, dtype, f"{method} fused state {key}")
        else:  # masks and counters: the same selections
            assert torch.equal(value, ref), key
    check_syncs(recorder)


def test_each_kernel_compiled_equals_eager_on_device(dev, mode):
    from megatron_ext.kernels.powersgd import powersgd_compress, powersgd_decompress
    from megatron_ext.kernels.radius import radius_compress, radius_decompress
    from megatron_ext.kernels.separate import separate_compress
    from tests.unit import test_kernels_dp as unit

    def both(fn):
        mode("off")
        eager = fn()
        mode("on")
        return eager, fn()

    for dtype in (torch.float32, torch.bfloat16):
        # SEPARATE: compress, then decompress into the whole bucket
        args, runs, _ = unit._separate_args(dtype)
        args = _to(dev, args)
        table = _to(dev, runs.table)
        args = args[:3] + (table,) + args[4:]
        (p0, bad0, u0), (p1, bad1, u1) = both(lambda: separate_compress(*args))
        assert_close(p1, p0, torch.float32, f"separate P {dtype}")
        assert_close(u1, u0, torch.float32, f"separate staged error {dtype}")
        assert not bad0.item() and not bad1.item()
        grad = args[0]
        region = runs.region(0, grad.numel())
        block = args[1].shape[1]

        eager, fused = both(
            lambda: unit._separate_decompressed(grad, p0, args[2], table, runs.chunk, 0, region)
        )
        assert_close(fused, eager, dtype, f"separate write-back {dtype}")
        assert region.last <= p0.shape[0] * block
        # PowerSGD
        args, runs, _ = unit._powersgd_args(dtype)
        args = _to(dev, args)
        args = args[:3] + (_to(dev, runs.table),) + args[4:]
        (m0, ps0, _), (m1, ps1, _) = both(lambda: powersgd_compress(*args))
        assert torch.equal(m0, m1)
        for a, b in zip(ps1, ps0):
            assert_close(a, b, torch.float32, f"powersgd P {dtype}")
        ps = [torch.linalg.qr(p)[0] for p in ps0]

        def pdecompress():
            m, out = m0.clone(), args[0].clone()
            powersgd_decompress(m, ps, args[2], 0.5, True, out, *args[3:])
            return m, out

        (em, eg), (fm, fg) = both(pdecompress)
        assert_close(fm, em, torch.float32, f"powersgd error {dtype}")
        assert_close(fg, eg, dtype, f"powersgd write-back {dtype}")
        # Radius: bit for bit
        grad, residual, unselected, index, valid = _to(dev, unit._radius_args(dtype, False))
        eager, fused = both(lambda: radius_compress(grad, residual, unselected, index, valid))
        for a, b in zip(eager, fused):
            assert torch.equal(a, b)

        def rdecompress():
            out = grad.clone()
            radius_decompress(out, unselected, index, eager[0] * 3)
            return out

        eager, fused = both(rdecompress)
        assert torch.equal(eager, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_on_device(dev, dtype):
    from megatron_ext.kernels.finite import nonfinite

    base = torch.randn(4097, dtype=torch.float64).to(dtype).to(dev)
    base[7] = torch.finfo(dtype).max
    assert not nonfinite(base).item()
    for value in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 2048, 4096):
            t = base.clone()
            t[at] = value
            assert nonfinite(t).item(), (value, at)


def test_outer_step_kernels_compiled_equal_eager_on_device(dev, mode):
    """DiLoCo's outer-step kernels (megatron_ext/kernels/outer.py): the pseudo-gradient bit
    for bit, the new snapshot and momentum within a few roundings, the finite flags equal,
    with and without a non-finite value."""
    from megatron_ext.kernels.outer import outer_sgd_step_, pseudo_gradient

    gen = torch.Generator().manual_seed(0)
    snap, current, buf = (torch.randn(100_003, generator=gen).to(dev) for _ in range(3))
    for poison in (False, True):
        if poison:
            current[-1] = float("nan")
        runs = []
        for m in ("off", "on"):
            mode(m)
            g, sent = pseudo_gradient(snap, current)
            s, b = snap.clone(), buf.clone()
            ok = outer_sgd_step_(s, b, g, 0.7, 0.9, True, False)
            runs.append((g, sent, s, b, ok))
        (g0, sent0, s0, b0, ok0), (g1, sent1, s1, b1, ok1) = runs
        assert torch.equal(g0.isnan(), g1.isnan())
        assert torch.equal(g0.nan_to_num(), g1.nan_to_num())
        assert bool(sent0) == bool(sent1) == (not poison) and bool(ok0) == bool(ok1)
        torch.testing.assert_close(s0, s1, rtol=1e-6, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(b0, b1, rtol=1e-6, atol=1e-6, equal_nan=True)
