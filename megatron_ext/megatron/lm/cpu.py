"""Run Megatron-LM's ``megatron.training`` (``pretrain_gpt.py``) on CPU with gloo.

What it does:
    On top of :func:`megatron_ext.megatron.cpu.enable_cpu_execution` (megatron-core's CUDA
    calls redirected to CPU), :func:`enable_megatron_lm_cpu` takes care of what
    Megatron-LM's training package adds:

    * ``megatron/training/initialize.py`` imports
      ``megatron.core.transformer.custom_layers.batch_invariant_kernels``, and megatron-core
      0.19's pipeline schedules import ``megatron.core.transformer.moe.ops.paged_stash``
      (MoE paged stash); both import triton at module level. Without triton a stand-in
      module with the same public names is registered for each (batch-invariant mode and
      the paged stash stay unavailable and say so if used);
    * ``initialize_megatron`` (as ``pretrain()`` calls it through
      ``megatron.training.training``) gets ``allow_no_cuda=True``;
    * ``megatron.legacy.fused_kernels.load`` (needs ``CUDA_HOME``/nvcc) becomes a no-op
      (core_v0.16; 0.19 has no ``megatron/legacy`` and loads no fused kernels);
    * ``megatron.core.datasets.utils.compile_helpers`` skips the build when
      ``helpers_cpp`` already imports (the megatron-core wheel ships it prebuilt but no
      Makefile), and otherwise builds it with *this* interpreter's pybind11 include path
      and extension suffix (the Makefile's ``python3`` can resolve to another Python, e.g.
      through a checkout's ``.python-version``).

    The environment gets ``TORCHDYNAMO_DISABLE=1`` and ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    (Megatron's fused elementwise ops are torch.compile'd; ``validate_args`` asserts the
    connections setting for TP > 1).

Why:
    To debug a Megatron-LM launch line (parallel layout, megatron-ext flags, checkpoints)
    on a laptop, and to test megatron-ext's Megatron-LM integration on CPU-only CI.

Constraints:
    * Off unless asked: ``megatron-ext pretrain --cpu`` or ``MEGATRON_EXT_CPU=1`` (read by
      :func:`megatron_ext.megatron.lm.install_megatron_lm_hooks`). With CUDA present it
      does nothing and says so.
    * Must run before ``megatron.training`` is first imported where triton is missing
      (``initialize.py`` fails to import otherwise).
    * The Megatron-LM flags CPU execution needs are checked after argument parsing
      (:data:`CPU_REQUIRED_FLAGS`: a run missing any of them is refused with one message
      naming every missing one, rather than changed behind the user's back, because each
      has a GPU meaning a launch line may have been written for). Fused paths that exist
      only as CUDA kernels and whose unfused path computes the same values are switched off
      instead (:data:`CPU_UNFUSED`: ``--no-masked-softmax-fusion``: with ``--bf16``/``--fp16``
      the fused softmax imports ``scaled_masked_softmax_cuda`` at the first forward;
      ``--no-rope-fusion``: with ``--position-embedding-type rope`` the fused RoPE needs
      Transformer Engine, also at the first forward). The limits of
      :mod:`megatron_ext.megatron.cpu` apply.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
from typing import Any, List, Optional, Tuple

from megatron_ext.config import ConfigError
from megatron_ext.megatron.cpu import register_triton_stand_ins
from megatron_ext.megatron.patching import ActiveInstall, AttributePatches

__all__ = [
    "CPU_ENV_VAR",
    "CPU_REQUIRED_FLAGS",
    "CPU_UNFUSED",
    "MegatronLMCpuHandle",
    "cpu_requested_by_env",
    "no_cuda_message",
    "enable_megatron_lm_cpu",
    "disable_megatron_lm_cpu",
    "check_cpu_args",
    "register_triton_stand_ins",
]

logger = logging.getLogger(__name__)

CPU_ENV_VAR = "MEGATRON_EXT_CPU"
"""Environment variable that switches CPU execution on for a patched pretrain_gpt.py."""


# (flag, args attribute, value CPU execution needs)
CPU_REQUIRED_FLAGS: Tuple[Tuple[str, str, Any], ...] = (
    ("--distributed-backend gloo", "distributed_backend", "gloo"),
    ("--transformer-impl local", "transformer_impl", "local"),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    ("--no-persist-layer-norm", "no_persist_layer_norm", True),
)


# (flag, args attribute, value): CUDA-only fused paths whose unfused path gives the same
# values; CPU execution sets them itself.
CPU_UNFUSED: Tuple[Tuple[str, str, Any], ...] = (
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    ("--no-rope-fusion", "apply_rope_fusion", False),
)


def cpu_requested_by_env() -> bool:
    """Whether ``MEGATRON_EXT_CPU`` asks for CPU execution (1/true/yes/on)."""
    return os.environ.get(CPU_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def no_cuda_message(how: str) -> Optional[str]:
    """The refusal for a GPU run on a machine where torch sees no CUDA device, else None.

    Megatron-LM's ``initialize_megatron`` would stop with a bare ``AssertionError: Megatron
    requires CUDA.`` (or, before it, an import error about triton, which only GPU builds
    bring); the fix is CPU execution, named here.

    Args:
        how: how this launch switches CPU execution on (``"--cpu"``, ``"MEGATRON_EXT_CPU=1"``).
    """
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"torch sees no CUDA device ({torch.__version__}) and CPU execution is off: Megatron-LM "
        f"needs CUDA unless megatron-ext runs it on CPU. To run here, add {how} and the flags "
        "CPU execution needs: "
        + " ".join(flag for flag, _, _ in CPU_REQUIRED_FLAGS)
        + " (configs/megatron_lm/gpt_tiny_separate_cpu.yaml has them)"
    )


def _compile_helpers() -> None:
    """megatron.core.datasets.utils.compile_helpers for CPU runs (see module docstring)."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError:
        pass
    import megatron.core.datasets as datasets

    folder = os.path.dirname(os.path.abspath(datasets.__file__))
    try:
        import pybind11
    except ImportError:
        raise RuntimeError(
            f"megatron.core.datasets.helpers_cpp is not built in {folder} and pybind11 is not "
            "installed to build it: pip install pybind11 (or use a megatron-core wheel, which "
            "ships it prebuilt)"
        ) from None
    includes = f"-I{pybind11.get_include()} -I{sysconfig.get_paths()['include']}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    command = ["make", "-C", folder, f"CPPFLAGS={includes}", f"LIBEXT={suffix}"]
    result = subprocess.run(command)
    if result.returncode != 0:
        raise RuntimeError(f"building helpers_cpp failed: {' '.join(command)}")


class MegatronLMCpuHandle:
    """The installed Megatron-LM CPU redirections; ``remove()`` restores them."""

    def __init__(self):
        self._patches = AttributePatches()
        self._stubbed_modules: list = []

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering the old value."""
        self._patches.set(owner, name, value)

    def remove(self) -> None:
        """Undo the Megatron-LM part (megatron-core's CPU execution stays on)."""
        self._patches.restore()
        for name in self._stubbed_modules:
            sys.modules.pop(name, None)
        self._stubbed_modules.clear()


_ACTIVE: ActiveInstall[MegatronLMCpuHandle] = ActiveInstall()


def _module_exists(name: str) -> bool:
    """Whether ``name``'s file exists, without importing it (its parents are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def enable_megatron_lm_cpu() -> Optional[MegatronLMCpuHandle]:
    """Switch on CPU execution of megatron-core and Megatron-LM's training package.

    Idempotent. Call before ``megatron.training`` is imported.

    Returns:
        The handle (CPU execution is forced: the caller asked for it).
    """
    if _ACTIVE.handle is not None:
        return _ACTIVE.handle
    import torch

    from megatron_ext.megatron.cpu import enable_cpu_execution

    handle = MegatronLMCpuHandle()
    if not torch.cuda.is_available():
        # Before enable_cpu_execution: it imports megatron.core, whose __init__ reaches 0.19's
        # schedules (and their paged-stash triton kernels).
        handle._stubbed_modules.extend(register_triton_stand_ins())
    if not enable_cpu_execution(force=True):  # MEGATRON_EXT_CPU=1 / --cpu: asked for
        handle.remove()
        return None
    training = importlib.import_module("megatron.training.training")
    handle.replace(
        training,
        "initialize_megatron",
        functools.partial(training.initialize_megatron, allow_no_cuda=True),
    )
    if _module_exists("megatron.legacy.fused_kernels"):  # core_v0.16; gone in 0.19
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
        handle.replace(fused_kernels, "load", lambda args: None)
    dataset_utils = importlib.import_module("megatron.core.datasets.utils")
    handle.replace(dataset_utils, "compile_helpers", _compile_helpers)
    _ACTIVE.handle = handle
    return handle


def disable_megatron_lm_cpu() -> None:
    """Undo :func:`enable_megatron_lm_cpu` (megatron-core's CPU execution stays on)."""
    _ACTIVE.remove()


def check_cpu_args(args: Any) -> List[str]:
    """Check and complete Megatron-LM's parsed args for CPU execution.

    Sets the :data:`CPU_UNFUSED` flags (CUDA-only fusions) and checks
    :data:`CPU_REQUIRED_FLAGS`.

    Args:
        args: Megatron-LM's parsed and validated args (changed in place).

    Returns:
        The flags it set (for the start-up log), e.g. ``["--no-masked-softmax-fusion"]``.

    Raises:
        ConfigError: naming every required flag that is missing.
    """
    missing = [flag for flag, attr, value in CPU_REQUIRED_FLAGS if getattr(args, attr) != value]
    if missing:
        raise ConfigError(
            [m.split()[0] for m in missing],
            "CPU execution (megatron-ext --cpu / MEGATRON_EXT_CPU=1) needs "
            + " ".join(missing)
            + " (no NCCL, Transformer Engine or Apex on CPU)",
        )
    changed = []
    for flag, attr, value in CPU_UNFUSED:
        if getattr(args, attr, value) != value:
            setattr(args, attr, value)
            changed.append(flag)
    return changed
