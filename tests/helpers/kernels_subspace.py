"""Protocol's fused codec kernels compiled against eager, on any device (unit and GPU tests).

:func:`compare_codec_kernels` runs the four ops of ``megatron_ext.kernels.subspace`` eager
(``--fused-kernels off``, the reference: the codec's chain as it always ran) and compiled
(``on``) on the same inputs and checks:

* the packed token ids and the decoded ids bit for bit, with ids whose 16-bit halves are NaN
  or infinity patterns of bf16/fp16 (a compiled kernel that treated them as floats could
  canonicalize them);
* the floating values within ``tol(dtype)``: fp32 within ``1e-6`` relative (the compiled
  function computes the same fp32 products; only a fused multiply-add may round
  differently), 16-bit outputs within one unit in the last place of the dtype (rounded from
  fp32 values that agree to ``1e-6``);
* non-finite inputs (an inf and a NaN in the activation) non-finite at the same places.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

# Ids whose int32 halves are special 16-bit float patterns: bf16 NaN 0x7FC0 and 0xFF81,
# fp16 NaN 0x7E00, infinities 0x7F80 (bf16) and 0x7C00 (fp16), a high half of 1.
SPECIAL_IDS = (0x7FC0, 0xFF81, 0x7E00, 0x7F80, 0x7C00, 0xFFFF, 0x10000 + 0x7FC0, 0, 1)
VOCAB = 0x10000 + 0x8000


def tol(dtype: torch.dtype) -> float:
    """Relative tolerance of a compiled output against eager (module docstring)."""
    return 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite), f"{what}: non-finite places differ"
    torch.testing.assert_close(
        out[finite].double(), ref[finite].double(), rtol=tol(dtype), atol=1e-7, msg=what
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def compare_codec_kernels(
    device: torch.device,
    dtype: torch.dtype,
    lead: Sequence[int] = (5, 3),
    d: int = 24,
    k: int = 5,
    nonfinite: bool = False,
) -> None:
    """Compiled against eager for one dtype and shape (module docstring)."""
    from megatron_ext import kernels
    from megatron_ext.compressors.subspace import orthonormal_basis
    from megatron_ext.kernels import subspace as ops

    lead = list(lead)
    tokens = math.prod(lead)
    gen = torch.Generator().manual_seed(tokens * 31 + d)
    u = orthonormal_basis(d, k, seed=tokens).to(device)
    fixed = (torch.randn(VOCAB, d, generator=gen) * 0.02).to(device, dtype)
    ids = torch.randint(VOCAB, (tokens,), generator=gen)
    ids[: min(tokens, len(SPECIAL_IDS))] = torch.tensor(SPECIAL_IDS[:tokens])
    ids = ids.reshape(lead).to(device)
    v = torch.randn(*lead, d, generator=gen).to(device) @ u @ u.t()
    x = (fixed[ids].float() + v).to(dtype)
    g = torch.randn(*lead, d, generator=gen).to(device, dtype)
    if nonfinite:
        x.view(-1)[0], x.view(-1)[-1] = float("inf"), float("nan")
        g.view(-1)[d] = float("nan")
    out = {}
    try:
        for mode in ("off", "on"):
            kernels.set_mode(mode)
            payload = ops.encode(x, ids, fixed, u)
            c = ops.coords(g, u)
            out[mode] = (payload, c)
            if mode == "off":
                ref_payload, ref_c = payload, c
            # the receivers decode the reference payloads (the sender's bits)
            out[mode] += ops.decode(ref_payload, fixed, u, lead, dtype)
            out[mode] += (ops.lift(ref_c, u, lead, dtype),)
    finally:
        kernels.set_mode(None)
    (p0, c0, x0, i0, l0), (p1, c1, x1, i1, l1) = out["off"], out["on"]
    cut = tokens * k
    assert p1.shape == p0.shape and p1.dtype == dtype
    assert torch.equal(_bits(p1[cut:]), _bits(p0[cut:])), "packed ids differ"
    assert torch.equal(i1, i0) and torch.equal(i0, ids.long()), "decoded ids differ"
    _close(p1[:cut], p0[:cut], dtype, "encode")
    _close(x1, x0, dtype, "decode")
    _close(c1, c0, dtype, "coords")
    _close(l1, l0, dtype, "lift")
    if nonfinite:
        assert not torch.isfinite(p0[:cut]).all() and not torch.isfinite(c0).all()
