"""The quantizer's fused kernels compiled on the device against eager on the device.

``tests/unit/test_kernels_quant.py`` checks compiled against eager on the CPU (C++ kernels,
bit for bit). Here the same ops run on the device under test (``tests/gpu/conftest.py``)
eager (``--fused-kernels off``) and compiled (``on``: Triton on CUDA), on the inputs the
methods pass (strided activations, odd sizes, bf16 / fp16 / fp32, stochastic rounding from
a seed drawn on the device):

* codes, packed bytes and flags: equal but for values on a rounding boundary where a
  compiled division or fused multiply-add rounds differently (at most 1e-3 of the bytes,
  as the CPU-vs-device quantizer test allows); scales bit for bit (one max each);
* values (dequantized rows, errors, buffer rows): relative error at most 1e-6 (one
  rounding of a multiply-add on values of order one);
* the property compiled mode must keep exactly: AQ-SGD's sender and receiver run the same
  decode-and-stage kernel on the same bytes, so their buffers stay bit-identical, and the
  quantized exchange's decoded gradient is the same on every rank (one kernel, the same
  bytes).

Dry run on the CPU: ``MEGATRON_EXT_GPU_TESTS_DEVICE=cpu`` (compiled C++ kernels, slow).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext import kernels
from megatron_ext.kernels import quant as Q
from tests.helpers.fused_modes import eager_and_compiled

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_kernel_mode")]

BYTES_MISMATCH = 1e-3
VALUES_REL = 1e-6


def _randn(*shape, seed=0, dtype=torch.float32, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _close(a, b, what):
    """Integer tensors: mismatching fraction; floating: relative error (NaN where both)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if not a.dtype.is_floating_point:
        frac = (a != b).double().mean().item() if a.numel() else 0.0
        assert frac <= BYTES_MISMATCH, f"{what}: {frac:.2%} differ"
        return
    a64, b64 = a.double().cpu(), b.double().cpu()
    assert torch.equal(a64.isnan(), b64.isnan()), what
    a64, b64 = a64.nan_to_num(0.0), b64.nan_to_num(0.0)
    den = a64.norm().item()
    err = (a64 - b64).norm().item() / (den or 1.0)
    assert err <= VALUES_REL, f"{what}: relative error {err:.2e}"


def test_sample_kernels_compiled_match_eager_on_device(dev):
    x = _randn(64, 6, 200, seed=1, dtype=torch.bfloat16, device=dev).transpose(0, 1)
    m = _randn(6, 64, 200, seed=2, dtype=torch.bfloat16, device=dev)
    seed = Q.draw_seed(dev, torch.Generator(device=dev).manual_seed(3))
    for args in [
        (x, m, seed, 4, "channel"),  # AQ-SGD's forward delta, stochastic
        (x, None, None, 8, "token"),  # gradients
        (x.float(), None, seed, 3, "microbatch"),  # DirectQ, generic packing
    ]:
        eager, compiled = eager_and_compiled(Q.quant_pack, *args)
        _close(eager, compiled, f"quant_pack {args[3]} bits {args[4]}")
    payload = Q.quant_pack(x, m, seed, 4, "channel")
    out = eager_and_compiled(
        Q.unpack_dequant,
        Q.quant_pack(x, None, None, 8, "token"),
        8,
        "token",
        6,
        64,
        200,
        torch.bfloat16,
    )
    _close(*out, "unpack_dequant")
    recv = eager_and_compiled(Q.aqsgd_decode_stage, payload, m, 4, "channel", torch.bfloat16)
    send = eager_and_compiled(Q.aqsgd_decode_stage, payload, m, 4, "channel", None)
    for i in range(3):
        _close(recv[0][i], recv[1][i], f"decode_stage output {i}")
    # compiled: the sender's and the receiver's graphs stage the very same rows
    for i in range(3):
        assert torch.equal(send[1][i], recv[1][i]), i
    first = eager_and_compiled(Q.aqsgd_stage, x, torch.float16)
    for i in range(3):
        _close(first[0][i], first[1][i], f"aqsgd_stage output {i}")


def test_exchange_kernels_compiled_match_eager_on_device(dev):
    size, part, block, n = 4, 25_000, 256, 99_999
    rows, padded, width, nbytes = Q.rows_layout(part, block, 4)
    grad = _randn(n, seed=4, dtype=torch.bfloat16, device=dev)
    error = _randn(size, padded, seed=5, device=dev, scale=0.01)
    seed = Q.draw_seed(dev)
    send = eager_and_compiled(Q.quantized_encode_rows, grad, error, seed, 4, block, size, part)
    _close(send[0][0], send[1][0], "worker bytes")
    _close(send[0][1], send[1][1], "worker error")
    recv = send[0][0]  # every partition from this rank (the shapes of an all-to-all)
    red = eager_and_compiled(
        Q.quantized_reduce_rows, recv, error[0], seed, 4, block, part, False, True
    )
    _close(red[0][2], red[1][2], "server bytes")
    _close(red[0][3], red[1][3], "server error")
    gathered = torch.stack([red[0][2]] * size)
    outs = []
    for mode in ("off", "on", "on"):
        kernels.set_mode(mode)
        out = torch.empty(n, dtype=torch.float32, device=dev)
        Q.quantized_decode_rows_into(gathered, 4, block, part, out=out)
        outs.append(out)
    _close(outs[0], outs[1], "decoded gradient")
    assert torch.equal(outs[1], outs[2])  # every rank applies the same values


def test_aqsgd_row_kernels_compiled_match_eager_on_device(dev):
    """The kernels on the whole buffer (rows gathered inside, the commit in place): payload,
    activations, rows and flags as the quantizer's tolerances allow; the rows no slot
    addresses untouched."""
    table = _randn(20, 64, 200, seed=4, dtype=torch.bfloat16, device=dev)
    index = torch.tensor([7, 2, 19, 11, 0, 5], device=dev)
    x = _randn(64, 6, 200, seed=5, dtype=torch.bfloat16, device=dev).transpose(0, 1)
    seed = Q.draw_seed(dev, torch.Generator(device=dev).manual_seed(6))
    payload = eager_and_compiled(Q.aqsgd_encode_rows, x, table, index, seed, 4, "channel")
    _close(*payload, "aqsgd_encode_rows")
    out = eager_and_compiled(
        Q.aqsgd_decode_rows, payload[0], table, index, 4, "channel", torch.bfloat16
    )
    _close(*out, "aqsgd_decode_rows")
    tables = [table.clone(), table.clone()]
    kernels.set_mode("off")
    flags_eager = Q.aqsgd_commit_rows(payload[0], tables[0], index, 4, "channel")
    kernels.set_mode("on")
    flags = Q.aqsgd_commit_rows(payload[0], tables[1], index, 4, "channel")
    kernels.set_mode(None)
    _close(tables[0], tables[1], "aqsgd_commit_rows rows")
    for a, b in zip(flags_eager, flags):
        assert torch.equal(a, b)
    rest = torch.ones(20, dtype=torch.bool, device=dev)
    rest[index] = False
    assert torch.equal(tables[1][rest].view(torch.int16), table[rest].view(torch.int16))


def test_aqsgd_boundary_compiled_keeps_both_buffers_identical(dev):
    from tests.helpers.method_steps import NO_MODE, CodecBoundary

    kernels.set_mode("on")
    boundary = CodecBoundary(
        "aqsgd",
        seq=128,
        micro_batch=4,
        hidden=256,
        num_microbatches=2,
        num_samples=16,
        device=dev,
        dtype=torch.bfloat16,
        rounding="stochastic",
    )
    boundary.steps(NO_MODE, 3 * boundary.steps_per_epoch)
    send, recv = boundary.sender.send.contents(), boundary.receiver.recv.contents()
    assert torch.equal(send.view(torch.int16), recv.view(torch.int16))
    assert bool(boundary.sender.send.visited.all())
