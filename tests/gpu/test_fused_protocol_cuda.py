"""Protocol's fused codec kernels compiled against eager on the device under test.

``tests/unit/test_kernels_subspace.py`` checks them on the CPU; here the same comparison
(``tests/helpers/kernels_subspace.py``: packed and decoded ids bit for bit, values within
one unit in the last place of 16-bit outputs, ``1e-6`` in fp32, non-finite places kept)
runs on CUDA, where ``--fused-kernels auto`` compiles them (Triton around cuBLAS's matmul).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.kernels import fused_unavailable
from tests.helpers.kernels_subspace import compare_codec_kernels

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_protocol_kernels_compiled_equal_eager(dtype, dev):
    why = fused_unavailable(dev.type)
    if why:
        pytest.skip(why)
    compare_codec_kernels(dev, dtype, lead=(512, 3), d=256, k=16)
    compare_codec_kernels(dev, dtype, lead=(7, 2), d=40, k=3, nonfinite=True)
