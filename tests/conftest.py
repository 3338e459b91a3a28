"""Test-session setup shared by tests/unit, tests/distributed and tests/megatron.

* Data caches (SentencePiece model, indexed datasets, GPTDataset index files) go to
  ``<repo>/.cache/tests`` (ignored by git) unless ``MEGATRON_EXT_CACHE`` is set, so the
  suite never writes into the user's ``~/.cache`` and reruns reuse the built data.
* ``gpu`` tests are skipped without CUDA (unless ``MEGATRON_EXT_GPU_TESTS_DEVICE`` names
  a device: the CPU dry run of tests/gpu); ``megatron_lm`` tests without a checkout in
  ``MEGATRON_LM_DIR``.
* Without triton, megatron-core 0.19's triton kernel modules get megatron-ext's
  stand-ins before any test imports megatron.core (importing ``megatron_ext.megatron``
  does that in every process, as it does for users).
"""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEGATRON_EXT_CACHE", str(REPO / ".cache" / "tests"))


def pytest_configure(config):
    import megatron_ext.megatron  # noqa: F401 (registers the triton stand-ins where needed)


def pytest_collection_modifyitems(config, items):
    import torch

    # tests/gpu runs on the CPU too when MEGATRON_EXT_GPU_TESTS_DEVICE=cpu (a dry run of
    # its test code; tests/gpu/conftest.py).
    has_cuda = torch.cuda.is_available() or bool(os.environ.get("MEGATRON_EXT_GPU_TESTS_DEVICE"))
    lm_dir = os.environ.get("MEGATRON_LM_DIR")
    has_lm = bool(lm_dir) and (Path(lm_dir) / "pretrain_gpt.py").is_file()
    for item in items:
        # get_closest_marker, not item.keywords: the tests/megatron_lm folder name is a
        # keyword too, and would skip the tests there that need no checkout.
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("megatron_lm") and not has_lm:
            item.add_marker(
                pytest.mark.skip(reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
            )
