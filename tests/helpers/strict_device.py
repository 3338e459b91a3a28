"""Strict-device mode: run a method's steps on stand-in device tensors and record every op.

What it does:
    :class:`StrictDeviceMode` is a ``TorchDispatchMode``. Tensors on the ``meta`` device
    stand in for GPU tensors (shapes and dtypes, no data), CPU tensors are host tensors, and
    every aten and c10d op a step issues passes through the mode, which records:

    * **findings** (:class:`Finding`), each with the first ``megatron_ext`` frame that issued
      it:

      - ``cpu-tensor``: a CPU tensor meeting a device tensor (an index included). 0-dim CPU
        tensors are allowed as operands of non-indexing ops, as CUDA itself allows them
        (they travel as kernel arguments, no copy, no sync); as an index, a copy source or a
        collective buffer they are findings too;
      - ``cpu-generator``: a CPU ``torch.Generator`` drawing device tensors (CUDA raises);
      - ``host-sync``: ``item``/``bool``/``int``/``float`` (``_local_scalar_dense``),
        ``torch.equal``, a device-to-host copy (``.cpu()``, ``tolist``);
      - ``data-dependent-shape``: ``nonzero``, boolean-mask indexing, ``masked_select``,
        ``unique``, ``repeat_interleave`` without ``output_size`` (each a sync on CUDA);
      - ``h2d-copy``: a host-to-device copy (``.to(device)``, ``copy_`` from a CPU
        tensor, ``torch.tensor(..., device=...)``, ``new_tensor``, Python lists used as
        indices; the last three are copied below the dispatcher, so the mode wraps their
        Python entry points while it is active);
      - ``collective-cpu``: a collective on a CPU tensor (NCCL only takes device tensors);
      - ``collective-unsupported``: a dtype or reduction NCCL does not support (see
        :func:`nccl_unsupported`).

      Syncs, data-dependent shapes and device-to-host copies are answered with made-up
      values (ones; half of the elements selected) so the step runs on. In a step declared
      ``sync_ok`` (setup, a checkpoint load, a selection step every K steps) syncs and
      host-to-device copies are recorded as *declared* and are not violations; the other
      classes always are (on a GPU they raise or silently serialize).
    * **device ops** per step: every op with a device output (or, returning nothing, a device
      argument: ``_foreach_*_``, a custom op's mutated tensor) that launches a kernel (views,
      ``empty`` and other metadata-only ops excluded; ops on host tensors are host ops), to
      assert launch budgets, each with its **memory traffic** (:class:`OpCost`: bytes read
      and written, the ``megatron_ext`` frame that issued it, and the *part* of the step it
      belongs to, see :meth:`StrictDeviceMode.part`);
    * **collectives** per step (:class:`CollectiveCall`: op, dtype, numel, reduction, group
      size), so runs of different ranks can be compared (:func:`compare_ranks`).

    :func:`run_ranks` runs "ranks" one after another in this process on torch's fake process
    group (``torch.testing._internal.distributed.fake_pg``: collectives return at once and
    move no data), each with its own inputs and objects. ``torch.distributed`` calls reach
    the mode as c10d ops (``c10d.allreduce_``, ``c10d._allgather_base_``,
    ``c10d.alltoall_base_``, ``c10d._reduce_scatter_base_``, ``c10d.broadcast_``, ...) whose
    process group and ``ReduceOp`` arrive as script objects; the few without a Meta kernel
    (``allreduce_coalesced_``, used by megatron's coalescing manager) run the fake group on
    host stand-ins of the same shapes.

Memory traffic (the cost model's unit; ``benchmarks/gpu_cost.py``):
    Each recorded device op moves the bytes it must read plus the bytes it must write, counted
    once per distinct device tensor (compulsory traffic; caches and re-reads inside a kernel
    are not modelled, so a matmul counts its operands once):

    * **reads**: every distinct device tensor argument (a tensor, or an identical view of
      it, passed twice counts once; different views count apart, even of one storage; a
      broadcast (stride-0) dimension counts once); host tensors and Python scalars are
      kernel arguments, not device memory;
    * **writes**: every tensor the op returns that does not alias an argument, and every
      argument the schema marks as written (``Tensor(a!)``: in-place ``self``, ``out=``,
      a custom op's ``mutates_args``);
    * an in-place op reads and writes ``self``; an ``out=`` argument is written, not read;
      **write-only** ops (``fill_``, ``zero_``, ``normal_``, ``uniform_``, ``bernoulli_``,
      ``random_``, ``exponential_``, ...; ``copy_`` and ``_foreach_copy_``) do not read their
      destination;
    * **gather-like** ops (``index_select``, ``gather``, ``index``, ``take``,
      ``take_along_dim``, ``embedding``) read only the elements they output (plus the
      index), not their whole source;
    * **scatter-like** ops (``index_copy_``, ``index_put_``, ``scatter_``, ``index_add_``,
      ``index_fill_``, ``put_``, ...) write only the addressed elements and read the values
      and the index; the accumulating ones (``index_add_``, ``scatter_add_``,
      ``index_put_(accumulate=True)``, ...) also read the addressed destination elements;
    * views and metadata-only ops cost nothing (they are not device ops);
    * collectives are not memory traffic: their buffer bytes are reported apart
      (:meth:`StepRecord.collective_bytes`).

    A fused kernel registered as a ``torch.library`` custom op with a fake (meta)
    implementation reaches the mode as one op with its own inputs, outputs and
    ``mutates_args``, so it is counted as one launch with exactly its own traffic, by the
    same rules and with no change here (``tests/unit/test_gpu_cost.py`` shows it). A kernel
    that gathers rows of a table argument inside it is gather-like for that argument: it
    reads only the rows it addresses, and writes only those where it updates the table in
    place (``megatron_ext.kernels.ROW_GATHERS`` names the table and what counts the rows).

What it proves, and what only a GPU can:
    It proves, on a CPU machine, that a steady-state step keeps every tensor on the device,
    never waits on the device from the host, never copies host data to the device, issues
    only collectives NCCL accepts, issues the same collective sequence on every rank, and
    launches a given number of device ops. It cannot prove the numbers are right (meta
    tensors have no data; the method's own tests check values), that kernels are fast, that
    streams and events are ordered correctly (``overlap_grad_reduce`` waits), that memory
    fits, or anything about NCCL's behaviour at run time (hangs, timeouts, algorithm
    choice). Ops implemented below the dispatcher (a C++ kernel calling another) are seen
    once, as the op the Python code called. Launch counts are counts of aten ops, a proxy
    for kernels (a fused CUDA op may launch several, ``linalg_qr`` many, ``torch.compile``
    fewer); traffic is the compulsory traffic defined above, a lower bound of what the
    kernels move.

Constraints:
    Test helper; pure torch. Needs a torch with the ``fake`` process-group backend.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "DEVICE",
    "Finding",
    "OpCost",
    "CollectiveCall",
    "StepRecord",
    "StrictDeviceMode",
    "RankRun",
    "run_ranks",
    "compare_ranks",
    "nccl_unsupported",
    "format_findings",
]

DEVICE = torch.device("meta")
"""The device that stands in for a GPU."""

ALWAYS = ("cpu-tensor", "cpu-generator", "collective-cpu", "collective-unsupported")
"""Finding kinds that are violations even in a step declared ``sync_ok``."""

_aten = torch.ops.aten

# Ops that allocate or alias without launching a kernel.
_NO_KERNEL = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.lift_fresh.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten._unsafe_view.default,
    _aten.set_.source_Tensor,
    _aten.resize_.default,
}

# Ops whose tensor arguments other than ``self`` are indices (a 0-dim CPU index is a
# finding too: CUDA would copy it to the device).
_INDEXING = {
    "index",
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "index_select",
    "index_copy",
    "index_copy_",
    "index_add",
    "index_add_",
    "index_fill",
    "index_fill_",
    "index_reduce",
    "index_reduce_",
    "gather",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "scatter_reduce_",
    "take",
    "take_along_dim",
    "put",
    "put_",
    "embedding",
    "embedding_dense_backward",
    "masked_fill",
    "masked_fill_",
    "masked_scatter",
    "masked_scatter_",
    "copy_",
    "_to_copy",
}

_DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
}

_REDUCE_NAMES = {
    int(getattr(dist.ReduceOp, n)): n
    for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
}

# torch dtypes ProcessGroupNCCL maps to an NCCL type (ProcessGroupNCCL.cpp, ``ncclDataType``);
# bool travels as uint8, fp8 types only without a reduction.
_NCCL_DTYPES = {
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.bool,
}
_NCCL_NO_REDUCE_DTYPES = {
    getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn") if hasattr(torch, n)
}
_REDUCING = {
    "allreduce_",
    "allreduce_coalesced_",
    "reduce_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
}


def nccl_unsupported(dtype: torch.dtype, reduce_op: Optional[str]) -> Optional[str]:
    """Why NCCL (through ProcessGroupNCCL) refuses or mis-handles ``dtype`` with
    ``reduce_op`` (None for gather/broadcast/send), or None if it is supported.

    Rules (ProcessGroupNCCL's ``ncclDataType`` map and ``getNcclReduceOp``; NCCL's
    ``ncclRedOp_t`` has sum, prod, max, min, avg and pre-multiplied sum only):
    dtypes outside the map (int16, uint16/32/64, complex through this path) are refused;
    BAND/BOR/BXOR are refused; AVG and PREMUL_SUM on bool are refused; PREMUL_SUM needs
    half, float, bfloat16 or double; fp8 cannot be reduced; AVG on integer types is an
    integer division in NCCL (truncates, unlike a float mean) and gloo refuses AVG
    altogether, so we count it as unsupported.
    """
    if dtype not in _NCCL_DTYPES and dtype not in _NCCL_NO_REDUCE_DTYPES:
        return f"dtype {dtype} has no NCCL type"
    if reduce_op is None:
        return None
    if dtype in _NCCL_NO_REDUCE_DTYPES:
        return f"NCCL cannot reduce {dtype}"
    if reduce_op in ("BAND", "BOR", "BXOR"):
        return f"NCCL has no {reduce_op} reduction"
    if dtype == torch.bool and reduce_op in ("AVG", "PREMUL_SUM"):
        return f"{reduce_op} on bool"
    if reduce_op == "PREMUL_SUM" and not dtype.is_floating_point:
        return f"PREMUL_SUM on {dtype}"
    if reduce_op == "AVG" and not dtype.is_floating_point:
        return f"AVG on integer dtype {dtype} (truncating; gloo refuses AVG)"
    return None


@dataclass(frozen=True)
class Finding:
    """One thing a GPU step must not do."""

    kind: str
    """One of the kinds in the module docstring."""

    op: str
    """The aten/c10d op that showed it."""

    detail: str
    """Shapes, devices, dtypes involved."""

    where: str
    """``file:line (function)`` of the innermost ``megatron_ext`` frame (else the caller in
    ``tests/`` or ``benchmarks/``)."""

    step: str
    """Name of the step it happened in."""

    declared: bool = False
    """Happened in a step declared ``sync_ok`` and is of a kind such a step may do."""

    def __str__(self) -> str:
        tag = " (declared)" if self.declared else ""
        return f"[{self.step}] {self.kind}{tag}: {self.op} {self.detail} at {self.where}"


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as a rank issued it."""

    op: str
    dtypes: Tuple[str, ...]
    numels: Tuple[int, ...]
    reduce_op: Optional[str]
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the call names (its buffers, not what goes on the wire)."""
        return sum(n * getattr(torch, d).itemsize for d, n in zip(self.dtypes, self.numels))


@dataclass(frozen=True)
class OpCost:
    """One device op (a launch) with its memory traffic (see the module docstring)."""

    op: str
    """The aten / custom op, e.g. ``aten.add_.Tensor``."""

    read: int
    """Bytes read from device memory."""

    written: int
    """Bytes written to device memory."""

    where: str
    """``file:line (function)`` of the innermost ``megatron_ext`` frame (else the caller)."""

    part: Optional[str] = None
    """The part of the step it ran in (:meth:`StrictDeviceMode.part`), None outside any."""

    @property
    def traffic(self) -> int:
        """Bytes read plus written."""
        return self.read + self.written


@dataclass
class StepRecord:
    """What one step did."""

    name: str
    sync_ok: bool
    device_ops: List[str] = field(default_factory=list)
    op_costs: List[OpCost] = field(default_factory=list)
    """One entry per ``device_ops`` entry, in the same order."""
    host_ops: List[str] = field(default_factory=list)
    collectives: List[CollectiveCall] = field(default_factory=list)
    collective_parts: List[Optional[str]] = field(default_factory=list)
    """The part each collective ran in, in ``collectives`` order."""
    findings: List[Finding] = field(default_factory=list)

    @property
    def violations(self) -> List[Finding]:
        """Findings that are not declared."""
        return [f for f in self.findings if not f.declared]

    def op_counts(self) -> Counter:
        """Device ops by name."""
        return Counter(self.device_ops)

    def costs(self, parts: Optional[Sequence[Optional[str]]] = None) -> List[OpCost]:
        """The device ops' costs, only those of ``parts`` when given."""
        if parts is None:
            return list(self.op_costs)
        return [c for c in self.op_costs if c.part in parts]

    def launches(self, parts: Optional[Sequence[Optional[str]]] = None) -> int:
        """Device ops (launch proxy), of ``parts`` when given."""
        return len(self.costs(parts))

    def traffic(self, parts: Optional[Sequence[Optional[str]]] = None) -> int:
        """Bytes read plus written by the device ops, of ``parts`` when given."""
        return sum(c.traffic for c in self.costs(parts))

    def collective_bytes(self, parts: Optional[Sequence[Optional[str]]] = None) -> int:
        """Buffer bytes of the collectives (not memory traffic), of ``parts`` when given."""
        return sum(
            c.nbytes
            for c, p in zip(self.collectives, self.collective_parts)
            if parts is None or p in parts
        )


def _where(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/megatron_ext/" in name and "/torch/" not in name:
            short = name[name.rindex("/megatron_ext/") + 1 :]
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        for top in ("/tests/", "/benchmarks/"):
            if fallback is None and top in name and name != __file__:
                fallback = f"{name[name.rindex(top) + 1 :]}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


def _tensors(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _is_dev(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE.type


def _is_cpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def _desc(t: torch.Tensor) -> str:
    return f"{t.device.type}{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"


def _made_up(shape: Sequence[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
    return torch.ones(tuple(shape), dtype=dtype, device=device)


# -- memory traffic (module docstring) ---------------------------------------------------------

# Ops whose first argument is written without being read.
_WRITE_ONLY = {
    "fill_",
    "zero_",
    "normal_",
    "uniform_",
    "bernoulli_",
    "random_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "copy_",
    "_foreach_copy_",
    "_foreach_zero_",
}

# Ops that read only the elements they output (plus the index tensors).
_GATHER = {
    "index_select",
    "gather",
    "index",
    "_unsafe_index",
    "take",
    "take_along_dim",
    "embedding",
}

# In-place ops that write only the addressed elements of ``self``: name -> whether they also
# read the addressed destination elements (accumulate / reduce).
_SCATTER = {
    "index_copy_": False,
    "index_fill_": False,
    "index_put_": None,  # accumulate=
    "_index_put_impl_": None,
    "put_": None,
    "scatter_": None,  # reduce=
    "scatter_add_": True,
    "scatter_reduce_": True,
    "index_add_": True,
    "index_reduce_": True,
}


def _footprint(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` addresses (a stride-0 dimension counts once)."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensor_key(t: torch.Tensor) -> Tuple[Any, ...]:
    """Identity of ``t``'s view: storage, offset, shape, strides and dtype (identical views of
    one storage compare equal)."""
    try:
        storage = t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # no storage (e.g. a nested tensor)
        storage = id(t)
    return (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _arg_values(func, args, kwargs) -> List[Tuple[Any, Any]]:
    """``(schema argument, value)`` of every argument the call passed."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.name in kwargs:
            out.append((a, kwargs[a.name]))
        elif i < len(args) and not a.kwarg_only:
            out.append((a, args[i]))
    return out


def _flat(v: Any) -> List[torch.Tensor]:
    """The tensors of one argument or return value (a tensor or a list of them)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


def _numel_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _row_gather(func, values) -> dict:
    """``{table argument: bytes read}`` of a fused kernel that reads only some rows of a
    table (``megatron_ext.kernels.ROW_GATHERS``); empty for every other op."""
    from megatron_ext.kernels import ROW_GATHERS

    entry = ROW_GATHERS.get(func._schema.name)
    if entry is None:
        return {}
    table_arg, rows_arg = entry
    byname = {a.name: v for a, v in values}
    table, rows = byname[table_arg], byname[rows_arg]
    if isinstance(rows, torch.Tensor):
        count = rows.numel()
    elif isinstance(rows, (list, tuple)):
        count = _numel_of(rows)
    else:
        count = int(rows)
    row_bytes = (table.numel() // max(table.shape[0], 1)) * table.element_size()
    return {table_arg: min(count * row_bytes, _footprint(table))}


def op_traffic(func, name: str, args, kwargs, out) -> Tuple[int, int]:
    """``(bytes read, bytes written)`` of one device op by the rules of the module docstring.

    Args:
        func: the op overload.
        name: its short name (``add_``).
        args, kwargs: the arguments as the caller passed them (host tensors are not counted).
        out: what the op returned.
    """
    values = _arg_values(func, args, kwargs)
    read: dict = {}
    written: dict = {}

    def add(table, t):
        if _is_dev(t):
            table.setdefault(_tensor_key(t), _footprint(t))

    if name in _GATHER:
        outs = [t for t in _flat(out) if _is_dev(t)]
        source = values[0][1]
        indices = [t for _, v in values[1:] for t in _flat(v) if _is_dev(t)]
        moved = sum(o.numel() for o in outs)
        r = moved * source.element_size() + sum(_footprint(i) for i in indices)
        return r, sum(_footprint(o) for o in outs)

    if name in _SCATTER and _is_dev(values[0][1]):
        dst = values[0][1]
        byname = {a.name: v for a, v in values}
        index_ts = [
            t for _, v in values[1:] for t in _flat(v) if _is_dev(t) and not t.is_floating_point()
        ]
        src = byname.get("source", byname.get("src", byname.get("values")))
        accumulate = _SCATTER[name]
        if accumulate is None:
            accumulate = bool(byname.get("accumulate", False)) or byname.get("reduce") is not None
        if name in ("index_put_", "_index_put_impl_"):
            indices = list(byname.get("indices") or [])
            shapes = [tuple(i.shape) for i in indices if isinstance(i, torch.Tensor)]
            n = _numel_of(torch.broadcast_shapes(*shapes)) if shapes else 1
            rest = [d for k, d in enumerate(dst.shape) if k >= len(indices) or indices[k] is None]
            count = n * _numel_of(rest)
        elif name in ("index_copy_", "index_add_", "index_reduce_"):
            count = src.numel()
        elif name == "index_fill_":
            dim = byname["dim"] % max(dst.dim(), 1)
            count = byname["index"].numel() * (
                dst.numel() // max(dst.shape[dim], 1) if dst.dim() else 1
            )
        else:  # scatter_*, put_
            count = byname["index"].numel()
        w = count * dst.element_size()
        r = sum(_footprint(i) for i in index_ts)
        if isinstance(src, torch.Tensor) and _is_dev(src):
            r += min(_footprint(src), count * src.element_size()) if src.dim() else _footprint(src)
        if accumulate:
            r += w
        return r, w

    write_only_first = name in _WRITE_ONLY
    gathered = _row_gather(func, values)
    for i, (a, v) in enumerate(values):
        mutable = a.alias_info is not None and a.alias_info.is_write
        for t in _flat(v):
            if not _is_dev(t):
                continue
            if mutable and a.name in gathered:
                # rows updated in place: the addressed rows read and written
                written.setdefault(_tensor_key(t), gathered[a.name])
                read.setdefault(_tensor_key(t), gathered[a.name])
            elif mutable:
                add(written, t)
                if not (a.kwarg_only or (write_only_first and i == 0)):
                    add(read, t)
            elif a.name in gathered:
                read.setdefault(_tensor_key(t), gathered[a.name])
            else:
                add(read, t)
    returns = func._schema.returns
    outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else [out]
    for r_schema, o in zip(returns, outs):
        if r_schema.alias_info is None:
            for t in _flat(o):
                add(written, t)
    return sum(read.values()), sum(written.values())


class StrictDeviceMode(TorchDispatchMode):
    """The strict-device dispatch mode (see module docstring).

    Use as a context manager around a whole rank's run; wrap each step in
    :meth:`step`. Ops outside any step go to a step named ``"setup"`` (``sync_ok``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps: List[StepRecord] = []
        self._current = StepRecord("setup", sync_ok=True)
        self.steps.append(self._current)
        self._part: Optional[str] = None

    # -- host data that never reaches the dispatcher ---------------------------------------

    def __enter__(self):
        self._patches = self._patch_host_data()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, orig in reversed(self._patches):
                setattr(owner, name, orig)

    def _patch_host_data(self) -> List[Tuple[Any, str, Any]]:
        """``torch.tensor(data, device=...)``, ``as_tensor``, ``new_tensor`` and Python
        sequences used as indices build their tensor on the host and copy it to the device
        below the dispatcher (torch excludes dispatch modes there), so the mode would not
        see those host-to-device copies: wrap the Python entry points while it is active."""
        mode = self
        patches = []

        def patch(owner, name, make):
            orig = getattr(owner, name)
            patches.append((owner, name, orig))
            setattr(owner, name, make(orig))

        def host_sequence(idx) -> bool:
            items = idx if isinstance(idx, tuple) else (idx,)
            return isinstance(idx, list) or any(
                isinstance(i, list) or type(i).__module__ == "numpy" and hasattr(i, "shape")
                for i in items
            )

        def factory(orig, name):
            def wrapped(data, *args, **kwargs):
                device = kwargs.get("device")
                if (
                    device is not None
                    and torch.device(device).type == DEVICE.type
                    and not isinstance(data, torch.Tensor)
                ):
                    mode._find("h2d-copy", f"torch.{name}", "host data built on the device")
                return orig(data, *args, **kwargs)

            return wrapped

        def new_tensor(orig):
            def wrapped(self_, data, *args, **kwargs):
                device = kwargs.get("device", self_.device)
                if torch.device(device).type == DEVICE.type and not _is_dev(data):
                    mode._find("h2d-copy", "Tensor.new_tensor", "host data built on the device")
                return orig(self_, data, *args, **kwargs)

            return wrapped

        def getitem(orig):
            def wrapped(self_, idx):
                if _is_dev(self_) and host_sequence(idx):
                    mode._find("h2d-copy", "Tensor.__getitem__", "Python sequence as index")
                return orig(self_, idx)

            return wrapped

        def setitem(orig):
            def wrapped(self_, idx, value):
                if _is_dev(self_) and host_sequence(idx):
                    mode._find("h2d-copy", "Tensor.__setitem__", "Python sequence as index")
                return orig(self_, idx, value)

            return wrapped

        patch(torch, "tensor", lambda o: factory(o, "tensor"))
        patch(torch, "as_tensor", lambda o: factory(o, "as_tensor"))
        patch(torch.Tensor, "new_tensor", new_tensor)
        patch(torch.Tensor, "__getitem__", getitem)
        patch(torch.Tensor, "__setitem__", setitem)
        return patches

    # -- steps -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, name: str = "steady", *, sync_ok: bool = False) -> Iterator[StepRecord]:
        """Record the ops inside as one step; ``sync_ok`` declares that it may sync and
        copy host data to the device (setup, checkpoint load, a selection every K steps)."""
        outer = self._current
        self._current = StepRecord(name, sync_ok=sync_ok)
        self.steps.append(self._current)
        try:
            yield self._current
        finally:
            self._current = outer

    @contextlib.contextmanager
    def part(self, name: Optional[str]) -> Iterator[None]:
        """Tag the device ops and collectives inside with ``name`` (:attr:`OpCost.part`),
        within the current step: a harness marks what a method does (``"codec"``,
        ``"hook"``) apart from its own scaffolding (inputs, megatron's optimizer), so a
        cost model charges the method only for its parts."""
        outer, self._part = self._part, name
        try:
            yield
        finally:
            self._part = outer

    def named(self, name: str) -> List[StepRecord]:
        """Every recorded step called ``name``."""
        return [s for s in self.steps if s.name == name]

    @property
    def findings(self) -> List[Finding]:
        """Every finding of every step."""
        return [f for s in self.steps for f in s.findings]

    @property
    def violations(self) -> List[Finding]:
        """Every undeclared finding."""
        return [f for f in self.findings if not f.declared]

    def _find(self, kind: str, op: Any, detail: str) -> None:
        step = self._current
        declared = step.sync_ok and kind not in ALWAYS
        step.findings.append(Finding(kind, str(op), detail, _where(), step.name, declared))

    # -- dispatch --------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs)
        name = func._schema.name.split("::")[-1]
        flat = _tensors((args, kwargs))
        dev = [t for t in flat if _is_dev(t)]
        out_dev = kwargs.get("device")
        makes_dev = out_dev is not None and torch.device(out_dev).type == DEVICE.type

        # Host synchronizations and data-dependent shapes: record, answer with made-up values.
        if func is _aten._local_scalar_dense.default and _is_dev(args[0]):
            self._find("host-sync", func, f"item() of {_desc(args[0])}")
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if func is _aten.equal.default and dev:
            self._find("host-sync", func, "torch.equal on device tensors")
            return True
        if name in _DATA_DEPENDENT and dev:
            self._find("data-dependent-shape", func, _desc(args[0]))
            return self._made_up_data_dependent(func, name, args, kwargs)
        if name == "repeat_interleave" and dev and kwargs.get("output_size") is None:
            self._find("data-dependent-shape", func, "repeat_interleave without output_size")
            kwargs["output_size"] = max(1, dev[0].numel())  # made up
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and dev:
            masks = [
                i
                for i in (args[1] or [])
                if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            ]
            if masks:
                self._find("data-dependent-shape", func, f"boolean mask {_desc(masks[0])}")
                args = list(args)
                args[1] = [self._mask_to_index(i) for i in args[1]]
                args = tuple(args)
                flat = _tensors((args, kwargs))

        # Copies across the host/device boundary.
        if func is _aten._to_copy.default:
            src = args[0]
            target = torch.device(kwargs.get("device") or src.device)
            if _is_dev(src) and target.type == "cpu":
                self._find("host-sync", func, f"device-to-host copy of {_desc(src)}")
                self._count(func, host=True)
                return _made_up(src.shape, kwargs.get("dtype") or src.dtype, "cpu")
            if _is_cpu(src) and target.type == DEVICE.type:
                self._find("h2d-copy", func, f"host-to-device copy of {_desc(src)}")
                out = func(src.to(DEVICE), **kwargs)
                self._count(func, out=out, args=args, kwargs=kwargs)
                return out
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if _is_cpu(dst) and _is_dev(src):
                self._find("host-sync", func, f"device-to-host copy_ of {_desc(src)}")
                self._count(func, host=True)
                with torch.no_grad():
                    dst.fill_(1)
                return dst
            if _is_dev(dst) and _is_cpu(src):
                self._find("h2d-copy", func, f"host-to-device copy_ of {_desc(src)}")
                out = func(dst, src.to(DEVICE), *args[2:], **kwargs)
                self._count(func, out=out, args=args, kwargs=kwargs)
                return out

        # Random draws: a CPU generator for device tensors.
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen.device.type == "cpu" and (dev or makes_dev):
            self._find("cpu-generator", func, f"CPU generator for device output ({name})")
            kwargs["generator"] = None

        # CPU tensors meeting device tensors.
        called = (args, kwargs)  # as passed: host operands are not device traffic
        if dev:
            cpu = [
                t
                for t in flat
                if _is_cpu(t) and (t.dim() > 0 or name in _INDEXING or name.startswith("index"))
            ]
            if cpu:
                self._find(
                    "cpu-tensor",
                    func,
                    f"{', '.join(_desc(t) for t in cpu[:3])} with {_desc(dev[0])}",
                )
            if any(_is_cpu(t) for t in flat):
                args, kwargs = tree_map(lambda a: a.to(DEVICE) if _is_cpu(a) else a, (args, kwargs))
        out = func(*args, **kwargs)
        self._count(func, out=out, args=called[0], kwargs=called[1])
        return out

    def _count(
        self, func, out: Any = None, host: bool = False, args: Any = (), kwargs: Any = None
    ) -> None:
        if func in _NO_KERNEL or func.is_view:
            return
        outs = _tensors(out) if out is not None else []
        # A device op writes a device tensor: one it returns, or (ops that return nothing,
        # e.g. _foreach_*_ or a custom op's mutated argument) one of its arguments. Ops on
        # host tensors (torch.equal of CPU indices, item() of a CPU step count) are host ops.
        on_device = any(_is_dev(t) for t in outs) or (
            not outs and any(_is_dev(t) for t in _tensors((args, kwargs or {})))
        )
        if host or not on_device:
            self._current.host_ops.append(str(func))
            return
        name = func._schema.name.split("::")[-1]
        read, written = op_traffic(func, name, args, kwargs or {}, out)
        self._current.device_ops.append(str(func))
        self._current.op_costs.append(OpCost(str(func), read, written, _where(3), self._part))

    def _mask_to_index(self, i: Any) -> Any:
        if not (isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)):
            return i
        # A made-up selection: half of the elements (at least one), on the device.
        n = max(1, i.numel() // 2)
        if i.dim() == 1:
            return torch.zeros(n, dtype=torch.long, device=DEVICE)
        raise NotImplementedError("strict-device mode: multi-dimensional boolean masks")

    def _made_up_data_dependent(self, func, name: str, args, kwargs) -> Any:
        x = args[0]
        n = max(1, x.numel() // 2)
        if name == "nonzero":
            return torch.zeros(n, x.dim(), dtype=torch.long, device=DEVICE)
        if name == "masked_select":
            return torch.zeros(n, dtype=x.dtype, device=DEVICE)
        # unique variants: (values, inverse, counts)
        values = torch.zeros(n, dtype=x.dtype, device=DEVICE)
        inverse = torch.zeros(x.shape, dtype=torch.long, device=DEVICE)
        counts = torch.ones(n, dtype=torch.long, device=DEVICE)
        return (values, inverse, counts) if name != "_unique" else (values, inverse)

    def _collective(self, func, args, kwargs) -> Any:
        name = func._schema.name.split("::")[-1]
        tensors = _tensors((args, kwargs))
        reduce_op = None
        group_size = 0
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.ScriptObject):
                qual = a._type().qualified_name()
                if qual.endswith("ReduceOp"):
                    reduce_op = _REDUCE_NAMES.get(a.op(), str(a.op()))
                elif qual.endswith("ProcessGroup"):
                    group_size = dist.ProcessGroup.unbox(a).size()
        call = CollectiveCall(
            op=name,
            dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors),
            numels=tuple(t.numel() for t in tensors),
            reduce_op=reduce_op,
            group_size=group_size,
        )
        self._current.collectives.append(call)
        self._current.collective_parts.append(self._part)
        cpu = [t for t in tensors if _is_cpu(t)]
        if cpu:
            self._find("collective-cpu", func, f"{name} on {_desc(cpu[0])}")
        for t in tensors:
            why = nccl_unsupported(t.dtype, reduce_op if name in _REDUCING else None)
            if why:
                self._find("collective-unsupported", func, f"{name}: {why}")
                break
        try:
            return func(*args, **kwargs)
        except NotImplementedError:
            # No Meta kernel (e.g. allreduce_coalesced_): run the fake group on host
            # stand-ins of the same shapes (it moves no data) and hand back the originals.
            back = {}

            def host(a):
                if _is_dev(a):
                    h = torch.empty(a.shape, dtype=a.dtype)
                    back[id(h)] = a
                    return h
                return a

            out = func(*tree_map(host, args), **tree_map(host, kwargs))
            return tree_map(lambda a: back.get(id(a), a), out)


def format_findings(findings: Sequence[Finding]) -> str:
    """One line per distinct finding (kind, op, where), with its count."""
    counts = Counter((f.kind, f.op, f.where, f.declared) for f in findings)
    first = {}
    for f in findings:
        first.setdefault((f.kind, f.op, f.where, f.declared), f)
    return "\n".join(f"{n} x {first[k]}" for k, n in counts.items())


@dataclass
class RankRun:
    """One rank's strict run."""

    rank: int
    world_size: int
    mode: StrictDeviceMode
    result: Any = None


def run_ranks(
    world_size: int,
    body: Callable[[int, StrictDeviceMode], Any],
    ranks: Optional[Sequence[int]] = None,
) -> List[RankRun]:
    """Run ``body(rank, mode)`` for every rank (or only ``ranks``), one after another, each on
    a fresh fake process group of ``world_size`` (WORLD) and under its own
    :class:`StrictDeviceMode`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("strict-device runs need this process without a process group")
    runs = []
    for rank in range(world_size) if ranks is None else ranks:
        # init_process_group chains a rank-prefixing sys.excepthook; do not let them pile up.
        excepthook = sys.excepthook
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            with StrictDeviceMode() as mode:
                result = body(rank, mode)
        finally:
            dist.destroy_process_group()
            sys.excepthook = excepthook
        runs.append(RankRun(rank, world_size, mode, result))
    return runs


def compare_ranks(runs: Sequence[RankRun]) -> List[str]:
    """Differences between the ranks' collective sequences, step by step (empty if none)."""
    problems = []
    ref = runs[0].mode.steps
    for run in runs[1:]:
        steps = run.mode.steps
        if [s.name for s in steps] != [s.name for s in ref]:
            problems.append(f"rank {run.rank} ran steps {[s.name for s in steps]}")
            continue
        for i, (a, b) in enumerate(zip(ref, steps)):
            if a.collectives != b.collectives:
                problems.append(
                    f"step {i} ({a.name}): rank 0 issued {a.collectives}, "
                    f"rank {run.rank} issued {b.collectives}"
                )
    return problems
