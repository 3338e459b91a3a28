"""Test-session setup shared by tests/unit, tests/distributed and tests/megatron.

* Data caches (SentencePiece model, indexed datasets, GPTDataset index files) go to
  ``<repo>/.cache/tests`` (ignored by git) unless ``MEGATRON_EXT_CACHE`` is set, so the
  suite never writes into the user's ``~/.cache`` and reruns reuse the built data.
* ``gpu`` tests are skipped without CUDA (unless ``MEGATRON_EXT_GPU_TESTS_DEVICE`` names
  a device: the CPU dry run of tests/gpu); ``megatron_lm`` tests without a checkout in
  ``MEGATRON_LM_DIR``.
* ``MEGATRON_LM_ARCHIVES=DIR`` (CI: ``.ci/run``), with ``MEGATRON_LM_DIR`` unset: the session
  extracts ``DIR/<tag>.tar.gz`` of the installed megatron-core's Megatron-LM tag into a
  temporary directory, sets ``MEGATRON_LM_DIR`` to it for the tests and the processes they
  start, and removes it at the end (tests/helpers/megatron_lm_archives.py).
* ``--require-megatron-lm`` (CI passes it through ``PYTEST_ADDOPTS``): no checkout is an
  error before any test runs, and a ``megatron_lm`` test that skips fails.
* ``fresh_kernel_mode``: the fused kernels' mode reset around each test of a module that
  asks for it (``pytestmark = pytest.mark.usefixtures("fresh_kernel_mode")``).
* Without triton, megatron-core 0.19's triton kernel modules get megatron-ext's
  stand-ins before any test imports megatron.core (importing ``megatron_ext.megatron``
  does that in every process, as it does for users).
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

os.environ.setdefault("MEGATRON_EXT_CACHE", str(REPO / ".cache" / "tests"))

_REQUIRE = "--require-megatron-lm"


@pytest.fixture
def fresh_kernel_mode(monkeypatch):
    """The fused kernels' mode (megatron_ext/kernels) from nothing: the environment's
    ``--fused-kernels`` variable removed and the mode reset, before and after the test."""
    from megatron_ext import kernels

    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.set_mode(None)
    yield
    kernels.set_mode(None)


def pytest_addoption(parser):
    parser.addoption(
        _REQUIRE,
        action="store_true",
        help="fail, instead of skipping, when no Megatron-LM checkout is given "
        "(MEGATRON_LM_DIR, or MEGATRON_LM_ARCHIVES) or a megatron_lm test skips",
    )


def _has_checkout() -> bool:
    lm_dir = os.environ.get("MEGATRON_LM_DIR")
    return bool(lm_dir) and (Path(lm_dir) / "pretrain_gpt.py").is_file()


def _checkout_from_archives(config) -> None:
    """``MEGATRON_LM_ARCHIVES`` without ``MEGATRON_LM_DIR``: extract this pass's tag."""
    from tests.helpers.megatron_lm_archives import (
        ArchiveError,
        checkout_from_archives,
        installed_release_tag,
    )

    archives = os.environ["MEGATRON_LM_ARCHIVES"]
    tag = installed_release_tag()
    into = Path(tempfile.mkdtemp(prefix=f"megatron-lm-{tag}-"))
    config.add_cleanup(lambda: shutil.rmtree(into, ignore_errors=True))
    try:
        checkout = checkout_from_archives(archives, tag, into)
    except ArchiveError as exc:
        raise pytest.UsageError(f"megatron_lm tests: {exc}") from None
    os.environ["MEGATRON_LM_DIR"] = str(checkout)
    config._megatron_lm_note = f"Megatron-LM {tag} extracted from {archives} into {checkout}"


def pytest_configure(config):
    import megatron_ext.megatron  # noqa: F401 (registers the triton stand-ins where needed)

    if os.environ.get("MEGATRON_LM_ARCHIVES") and not os.environ.get("MEGATRON_LM_DIR"):
        _checkout_from_archives(config)
    if config.getoption(_REQUIRE) and not _has_checkout():
        raise pytest.UsageError(
            f"{_REQUIRE}: no Megatron-LM checkout: set MEGATRON_LM_DIR to a checkout of a "
            "supported tag, or MEGATRON_LM_ARCHIVES to a folder of <tag>.tar.gz source archives"
            + (
                f" (MEGATRON_LM_DIR={os.environ['MEGATRON_LM_DIR']} holds no pretrain_gpt.py)"
                if os.environ.get("MEGATRON_LM_DIR")
                else ""
            )
        )


def pytest_report_header(config):
    note = getattr(config, "_megatron_lm_note", None)
    if note is None and _has_checkout():
        note = f"Megatron-LM checkout: {os.environ['MEGATRON_LM_DIR']}"
    return note


def pytest_collection_modifyitems(config, items):
    import torch

    # tests/gpu runs on the CPU too when MEGATRON_EXT_GPU_TESTS_DEVICE=cpu (a dry run of
    # its test code; tests/gpu/conftest.py).
    has_cuda = torch.cuda.is_available() or bool(os.environ.get("MEGATRON_EXT_GPU_TESTS_DEVICE"))
    has_lm = _has_checkout()
    for item in items:
        # get_closest_marker, not item.keywords: the tests/megatron_lm folder name is a
        # keyword too, and would skip the tests there that need no checkout.
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("megatron_lm") and not has_lm:
            item.add_marker(
                pytest.mark.skip(reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``--require-megatron-lm``, a ``megatron_lm`` test that skips (a fixture's own
    ``pytest.skip``, e.g. no dataset helpers for a patched copy) fails instead."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and item.config.getoption(_REQUIRE)
        and item.get_closest_marker("megatron_lm")
        and not hasattr(report, "wasxfail")
    ):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"{_REQUIRE}: this megatron_lm test skipped: {reason}"
