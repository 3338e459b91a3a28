"""Grass: a linear layer whose backward computes only the selected rows of the weight gradient.

What it does:
    Grass (docs/methods/grass.md) trains a weight ``W`` (``m x n``) through a sparse
    projection ``P^T = rho B``: ``B`` selects ``r`` rows of the gradient ``G = dY^T X`` and
    ``rho`` scales them. The backward never forms ``G``: it computes
    ``G_C = rho (B dY^T) X``, one ``(r x tokens) x (tokens x n)`` matmul, and the input
    gradient ``dX = dY W`` exactly. When ``n < m`` the smaller dimension is projected
    instead (the paper's rule): ``G_C = dY^T (X B^T rho)``, an ``m x r`` matrix of selected
    columns.

    The projected weight itself is frozen (no gradient, no optimizer state); the gradient
    ``G_C`` goes to a small trainable *virtual parameter* ``V`` (``r x n`` or ``m x r``), so
    that data parallelism reduces ``r x n`` values and the optimizer keeps ``r x n`` state
    (the paper's appendix H). ``V`` is the change of the selected rows since the selection,
    in projected coordinates: the selected rows of ``W`` are ``base + P V`` where ``base``
    holds them in fp32 at selection time (:meth:`GrassLayer.write_rows`). Then the gradient
    of ``V`` is exactly ``P^T G = G_C``, and an optimizer step on ``V`` moves ``W`` by
    ``P dV`` — Grass's update ``W <- W + P Delta`` — for every selection rule, with
    duplicate rows (sampling with replacement) summed.

    Selection (:func:`select`) every ``K`` steps from the row norms of the step's gradient:
    Top-r; multinomial by row norm or squared norm with replacement (``rho = 1/sqrt(r q_j)``,
    unbiased) or without (``rho = 1``); uniform with replacement or without (``rho = 1``).
    The norms come from a sketch accumulated in the backward without forming ``G`` for more
    than one microbatch of one layer: ``G Omega = dY^T (X Omega)`` with a seeded Gaussian
    ``Omega`` (``n x s``), which sums exactly over microbatches and data-parallel ranks (an
    ``m x s`` all-reduce), or with ``s = 0`` the exact ``G`` (tests, small models). A fused
    weight (Q/K/V, gate/up) is selected part by part, ``r`` indices each from each part's
    own norms, as the paper's separate layers (:class:`GrassLayer`).

Shapes:
    input ``[..., n]``, weight ``[m, n]``, output ``[..., m]``; tokens = product of the
    leading dimensions.

On a GPU:
    A selection (``index``, ``rho``, the unique rows, the slot table and ``base``) lives on
    the weight's device, moved there once when it is made or loaded. A selection step
    (every ``K`` steps) works on the host: the norms go to the CPU for the sampling, and
    the seeded sketch matrix comes from a CPU generator (the same bits on every rank and
    device). Every other step does no host<->device copy and no host synchronization
    (no ``.item()``, ``.tolist()`` or boolean-mask indexing) in the forward, the backward
    and the optimizer's row write.

    Launches: a layer's microbatch runs the forward matmul, the input-gradient matmul, the
    gather of the selected rows (or columns), the projected matmul and the accumulation
    into ``main_grad`` (5, against dense's 4): ``rho`` is cast once per selection, not
    multiplied at all where it is all ones (top-r and the rules without replacement: known
    on the host when the selection is made), and a lower-precision ``G_C`` is added to the
    fp32 ``main_grad`` without a cast (``add_`` widens it exactly). The optimizer's row
    write of all layers (:func:`write_rows`) batches what it can into foreach ops.

    Duplicate rows (sampling with replacement) are summed deterministically: no
    ``index_add_``, which accumulates with atomics on CUDA (a summation order that changes
    from run to run, so data-parallel replicas would drift apart by an ulp a step). The
    slots of each unique row are listed once per selection in a table and added by
    gathers in slot order (:meth:`GrassLayer.current_rows`): the same order as the CPU's
    sequential ``index_add_``, so the result is bit-identical to it.

Constraints:
    Pure torch; never imports Megatron. Tensor-parallel communication of megatron's
    column- and row-parallel layers is re-done here (sequence-parallel gather and
    reduce-scatter, data-gradient all-reduce, and the sketch sum of ranks that share the
    projected dimension), with the process group passed in.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "SELECTION_METHODS",
    "GrassLayer",
    "grass_linear",
    "select",
    "needs_sketch",
    "projected_dim",
    "virtual_shape",
    "write_rows",
]

SELECTION_METHODS = ("topr", "norm", "norm2", "norm-nr", "norm2-nr", "uniform", "uniform-nr")
"""``--grass-method`` values: Top-r; Multinomial-Norm / -Norm2 with replacement (unbiased
``rho``) or without (``-nr``, ``rho = 1``); uniform with replacement (``rho =
sqrt(size / r)``) or without (``uniform-nr``, ``rho = 1``)."""


def projected_dim(shape: Tuple[int, int]) -> Tuple[str, int]:
    """Which dimension of an ``m x n`` weight Grass projects: ('row', m) if ``m <= n``,
    else ('col', n) — the smaller one (the paper's rule)."""
    m, n = shape
    return ("row", m) if m <= n else ("col", n)


def needs_sketch(method: str, rank: int, size: int) -> bool:
    """Whether the selection depends on the gradient (the uniform rules, and choosing every
    index without replacement, do not)."""
    if method in ("uniform", "uniform-nr"):
        return False
    if rank >= size and method in ("topr", "norm-nr", "norm2-nr"):
        return False
    return True


def select(
    norms_sq: Optional[torch.Tensor],
    size: int,
    rank: int,
    method: str,
    generator: torch.Generator,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Choose ``rank`` of ``size`` indices and their scales ``rho``.

    Args:
        norms_sq: squared row norms of the gradient (fp32, ``[size]``); unused by the
            uniform rules and when every index is chosen without replacement.
        size: number of rows (or columns) to choose from.
        rank: ``r``.
        method: one of :data:`SELECTION_METHODS`.
        generator: CPU generator of the sampling methods (seeded identically on every
            data-parallel rank).

    Returns:
        ``(index, rho)``: int64 ``[r]`` and fp32 ``[r]`` on the CPU. Top-r and the ``-nr``
        methods give distinct indices in increasing order.

    Raises:
        ValueError: ``norms_sq`` holds an inf or NaN (a descending sort puts NaN first, and
            the sampling rules have no distribution to draw from); the caller postpones the
            selection instead (:class:`megatron_ext.optim.grass.GrassOptimizerHook`).
    """
    if method not in SELECTION_METHODS:
        raise ValueError(f"unknown Grass selection method {method!r}")
    if rank > size:
        raise ValueError(f"rank {rank} exceeds the {size} rows to choose from")
    ones = torch.ones(rank, dtype=torch.float32)
    if not needs_sketch(method, rank, size):
        if method == "uniform":
            index = torch.randint(size, (rank,), generator=generator)
            return index, torch.full((rank,), math.sqrt(size / rank))
        if method == "uniform-nr" and rank < size:
            # r distinct indices, every r-subset equally likely; rho = 1 as for the other
            # rules without replacement (the paper's Uniform-NR)
            index = torch.randperm(size, generator=generator)[:rank]
            return torch.sort(index).values, ones
        return torch.arange(size), ones
    # A selection step: the norms come to the host (a synchronization every K steps).
    scores = norms_sq.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("Grass selection from norms that are not finite (inf or NaN)")
    scores = scores.clamp_min(0)
    if method == "topr":
        # Stable order: ties go to the lower index on every rank alike.
        order = torch.sort(scores, descending=True, stable=True).indices[:rank]
        return torch.sort(order).values, ones
    q = scores.sqrt() if method.startswith("norm-") or method == "norm" else scores
    total = q.sum()
    if not torch.isfinite(total):
        # finite norms whose sum overflows fp64 cannot happen from fp32 sketches
        raise ValueError("Grass selection: the sum of the norms is not finite")
    if total <= 0:
        # An all-zero gradient (a layer no token reached) prefers no row: uniform, as the
        # floor below gives any zero row.
        q = torch.ones(size, dtype=torch.float64)
    else:
        # A zero-norm row keeps a tiny probability, so that sampling r distinct rows
        # without replacement is always possible.
        q = q / total
        q = q + 1e-12 / size
    q = q / q.sum()
    if method.endswith("-nr"):
        index = torch.multinomial(q, rank, replacement=False, generator=generator)
        return torch.sort(index).values, ones
    index = torch.multinomial(q, rank, replacement=True, generator=generator)
    rho = (1.0 / torch.sqrt(rank * q[index])).to(torch.float32)
    return index, rho


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


def _slot_table(inverse: torch.Tensor, num_unique: int) -> torch.Tensor:
    """The slots of each unique row, for a deterministic sum of duplicate rows.

    Args:
        inverse: int64 ``[r]`` (CPU): the unique row of each of the ``r`` slots.
        num_unique: ``u``.

    Returns:
        int64 ``[u, c]`` (CPU), ``c`` the largest multiplicity: row ``j`` lists its slots in
        increasing order, padded with ``r`` (a zero row appended to the slots' values).
    """
    r = inverse.numel()
    order = torch.sort(inverse, stable=True).indices  # slots grouped by row, in slot order
    counts = torch.bincount(inverse, minlength=num_unique)
    width = max(1, int(counts.max())) if r else 1
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(width)
    position = (starts[:, None] + column[None, :]).clamp_max(max(r - 1, 0))
    valid = column[None, :] < counts[:, None]
    return torch.where(valid, order[position], torch.full_like(position, r))


def virtual_shape(
    mode: str, weight_shape: Tuple[int, int], rank: int, num_parts: int = 1
) -> Tuple[int, int]:
    """Shape of the virtual parameter ``V`` of a (local) weight with ``num_parts`` parts of
    ``rank`` selections each: ``[parts * r, n]`` for rows, ``[m / parts, parts * r]`` for
    columns (:class:`GrassLayer`)."""
    m, n = weight_shape
    if mode == "row":
        return (num_parts * rank, n)
    return (m // num_parts, num_parts * rank)


@dataclass
class GrassLayer:
    """One projected weight: its selection, virtual parameter and sketch (see module doc).

    A weight may hold several matrices that the paper trains as separate layers (the fused
    Q, K, V of attention; the gate and up projections of SwiGLU). Each such *part* gets its
    own ``r`` indices, chosen by the rule from its own norms:

    * ``mode == 'row'`` with ``part_rows``: each part is a set of rows of the weight (Q, K
      and V interleave per query group in megatron-core); the selected rows of every part
      are the slots of ``V`` (``[parts * r, n]``), part by part.
    * ``mode == 'col'`` with ``num_col_parts = P > 1``: the weight is ``P`` equal blocks of
      ``f = m / P`` rows (gate, up), each choosing its own ``r`` columns. The selectable
      units are the ``P * n`` columns of the blocks placed side by side (``[f, P n]``):
      unit ``k`` is column ``k % n`` of block ``k // n``; ``V`` is ``[f, P r]``.

    Tensor parallelism: ``tp_shared`` says that the projected dimension is not split over
    the ``tp_size`` ranks of ``tp_group`` (rows of a row-parallel layer, columns of a
    column-parallel one): the ranks then sum their sketches (exactly the unsharded
    sketch: ``Omega`` is drawn for the unsharded other dimension and each rank takes its
    slice) and draw from the same generator, so they choose the same indices as one
    unsharded rank would. Otherwise each rank selects among its own shard's indices
    (``rank`` is then the per-shard count) with a generator that also depends on its
    tensor-parallel rank.

    Args:
        fqn: the layer's global FQN (state keys).
        weight: the frozen weight ``[m, n]`` (the model's tensor, updated in place).
        param: the virtual parameter ``V`` (:func:`virtual_shape`).
        mode: 'row' or 'col' (:func:`projected_dim` of each part's unsharded shape).
        rank: ``r`` of each part on this rank.
        method: selection rule.
        sketch_size: columns of the Gaussian sketch (0: the exact gradient).
        seed: run seed of sketches and sampling.
        part_rows: row mode only: the CPU int64 rows of each part (None: one part).
        num_col_parts: col mode only: ``P``.
        tp_group: tensor-parallel group (for ``tp_shared`` with ``tp_size > 1``).
        tp_size: tensor-parallel size of the layer.
        tp_rank: this rank's index in ``tp_group``.
        tp_shared: the projected dimension is replicated over ``tp_group``.
    """

    fqn: str
    weight: torch.Tensor
    param: torch.Tensor
    mode: str
    rank: int
    method: str
    sketch_size: int
    seed: int
    part_rows: Optional[Tuple[torch.Tensor, ...]] = None
    num_col_parts: int = 1
    tp_group: Any = None
    tp_size: int = 1
    tp_rank: int = 0
    tp_shared: bool = False
    # The selection, on the weight's device (set_selection / load_state_dict): the r
    # indices, their scales, the sorted unique rows, the slots of each unique row
    # (_slot_table) and the rows' fp32 values at selection time.
    index: Optional[torch.Tensor] = None
    rho: Optional[torch.Tensor] = None
    unique: Optional[torch.Tensor] = None
    slots: Optional[torch.Tensor] = None
    base: Optional[torch.Tensor] = None
    sketching: bool = False
    sketch: Optional[torch.Tensor] = None
    omega: Optional[torch.Tensor] = None
    # An fp32 copy of the whole weight (keep_master), for an outer synchronization that
    # writes every row of a bf16/fp16 weight: row writes go to both, rows are read from it.
    master: Optional[torch.Tensor] = None
    # col mode with P > 1: the column of each slot, and block / column of each unique unit
    _slot_col: Optional[torch.Tensor] = None
    _unit_block: Optional[torch.Tensor] = None
    _unit_col: Optional[torch.Tensor] = None
    # Known on the host when a selection is made or loaded (no device sync): every rho is 1
    # (top-r and the rules without replacement: no scaling pass), the slot table is the
    # identity (distinct sorted indices: no permutation pass); rho cast to each dtype the
    # backward met (once per selection, not per microbatch).
    _rho_one: bool = False
    _slots_identity: bool = False
    _rho_by_dtype: Optional[Dict[torch.dtype, torch.Tensor]] = None

    def __post_init__(self):
        if self.mode not in ("row", "col"):
            raise ValueError(f"Grass mode must be 'row' or 'col', got {self.mode!r}")
        m, n = self.weight.shape
        if self.part_rows is not None and self.mode != "row":
            raise ValueError("part_rows is for row mode")
        if self.num_col_parts != 1 and (self.mode != "col" or m % self.num_col_parts):
            raise ValueError(f"{self.num_col_parts} column parts do not split {m} rows")
        if self.part_rows is not None:
            self.part_rows = tuple(p.to("cpu", torch.int64) for p in self.part_rows)
        expected = virtual_shape(self.mode, (m, n), self.rank, self.num_parts)
        if tuple(self.param.shape) != expected:
            raise ValueError(
                f"virtual parameter of {self.fqn} is {tuple(self.param.shape)}, expected "
                f"{expected}"
            )

    @property
    def num_parts(self) -> int:
        """Number of parts, each with its own ``r`` indices."""
        if self.mode == "row":
            return 1 if self.part_rows is None else len(self.part_rows)
        return self.num_col_parts

    @property
    def size(self) -> int:
        """Units (rows, or columns of the parts side by side) selected from."""
        m, n = self.weight.shape
        return m if self.mode == "row" else self.num_col_parts * n

    def part_units(self) -> Tuple[torch.Tensor, ...]:
        """The CPU int64 units of each part (indices into :attr:`size`)."""
        if self.mode == "row":
            return self.part_rows if self.part_rows is not None else (torch.arange(self.size),)
        n = self.weight.shape[1]
        return tuple(torch.arange(p * n, (p + 1) * n) for p in range(self.num_col_parts))

    @property
    def _other(self) -> int:
        """Length of a unit (the dimension not projected, per part)."""
        m, n = self.weight.shape
        return n if self.mode == "row" else m // self.num_col_parts

    @property
    def needs_sketch(self) -> bool:
        """Whether this layer's selection depends on the gradient."""
        return any(needs_sketch(self.method, self.rank, part.numel()) for part in self.part_units())

    # -- backward ---------------------------------------------------------------------------

    def _blocks(self, dy: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``dy`` ``[tokens, m]`` split into the column parts' output blocks."""
        return dy.split(self._other, dim=1)

    def projected_grad(self, dy: torch.Tensor, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``G_C`` from output gradients ``dy`` ``[tokens, m]`` and inputs ``x``
        ``[tokens, n]`` (fp32); None before the first selection. Adds to the sketch when
        one is being taken."""
        if self.sketching:
            self._add_sketch(dy, x)
        if self.index is None:
            return None
        # index and rho are on the weight's device already (no copy); rho is cast to dy's
        # dtype once per selection, and a rho of ones scales nothing (x * 1 == x bit for bit)
        rho = None if self._rho_one else self._rho_as(dy.dtype)
        if self.mode == "row":
            rows = dy.index_select(1, self.index)
            return (rows if rho is None else rows * rho).t().matmul(x)
        if self.num_col_parts == 1:
            cols = x.index_select(1, self.index)
            return dy.t().matmul(cols if rho is None else cols * rho)
        # block p's slots are p*r .. (p+1)*r - 1 (part-major, see reselect)
        cols = x.index_select(1, self._slot_col)
        xs = (cols if rho is None else cols * rho).split(self.rank, dim=1)
        return torch.cat([b.t().matmul(c) for b, c in zip(self._blocks(dy), xs)], dim=1)

    def _rho_as(self, dtype: torch.dtype) -> torch.Tensor:
        """``rho`` in ``dtype``, cast once per selection (on the device); fp32 is ``rho``
        itself (no second copy held)."""
        if dtype == self.rho.dtype:
            return self.rho
        if self._rho_by_dtype is None:
            self._rho_by_dtype = {}
        rho = self._rho_by_dtype.get(dtype)
        if rho is None:
            rho = self._rho_by_dtype[dtype] = self.rho.to(dtype)
        return rho

    def _add_sketch(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        dy32, x32 = dy.float(), x.float()
        if self.mode == "row":
            if self.sketch_size == 0:
                part = dy32.t().matmul(x32)
            else:
                part = dy32.t().matmul(x32.matmul(self.omega))
        else:
            parts = []
            for b in self._blocks(dy32):
                left = b.t() if self.sketch_size == 0 else b.matmul(self.omega).t()
                parts.append(left.matmul(x32))
            part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        self.sketch = part if self.sketch is None else self.sketch.add_(part)

    def _generator(self, seed: int, step: int, a: int, b: int) -> torch.Generator:
        key = self.fqn if self.tp_shared or self.tp_size == 1 else f"{self.fqn}@tp{self.tp_rank}"
        return torch.Generator().manual_seed((seed * a + step * b + _stable_hash(key)) % (2**63))

    def start_sketch(self, step: int) -> None:
        """Accumulate a sketch of this step's gradient (cleared by :meth:`reselect`)."""
        self.sketching = self.needs_sketch
        self.sketch = None
        if self.sketching and self.sketch_size > 0:
            other = self._other
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + step * 7919 + _stable_hash(self.fqn)) % (2**63)
            )
            # A selection step: drawn on the CPU (the same bits on every rank and device)
            # and copied to the device once for the step's microbatches. Where the ranks
            # of tp_group sum their sketches, Omega is drawn for the unsharded dimension
            # and each takes its slice, so that the sum is the unsharded G Omega.
            if self.tp_shared and self.tp_size > 1:
                omega = torch.randn(other * self.tp_size, self.sketch_size, generator=gen)
                omega = omega[self.tp_rank * other : (self.tp_rank + 1) * other]
            else:
                omega = torch.randn(other, self.sketch_size, generator=gen)
            self.omega = omega.to(self.weight.device)
            self._sketch_step = step

    def reduce_sketch_over_tp(self) -> None:
        """Sum the sketch over ``tp_group`` where the projected dimension is shared
        (collective over the tensor-parallel group; a no-op otherwise)."""
        if self.sketching and self.tp_shared and self.tp_size > 1:
            if self.sketch is None:
                self.sketch = self.empty_sketch()
            torch.distributed.all_reduce(self.sketch, group=self.tp_group)

    def sketch_norms(self) -> torch.Tensor:
        """Squared norms of the units estimated from the (reduced) sketch."""
        dim = 1 if self.mode == "row" else 0
        return self.sketch.pow(2).sum(dim=dim)

    def empty_sketch(self) -> torch.Tensor:
        """A zero sketch of the right shape (a rank whose backward did not reach the layer)."""
        s = self.sketch_size
        if self.mode == "row":
            shape = (self.size, self._other if s == 0 else s)
        else:
            shape = (self._other if s == 0 else s, self.size)
        return torch.zeros(shape, dtype=torch.float32, device=self.weight.device)

    # -- the weight ------------------------------------------------------------------------

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``V`` (or a tensor shaped like it) with one slot per row."""
        return t if self.mode == "row" else t.t()

    def _gather_units(self, unique: torch.Tensor) -> torch.Tensor:
        """The weight's units ``unique`` (on its device) as rows ``[u, other]`` (from the
        fp32 master copy where there is one)."""
        w = self.weight if self.master is None else self.master
        if self.mode == "row":
            return w.index_select(0, unique)
        if self.num_col_parts == 1:
            return w.t().index_select(0, unique)
        blocks = w.view(self.num_col_parts, self._other, w.shape[1]).transpose(1, 2)
        return blocks[self._unit_block, self._unit_col]

    def _scatter_units(self, rows: torch.Tensor) -> None:
        """Write ``rows`` ``[u, other]`` (fp32) into the weight's selected unique units (and
        into the fp32 master copy where there is one)."""
        targets = [(self.weight, rows.to(self.weight.dtype))]
        if self.master is not None:
            targets.append((self.master, rows.to(self.master.dtype)))
        with torch.no_grad():
            for w, values in targets:
                # distinct indices: index_copy_ and index_put_ are deterministic
                if self.mode == "row":
                    w.index_copy_(0, self.unique, values)
                elif self.num_col_parts == 1:
                    w.t().index_copy_(0, self.unique, values)
                else:
                    blocks = w.view(self.num_col_parts, self._other, w.shape[1]).transpose(1, 2)
                    blocks.index_put_((self._unit_block, self._unit_col), values)

    @property
    def master_dtype(self) -> torch.dtype:
        """Precision of ``base``: fp32 (fp64 for an fp64 weight)."""
        return torch.float64 if self.weight.dtype == torch.float64 else torch.float32

    def current_rows(self, v: torch.Tensor) -> torch.Tensor:
        """fp32 values of the selected unique rows: ``base + P V`` (duplicates summed).

        Deterministic on every device (module doc): ``delta[j]`` adds the scaled rows of
        row ``j``'s slots by one gather per multiplicity, in slot order, instead of an
        atomic ``index_add_``.
        """
        return self.base + self._delta(v)

    def _delta(self, v: torch.Tensor) -> torch.Tensor:
        """``P V`` on the unique rows (:meth:`current_rows` without ``base``); may be a view
        of ``v`` (no scaling, no permutation)."""
        dtype = self.base.dtype
        scaled = self._rows(v).to(dtype)
        if not self._rho_one:
            scaled = scaled * self._rho_as(dtype)[:, None]
        if self._slots_identity:  # distinct sorted rows: slot j is unique row j
            delta = scaled
        elif self.slots.shape[1] == 1:  # distinct rows: a permutation of the slots
            delta = scaled.index_select(0, self.slots[:, 0])
        else:
            padded = torch.cat([scaled, scaled.new_zeros(1, scaled.shape[1])])
            delta = torch.zeros_like(self.base)
            for column in self.slots.unbind(1):
                delta.add_(padded.index_select(0, column))
        return delta

    def write_rows(self, v: torch.Tensor) -> None:
        """Write ``base + P V`` into the selected rows of the frozen weight."""
        if self.index is None:
            return
        self._scatter_units(self.current_rows(v))

    def keep_master(self) -> Optional[torch.Tensor]:
        """Keep an fp32 copy of the whole weight when the weight itself is lower precision
        (bf16/fp16), from now on written with every row write; returns it (None for an
        fp32/fp64 weight, which is its own fp32 value). For an outer synchronization that
        moves every row: without it, rows outside the selection would only hold bf16 values
        and the outer step's fp32 result would be rounded away between syncs. It starts as
        the weight (at install, before the first step; a resume then loads the saved copy);
        the selected rows hold their fp32 values from the next row write on."""
        if self.master is None and self.weight.dtype not in (torch.float32, torch.float64):
            self.master = self.weight.detach().to(torch.float32, copy=True)
        return self.master

    def effective_weight(self) -> torch.Tensor:
        """The weight at full precision: the fp32 master copy, or the fp32/fp64 weight.
        Its selected rows are ``base + P V`` after every optimizer step (the hook's
        :meth:`write_rows`)."""
        if self.master is not None:
            return self.master
        if self.weight.dtype not in (torch.float32, torch.float64):
            raise RuntimeError(f"{self.fqn}: a {self.weight.dtype} weight needs keep_master()")
        return self.weight

    def rebase(self) -> None:
        """After the whole weight was written from outside (an outer step): take the
        selected rows' values as ``base``. The caller then zeroes ``V`` (its Adam moments
        stay: they are of the gradient, not of ``V``'s value)."""
        if self.index is not None:
            self.base = self._gather_units(self.unique).to(self.master_dtype)

    def _adopt(self, index: torch.Tensor, unique: torch.Tensor, device: Any) -> None:
        """Set ``index``, ``unique`` and the column-part helpers on ``device``."""
        self.index = index.to(device)
        self.unique = unique.to(device)
        if self.mode == "col" and self.num_col_parts > 1:
            n = self.weight.shape[1]
            self._slot_col = (index % n).to(device)
            self._unit_block = (unique // n).to(device)
            self._unit_col = (unique % n).to(device)

    def _adopt_scales(self, rho: torch.Tensor, slots: torch.Tensor, device: Any) -> None:
        """Set ``rho`` and the slot table (host tensors, moved to ``device`` here) and what
        the host knows of them: all ones, the identity (module doc, no device sync)."""
        self._rho_one = rho.device.type == "cpu" and bool(rho.eq(1).all())
        self._slots_identity = (
            slots.device.type == "cpu"
            and slots.shape[1] == 1
            and torch.equal(slots[:, 0], torch.arange(slots.shape[0]))
        )
        self._rho_by_dtype = None
        self.rho = rho.detach().to(device, torch.float32)
        self.slots = slots.to(device)

    def set_selection(self, index: torch.Tensor, rho: torch.Tensor, v: torch.Tensor) -> None:
        """Adopt a new selection: fold ``V`` into the weight, take the new rows' fp32 values
        as ``base`` (rows kept from the old selection keep their fp32 values) and zero ``V``.

        ``index`` and ``rho`` come from :func:`select` (CPU); they are moved to the weight's
        device here, once per selection. With several parts, ``index`` lists the ``r``
        slots of each part in turn (:meth:`reselect`).
        """
        device = self.weight.device
        index = index.detach().to("cpu", torch.int64)
        unique, inverse = torch.unique(index, sorted=True, return_inverse=True)
        slots = _slot_table(inverse, unique.numel())
        old_unique, values = None, None
        if self.index is not None:
            values = self.current_rows(v)
            self.write_rows(v)
            old_unique = self.unique
        self._adopt(index, unique, device)
        base = self._gather_units(self.unique).to(self.master_dtype)
        if old_unique is not None:
            # Find each new row among the old (sorted) ones on the device.
            pos = torch.searchsorted(old_unique, self.unique).clamp_max(old_unique.numel() - 1)
            kept = old_unique.index_select(0, pos).eq(self.unique)
            base = torch.where(kept[:, None], values.index_select(0, pos), base)
        self._adopt_scales(rho, slots, device)
        self.base = base
        with torch.no_grad():
            v.zero_()

    def choose(self, step: int, norms: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The selection for ``step`` (CPU ``index``, ``rho``): :func:`select` of each part
        from its own norms, the parts' ``r`` slots one after another."""
        gen = self._generator(self.seed, step, 1_000_033, 104_729)
        parts = self.part_units()
        if len(parts) == 1:
            return select(norms, self.size, self.rank, self.method, gen)
        if norms is not None:
            norms = norms.detach().to("cpu")
        indices, rhos = [], []
        for part in parts:
            own = None if norms is None else norms.index_select(0, part)
            index, rho = select(own, part.numel(), self.rank, self.method, gen)
            indices.append(part.index_select(0, index))
            rhos.append(rho)
        return torch.cat(indices), torch.cat(rhos)

    def reselect(self, step: int, v: torch.Tensor, norms: Optional[torch.Tensor] = None) -> None:
        """Choose the next selection (from the reduced sketch where one was taken).

        Args:
            step: the selection step (seeds the sampling).
            v: the virtual parameter's fp32 values (folded into the weight, then zeroed).
            norms: :meth:`sketch_norms`, if the caller has them already.
        """
        if not self.sketching:
            norms = None
        elif norms is None:
            norms = self.sketch_norms()
        index, rho = self.choose(step, norms)
        self.set_selection(index, rho, v)
        self.sketching, self.sketch, self.omega = False, None, None

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Selection and fp32 rows (no sketch: a checkpoint is taken between steps)."""
        if self.index is None:
            return {}
        return {
            "index": self.index.detach().cpu().clone(),
            "rho": self.rho.detach().cpu().clone(),
            "base": self.base.detach().cpu().clone(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the weight and ``V`` come from the model checkpoint)."""
        if not state:
            self.index = self.rho = self.unique = self.slots = self.base = None
            return
        index = state["index"].to("cpu", torch.int64)
        unique, inverse = torch.unique(index, sorted=True, return_inverse=True)
        if index.numel() != self.num_parts * self.rank or state["base"].shape != (
            unique.numel(),
            self._other,
        ):
            raise ValueError(f"Grass state of {self.fqn} does not fit its weight")
        # moved to the weight's device once, here
        device = self.weight.device
        self._adopt(index, unique, device)
        self._adopt_scales(state["rho"], _slot_table(inverse, unique.numel()), device)
        self.base = state["base"].to(device, self.master_dtype)
        self.sketching, self.sketch, self.omega = False, None, None


def write_rows(layers: Sequence[GrassLayer], values: Sequence[torch.Tensor]) -> None:
    """:meth:`GrassLayer.write_rows` of several layers (``values``: each one's ``V``) with
    the same results: the additions ``base + P V`` of the layers whose two operands share
    one layout (row mode; the scaling and permutation that are not identities already done
    per layer) run as one foreach op per device and dtype (one launch instead of one per
    layer); each layer's scatter into its weight stays its own op.

    Not a fused kernel per layer: the rows are ``r x n`` (about 1% of Grass's traffic), so a
    row write is bound by launches and host time, and a custom op costs more host time per
    call than the passes it would merge (CPU, one thread, 8 x 32 rows: the eager chain of
    add, cast and ``index_copy_`` 6 us; the same as a custom op 28 us eager, 52 us
    compiled). Batching across layers is what pays."""
    chosen = [(layer, v) for layer, v in zip(layers, values) if layer.index is not None]
    deltas = [layer._delta(v) for layer, v in chosen]
    rows: List[Optional[torch.Tensor]] = [None] * len(chosen)
    groups: Dict[Tuple[Any, torch.dtype], List[int]] = {}
    for i, ((layer, _), delta) in enumerate(zip(chosen, deltas)):
        base = layer.base
        if delta.shape == base.shape and delta.stride() == base.stride():
            groups.setdefault((base.device, base.dtype), []).append(i)
        else:
            rows[i] = base + delta
    for members in groups.values():
        bases = [chosen[i][0].base for i in members]
        sums = torch._foreach_add(bases, [deltas[i] for i in members])
        for i, total in zip(members, sums):
            rows[i] = total
    for (layer, _), total in zip(chosen, rows):
        layer._scatter_units(total)


# torch >= 2.13 names these all_gather_single / reduce_scatter_single and deprecates the old
# names with a FutureWarning at every call site; older releases only have the old names.
_ALL_GATHER = getattr(torch.distributed, "all_gather_single", None) or (
    torch.distributed.all_gather_into_tensor
)
_REDUCE_SCATTER = getattr(torch.distributed, "reduce_scatter_single", None) or (
    torch.distributed.reduce_scatter_tensor
)


def _all_gather_first_dim(t: torch.Tensor, group: Any) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    _ALL_GATHER(out, t.contiguous(), group=group)
    return out


def _reduce_scatter_first_dim(t: torch.Tensor, group: Any) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    out = torch.empty((t.shape[0] // world,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    _REDUCE_SCATTER(out, t.contiguous(), group=group)
    return out


class _GrassLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, param, layer, allreduce_dgrad, sequence_parallel, group):
        total = _all_gather_first_dim(input, group) if sequence_parallel else input
        output = torch.matmul(total, weight.t())
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(input, weight)
        ctx.layer, ctx.group = layer, group
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        ctx.has_bias = bias is not None and bias.requires_grad
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        layer, group = ctx.layer, ctx.group
        total = _all_gather_first_dim(input, group) if ctx.sequence_parallel else input
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter_first_dim(grad_input, group)
        elif ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=group)
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        x = total.reshape(-1, total.shape[-1])
        grad_bias = dy.sum(dim=0) if ctx.has_bias else None
        g = layer.projected_grad(dy, x)
        param = layer.param
        if g is None:
            g = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            # megatron-core DDP: accumulate in its fp32 buffer (gradient-accumulation
            # fusion); the dummy gradient still runs the parameter's grad hook. A lower
            # precision g is added as it is: add_ widens it exactly, as a cast would.
            if torch.promote_types(g.dtype, main_grad.dtype) != main_grad.dtype:
                g = g.to(main_grad.dtype)
            main_grad.add_(g)
            param.grad_added_to_main_grad = True
            grad_param = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        else:
            grad_param = g.to(param.dtype)
        return grad_input, None, grad_bias, grad_param, None, None, None, None


def grass_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    layer: GrassLayer,
    *,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """``input @ weight.T (+ bias)`` with Grass's backward (see module doc).

    Args:
        input: ``[..., n]`` (this rank's sequence shard under sequence parallelism).
        weight: the frozen ``[m, n]`` weight (``layer.weight``).
        bias: optional ``[m]`` bias, trained densely.
        layer: selection, virtual parameter and sketch of this weight.
        allreduce_dgrad: all-reduce the input gradient over ``group`` (column-parallel).
        sequence_parallel: all-gather the input over ``group`` along dim 0 in forward and
            reduce-scatter the input gradient in backward.
        group: tensor-parallel process group.
    """
    return _GrassLinear.apply(
        input, weight, bias, layer.param, layer, allreduce_dgrad, sequence_parallel, group
    )
