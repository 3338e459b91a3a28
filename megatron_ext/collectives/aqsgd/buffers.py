"""AQ-SGD's per-sample activation buffers: where ``m(xi)`` lives and how its rows move.

What it does:
    :class:`SampleBuffers` holds one side of one pipeline boundary: ``[num_slots, rows,
    cols]`` (one row per sample this data-parallel rank owns, of this rank's tokens by the
    hidden size) and the host visit flags, in one of three tiers: device memory (indexed in
    place by the fused kernels), host memory (read through two pinned staging tensors used
    in turn) or a memory-mapped file. Host and disk reads can be prefetched on a background
    thread. :func:`buffer_nbytes` sizes one buffer (the codec's fit check and preflight).
    :class:`_Staged` (a step's pending update of one buffer) and :class:`_Plan` (one
    microbatch's indices, prepared by ``AQSGDCodec.begin_step``) are the records the codec
    stages a step in.

Why:
    The storage (tier, staging, prefetch) is one concern and the codec's protocol
    (``codecs.py``: what is sent, written and committed, and when) another; each reads and
    is tested on its own.

Constraints:
    torch and numpy only (never torch.distributed or Megatron). Slot indices and visit
    flags live on the host (payload sizes must be known before a receive is posted). A
    host or disk read never makes a ``non_blocking`` copy of pageable memory (it would be
    synchronous): rows go through pinned staging, reused only once its copy is done.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["SampleBuffers", "buffer_nbytes"]


def buffer_nbytes(num_slots: int, rows: int, cols: int, dtype: torch.dtype) -> int:
    """Bytes of one boundary's buffer."""
    return num_slots * rows * cols * torch.tensor([], dtype=dtype).element_size()


def _key(slots: torch.Tensor) -> bytes:
    """A prefetch key of host slot indices (no device synchronization)."""
    return slots.numpy().tobytes()


class SampleBuffers:
    """``m(xi)`` of one side of one boundary: ``[num_slots, rows, cols]`` plus visit flags.

    The visit flags and the slot indices that callers pass live on the host: the payload
    size of a transfer depends on them and must be known before the receive is posted.
    Device buffers are indexed with the same slots on their device, passed by the caller
    (prepared once per step), or else copied there per access (a small host-to-device
    copy, no device-to-host synchronization). Host and disk
    buffers gather the rows into a pinned staging tensor (two of them, used in turn, each
    reused only once the copy out of it has completed) and copy that to the device
    asynchronously: indexing a host tensor returns pageable memory, whose
    ``non_blocking`` copy would be synchronous.

    Args:
        num_slots: samples this rank owns.
        rows: sequence length (of this rank's shard).
        cols: hidden size.
        dtype: storage dtype.
        where: "device", "host" (pageable; staged through pinned memory when CUDA exists)
            or "disk" (memory-mapped file).
        device: where rows are used.
        path: the file of "disk" buffers.
    """

    def __init__(
        self,
        num_slots: int,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        where: str,
        device: torch.device,
        path: Optional[str] = None,
    ):
        self.num_slots, self.rows, self.cols, self.dtype = num_slots, rows, cols, dtype
        self.where, self.device, self.path = where, torch.device(device), path
        self.visited = torch.zeros(num_slots, dtype=torch.bool)
        self.row_bytes = rows * cols * torch.tensor([], dtype=dtype).element_size()
        self._memmap = None
        self._data: Optional[torch.Tensor] = None
        if where == "device":
            self._data = torch.zeros(num_slots, rows, cols, dtype=dtype, device=self.device)
        elif where == "host":
            self._data = torch.zeros(num_slots, rows, cols, dtype=dtype)
        elif where == "disk":
            self._memmap = np.memmap(
                path, mode="w+", dtype=np.uint8, shape=(num_slots, self.row_bytes)
            )
        else:
            raise ValueError(f"unknown buffer place {where!r}")
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._prefetched: Dict[bytes, concurrent.futures.Future] = {}
        # Host and disk buffers read into one of two pinned tensors (a CUDA device only);
        # the event says when the copy out of it is done and it may be refilled.
        self._staging: List[Optional[torch.Tensor]] = [None, None]
        self._staging_done: List[Optional[Any]] = [None, None]
        self._turn = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows."""
        return self.num_slots * self.row_bytes

    @property
    def table(self) -> torch.Tensor:
        """The whole ``[num_slots, rows, cols]`` tensor of device buffers (the fused kernels
        read and update its rows in place; ``megatron_ext/kernels/quant.py``)."""
        if self.where != "device":
            raise ValueError("only device buffers are indexed by the kernels in place")
        return self._data

    def _staging_rows(self, k: int) -> Tuple[torch.Tensor, int]:
        """A pinned ``[k, rows, cols]`` view whose previous copy to the device is done."""
        turn = self._turn
        self._turn ^= 1
        done = self._staging_done[turn]
        if done is not None:
            done.synchronize()
        buf = self._staging[turn]
        if buf is None or buf.shape[0] < k:
            buf = torch.empty(k, self.rows, self.cols, dtype=self.dtype, pin_memory=True)
            self._staging[turn] = buf
        return buf[:k], turn

    def _load(self, slots: torch.Tensor) -> Tuple[torch.Tensor, Optional[Any]]:
        """Rows of host / disk ``slots`` (host int64) on the device, and the CUDA event
        that completes their copy (None on the CPU)."""
        k = slots.numel()
        if self._memmap is not None:
            raw = torch.from_numpy(self._memmap[slots.numpy()])
            rows = raw.view(self.dtype).view(k, self.rows, self.cols)
        else:
            rows = None
        if self.device.type != "cuda":
            if rows is None:
                rows = self._data.index_select(0, slots)
            return rows.to(self.device), None
        # The prefetch thread's current device is not this rank's: name it. The lock
        # keeps the prefetch thread and a direct read from taking the same staging tensor.
        with self._lock, torch.cuda.device(self.device):
            staging, turn = self._staging_rows(k)
            if rows is not None:
                staging.copy_(rows)
            else:
                torch.index_select(self._data, 0, slots, out=staging)
            out = staging.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        self._staging_done[turn] = done
        return out, done

    def prefetch(self, slots: torch.Tensor) -> None:
        """Start reading ``slots`` (host int64) in the background (host and disk buffers)."""
        if self.where == "device":
            return
        key = _key(slots)
        if key in self._prefetched:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._prefetched[key] = self._executor.submit(self._load, slots.clone())

    def read(self, slots: torch.Tensor, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows of ``slots`` (host int64) on the device, ``[k, rows, cols]`` (a prefetched
        read if any). ``index``: the same slots already on the device (device buffers
        then copy nothing to the device)."""
        if self.where == "device":
            if index is None:
                index = slots.to(self.device, non_blocking=True)
            return self._data.index_select(0, index)
        future = self._prefetched.pop(_key(slots), None)
        rows, done = future.result() if future is not None else self._load(slots)
        if done is not None:
            # The copy ran on the reading thread's stream; order this stream after it.
            torch.cuda.current_stream(self.device).wait_event(done)
        return rows

    def write(
        self,
        slots: torch.Tensor,
        values: torch.Tensor,
        index: Optional[torch.Tensor] = None,
        keep: Optional[torch.Tensor] = None,
    ) -> None:
        """Store ``values`` (``[k, rows, cols]``, the storage dtype) at ``slots`` (host
        int64, distinct).

        Args:
            slots: host int64 slots.
            values: rows to store.
            index: device buffers: the same slots on the device (no host-to-device copy).
            keep: device buffers: a device bool ``[k]``; rows where it is False keep their
                old value (a ``where`` on the device: the host never reads the mask).
        """
        if self._memmap is not None:
            if keep is not None:
                raise ValueError("a device mask is only for device buffers")
            raw = values.detach().to("cpu").contiguous().view(torch.uint8)
            self._memmap[slots.numpy()] = raw.reshape(slots.numel(), -1).numpy()
            return
        if index is None:
            index = slots.to(self._data.device, non_blocking=True)
        values = values.detach().to(self._data.device)
        if keep is not None:
            if self.where != "device":
                raise ValueError("a device mask is only for device buffers")
            old = self._data.index_select(0, index)
            values = torch.where(keep.view(-1, 1, 1), values, old)
        self._data.index_copy_(0, index, values)

    def checksum(self) -> float:
        """Sum of the stored values and visit flags (for the bit-identity tests)."""
        if self._memmap is not None:
            data = torch.from_numpy(np.asarray(self._memmap)).view(self.dtype)
        else:
            data = self._data
        return float(data.double().sum()) + float(self.visited.sum())

    def contents(self) -> torch.Tensor:
        """All rows, ``[num_slots, rows, cols]`` on the CPU (for checkpoints)."""
        if self._memmap is not None:
            self._memmap.flush()
            raw = torch.from_numpy(np.array(self._memmap))
            return raw.view(self.dtype).view(self.num_slots, self.rows, self.cols)
        return self._data.detach().to("cpu").clone()

    def restore(self, rows: torch.Tensor, visited: torch.Tensor) -> None:
        """Set every row and visit flag (from :meth:`contents` of a checkpoint)."""
        if tuple(rows.shape) != (self.num_slots, self.rows, self.cols):
            raise ValueError(
                f"AQ-SGD buffer of shape {tuple(rows.shape)} does not fit "
                f"{(self.num_slots, self.rows, self.cols)}"
            )
        self.write(torch.arange(self.num_slots), rows.to(self.dtype))
        self.visited.copy_(visited)

    def drop_prefetched(self) -> None:
        """Forget reads not consumed yet (the rows may change at a commit)."""
        self._prefetched.clear()

    def reset(self) -> None:
        """Forget every sample: the next visit of each is a full-precision first visit."""
        self.visited.zero_()
        self._prefetched.clear()


@dataclass
class _Staged:
    """A step's pending update of one buffer (one microbatch)."""

    slots: torch.Tensor
    """Host int64 slots."""

    values: Optional[torch.Tensor]
    """``[k, rows, cols]`` in the buffer dtype (clamped to its range), on the device; None
    once written, or for a deferred update (``payload``)."""

    finite: Optional[torch.Tensor]
    """Device bool ``[k]``: the sample's value was finite (only those are written); None
    until a deferred update is applied."""

    clamped: Optional[torch.Tensor]
    """Device bool ``[k]``: the value was clamped to the buffer dtype's range (None as
    ``finite``)."""

    index: Optional[torch.Tensor] = None
    """The slots on the device (from :meth:`AQSGDCodec.begin_step`), or None."""

    exact: bool = False
    """``values`` already hold the current row of every non-finite sample (revisits: the
    fused decode keeps ``m``), so a commit of distinct slots writes them as they are."""

    written: bool = False
    """The rows were written on the device already (only the visit flags are pending)."""

    payload: Optional[torch.Tensor] = None
    """A deferred update of device buffer rows (revisits): the quantized deltas, applied to
    the buffer in place at the commit (``aqsgd_commit_rows``); None once applied."""


@dataclass
class _Plan:
    """One microbatch's indices on one side, prepared by :meth:`AQSGDCodec.begin_step`:
    host copies decide payload sizes, device copies index device tensors."""

    slots: torch.Tensor
    """Host int64 slots of the microbatch's samples."""

    num_first: int
    """How many of them are first visits (travel raw)."""

    revisit_slots: torch.Tensor
    """Host int64 slots of the revisits (host / disk buffer reads)."""

    first_slots: torch.Tensor
    """Host int64 slots of the first visits."""

    first: torch.Tensor
    """Device positions (in the microbatch) of the first visits."""

    revisit: torch.Tensor
    """Device positions of the revisits."""

    revisit_index: torch.Tensor
    """Device slots of the revisits."""

    first_index: torch.Tensor
    """Device slots of the first visits."""

    index: torch.Tensor
    """Device slots of every sample (warm-up commits)."""
