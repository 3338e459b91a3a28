"""The data-parallel reducers' fused kernels, compiled against eager, and the non-finite check.

Kernels (``megatron_ext/kernels/``): SEPARATE's compress / decompress, PowerSGD's compress /
decompress, Radius's compress / decompress, the packing they share, and the whole-buffer
non-finite check (``finite.py``) the reducers' input flag and DiLoCo's outer step use.

What is compared (``--fused-kernels on``, i.e. ``torch.compile``'s C++ kernels on this CPU,
against the eager reference, which is the reducers' chain as it ran before the kernels):

* data movement bit for bit: packed gradients, the elements written back, everything a
  kernel must leave alone (1-D parameters, padding, positions outside a shard), Radius's
  gathered values and residual, the non-finite flags;
* values within a stated tolerance where inductor may contract a multiply and an add into
  one rounding (SEPARATE's and PowerSGD's error updates, the reconstructions): a few ulps of
  the values' magnitude (``_close``), where the matmuls themselves are the same BLAS calls.

Every bucket dtype the reducers accept (fp32, bf16, fp16), odd sizes (matrices whose sizes
are not multiples of the block, a last row padded, a single run), one-element and empty
edge cases of the flag. Compiles are kept few: each kernel is compiled in fp32 and in one
16-bit dtype (every dtype is compiled by some kernel through the same casts; the other
variants are checked eagerly); most of this file's time is compiling.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext import kernels
from megatron_ext.kernels.finite import nonfinite, nonfinite_flag
from megatron_ext.kernels.packing import Runs, gather, scatter_
from megatron_ext.kernels.powersgd import powersgd_compress, powersgd_decompress
from megatron_ext.kernels.radius import radius_compress, radius_decompress
from megatron_ext.kernels.separate import separate_compress, separate_decompress

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]

pytestmark = pytest.mark.skipif(
    kernels.fused_unavailable("cpu") is not None, reason="torch.compile cannot run here"
)


@pytest.fixture
def modes(monkeypatch):
    """``run(fn)`` -> ``(eager result, compiled result)`` of calling ``fn()`` in each mode."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)

    def run(fn, compiled=True):
        kernels.set_mode("off")
        eager = fn()
        if not compiled:  # a variant whose compile another test's covers: eager twice
            return eager, fn()
        kernels.set_mode("on")
        try:
            fused = fn()
        finally:
            kernels.set_mode(None)
        return eager, fused

    yield run
    kernels.set_mode(None)


def _close(actual, expected, ulps=8):
    """Within ``ulps`` units in the last place of fp32 at the values' magnitude: what
    contracting ``a * b + c`` into one rounding (or reordering a sum of two) changes."""
    scale = expected.abs().amax().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=ulps * 2**-23 * max(scale, 1e-30))


# -- a bucket -----------------------------------------------------------------------------------

# Weight matrices of odd sizes between 1-D parameters: 7 x 9 and 5 x 3 are not multiples of any
# block, so packed rows straddle matrices and the last row is padded.
LAYOUT = [
    ("w0", (12, 16)),
    ("b0", (16,)),
    ("w1", (7, 9)),
    ("n1", (9,)),
    ("w2", (5, 3)),
    ("w3", (8, 16)),
]
PAD = 6


def _bucket(dtype, seed=0):
    """A flat bucket (+ padding), its matrix runs and its 1-D runs."""
    gen = torch.Generator().manual_seed(seed)
    pos, mats, ones = 0, [], []
    for name, shape in LAYOUT:
        n = math.prod(shape)
        (mats if len(shape) == 2 else ones).append((name, pos, n, shape))
        pos += n
    grad = torch.zeros(pos + PAD, dtype=dtype)
    grad[:pos] = torch.randn(pos, generator=gen).to(dtype)
    return grad, mats, ones


def _untouched(before, after, mats, lo=0, hi=None):
    """Every element outside the matrices' part of ``[lo, hi)`` is bit-identical."""
    keep = torch.ones(before.numel(), dtype=torch.bool)
    hi = before.numel() if hi is None else hi
    for _, start, n, _ in mats:
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            keep[a:b] = False
    assert torch.equal(before[keep], after[keep])


def test_packing_both_bodies_move_the_same_elements(modes):
    grad, mats, _ = _bucket(torch.float32)
    runs = Runs.build([m[1] for m in mats], [m[2] for m in mats], grad.device)
    size = runs.total + 7  # a padded last row

    def pack():
        return kernels.run(
            gather,
            grad,
            size,
            runs.total,
            runs.table,
            runs.chunk,
            runs.starts,
            runs.offsets,
            runs.numels,
        )

    eager, fused = modes(pack, compiled=False)  # compiled inside the ops below
    assert torch.equal(eager, fused) and torch.equal(eager[runs.total :], torch.zeros(7))
    assert torch.equal(eager[: mats[0][2]], grad[: mats[0][2]])
    # region: the packed interval inside a bucket range, and a scatter of it
    lo, hi = mats[1][1] + 2, mats[3][1] + 5
    region = runs.region(lo, hi)
    values = torch.arange(runs.total, dtype=torch.float32) + 0.5

    def write():
        out = grad.clone()
        kernels.run(
            scatter_,
            out,
            values,
            0,
            region.first,
            region.last,
            runs.table,
            runs.chunk,
            (region.dst, region.src, region.lengths),
        )
        return out

    eager, fused = modes(write, compiled=False)
    assert torch.equal(eager, fused)
    _untouched(grad, eager, mats, lo, hi)
    assert eager[lo].item() == values[region.first].item()


# -- SEPARATE -----------------------------------------------------------------------------------


def _separate_args(dtype, block=8, ratio=2, beta=0.25, stage=True):
    grad, mats, _ = _bucket(dtype)
    runs = Runs.build([m[1] for m in mats], [m[2] for m in mats], grad.device)
    rows = math.ceil(runs.total / block)
    gen = torch.Generator().manual_seed(1)
    error = torch.randn(rows, block, generator=gen)
    error.view(-1)[runs.total :] = 0
    omega = torch.linalg.qr(torch.randn(block, block // ratio, generator=gen, dtype=torch.float64))[
        0
    ]
    omega = (omega * math.sqrt(block)).float()
    args = (
        grad,
        error,
        omega,
        runs.table,
        runs.chunk,
        runs.total,
        runs.starts,
        runs.offsets,
        runs.numels,
        beta,
        stage,
    )
    return args, runs, mats


def _separate_decompressed(grad, p, omega, table, chunk, offset, region):
    """A copy of ``grad`` with ``region`` (a ``Runs.region``) written back from ``p``, rows of
    P whose first starts at bucket element ``offset`` (decompression of the whole bucket:
    all of P, offset 0)."""
    out = grad.clone()
    separate_decompress(
        p,
        omega,
        out,
        table,
        chunk,
        offset,
        region.first,
        region.last,
        region.dst,
        region.src,
        region.lengths,
    )
    return out


# Compiled: fp32 (with and without the staged error) and bf16; fp16 goes through the same
# casts as bf16 (checked eagerly, to keep the compiles few).
@pytest.mark.parametrize(
    "dtype, stage, compiled",
    [
        (torch.float32, True, True),
        (torch.float32, False, True),
        (torch.bfloat16, True, True),
        (torch.float16, True, False),
    ],
    ids=["fp32", "fp32-reset", "bf16", "fp16"],
)
def test_separate_kernels_compiled_match_eager(modes, dtype, stage, compiled):
    args, runs, mats = _separate_args(dtype, stage=stage)
    grad, error, omega = args[:3]
    (p0, bad0, u0), (p1, bad1, u1) = modes(lambda: separate_compress(*args), compiled)
    _close(p1, p0)
    assert not bad0 and not bad1
    if stage:
        _close(u1, u0)
        assert torch.equal(u1.view(-1)[runs.total :], torch.zeros(u1.numel() - runs.total))
        # the eager chain is the reducer's own: e(1 - b) + b (h - P Omega^T / k)
        h = torch.zeros_like(error).view(-1)
        for (_, start, n, _), off in zip(mats, runs.offsets):
            h[off : off + n] = grad[start : start + n].float()
        h = h.view_as(error) + error
        k = omega.shape[1]
        want = error * (1 - 0.25) + 0.25 * (h - (h @ omega) @ omega.t() / k)
        want.view(-1)[runs.total :] = 0
        _close(u0, want, ulps=64)
    else:
        assert u0.numel() == u1.numel() == 0
    # decompress: the whole bucket, then a shard (rows r0.. of P, a bucket range)
    for lo, hi in ((0, grad.numel()), (mats[1][1] + 3, mats[3][1] + 11)):
        region = runs.region(lo, hi)
        block = error.shape[1]
        r0, r1 = region.first // block, math.ceil(region.last / block)

        eager, fused = modes(
            lambda: _separate_decompressed(
                grad, p0[r0:r1], omega, runs.table, runs.chunk, r0 * block, region
            ),
            compiled and stage,
        )
        _untouched(grad, eager, mats, lo, hi)
        _untouched(grad, fused, mats, lo, hi)
        if dtype == torch.float32:
            _close(fused, eager)
        else:  # one rounding to the bucket's dtype may fall either side of a tie
            torch.testing.assert_close(fused.float(), eager.float(), rtol=2**-7, atol=0)


def test_separate_compress_flags_non_finite_inputs(modes):
    args, runs, mats = _separate_args(torch.float32)
    for where in ("grad", "error"):
        for value in (float("nan"), float("inf"), float("-inf")):
            grad, error = args[0].clone(), args[1].clone()
            if where == "grad":
                grad[mats[2][1] + 1] = value  # inside a matrix
            else:
                error.view(-1)[runs.total - 1] = value
            bad = modes(lambda: separate_compress(grad, error, *args[2:])[1])
            assert bad[0].item() and bad[1].item(), (where, value)
    # a NaN in a 1-D parameter or the padding is not the compressor's input
    grad = args[0].clone()
    grad[mats[0][2] + 3] = float("nan")
    grad[-1] = float("inf")
    bad = modes(lambda: separate_compress(grad, *args[1:])[1])
    assert not bad[0].item() and not bad[1].item()


# -- PowerSGD -----------------------------------------------------------------------------------


def _powersgd_args(dtype, error_feedback=True):
    # two batches: three 6 x 10 matrices and one 4 x 5, between 1-D parameters
    gen = torch.Generator().manual_seed(2)
    shapes = [(6, 10), (6, 10), (4, 5), (6, 10)]
    pos, starts = 3, []
    for r, c in shapes:
        starts.append(pos)
        pos += r * c + 2
    grad = torch.randn(pos + PAD, generator=gen).to(dtype)
    order = [0, 1, 3, 2]  # batch by batch
    runs = Runs.build(
        [starts[i] for i in order], [shapes[i][0] * shapes[i][1] for i in order], grad.device
    )
    dims = [3, 6, 10, 1, 4, 5]
    error = torch.randn(runs.total, generator=gen) if error_feedback else grad.new_empty(0)
    qs = [torch.randn(3, 10, 2, generator=gen), torch.randn(1, 5, 2, generator=gen)]
    args = (grad, error, qs, runs.table, runs.chunk, runs.starts, runs.offsets, runs.numels, dims)
    return args, runs, [(None, s, r * c, (r, c)) for s, (r, c) in zip(starts, shapes)]


# Compiled: fp32 and fp16 (bf16's casts are compiled in SEPARATE's and Radius's tests).
@pytest.mark.parametrize(
    "dtype, compiled",
    [(torch.float32, True), (torch.bfloat16, False), (torch.float16, True)],
    ids=IDS,
)
def test_powersgd_kernels_compiled_match_eager(modes, dtype, compiled):
    args, runs, mats = _powersgd_args(dtype)
    grad, error, qs = args[:3]
    (m0, ps0, bad0), (m1, ps1, bad1) = modes(lambda: powersgd_compress(*args), compiled)
    assert torch.equal(m0, m1) and not bad0 and not bad1  # a gather and one add
    for a, b in zip(ps1, ps0):
        _close(a, b)
    want = torch.cat([grad[s : s + n].float() for s, n in zip(runs.starts, runs.numels)]) + error
    assert torch.equal(m0, want)
    ps = [torch.linalg.qr(p)[0] for p in ps0]

    def decompress():
        m, out = m0.clone(), grad.clone()
        powersgd_decompress(m, ps, qs, 0.5, True, out, *args[3:])
        return m, out

    (em, eg), (fm, fg) = modes(decompress, compiled)
    _untouched(grad, eg, mats)
    _untouched(grad, fg, mats)
    _close(fm, em)
    if dtype == torch.float32:
        _close(fg, eg)
    else:
        torch.testing.assert_close(fg.float(), eg.float(), rtol=2**-7, atol=0)
    # the error is M - share * P Q^T, the bucket P Q^T
    approx = torch.bmm(ps[0], qs[0].transpose(1, 2))
    _close(em[:180].view(3, 6, 10), m0[:180].view(3, 6, 10) - 0.5 * approx)
    # a NaN in a matrix is flagged; without error feedback M is G
    bad_grad = grad.clone()
    bad_grad[runs.starts[3]] = float("nan")
    flags = modes(lambda: powersgd_compress(bad_grad, *args[1:])[2], compiled)
    assert flags[0].item() and flags[1].item()


def test_powersgd_compress_without_error_feedback(modes):
    args, runs, _ = _powersgd_args(torch.float32, error_feedback=False)
    (m0, _, _), (m1, _, _) = modes(lambda: powersgd_compress(*args), compiled=False)
    grad = args[0]
    want = torch.cat([grad[s : s + n].float() for s, n in zip(runs.starts, runs.numels)])
    assert torch.equal(m0, want) and torch.equal(m1, want)


# -- Radius -------------------------------------------------------------------------------------


def _radius_args(dtype, padded):
    gen = torch.Generator().manual_seed(3)
    n = 101
    grad = torch.randn(n, generator=gen).to(dtype)
    grad[-3:] = 0  # padding
    residual = torch.randn(n, generator=gen)
    residual[-3:] = 0
    selected = torch.rand(n - 3, generator=gen) < 0.3
    selected[40:45] = True  # a 1-D parameter
    unselected = torch.zeros(n, dtype=torch.bool)
    unselected[: n - 3] = ~selected
    index = torch.nonzero(selected).view(-1)
    valid = torch.empty(0, dtype=torch.bool)
    if padded:  # two owner groups padded to the same width (the distributed optimizer's)
        half = index.numel() // 2
        width = index.numel() - half
        index = torch.cat([index[:half], torch.zeros(width - half, dtype=torch.long), index[half:]])
        valid = torch.ones(2 * width, dtype=torch.bool)
        valid[half:width] = False
    return grad, residual, unselected, index, valid


# Compiled: fp32 (all-reduce's index) and bf16 (the distributed optimizer's padded index).
@pytest.mark.parametrize(
    "dtype, padded, compiled",
    [(torch.float32, False, True), (torch.bfloat16, True, True), (torch.float16, False, False)],
    ids=IDS,
)
def test_radius_kernels_compiled_match_eager_bit_for_bit(modes, dtype, padded, compiled):
    grad, residual, unselected, index, valid = _radius_args(dtype, padded)
    eager, fused = modes(
        lambda: radius_compress(grad, residual, unselected, index, valid), compiled
    )
    for a, b in zip(eager, fused):
        assert torch.equal(a, b)
    values, new_residual, bad = eager
    assert torch.equal(new_residual, residual + grad.float() * unselected) and not bad
    want = grad[index].float() * (valid if padded else 1)
    assert torch.equal(values, want)
    reduced = values * 3

    def decompress():
        out = grad.clone()
        radius_decompress(
            out,
            unselected,
            index[valid] if padded else index,
            reduced[valid] if padded else reduced,
        )
        return out

    eager, fused = modes(decompress, compiled)
    assert torch.equal(eager, fused)
    assert torch.equal(eager[unselected], torch.zeros(int(unselected.sum()), dtype=dtype))
    # a NaN in the residual of an unselected entry is this rank's input too
    residual = residual.clone()
    residual[int(torch.nonzero(unselected)[0])] = float("nan")
    flags = modes(lambda: radius_compress(grad, residual, unselected, index, valid)[2], compiled)
    assert flags[0].item() and flags[1].item()


# -- the non-finite check -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_nonfinite_matches_isfinite(dtype):
    big = torch.finfo(dtype).max
    base = torch.tensor([1.0, -2.0, big, -big, 0.0, -0.0], dtype=dtype)
    assert not nonfinite(base)  # the largest finite values are finite
    for value in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 3, 5):
            t = base.clone()
            t[at] = value
            assert nonfinite(t).item() and nonfinite(base, t).item()
            assert nonfinite_flag(t.device, base, t).tolist() == [1.0]
    one = torch.tensor([float("nan")], dtype=dtype)
    assert nonfinite(one) and not nonfinite(torch.ones(1, dtype=dtype))
    # empty tensors are skipped; nothing at all is no answer (and a 0 flag)
    assert nonfinite(torch.empty(0, dtype=dtype)) is None
    assert nonfinite_flag(torch.device("cpu")).tolist() == [0.0]
    # known flags (a kernel's) join the answer
    assert nonfinite(base, known=[torch.tensor(True)]).item()
    assert not nonfinite(base, known=[torch.tensor(False)]).item()
    # mixed dtypes in one call, 2-D
    assert nonfinite(base.view(2, 3), torch.tensor([float("inf")])).item()
