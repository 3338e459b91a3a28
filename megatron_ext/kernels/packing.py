"""Packed views of a flat gradient bucket: its weight matrices back to back, and back.

What it does:
    A compressed reduction works on some of a bucket's parameters (the weight matrices)
    packed back to back, skipping the others (biases, norms, padding). :class:`Runs`
    describes such a packing once, at install: run ``i`` is
    ``bucket[starts[i] : starts[i] + numels[i]]`` at packed offset ``offsets[i]``.
    :func:`gather` builds the packed fp32 buffer from the bucket and :func:`scatter_`
    writes packed values back into it (with a cast to the bucket's dtype); both are pure
    functions that the fused kernels (``megatron_ext/kernels/separate.py``,
    ``powersgd.py``) call inside their chains.

    Each has two bodies that move the same elements:

    * eager: one ``torch._foreach_copy_`` over the runs (one multi-tensor kernel on a GPU,
      whatever the number of runs), as the reducers did before the fused kernels;
    * traced by ``torch.compile`` (``torch.compiler.is_compiling()``): index arithmetic
      from a small device table, ``bucket[p + table[p // chunk]]`` for packed position
      ``p`` (``chunk`` divides every run's length, so each chunk lies in one run), which
      inductor fuses into the kernel's other element-wise work as an indirect load or
      store: one kernel for any number of runs, and one compiled kernel for every bucket
      (the run lists, which differ per bucket, are not traced, so they install no guard).

Why two bodies:
    A Python loop over the runs inside a compiled function would trace one copy per run
    (hundreds per bucket), recompile for every bucket layout and launch one kernel per
    run; the table's index arithmetic run eagerly would instead cost several int64 passes
    over the packed buffer (arange, divide, gather). ``tests/unit/test_kernels_dp.py``
    checks that the two bodies move the same elements, bit for bit.

Memory:
    The table holds one int64 per ``chunk`` packed elements, ``chunk`` the greatest common
    divisor of the runs' lengths: a multiple of the hidden size for a transformer's weight
    matrices (under 0.01 bytes per element at hidden 1024), up to 8 bytes per element for
    matrices of coprime sizes (tiny test shapes).

Constraints:
    Pure torch; no torch.distributed, no Megatron. Runs do not overlap. For
    :meth:`Runs.region` they are in bucket order (the packed-to-bucket map is increasing),
    so the packed positions of the elements inside a bucket range ``[lo, hi)`` form one
    interval; :func:`gather` and :func:`scatter_` of whole packings take any order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

__all__ = ["Runs", "Region", "gather", "scatter_"]


@dataclass(frozen=True)
class Region:
    """The packed interval ``[first, last)`` whose elements lie in a bucket range, and the
    pieces of the eager copy: ``bucket[dst[i] : dst[i] + lengths[i]]`` receives packed
    positions ``src[i] ...``."""

    first: int
    last: int
    dst: List[int]
    src: List[int]
    lengths: List[int]


@dataclass(frozen=True)
class Runs:
    """A packing of bucket runs (module docstring)."""

    starts: List[int]
    """Bucket position of each run."""

    offsets: List[int]
    """Packed position of each run."""

    numels: List[int]
    """Length of each run."""

    chunk: int
    """Packed elements per table entry: divides every run's length."""

    table: torch.Tensor
    """int64 ``[ceil(total / chunk)]`` on the bucket's device: bucket position minus packed
    position of each chunk."""

    @classmethod
    def build(cls, starts: Sequence[int], numels: Sequence[int], device: torch.device) -> "Runs":
        """Runs at bucket positions ``starts`` of lengths ``numels``, packed back to back."""
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        chunk = 0
        for n in numels:
            chunk = math.gcd(chunk, int(n))
        chunk = max(chunk, 1)
        shifts = [s - o for s, o, n in zip(starts, offsets, numels) for _ in range(n // chunk)]
        # Built on the host once (install, load, a G-SEPARATE re-segmentation).
        table = torch.tensor(shifts or [0], dtype=torch.long).to(device)
        return cls(list(starts), offsets, list(numels), chunk, table)

    @property
    def total(self) -> int:
        """Packed elements."""
        return sum(self.numels)

    def region(self, lo: int, hi: int) -> Region:
        """The packed positions of the elements in bucket range ``[lo, hi)``."""
        first = last = None
        dst, src, lengths = [], [], []
        for start, off, n in zip(self.starts, self.offsets, self.numels):
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                first = off + (a - start) if first is None else first
                last = off + (b - start)
                dst.append(a)
                src.append(off + (a - start))
                lengths.append(b - a)
        if first is None:
            return Region(0, 0, [], [], [])
        return Region(first, last, dst, src, lengths)


def gather(
    bucket: torch.Tensor,
    size: int,
    total: int,
    table: torch.Tensor,
    chunk: int,
    starts: List[int],
    offsets: List[int],
    numels: List[int],
) -> torch.Tensor:
    """The ``total`` packed elements of ``bucket`` as fp32 ``[size]`` (``size >= total``;
    the elements past ``total`` are zero)."""
    if torch.compiler.is_compiling():
        p = torch.arange(size, device=bucket.device)
        c = torch.clamp(torch.div(p, chunk, rounding_mode="floor"), max=table.numel() - 1)
        valid = p < total
        src = torch.where(valid, p + table[c], 0)
        return torch.where(valid, bucket[src].float(), 0.0)
    out = (torch.zeros if size > total else torch.empty)(
        size, dtype=torch.float32, device=bucket.device
    )
    torch._foreach_copy_(
        [out[o : o + n] for o, n in zip(offsets, numels)],
        [bucket[s : s + n] for s, n in zip(starts, numels)],
    )
    return out


def scatter_(
    bucket: torch.Tensor,
    values: torch.Tensor,
    base: int,
    first: int,
    last: int,
    table: torch.Tensor,
    chunk: int,
    region: Tuple[List[int], List[int], List[int]],
) -> None:
    """Write packed positions ``[first, last)`` into ``bucket`` (cast to its dtype), taking
    packed position ``p`` from ``values[p - base]``; ``region`` is the eager copy's
    ``(dst, src, lengths)`` (:class:`Region`)."""
    if torch.compiler.is_compiling():
        p = torch.arange(first, last, device=bucket.device)
        dst = p + table[torch.div(p, chunk, rounding_mode="floor")]
        bucket.index_put_((dst,), values[first - base : last - base].to(bucket.dtype))
        return
    dst, src, lengths = region
    torch._foreach_copy_(
        [bucket[d : d + n] for d, n in zip(dst, lengths)],
        [values[s - base : s - base + n] for s, n in zip(src, lengths)],
    )
