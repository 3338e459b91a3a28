"""The k-bit quantizer's fused kernels (megatron_ext/kernels/quant.py): blocks, eager vs compiled.

Eager (``--fused-kernels off``) is the reference: the methods' results in that mode are the
ones of the chains before the kernels existed (their own tests: test_quantize.py,
test_aqsgd_codec.py, tests/distributed/test_error_feedback.py). Here:

* the building blocks: packing of every width (1-8 bits) at sizes that are not multiples of
  8, bytes of fp16 / fp32 values read back at unaligned offsets, the hash noise (uniform,
  seeded, reproducible) and the unbiasedness of stochastic rounding through the ops;
* every op compiled (``on``: ``torch.compile``, C++ on this CPU) against eager, on odd shapes
  and strided inputs, in the dtypes the methods accept (codecs fp32 / bf16 / fp16, gradient
  buckets fp32 / bf16): codes, packed bytes, scales and flags bit for bit, and the values too
  (tolerance 0: the CPU compiler contracts no multiply-add, see the module docstring of
  megatron_ext/kernels/quant.py; a GPU may differ by one rounding, tests/gpu checks that);
  stochastic rounding draws the same hash noise compiled and eager; non-finite inputs keep
  their flags (the non-finite flag of the exchange, AQ-SGD's finite / clamped flags and its
  rule that a non-finite sample keeps its buffer row);
* AQ-SGD's two sides stay bit-identical when compiled.

Compiles cost seconds each on this machine; the compiled cases are few and small.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext import kernels
from megatron_ext.kernels import quant as Q
from tests.helpers.fused_modes import (
    assert_same,
    eager_and_compiled,
    seeded_randn,
)

pytestmark = pytest.mark.usefixtures("fresh_kernel_mode")


# -- building blocks (eager) -------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_round_trips_every_width_at_odd_sizes(bits):
    gen = torch.Generator().manual_seed(bits)
    for length in (1, 7, 13, 40):
        codes = torch.randint(0, 1 << bits, (3, length), generator=gen, dtype=torch.uint8)
        width = length if bits == 8 else length + (-length) % 8
        packed = Q.pack_codes(codes, bits, width)
        assert packed.shape == (3, Q.packed_nbytes(width, bits))
        back = Q.unpack_codes(packed, bits, width)
        assert torch.equal(back[:, :length], codes) and not back[:, length:].any()


def test_bytes_read_back_at_any_offset():
    values = torch.tensor([[1.5, -65504.0, 3e-5, float("inf")]], dtype=torch.float16)
    raw = Q._bytes_of(values)
    assert torch.equal(raw, values.view(torch.uint8))  # the host's little-endian layout
    shifted = torch.cat([torch.tensor([7], dtype=torch.uint8), raw.view(-1)])[1:]
    assert shifted.storage_offset() == 1  # odd: a plain .view(float16) refuses it
    assert torch.equal(Q._from_bytes(shifted.view(1, -1), torch.float16), values)
    flags = torch.tensor([[0.0, 1.0, -2.5, float("nan")]])
    back = Q._from_bytes(Q._bytes_of(flags), torch.float32)
    assert torch.equal(back.view(torch.int32), flags.view(torch.int32))


def test_hash_noise_is_uniform_seeded_and_reproducible():
    seed = torch.tensor([12345, 678], dtype=torch.int64)
    u = Q.uniform_noise(seed, (256, 256), torch.device("cpu"))
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    assert torch.equal(u, Q.uniform_noise(seed, (256, 256), torch.device("cpu")))
    # 65536 draws: mean 1/2 and variance 1/12 within ~5 standard errors; deciles even
    assert abs(u.mean().item() - 0.5) < 0.006 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 6553.6).abs().max() < 6553.6 * 0.05
    # neighbours are not correlated, another seed gives other noise
    assert abs(torch.corrcoef(torch.stack([u.view(-1)[:-1], u.view(-1)[1:]]))[0, 1]) < 0.02
    other = Q.uniform_noise(seed + 1, (256, 256), torch.device("cpu"))
    assert (other != u).float().mean() > 0.99
    # an index past 2^32 still mixes in (tensors that large are not drawn here)
    assert Q._hash32(torch.tensor([5]) ^ 1) != Q._hash32(torch.tensor([5]))


def test_stochastic_rounding_through_the_ops_is_unbiased():
    # 2 bits: steps of half the scale; the first row sets the scale of every channel.
    x = torch.linspace(-0.9, 0.4, 32).view(1, 32, 1).expand(1, 32, 3).contiguous()
    x[0, 0] = 1.0
    total = torch.zeros_like(x)
    trials = 2000
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        payload = Q.quant_pack(x, None, Q.draw_seed(x.device, gen), 2, "channel")
        total += Q.unpack_dequant(payload, 2, "channel", 1, 32, 3, torch.float32)
    # the standard error of the mean is below 0.25 / sqrt(2000) = 0.0056
    assert ((total / trials) - x)[0, 1:].abs().max() < 0.03
    nearest = Q.unpack_dequant(
        Q.quant_pack(x, None, None, 2, "channel"), 2, "channel", 1, 32, 3, torch.float32
    )
    assert (nearest - x)[0, 1:].abs().max() > 0.1


# -- compiled against eager --------------------------------------------------------------------
#
# One compiled graph per op variant, each a different dtype, width and option, so the few
# compiles (seconds each) cover: fp32 / bf16 / fp16 inputs, 3 bits (the generic packing) and
# 4 bits (whole codes per byte), every scale grouping, strided inputs, sizes that are not
# multiples of 8 or of the row, subtraction, error feedback, stochastic rounding, the
# reduce-scatter mean, non-finite inputs and the flags.


def test_sample_codecs_compiled_equal_eager():
    """quant_pack, unpack_dequant, aqsgd_decode_stage (sender and receiver), aqsgd_stage."""
    # AQ-SGD's forward delta: bf16 [k, rows, cols] = [3, 5, 7] transposed from [s, b, h] as
    # the codecs pass it (strided; 35 values a sample), minus bf16 buffer rows, 4 bits per
    # channel, stochastic rounding.
    x = seeded_randn(5, 3, 7, seed=1, dtype=torch.bfloat16).transpose(0, 1)
    m = seeded_randn(3, 5, 7, seed=2, dtype=torch.bfloat16)
    seed = Q.draw_seed(x.device, torch.Generator().manual_seed(3))
    eager, compiled = eager_and_compiled(Q.quant_pack, x, m, seed, 4, "channel")
    assert_same(eager, compiled, "quant_pack bf16 channel stochastic")
    # fp16 activations, 3 bits, one scale per channel over the micro-batch; decoded to fp16
    a = seeded_randn(3, 5, 7, seed=5, dtype=torch.float16, scale=3.0)
    payload16 = Q.quant_pack(a, None, None, 3, "microbatch")
    decoded = eager_and_compiled(
        Q.unpack_dequant, payload16, 3, "microbatch", 3, 5, 7, torch.float16
    )
    assert_same(*decoded, "unpack_dequant fp16 microbatch 3 bits")
    # (3 bits: within a quarter of its channel's scale, a little more for fp16 roundings)
    assert (decoded[0].float() - a.float()).abs().max() <= a.float().abs().max() / 4 * 1.01
    # AQ-SGD's buffer update with fp16 rows, per token: one sample goes past fp16's range
    # (stored clamped), one holds a NaN (its old row stays); the receiver's fp32 activations
    # and the sender's (none) come from two graphs that must stage the same rows
    x2 = seeded_randn(3, 5, 7, seed=6)
    m2 = seeded_randn(3, 5, 7, seed=7)
    x2[1, 2, 3] = m2[1, 2, 3] + 100.0
    payload = Q.quant_pack(x2, m2, None, 4, "token")
    old = m2.half()
    old[1, 2, 3], old[2, 0, 0] = 65504.0, float("nan")
    receiver = eager_and_compiled(Q.aqsgd_decode_stage, payload, old, 4, "token", torch.float32)
    assert_same(*receiver, "aqsgd_decode_stage receiver")
    sender = eager_and_compiled(Q.aqsgd_decode_stage, payload, old, 4, "token", None)
    assert_same(*sender, "aqsgd_decode_stage sender")
    assert_same(sender[1][:3], receiver[1][:3], "both sides stage the same rows (compiled)")
    staged, finite, clamped, out = receiver[1]
    assert finite.tolist() == [True, True, False] and clamped.tolist() == [False, True, False]
    assert staged[1, 2, 3].item() == 65504.0 and out[1, 2, 3].item() > 65504.0
    assert torch.equal(staged[2].view(torch.int16), old[2].view(torch.int16))
    assert sender[1][3].numel() == 0
    # first visits: bf16 rows into fp16 buffers, a clamped and a non-finite sample
    rows = seeded_randn(3, 5, 7, seed=8, dtype=torch.bfloat16)
    rows[0, 0, 0], rows[2, 1, 1] = 7e4, float("inf")
    first = eager_and_compiled(Q.aqsgd_stage, rows, torch.float16)
    assert_same(*first, "aqsgd_stage")
    assert first[1][1].tolist() == [True, True, False]
    assert first[1][2].tolist() == [True, False, False]


def test_exchange_kernels_compiled_equal_eager():
    """The quantized exchange's worker, server and decode kernels: a bucket of 1000 values
    over 3 ranks (partitions of 334 in rows of 32: padding inside the last row and past the
    bucket), bf16 gradients with error feedback, stochastic rounding, the flag."""
    size, part, block, n = 3, 334, 32, 1000
    rows, padded, width, nbytes = Q.rows_layout(part, block, 3)
    gen = torch.Generator().manual_seed(1)
    sends = []
    for r in range(size):
        grad = seeded_randn(n, seed=10 + r, dtype=torch.bfloat16)
        error = seeded_randn(size, padded, seed=20 + r, scale=0.01)
        seed = Q.draw_seed(grad.device, gen)
        eager, compiled = eager_and_compiled(
            Q.quantized_encode_rows, grad, error, seed, 3, block, size, part
        )
        assert_same(eager, compiled, f"encode rank {r}")
        sends.append(eager[0])
        assert eager[0].shape == (size, nbytes + 4) and eager[1].shape == (size, padded)
    # a NaN sets every partition's flag; the codes of its 8-code group and the scales of its
    # row are not specified (module docstring of megatron_ext/kernels/quant.py)
    grad[17] = float("nan")
    eager, compiled = eager_and_compiled(
        Q.quantized_encode_rows, grad, error, seed, 3, block, size, part
    )
    assert Q._from_bytes(compiled[0][:, nbytes:], torch.float32).view(-1).tolist() == [1.0] * 3
    keep = torch.ones(nbytes + 4, dtype=torch.bool)
    keep[17 // 8 * 3 : 17 // 8 * 3 + 3] = False
    keep[nbytes - 2 * rows : nbytes] = False
    assert torch.equal(eager[0][0, keep], compiled[0][0, keep])
    assert torch.equal(eager[0][1:], compiled[0][1:])
    assert torch.equal(eager[1].isnan(), compiled[1].isnan())
    # rank 1's server side: partition 1 of every rank, averaged, quantized again with its
    # server error (the fp32 server values: tolerance 0 as well)
    recv = torch.stack([sends[r][1] for r in range(size)])
    server_error = seeded_randn(padded, seed=30, scale=0.01)
    eager, compiled = eager_and_compiled(
        Q.quantized_reduce_rows, recv, server_error, None, 3, block, part, True, True
    )
    assert_same(eager, compiled, "reduce (mean) + requantize")
    assert eager[0].item() == 0.0 and eager[2].shape == (nbytes,) and eager[1].numel() == 0
    # the reduce-scatter variant (the exact mean, no re-quantization) agrees with it
    flag, r, _, _ = Q.quantized_reduce_rows(recv, None, None, 3, block, part, True, False)
    assert torch.equal(
        eager[3] + Q._decode_rows(eager[2].view(1, -1), 3, block, padded)[0], r + server_error
    )
    # every rank's re-quantized partition gathered and written into a bf16 bucket
    gathered = torch.stack([eager[2]] * size)
    outs = []
    for mode in ("off", "on"):
        kernels.set_mode(mode)
        out = torch.full((n,), 7.0, dtype=torch.bfloat16)
        Q.quantized_decode_rows_into(gathered, 3, block, part, out=out)
        outs.append(out)
    assert_same(outs[0], outs[1], "decode into a bf16 bucket")
    assert not (outs[0] == 7.0).any()
