"""Run real megatron-core (and Megatron-LM) on CPU with the gloo backend.

What it does:
    megatron-core assumes CUDA in a few dozen places: ``device="cuda"`` literals,
    ``torch.cuda.current_device()`` as an allocation device, CUDA streams and events around
    collectives, the CUDA RNG tracker of tensor parallelism, ``param.type() ==
    'torch.cuda.FloatTensor'`` checks in the optimizer and gradient clipping. This module
    redirects exactly those calls so that the *unmodified* library code (GPTModel, DDP with
    and without overlapped reduction and the distributed optimizer, the pipeline schedules,
    tensor parallelism, the Megatron optimizer, dist_checkpointing) runs on CPU tensors:

    * a ``TorchFunctionMode`` maps every ``device=`` argument naming CUDA (``"cuda"``,
      ``"cuda:N"``, an int, ``torch.device("cuda")``) to CPU, makes ``Tensor.cuda()`` and
      ``Tensor.pin_memory()`` return the tensor itself, rewrites ``Tensor.to("cuda")`` and
      reports ``Tensor.type()`` as the ``torch.cuda.*Tensor`` string Megatron expects;
    * ``torch.cuda`` gets CPU stand-ins: one "device" (``device_count() == 1``, which
      megatron needs to initialize model parallelism and its RNG tracker), no-op streams and
      events, zero memory statistics, and an RNG whose state *is* the CPU generator's;
    * megatron-core's ``tensor_parallel.random`` reads and writes that RNG state, so the
      tensor-parallel RNG tracker forks and restores states exactly as on a GPU.

Why:
    Users debug parallel layouts on a laptop, and our tests run the real library code paths
    on CI machines without GPUs. Nothing is mocked: the math and the collectives are
    megatron-core's own; only device placement, streams and RNG plumbing are redirected.

Constraints and limits (also listed in docs/getting-started.md, CPU execution):
    * Off by default. ``enable_cpu_execution()`` switches it on; when CUDA is available it
      does nothing and says so, so GPU runs are never altered, unless ``force=True``: the
      driver's ``--cpu`` and Megatron-LM's ``MEGATRON_EXT_CPU=1`` are explicit requests and
      force it (without, a GPU machine put the model on the GPU and the batches on the CPU;
      seen on an H100).
    * One process-wide switch; install before megatron-core allocates tensors.
    * Only the local (non Transformer-Engine) layer spec works; run with
      ``gradient_accumulation_fusion=False`` (Apex's fused wgrad kernel is CUDA-only).
    * Not usable on CPU: sequence parallelism (needs TE/Apex norms), the interleaved schedule
      with overlapped P2P (nondeterministic on gloo), loading distributed-optimizer
      checkpoints through Megatron-LM's torch_dist path without TE/Apex.
    * Dropout draws from the CPU generator for both the "CPU" and the "CUDA" stream of
      random numbers, so dropout masks differ from a GPU run with the same seed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.megatron.patching import ActiveInstall, AttributePatches

__all__ = [
    "enable_cpu_execution",
    "disable_cpu_execution",
    "is_cpu_execution_enabled",
    "register_triton_stand_ins",
]

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")

# Tensor.type() strings Megatron compares against, keyed by dtype.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device: Any) -> bool:
    """True if ``device`` names a CUDA device (as a str, int or torch.device)."""
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "CUDA device N" in torch's device arguments; bool is not a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments of torch functions to CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            name = _CUDA_TYPE_NAMES.get(tensor.dtype)
            if name is not None and tensor.device.type == "cpu":
                return name
        elif func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        elif func is torch.Tensor.to:
            args = tuple(_map_device(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        return func(*args, **kwargs)


class _Stream:
    """CPU stand-in for ``torch.cuda.Stream``: all work is synchronous on CPU."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    """CPU stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _DeviceProperties:
    name = "cpu"
    major = 9
    minor = 0
    total_memory = 0
    multi_processor_count = 1


def _returning(value: Any) -> Callable[..., Any]:
    """A fresh function object returning ``value``.

    Every stand-in must be a distinct object: torch._dynamo's trace rules index
    ``torch.cuda`` functions by identity and reject one object registered under two names.
    """

    def stand_in(*args, **kwargs):
        return value() if callable(value) else value

    return stand_in


def _stream_context(stream=None):
    return contextlib.nullcontext(stream)


def _cuda_stand_ins() -> Dict[str, Any]:
    """Attributes of ``torch.cuda`` replaced while CPU execution is on."""
    return {
        # Megatron allocates on torch.cuda.current_device(); the mode maps the int to CPU.
        "current_device": _returning(0),
        # Model-parallel initialization and RNG seeding run only when device_count() > 0.
        "device_count": _returning(1),
        "set_device": _returning(None),
        "synchronize": _returning(None),
        "empty_cache": _returning(None),
        "ipc_collect": _returning(None),
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": _returning(_Stream),
        "default_stream": _returning(_Stream),
        "set_stream": _returning(None),
        "stream": _stream_context,
        "get_device_capability": _returning((9, 0)),
        "get_device_properties": _returning(_DeviceProperties),
        "get_device_name": _returning("cpu"),
        "memory_allocated": _returning(0),
        "max_memory_allocated": _returning(0),
        "memory_reserved": _returning(0),
        "max_memory_reserved": _returning(0),
        "reset_peak_memory_stats": _returning(None),
        "reset_max_memory_allocated": _returning(None),
        "memory_stats": _returning(dict),
        # The "CUDA" generator is the CPU generator: same state, same seeding.
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.random.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.random.default_generator.manual_seed(int(seed)),
        "seed": _returning(None),
        "seed_all": _returning(None),
        "initial_seed": lambda: torch.initial_seed(),
    }


def _megatron_stand_ins() -> List[Tuple[str, str, Any]]:
    """(module, attribute, replacement) for megatron-core's CUDA-only helpers."""

    def get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return [
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", get_cuda_rng_state),
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", set_cuda_rng_state),
    ]


class _ExpectedRngWarningFilter(logging.Filter):
    """Drops the tracker's "CPU RNG state changed" warning, expected by construction here.

    The tensor-parallel RNG tracker warns when the CPU generator changes inside a forked
    "CUDA" RNG region; with the CUDA generator emulated by the CPU generator it always does.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


class _CpuExecution:
    """The installed redirections; ``remove()`` restores every replaced attribute."""

    def __init__(self):
        self._patches = AttributePatches()
        self._mode: Optional[_CudaToCpuMode] = None
        self._filter = _ExpectedRngWarningFilter()

    def install(self) -> None:
        # Build dynamo's identity-keyed rule map while torch.cuda still holds the originals.
        importlib.import_module("torch._dynamo.trace_rules").get_torch_obj_rule_map()
        for name, value in _cuda_stand_ins().items():
            self._patches.set(torch.cuda, name, value)
        if hasattr(torch.cuda, "random"):
            self._patches.set(torch.cuda.random, "get_rng_state", torch.cuda.get_rng_state)
            self._patches.set(torch.cuda.random, "set_rng_state", torch.cuda.set_rng_state)
        for module_name, attr, value in _megatron_stand_ins():
            module = importlib.import_module(module_name)
            self._patches.set(module, attr, value)
        self._patches.set(importlib.import_module("torch._dynamo.config"), "disable", True)
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(self._filter)
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()

    def remove(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(self._filter)
        self._patches.restore()


_ACTIVE: ActiveInstall[_CpuExecution] = ActiveInstall()


def is_cpu_execution_enabled() -> bool:
    """Whether ``enable_cpu_execution()`` has installed the CPU redirections."""
    return _ACTIVE.handle is not None


_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _stand_in_module(name: str, feature: str) -> Tuple[types.ModuleType, Callable[..., Any]]:
    """An empty stand-in module ``name`` and the function its triton kernels become: it
    raises that ``feature`` needs triton."""
    module = types.ModuleType(name)
    module.__doc__ = "megatron-ext CPU stand-in: triton is not installed."

    def unavailable(*args, **kwargs):
        raise RuntimeError(
            f"{feature} needs triton (a GPU build); megatron-ext's CPU execution replaced {name}"
        )

    return module, unavailable


def _batch_invariant_stand_in() -> types.ModuleType:
    """Module with the public names of batch_invariant_kernels, for machines without triton."""
    module, unavailable = _stand_in_module(_BATCH_INVARIANT, "--batch-invariant-mode")

    @contextlib.contextmanager
    def set_batch_invariant_mode(enabled: bool = True):
        if enabled:
            unavailable()
        yield

    module.is_batch_invariant_mode_enabled = lambda: False
    module.enable_batch_invariant_mode = unavailable
    module.disable_batch_invariant_mode = lambda: None
    module.set_batch_invariant_mode = set_batch_invariant_mode
    return module


def _paged_stash_stand_in() -> types.ModuleType:
    """Module with the public names of moe.ops.paged_stash (0.19), for machines without triton."""
    module, unavailable = _stand_in_module(_PAGED_STASH_OPS, "the MoE paged stash")
    module.GLOBAL_BLOCK_SIZE = 1024
    module.paged_stash_copy_kernel = unavailable
    module.paged_stash_pop_kernel = unavailable
    return module


# Modules that import triton at module level, with their stand-ins.
_TRITON_STAND_INS = {
    _BATCH_INVARIANT: _batch_invariant_stand_in,
    _PAGED_STASH_OPS: _paged_stash_stand_in,
}


def register_triton_stand_ins() -> List[str]:
    """Without triton, register the stand-ins of the modules that import it (see module
    docstring) unless already imported; returns the names registered.

    Must run before megatron-core imports them (0.19: ``import megatron.core`` already
    does); the modules are not looked up first, so a name a release lacks is never imported.
    Batch-invariant mode and the MoE paged stash stay unavailable and say so if used.
    """
    if importlib.util.find_spec("triton") is not None:
        return []
    registered = []
    for name, stand_in in _TRITON_STAND_INS.items():
        if name not in sys.modules:
            sys.modules[name] = stand_in()
            registered.append(name)
    return registered


def enable_cpu_execution(force: bool = False) -> bool:
    """Switch on CPU execution of megatron-core (idempotent).

    Args:
        force: install even when CUDA is available (an explicit --cpu / MEGATRON_EXT_CPU=1).

    Returns:
        True if the redirections are active after the call, False if CUDA is present and
        nothing was changed.
    """
    if _ACTIVE.handle is not None:
        return True
    if torch.cuda.is_available() and not force:
        logger.info("megatron_ext: CUDA is available; CPU execution is not enabled.")
        return False
    # Megatron's fused elementwise ops are torch.compile'd (megatron/core/jit.py); inductor
    # is neither needed nor reliable under the device mode.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _ACTIVE.handle = _CpuExecution()
    _ACTIVE.handle.install()
    return True


def disable_cpu_execution() -> None:
    """Undo ``enable_cpu_execution()``."""
    _ACTIVE.remove()
