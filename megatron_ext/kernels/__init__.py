"""Fused kernels: a method's chain of tensor operations as one pass through memory.

What it does:
    Each fused kernel is a **pure torch function** (the chain the eager code runs, written
    once) exposed as a ``torch.library`` custom op ``megatron_ext::<name>`` with a fake
    (meta) implementation. The op's device implementation runs the function either
    compiled by ``torch.compile`` (inductor: Triton kernels on CUDA, C++ loops on the CPU)
    or as it is (eager), as :func:`use_fused` decides for the tensors at hand:

    * ``off``: always eager: the reference, and the fallback;
    * ``on``: compiled on every device (refused at configuration, naming the flag, where
      ``torch.compile`` cannot run: :func:`fused_unavailable`);
    * ``auto`` (default): compiled for accelerator tensors (CUDA), eager on the CPU, where
      runs are small and the compile time (seconds per kernel and shape) would dominate.

    The mode comes from ``--fused-kernels`` (:class:`megatron_ext.config.KernelsConfig`,
    applied by the runtime with :func:`set_mode`), else the environment variable
    ``MEGATRON_EXT_FUSED_KERNELS``, else ``auto``.

Why:
    Unfused, every torch operation of a compressor is a full pass through memory and a
    kernel launch: on an H100 the methods' kernels cost 7-125 device copies of the tensor
    they compress, and their steps were 18-46% slower than uncompressed training
    (docs/performance/gpu/report.md; the CPU cost model, benchmarks/gpu_cost.py, counts
    the same passes without a GPU). Why ``torch.compile`` of pure functions rather than
    hand-written Triton: one source for every device (the eager function is the reference
    the compiled one is tested against, on the CPU too, where Triton only runs in its
    interpreter), measured CPU gains (4-bit quantize + pack of 4096 x 1024 fp32, 2 threads:
    eager 14.6 ms, compiled 8.0 ms against a 4.8 ms copy: 3.0 -> 1.7 copies, codes
    bit-identical), and the custom op makes the dispatch modes (strict-device, the cost
    model) see one op with its own inputs and outputs, as one kernel would be. A kernel
    whose compiled form measures badly on a GPU gets a hand-written Triton implementation
    behind the same op.

Constraints:
    Pure torch (no Megatron, no ``torch.distributed``). A kernel's fake implementation must
    return exactly the shapes and dtypes of the real one. Compiled and eager results must
    agree as each kernel's test states (integer codes, packing and selections bit for bit;
    floating values within a stated tolerance, as inductor may fuse a multiply-add).
    Stochastic rounding inside a kernel draws from a counter-based hash of a seed and the
    element index (the seed drawn on the device from the caller's generator), so eager and
    compiled draw the same noise.

How to add a kernel:
    1. Write the chain as a pure function ``_name(...)`` in ``megatron_ext/kernels/<topic>.py``
       (tensors and Python scalars in, tensors out or mutated in place).
    2. Give it full type hints and the op's docstring, make it the op with
       ``name = define_op("megatron_ext::name", _name, mutates_args=...)`` (the schema is
       ``_name``'s signature, the device implementation ``run(_name, *args)``), and
       register its fake with ``@name.register_fake``.
    3. Call the op from the method's code; test compiled against eager
       (``tests/unit/test_kernels_*.py``) and the step's traffic in the cost model.
    4. A kernel that reads only some rows of a table argument (a gather inside it; or
       updates only those rows of a table it mutates) says so in :data:`ROW_GATHERS`, so
       the cost model does not count the whole table.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

__all__ = [
    "MODES",
    "ENV_VAR",
    "ROW_GATHERS",
    "set_mode",
    "mode",
    "use_fused",
    "fused_unavailable",
    "run",
    "define_op",
]

MODES = ("auto", "on", "off")
"""``--fused-kernels`` choices (module docstring)."""

ENV_VAR = "MEGATRON_EXT_FUSED_KERNELS"
"""The mode of a process where no flag set it (tests, benchmarks)."""

ROW_GATHERS: Dict[str, Tuple[str, str]] = {}
"""Kernels that read (or, for a table in their ``mutates_args``, update in place) only
some rows of a table argument, for the cost model
(``tests/helpers/strict_device.py``): ``"megatron_ext::name"`` -> (the table argument, the
argument that counts the rows read: a tensor of row indices, one row per element, or an int
or a list of ints whose product is the count). Each kernel's module registers its own."""

_mode: Optional[str] = None


def _check(value: str, where: str) -> str:
    if value not in MODES:
        raise ValueError(f"{where}: expected one of {', '.join(MODES)}, got {value!r}")
    return value


def set_mode(value: Optional[str]) -> None:
    """Set the process's mode (None: back to the environment's or ``auto``).

    Raises:
        ValueError: an unknown mode, or ``on`` where :func:`fused_unavailable` says why not.
    """
    global _mode
    if value is not None:
        _check(value, "--fused-kernels")
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        why = next(filter(None, map(fused_unavailable, devices)), None) if value == "on" else None
        if why:
            raise ValueError(f"--fused-kernels on: {why}; use --fused-kernels auto or off")
    _mode = value


def mode() -> str:
    """The mode in force: :func:`set_mode`'s, else ``MEGATRON_EXT_FUSED_KERNELS``, else auto."""
    if _mode is not None:
        return _mode
    return _check(os.environ.get(ENV_VAR, "auto"), ENV_VAR)


@functools.lru_cache(maxsize=None)
def fused_unavailable(device_type: str = "cpu") -> Optional[str]:
    """Why ``torch.compile`` cannot compile kernels for ``device_type`` tensors in this
    process, or None when it can (CPU: a C++ compiler; CUDA: triton)."""
    try:
        import torch._dynamo as dynamo
    except ImportError as exc:  # pragma: no cover - torch builds without dynamo
        return f"torch.compile is missing from this torch ({exc})"
    if not dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python or platform"
    if device_type == "cpu":
        if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
            return "torch.compile needs a C++ compiler for CPU kernels (set CXX or install g++)"
    elif device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile needs triton for CUDA kernels (pip install triton)"
    return None


def use_fused(tensor: torch.Tensor) -> bool:
    """Whether a kernel on ``tensor`` runs compiled (True) or eager (False)."""
    current = mode()
    if current == "off":
        return False
    if current == "on":
        return True
    return tensor.device.type not in ("cpu", "meta")


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    # fullgraph: a graph break would split the kernel silently; dynamic: one compile serves
    # every bucket / activation size instead of one per shape; emulate_precision_casts:
    # keep eager's roundings to fp16 / bf16 inside a fused kernel (by default inductor
    # drops a downcast followed by an upcast, e.g. an fp16 scale used in fp32, and the
    # compiled kernel would disagree with the eager reference).
    return torch.compile(
        fn, fullgraph=True, dynamic=True, options={"emulate_precision_casts": True}
    )


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call pure function ``fn(*args, **kwargs)`` compiled or eager, as :func:`use_fused`
    decides for its first tensor argument."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    if use_fused(first):
        return _compiled(fn)(*args, **kwargs)
    return fn(*args, **kwargs)


def define_op(
    name: str,
    fn: Callable[..., Any],
    *,
    mutates_args: Iterable[str] = (),
    check: Optional[Callable[..., None]] = None,
) -> torch.library.CustomOpDef:
    """The custom op ``name`` (``"megatron_ext::<name>"``) of pure function ``fn``.

    Its schema is inferred from ``fn``'s signature and type hints (the parameter names are
    the op's), its docstring is ``fn``'s, and its implementation on every device is
    ``run(fn, *args)``. The caller registers the fake (``@op.register_fake``).

    Args:
        name: the qualified op name.
        fn: the pure function (module docstring, "How to add a kernel").
        mutates_args: the names of the arguments ``fn`` writes in place.
        check: called with the op's arguments before ``fn`` runs, outside the compiled
            code (validation that raises); None: no check.
    """
    mutates_args = tuple(mutates_args)

    def implementation(*args: Any, **kwargs: Any) -> Any:
        if check is not None:
            check(*args, **kwargs)
        return run(fn, *args, **kwargs)

    schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
    op = torch.library.custom_op(name, implementation, mutates_args=mutates_args, schema=schema)
    op.__doc__ = fn.__doc__
    return op
