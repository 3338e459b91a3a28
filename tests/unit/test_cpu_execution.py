"""megatron_ext.megatron.cpu: what the CPU redirections do, and that they undo cleanly.

Runs in a subprocess so the process-wide switch cannot leak into other tests.
"""

import subprocess
import sys
import textwrap


def _run(code):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_redirections_and_removal():
    out = _run("""
        import torch
        from megatron_ext.megatron.cpu import (
            disable_cpu_execution, enable_cpu_execution, is_cpu_execution_enabled)
        assert enable_cpu_execution() is True and is_cpu_execution_enabled()
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert x.cuda() is x and x.to("cuda:0").device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64
        assert torch.cuda.device_count() == 1
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
        torch.cuda.synchronize()
        # The "CUDA" generator is the CPU generator.
        torch.cuda.manual_seed(5)
        a = torch.rand(3)
        torch.manual_seed(5)
        assert torch.equal(a, torch.rand(3))
        # megatron's tensor-parallel RNG tracker forks and restores states on CPU.
        from megatron.core.tensor_parallel import random as mp_random
        mp_random.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = mp_random.get_cuda_rng_tracker()
        before = torch.get_rng_state()
        with tracker.fork():
            inside = torch.rand(2)
        assert torch.equal(torch.get_rng_state(), before)
        with tracker.fork():
            inside2 = torch.rand(2)
        assert not torch.equal(inside, inside2)  # the tracker state advanced
        disable_cpu_execution()
        assert not is_cpu_execution_enabled()
        assert torch.cuda.device_count() == 0
        try:
            torch.zeros(1, device="cuda")
        except (RuntimeError, AssertionError):
            print("restored")
        """)
    assert "restored" in out


def test_noop_when_cuda_is_available():
    out = _run("""
        import torch
        torch.cuda.is_available = lambda: True
        from megatron_ext.megatron.cpu import enable_cpu_execution, is_cpu_execution_enabled
        assert enable_cpu_execution() is False
        assert not is_cpu_execution_enabled()
        assert torch.cuda.device_count() == 0  # nothing was replaced
        print("noop")
        """)
    assert "noop" in out
