"""Exact byte accounting of the communication of a training step, by category.

What it does:
    Two independent counters:

    * :class:`CommMeter` is fed by megatron_ext's seams (the data-parallel gradient
      reduction, the pipeline send/receive). Each seam records, per transfer, the bytes of
      the payload it actually hands to ``torch.distributed`` *and* the bytes the same
      transfer would have had uncompressed ("dense"). It keeps per-step and per-run totals
      by category.
    * :class:`ProcessGroupTrafficMeter` wraps the methods of ``torch.distributed``'s
      ``ProcessGroup`` class (the point every collective and point-to-point call of torch,
      megatron-core and megatron_ext goes through) and records every transfer with its
      process group. It measures what the seams cannot see (tensor-parallel all-reduces,
      the distributed optimizer's parameter all-gather, loss and norm reductions) and, in
      tests, checks the seams' numbers against what really reached the process groups.
      Seams wrap their own calls in :meth:`ProcessGroupTrafficMeter.tagged` so that the two
      are not counted twice.

    Categories: ``dp-grad`` (data-parallel gradients), ``dp-param`` (distributed-optimizer
    parameter all-gather), ``pp-act`` / ``pp-grad`` (pipeline activations / activation
    gradients), ``subspace`` (Protocol Models' subspace updates: the boundary-gradient
    accumulator reduced over data parallelism and the new basis sent to every stage),
    ``tp`` (tensor parallelism), ``outer`` (DiLoCo's exchange across sites) and ``other``
    (:data:`~megatron_ext.traffic_categories.CATEGORIES`).

Convention for collectives (why a formula at all):
    A point-to-point transfer of N bytes sends N bytes and receives N bytes, exactly. For a
    collective the bytes a rank puts on the wire depend on the algorithm; we use the ring
    (bus-bandwidth) convention that NCCL's and gloo's ring algorithms realise: over a group
    of p ranks an all-reduce of N bytes sends and receives ``2 (p-1)/p N`` per rank, a
    reduce-scatter (N = input size) and an all-gather (N = output size) ``(p-1)/p N``, a
    broadcast ``(p-1)/p N`` (pipelined ring). Exact for p = 2 with every gloo algorithm and
    checked against interface counters by ``megatron-ext netbench``.

Constraints:
    torch.distributed only; never imports Megatron. Counters are plain Python integers in
    the calling process; aggregation across ranks is the caller's business
    (:func:`all_ranks_totals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_ext.traffic_categories import CATEGORIES

__all__ = [
    "CATEGORIES",
    "Traffic",
    "CommMeter",
    "ProcessGroupTrafficMeter",
    "collective_wire_bytes",
    "all_ranks_totals",
    "gather_rank_totals",
    "sum_rank_totals",
    "comm_report",
    "comm_scalars",
    "collective_device",
    "format_traffic",
    "format_bytes",
]


@dataclass
class Traffic:
    """Bytes of one category: as sent, and as they would be uncompressed."""

    sent: int = 0
    """Bytes this rank put on the wire."""

    recv: int = 0
    """Bytes this rank received."""

    dense_sent: int = 0
    """Bytes that would have been sent without compression."""

    dense_recv: int = 0
    """Bytes that would have been received without compression."""

    num_ops: int = 0
    """Number of transfers recorded."""

    def add(self, other: "Traffic") -> None:
        """Accumulate ``other`` into this record."""
        self.sent += other.sent
        self.recv += other.recv
        self.dense_sent += other.dense_sent
        self.dense_recv += other.dense_recv
        self.num_ops += other.num_ops

    def as_dict(self) -> Dict[str, int]:
        """Plain dict for JSON."""
        return dataclasses.asdict(self)


def collective_wire_bytes(op: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) for a collective under the ring convention.

    Args:
        op: one of ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
            ``all_to_all``, ``send``, ``recv``, ``barrier``.
        nbytes: payload size: the tensor for all_reduce / broadcast / send / recv, the full
            (unsharded) input for reduce_scatter, the full output for all_gather.
        group_size: ranks in the group.

    Returns:
        Bytes sent by this rank (equal to the bytes received for these collectives).
    """
    p = group_size
    if p <= 1 and op not in ("send", "recv"):
        return 0
    if op == "all_reduce":
        return 2 * (p - 1) * nbytes // p
    if op in ("reduce_scatter", "all_gather", "broadcast", "all_to_all"):
        return (p - 1) * nbytes // p
    if op in ("send", "recv"):
        return nbytes
    if op == "barrier":
        return 0
    raise ValueError(f"unknown collective {op!r}")


class CommMeter:
    """Per-step and per-run byte counters by category, fed by the seams.

    Usage per training step: the seams call :meth:`record`; the training loop calls
    :meth:`end_step` once per iteration, which closes the step and returns its counters.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._step: Dict[str, Traffic] = defaultdict(Traffic)
        self._total: Dict[str, Traffic] = defaultdict(Traffic)
        self.num_steps = 0

    def record(
        self,
        category: str,
        *,
        sent: int = 0,
        recv: int = 0,
        dense_sent: Optional[int] = None,
        dense_recv: Optional[int] = None,
    ) -> None:
        """Record one transfer.

        Args:
            category: one of :data:`CATEGORIES`.
            sent: bytes this rank sends.
            recv: bytes this rank receives.
            dense_sent: bytes it would send uncompressed (default: ``sent``).
            dense_recv: bytes it would receive uncompressed (default: ``recv``).
        """
        if not self.enabled:
            return
        if category not in CATEGORIES:
            raise ValueError(f"unknown traffic category {category!r}")
        t = Traffic(
            sent=int(sent),
            recv=int(recv),
            dense_sent=int(sent if dense_sent is None else dense_sent),
            dense_recv=int(recv if dense_recv is None else dense_recv),
            num_ops=1,
        )
        with self._lock:
            self._step[category].add(t)

    def merge(self, counts: Dict[str, Traffic]) -> None:
        """Add externally measured per-category counts to the current step."""
        if not self.enabled:
            return
        with self._lock:
            for category, t in counts.items():
                self._step[category].add(t)

    def current_step(self) -> Dict[str, Traffic]:
        """Counters of the step in progress (a copy)."""
        with self._lock:
            return {c: dataclasses.replace(t) for c, t in self._step.items()}

    def end_step(self) -> Dict[str, Traffic]:
        """Close the current step: add it to the run totals and return its counters."""
        with self._lock:
            step = dict(self._step)
            self._step = defaultdict(Traffic)
            for category, t in step.items():
                self._total[category].add(t)
            self.num_steps += 1
        return step

    def totals(self) -> Dict[str, Traffic]:
        """Run totals over the closed steps (a copy)."""
        with self._lock:
            return {c: dataclasses.replace(t) for c, t in self._total.items()}

    def reset(self) -> None:
        """Forget all counts."""
        with self._lock:
            self._step = defaultdict(Traffic)
            self._total = defaultdict(Traffic)
            self.num_steps = 0


def collective_device(group: Optional[Any] = None) -> torch.device:
    """Where a small tensor must live to be reduced over ``group``: the current CUDA device
    when the group's backend is NCCL (an NCCL-only group cannot reduce CPU tensors, which
    is how Megatron-LM initializes torch.distributed), otherwise the CPU."""
    if "nccl" in str(torch.distributed.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_FIELDS = tuple(f.name for f in dataclasses.fields(Traffic))


def _flatten(counts: Dict[str, Traffic], device: Any = "cpu") -> torch.Tensor:
    return torch.tensor(
        [getattr(counts.get(c, Traffic()), f) for c in CATEGORIES for f in _FIELDS],
        dtype=torch.int64,
        device=device,
    )


def _unflatten(t: torch.Tensor) -> Dict[str, Traffic]:
    values, n, out = t.tolist(), len(_FIELDS), {}
    for i, c in enumerate(CATEGORIES):
        rec = Traffic(*values[i * n : (i + 1) * n])
        if rec.num_ops or rec.sent or rec.recv:
            out[c] = rec
    return out


def all_ranks_totals(
    counts: Dict[str, Traffic], group: Optional[Any] = None, *, with_max: bool = False
) -> Tuple[Dict[str, Traffic], Optional[Dict[str, Traffic]]]:
    """Sum (and, with ``with_max``, max) over ranks of per-category counters: one all-reduce
    of int64s each, not counted as training traffic.

    Args:
        counts: this rank's counters.
        group: process group (default: world).
        with_max: also reduce the per-rank maximum (a second all-reduce).

    Returns:
        ``(sum_over_ranks, max_over_ranks or None)``.
    """
    if not torch.distributed.is_initialized():
        flat = _flatten(counts)
        return _unflatten(flat), (_unflatten(flat) if with_max else None)
    flat = _flatten(counts, collective_device(group))
    total = flat.clone()
    peak = flat.clone() if with_max else None
    with ProcessGroupTrafficMeter.untracked():
        torch.distributed.all_reduce(total, group=group)
        if peak is not None:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    return _unflatten(total), (_unflatten(peak) if peak is not None else None)


def gather_rank_totals(counts: Dict[str, Traffic], group: Optional[Any] = None) -> List[Dict]:
    """Every rank's per-category counters (all-gather), as a list of plain dicts by rank."""
    if not torch.distributed.is_initialized():
        rows = [_flatten(counts)]
    else:
        flat = _flatten(counts, collective_device(group))
        rows = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size(group))]
        with ProcessGroupTrafficMeter.untracked():
            torch.distributed.all_gather(rows, flat, group=group)
    return [{c: rec.as_dict() for c, rec in _unflatten(row).items()} for row in rows]


def sum_rank_totals(per_rank: List[Dict]) -> Dict[str, Traffic]:
    """The sum over ranks of :func:`gather_rank_totals`' rows (no further communication)."""
    out: Dict[str, Traffic] = {}
    for row in per_rank:
        for c, rec in row.items():
            out.setdefault(c, Traffic()).add(Traffic(**rec))
    return out


def comm_scalars(sums: Dict[str, Traffic], num_steps: int = 1) -> Dict[str, float]:
    """TensorBoard / W&B scalars of per-category bytes per step (summed over ranks)."""
    n = max(1, num_steps)
    out: Dict[str, float] = {}
    for c, t in sums.items():
        out[f"comm/{c} bytes sent per step"] = t.sent / n
        out[f"comm/{c} dense bytes per step"] = t.dense_sent / n
    return out


def comm_report(meter: "CommMeter", group: Optional[Any] = None) -> Dict[str, Any]:
    """The ``comm`` block of a run's JSON report: totals over ranks and per step, and every
    rank's totals (collective: one all-gather over ``group``)."""
    per_rank = gather_rank_totals(meter.totals(), group)
    total = sum_rank_totals(per_rank)
    steps = max(1, meter.num_steps)
    return {
        "convention": "bytes per rank; collectives counted with the ring convention "
        "(megatron_ext.accounting)",
        "steps": steps,
        "all_ranks_total": {c: t.as_dict() for c, t in total.items()},
        "all_ranks_per_step": {
            c: {k: v / steps for k, v in t.as_dict().items()} for c, t in total.items()
        },
        "per_rank_total": per_rank,
    }


def format_bytes(nbytes: float) -> str:
    """Human-readable decimal size: ``512 B``, ``12.3 KB``, ``59.09 MB``, ``1.20 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_traffic(counts: Dict[str, Traffic], num_steps: int = 1) -> str:
    """Log-line field in Megatron's style, bytes sent per step summed over ranks.

    Example: `` bytes sent/step (all ranks): dp-grad 3.69 MB (dense 59.09 MB, x16.0),
    other 16 B |``.

    Args:
        counts: per-category bytes (summed over ranks and over the log interval).
        num_steps: steps the counts cover; values are shown per step.
    """
    parts = []
    n = max(1, num_steps)
    for c in CATEGORIES:
        t = counts.get(c)
        if t is None or (t.sent == 0 and t.dense_sent == 0):
            continue
        part = f"{c} {format_bytes(t.sent / n)}"
        if t.dense_sent != t.sent:
            ratio = t.dense_sent / t.sent if t.sent else float("inf")
            part += f" (dense {format_bytes(t.dense_sent / n)}, x{ratio:.1f})"
        parts.append(part)
    if not parts:
        return ""
    return " bytes sent/step (all ranks): " + ", ".join(parts) + " |"


# ---------------------------------------------------------------------------------------------
# Process-group level measurement
# ---------------------------------------------------------------------------------------------


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# ProcessGroup method -> (collective kind, function giving the payload size N from args).
# Arguments follow torch/distributed/distributed_c10d.py's calls into ProcessGroup.
_PG_METHODS: Dict[str, Tuple[str, Callable[[Sequence[Any]], int]]] = {
    "allreduce": ("all_reduce", lambda a: _nbytes(a[0])),
    "allreduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0])),
    # (output(s), input(s)): N = input size.
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_single_coalesced": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[1])),
    # ([outputs], [[inputs per rank]]): N = all inputs.
    "reduce_scatter": ("reduce_scatter", lambda a: _nbytes(a[1])),
    # (output(s), input(s)): N = output size.
    "all_gather_single": ("all_gather", lambda a: _nbytes(a[0])),
    "all_gather_single_coalesced": ("all_gather", lambda a: _nbytes(a[0])),
    "_allgather_base": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_coalesced": ("all_gather", lambda a: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0])),
    # (output, input, ...): N = input size.
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[1])),
    "alltoall_base": ("all_to_all", lambda a: _nbytes(a[1])),
    "alltoall": ("all_to_all", lambda a: _nbytes(a[1])),
    "send": ("send", lambda a: _nbytes(a[0])),
    "recv": ("recv", lambda a: _nbytes(a[0])),
    "recv_anysource": ("recv", lambda a: _nbytes(a[0])),
}


@dataclass
class PGRecord:
    """One transfer seen at the process-group level."""

    group_name: str
    group_size: int
    kind: str
    nbytes: int
    sent: int
    recv: int
    tag: Optional[str]


class ProcessGroupTrafficMeter:
    """Counts every transfer that reaches a ``torch.distributed`` ProcessGroup.

    Installs wrappers on the ``ProcessGroup`` class methods (see ``_PG_METHODS``); the
    wrappers record and delegate. Only one meter can be installed at a time.

    Args:
        classify: maps ``(group, kind)`` of an untagged transfer to a category; default
            ``"other"``.
    """

    _installed: Optional["ProcessGroupTrafficMeter"] = None
    _local = threading.local()

    def __init__(self, classify: Optional[Callable[[Any, str], str]] = None):
        self.classify = classify or (lambda group, kind: "other")
        self.records: List[PGRecord] = []
        self.keep_records = False
        self._lock = threading.Lock()
        self._step: Dict[str, Traffic] = defaultdict(Traffic)
        self._tagged_step: Dict[str, Traffic] = defaultdict(Traffic)
        self._saved: Dict[str, Any] = {}

    # -- tagging ----------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def tagged(cls, category: str, *, force: bool = False) -> Iterator[None]:
        """Mark transfers issued inside the block as already counted by a seam.

        ``force``: the category holds for the whole block, nested ``tagged`` blocks included
        (a DP compressor reused for DiLoCo's outer exchange tags its collectives ``dp-grad``;
        inside the outer step they are ``outer``).
        """
        if getattr(cls._local, "forced", False):
            yield
            return
        prev = getattr(cls._local, "tag", None)
        cls._local.tag = category
        cls._local.forced = force
        try:
            yield
        finally:
            cls._local.tag = prev
            cls._local.forced = False

    @classmethod
    @contextlib.contextmanager
    def untracked(cls) -> Iterator[None]:
        """Transfers inside the block are bookkeeping of the accounting itself: not counted."""
        with cls.tagged("__untracked__"):
            yield

    # -- install ----------------------------------------------------------------------------

    def install(self) -> "ProcessGroupTrafficMeter":
        """Wrap the ProcessGroup methods; returns self."""
        if ProcessGroupTrafficMeter._installed is not None:
            raise RuntimeError("a ProcessGroupTrafficMeter is already installed")
        pg_cls = torch.distributed.ProcessGroup
        for name, (kind, size_fn) in _PG_METHODS.items():
            original = getattr(pg_cls, name, None)
            if original is None:
                continue
            # Keep the raw class attribute (pybind11's method descriptor) to restore it;
            # getattr returns an unbound function that would not bind `self` once set back.
            self._saved[name] = vars(pg_cls).get(name)
            setattr(pg_cls, name, self._wrap(original, kind, size_fn))
        ProcessGroupTrafficMeter._installed = self
        return self

    def remove(self) -> None:
        """Restore the original ProcessGroup methods."""
        pg_cls = torch.distributed.ProcessGroup
        for name, original in self._saved.items():
            if original is None:
                delattr(pg_cls, name)
            else:
                setattr(pg_cls, name, original)
        self._saved.clear()
        if ProcessGroupTrafficMeter._installed is self:
            ProcessGroupTrafficMeter._installed = None

    def _wrap(self, original: Callable, kind: str, size_fn: Callable) -> Callable:
        meter = self

        def wrapper(group, *args, **kwargs):
            try:
                meter._record(group, kind, size_fn(args))
            except Exception:  # accounting must never break communication
                pass
            return original(group, *args, **kwargs)

        wrapper.__name__ = getattr(original, "__name__", kind)
        wrapper.__wrapped__ = original
        return wrapper

    def _record(self, group: Any, kind: str, nbytes: int) -> None:
        tag = getattr(ProcessGroupTrafficMeter._local, "tag", None)
        if tag == "__untracked__":
            return
        size = group.size()
        wire = collective_wire_bytes(kind, nbytes, size)
        sent = 0 if kind == "recv" else wire
        recv = 0 if kind == "send" else wire
        rec = Traffic(sent=sent, recv=recv, dense_sent=sent, dense_recv=recv, num_ops=1)
        with self._lock:
            if tag is None:
                self._step[self.classify(group, kind)].add(rec)
            else:
                self._tagged_step[tag].add(rec)
            if self.keep_records:
                name = group.group_name if hasattr(group, "group_name") else str(id(group))
                self.records.append(PGRecord(name, size, kind, nbytes, sent, recv, tag))

    # -- reading ----------------------------------------------------------------------------

    def end_step(self) -> Tuple[Dict[str, Traffic], Dict[str, Traffic]]:
        """Close the step; returns ``(untagged_by_category, tagged_by_seam_category)``."""
        with self._lock:
            untagged, tagged = dict(self._step), dict(self._tagged_step)
            self._step = defaultdict(Traffic)
            self._tagged_step = defaultdict(Traffic)
        return untagged, tagged
