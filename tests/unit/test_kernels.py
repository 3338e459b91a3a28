"""The fused-kernel policy (megatron_ext.kernels): which mode runs compiled, and refusals.

Each kernel's own test (compiled against eager, its traffic in the cost model) is in a
``tests/unit/test_kernels_<topic>.py`` of its own.
"""

import pytest
import torch

from megatron_ext import kernels
from megatron_ext.config import (
    ConfigError,
    ParallelLayout,
    ext_config_from_flags,
    validate_ext_config,
)

pytestmark = pytest.mark.usefixtures("fresh_kernel_mode")


def test_modes_decide_per_device(monkeypatch):
    cpu = torch.zeros(2)
    meta = torch.zeros(2, device="meta")
    assert kernels.mode() == "auto" and not kernels.use_fused(cpu) and not kernels.use_fused(meta)
    monkeypatch.setenv(kernels.ENV_VAR, "on")
    assert kernels.mode() == "on" and kernels.use_fused(cpu)
    kernels.set_mode("off")  # the flag wins over the environment
    assert not kernels.use_fused(cpu)
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    kernels.set_mode(None)
    with pytest.raises(ValueError, match="MEGATRON_EXT_FUSED_KERNELS: expected one of auto"):
        kernels.mode()


def test_on_is_refused_naming_the_flag_where_compile_cannot_run(monkeypatch):
    monkeypatch.setattr(kernels, "fused_unavailable", lambda device="cpu": "no C++ compiler")
    with pytest.raises(ValueError, match="--fused-kernels on: no C\\+\\+ compiler"):
        kernels.set_mode("on")
    cfg = ext_config_from_flags(["--fused-kernels", "on"])
    with pytest.raises(ConfigError, match="^--fused-kernels: 'on' compiles CPU kernels too"):
        validate_ext_config(cfg, ParallelLayout())
    validate_ext_config(ext_config_from_flags(["--fused-kernels", "auto"]), ParallelLayout())


def _axpy(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    return a * x + y


def test_run_compiles_where_the_mode_says_and_agrees_with_eager(monkeypatch):
    compiled_fns = []
    real = kernels._compiled

    def spy(fn):
        compiled_fns.append(fn)
        return real(fn)

    monkeypatch.setattr(kernels, "_compiled", spy)
    x, y = torch.randn(1000), torch.randn(1000)
    eager = kernels.run(_axpy, x, y, 3.0)
    assert compiled_fns == []
    kernels.set_mode("on")
    compiled = kernels.run(_axpy, x, y, 3.0)
    assert compiled_fns == [_axpy]
    # inductor may fuse a * x + y into one multiply-add: within one rounding of the result
    torch.testing.assert_close(compiled, eager, rtol=2**-23, atol=0)
