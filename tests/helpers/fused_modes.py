"""The fused kernels (megatron_ext/kernels) run eager and compiled in one test, and compared.

* :func:`eager_and_compiled`: an op's result eager (mode "off") and compiled (mode "on").
* :func:`seeded_randn`: a reproducible normal tensor (CPU generator) in a given dtype.
* :func:`assert_same`: bitwise equality, NaN == NaN, dtype and shape included.
"""

from __future__ import annotations

import torch

from megatron_ext import kernels


def eager_and_compiled(op, *args, **kwargs):
    """``op(*args, **kwargs)`` eager and compiled (mode "off", then "on"; a recompile past
    dynamo's limit fails instead of running eager in silence); the mode is reset after."""
    kernels.set_mode("off")
    eager = op(*args, **kwargs)
    kernels.set_mode("on")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = op(*args, **kwargs)
    kernels.set_mode(None)
    return eager, compiled


def seeded_randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    """``randn(*shape) * scale`` from a generator seeded with ``seed``, cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_same(a, b, what):
    """Bitwise equality (NaN == NaN), dtype and shape included; tuples and lists item by item."""
    if isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)
    else:
        assert torch.equal(a, b), what
