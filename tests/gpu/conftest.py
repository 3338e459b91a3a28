"""Fixtures of the ``gpu`` test set: the device under test and a world-size-1 process group.

The device under test is CUDA when available. With ``MEGATRON_EXT_GPU_TESTS_DEVICE=cpu`` the
same tests run on the CPU against the CPU reference (a dry run of the test code itself on a
machine without a GPU: every comparison then holds trivially up to run-to-run determinism,
and sync capture is a no-op that says so). Without CUDA and without that variable
``tests/conftest.py`` skips them.
"""

import os

import pytest
import torch

ENV = "MEGATRON_EXT_GPU_TESTS_DEVICE"


def device_under_test() -> torch.device:
    """CUDA, or the CPU when ``MEGATRON_EXT_GPU_TESTS_DEVICE=cpu`` (the dry run)."""
    forced = os.environ.get(ENV)
    if forced:
        return torch.device(forced)
    return torch.device("cuda")


@pytest.fixture(scope="session")
def dev() -> torch.device:
    return device_under_test()


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 matmuls in full precision on CUDA (TF32 off), restored afterwards."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def pg(dev):
    """A world-size-1 process group in this process: gloo for CPU tensors, NCCL for CUDA
    tensors (one group, one backend per device type), destroyed after the module."""
    import torch.distributed as dist

    from tests.helpers.dist import free_port

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()
