"""Rank layout of a Megatron job and the rank pairs a netbench run shapes.

What it does:
    :class:`ParallelLayout` maps a global rank to its (tensor, data, pipeline) parallel
    coordinates with Megatron's default order ``"tp-cp-ep-dp-pp"`` (tensor parallel fastest,
    then data parallel, then pipeline; context and expert parallel sizes are 1 here)::

        rank = pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank

    It classifies each ordered rank pair by the kind of traffic Megatron sends over it
    (:data:`PAIR_PP`, :data:`PAIR_DP`, :data:`PAIR_TP` or :data:`PAIR_OTHER`) and turns a
    shaping scope (:data:`SCOPES`) into the set of pairs to shape. With ``sites`` S, the
    data-parallel ranks are split into S sites of consecutive DP ranks (a site is a contiguous
    block of DP ranks across every tensor and pipeline coordinate, the groups of an outer
    synchronization such as DiLoCo) and the ``"sites"`` scope selects every pair of ranks in
    different sites. :func:`select_check_links` picks the few links whose throughput is
    measured before a run.

Why:
    A compression method helps only the traffic it compresses: gradient compression the
    data-parallel links, activation compression the links between pipeline stages. Shaping
    one kind of link at a time (``--shape pp`` or ``--shape dp``) models a cluster whose
    slow links carry that traffic, for example pipeline stages on different nodes.
    ``--shape sites`` models training across datacenters: fast links inside a site, a slow
    link between sites, whatever kind of traffic crosses it.

Constraints:
    Pure Python; no torch, no Megatron, no subprocesses, so it is unit-tested without root.
    Context and expert parallelism are not modelled (their sizes are taken as 1).
"""

from __future__ import annotations

import dataclasses
from typing import FrozenSet, List, Optional, Set, Tuple

__all__ = [
    "PAIR_DP",
    "PAIR_OTHER",
    "PAIR_PP",
    "PAIR_TP",
    "SCOPES",
    "ParallelLayout",
    "RankCoord",
    "select_check_links",
]

Pair = Tuple[int, int]

PAIR_PP = "pp"
"""The two ranks sit in different pipeline stages (their ``pp_rank`` differs)."""

PAIR_DP = "dp"
"""Same pipeline stage and tensor-parallel rank, different data-parallel rank."""

PAIR_TP = "tp"
"""Same pipeline stage and data-parallel rank, different tensor-parallel rank."""

PAIR_OTHER = "other"
"""Same pipeline stage, but both the tensor- and data-parallel ranks differ."""

SCOPES = ("all", "pp", "dp", "sites")
"""Shaping scopes: every link, links between pipeline stages, data-parallel links, or the
links between sites (ranks whose data-parallel ranks fall in different sites)."""


@dataclasses.dataclass(frozen=True)
class RankCoord:
    """Parallel coordinates of one global rank."""

    tp_rank: int
    """Rank inside the tensor-parallel group."""

    dp_rank: int
    """Rank inside the data-parallel group."""

    pp_rank: int
    """Pipeline stage."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """World size split into tensor, data and pipeline parallel groups (Megatron order).

    Raises:
        ValueError: A size is not a positive integer, or ``world_size`` is not divisible by
            ``tp_size * pp_size``.
    """

    world_size: int
    """Number of ranks."""

    tp_size: int = 1
    """Tensor-parallel size (Megatron's ``--tensor-model-parallel-size``)."""

    pp_size: int = 1
    """Pipeline-parallel size (Megatron's ``--pipeline-model-parallel-size``)."""

    sites: int = 1
    """Number of sites the data-parallel ranks are split into (consecutive DP ranks)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "sites"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % (self.tp_size * self.pp_size):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tp*pp = "
                f"{self.tp_size}*{self.pp_size}; the data-parallel size must be an integer"
            )
        if self.dp_size % self.sites:
            raise ValueError(
                f"the data-parallel size {self.dp_size} (world {self.world_size} / "
                f"(tp {self.tp_size} * pp {self.pp_size})) is not divisible by {self.sites} "
                "sites; every site needs the same number of data-parallel ranks"
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel size, ``world_size // (tp_size * pp_size)``."""
        return self.world_size // (self.tp_size * self.pp_size)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")

    def coord(self, rank: int) -> RankCoord:
        """Coordinates of a global rank.

        Args:
            rank: Global rank in ``[0, world_size)``.

        Returns:
            Its tensor-, data- and pipeline-parallel ranks.
        """
        self._check_rank(rank)
        return RankCoord(
            tp_rank=rank % self.tp_size,
            dp_rank=(rank // self.tp_size) % self.dp_size,
            pp_rank=rank // (self.tp_size * self.dp_size),
        )

    def site(self, rank: int) -> int:
        """Site of a global rank: ``dp_rank // (dp_size // sites)`` (consecutive DP ranks)."""
        return self.coord(rank).dp_rank // (self.dp_size // self.sites)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank of the given coordinates (inverse of :meth:`coord`)."""
        if not (
            0 <= tp_rank < self.tp_size
            and 0 <= dp_rank < self.dp_size
            and 0 <= pp_rank < self.pp_size
        ):
            raise ValueError(f"coordinates tp={tp_rank} dp={dp_rank} pp={pp_rank} out of range")
        return pp_rank * self.dp_size * self.tp_size + dp_rank * self.tp_size + tp_rank

    def classify(self, src: int, dst: int) -> str:
        """Kind of the ordered pair ``(src, dst)``: one of the ``PAIR_*`` constants.

        Raises:
            ValueError: A rank is out of range or ``src == dst``.
        """
        if src == dst:
            raise ValueError(f"a link needs two different ranks, got {src} twice")
        a, b = self.coord(src), self.coord(dst)
        if a.pp_rank != b.pp_rank:
            return PAIR_PP
        if a.tp_rank == b.tp_rank:
            return PAIR_DP
        if a.dp_rank == b.dp_rank:
            return PAIR_TP
        return PAIR_OTHER

    def all_pairs(self) -> List[Pair]:
        """Every ordered pair of different ranks, sorted."""
        n = self.world_size
        return [(s, d) for s in range(n) for d in range(n) if s != d]

    def pairs(self, scope: str) -> FrozenSet[Pair]:
        """Ordered rank pairs that a shaping scope selects.

        Args:
            scope: ``"all"`` (every pair), ``"pp"`` (ranks in different pipeline stages)
                ``"dp"`` (data-parallel peers) or ``"sites"`` (ranks in different sites,
                whatever their tensor and pipeline coordinates).

        Returns:
            The selected pairs; it can be empty (``"pp"`` with one stage, ``"sites"`` with
            one site).
        """
        if scope not in SCOPES:
            raise ValueError(f"unknown shaping scope {scope!r}; choose one of {SCOPES}")
        if scope == "all":
            return frozenset(self.all_pairs())
        if scope == "sites":
            return frozenset(p for p in self.all_pairs() if self.site(p[0]) != self.site(p[1]))
        return frozenset(p for p in self.all_pairs() if self.classify(*p) == scope)


def _ring_order(num_ranks: int, pair: Pair) -> Tuple[int, int]:
    # Ring neighbours first (distance 1), then further ranks: those are the links a ring
    # collective uses, so they are the most representative ones to measure.
    return ((pair[1] - pair[0]) % num_ranks, pair[0])


def select_check_links(
    num_ranks: int,
    shaped_pairs: Set[Pair],
    *,
    max_links: int = 4,
    include_unshaped: bool = True,
) -> Tuple[List[Pair], Optional[Pair]]:
    """Pick a representative subset of links to measure before a run.

    Shaping is installed on each sender's interface, so every sender with shaped traffic
    owns its own qdisc; the selection first takes one shaped link per sender (ring
    neighbour first), then fills up to ``max_links`` with further shaped links in ring
    order. All shaped links are measured when there are at most ``max_links``.

    Args:
        num_ranks: Number of ranks.
        shaped_pairs: Ordered pairs whose traffic is shaped.
        max_links: Upper bound on the number of shaped links returned.
        include_unshaped: Also return one unshaped link (if any exists) as a reference.

    Returns:
        ``(shaped_links, unshaped_link)``; ``unshaped_link`` is ``None`` when not asked for
        or when every pair is shaped.
    """
    if max_links < 0:
        raise ValueError(f"max_links must be >= 0, got {max_links}")
    shaped = sorted(shaped_pairs, key=lambda p: _ring_order(num_ranks, p))
    chosen: List[Pair] = []
    senders: Set[int] = set()
    for pair in shaped:
        if len(chosen) >= max_links:
            break
        if pair[0] not in senders:
            senders.add(pair[0])
            chosen.append(pair)
    for pair in shaped:
        if len(chosen) >= max_links:
            break
        if pair not in chosen:
            chosen.append(pair)
    unshaped: Optional[Pair] = None
    if include_unshaped:
        everything = [(s, d) for s in range(num_ranks) for d in range(num_ranks) if s != d]
        rest = sorted(
            (p for p in everything if p not in shaped_pairs),
            key=lambda p: _ring_order(num_ranks, p),
        )
        unshaped = rest[0] if rest else None
    return chosen, unshaped
