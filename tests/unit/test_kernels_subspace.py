"""Protocol's fused codec kernels (``megatron_ext.kernels.subspace``) on the CPU.

Eager is the codec's chain as it always ran, bit for bit; compiled (``torch.compile``,
C++ on the CPU) equals eager within ``tests/helpers/kernels_subspace.py``'s tolerances in
every dtype a Protocol pipeline carries (fp32, bf16, fp16), with token ids that are NaN and
infinity patterns of the 16-bit payload, odd sizes, one token, and non-finite activations.
The same comparison runs on CUDA in ``tests/gpu/test_fused_protocol_cuda.py``. Compile time dominates
this file (about 4 s per op and dtype on two loaded cores).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.kernels import fused_unavailable
from tests.helpers.kernels_subspace import VOCAB, compare_codec_kernels

CPU = torch.device("cpu")


def test_eager_ops_are_the_codec_chain_bit_for_bit():
    from megatron_ext import kernels
    from megatron_ext.compressors.subspace import orthonormal_basis
    from megatron_ext.kernels import subspace as ops

    gen = torch.Generator().manual_seed(0)
    u = orthonormal_basis(16, 3, seed=1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        fixed = torch.randn(VOCAB, 16, generator=gen).to(dtype)
        ids = torch.randint(VOCAB, (4, 2), generator=gen)
        x, g = (torch.randn(4, 2, 16, generator=gen).to(dtype) for _ in range(2))
        c = (x.float() - fixed[ids].float()) @ u
        packed = ids.to(torch.int32).view(dtype).reshape(-1)
        payload = torch.cat([c.to(dtype).reshape(-1), packed])
        gc = (g.reshape(-1, 16).float() @ u).to(dtype).reshape(-1)
        kernels.set_mode("off")
        try:
            assert torch.equal(
                ops.encode(x, ids, fixed, u).view(torch.uint8), payload.view(torch.uint8)
            )
            xd, idd = ops.decode(payload, fixed, u, [4, 2], dtype)
            cd = payload[:24].float().reshape(4, 2, 3)
            assert torch.equal(xd, (cd @ u.t() + fixed[ids].float()).to(dtype))
            assert torch.equal(idd, ids)
            assert torch.equal(ops.coords(g, u), gc)
            lifted = (gc.float().reshape(4, 2, 3) @ u.t()).to(dtype)
            assert torch.equal(ops.lift(gc, u, [4, 2], dtype), lifted)
        finally:
            kernels.set_mode(None)


@pytest.mark.skipif(bool(fused_unavailable("cpu")), reason=str(fused_unavailable("cpu")))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_equals_eager(dtype):
    compare_codec_kernels(CPU, dtype, lead=(5, 3))
    compare_codec_kernels(CPU, dtype, lead=(7, 2), d=40, k=3, nonfinite=True)
    if dtype == torch.float32:
        compare_codec_kernels(CPU, dtype, lead=(1, 1))  # one token (sizes of 1 specialize)
