"""DiLoCo's layout: which ranks exchange with which (sites), and what is exchanged when
(Streaming DiLoCo's fragments).

What it does:
    :func:`site_groups` splits every data-parallel group into runs of consecutive ranks (the
    sites) and builds, for this rank, the group of its site (the gradient seam reduces over
    it every step) and the outer group of the ranks at its position in every site (the
    outer exchange). :func:`split_fragments` splits the parameters (in FQN order) into
    contiguous fragments balanced by element count, every parameter in exactly one;
    :func:`fragment_due` says which fragments synchronize after a given count of inner steps
    (fragment ``i`` after the steps ``t`` with ``t % H == (i * H) // F``).

Why:
    Inside a site training is ordinary data parallelism; only the outer step crosses sites.
    Streaming DiLoCo (Douillard et al., 2025) spreads the outer exchange over the interval:
    one fragment at a time instead of every parameter at once.

Constraints:
    torch.distributed only; never imports Megatron. :func:`site_groups` is collective: every
    rank of the world calls it, in the same order (``new_group`` is collective). The
    fragment schedule is pure Python: the same answer on every rank and site (it is by
    iteration).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["site_groups", "split_fragments", "fragment_due"]


def site_groups(
    dp_group: torch.distributed.ProcessGroup, num_sites: int
) -> Tuple[torch.distributed.ProcessGroup, torch.distributed.ProcessGroup, int]:
    """Process groups of the sites: ``(inner, outer, site)`` for this rank.

    The ranks of every data-parallel group (there is one per tensor/pipeline position) are
    split into ``num_sites`` runs of consecutive data-parallel ranks. ``inner`` is this
    rank's site (the gradient seam reduces over it), ``outer`` the ranks at this rank's
    position in every site (the outer exchange), ``site`` this rank's site index. Every
    rank of the world must call this, in the same order (``new_group`` is collective).

    Raises:
        ValueError: the data-parallel size is not a multiple of ``num_sites``.
    """
    dist = torch.distributed
    ranks = dist.get_process_group_ranks(dp_group)
    dp = len(ranks)
    if num_sites < 1 or dp % num_sites:
        raise ValueError(f"{num_sites} sites do not divide the data-parallel size {dp}")
    everyone: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    all_dp_groups = sorted({tuple(r) for r in everyone})
    per_site = dp // num_sites
    me = dist.get_rank()
    inner = outer = None
    site = -1
    for group_ranks in all_dp_groups:
        for s in range(num_sites):
            members = list(group_ranks[s * per_site : (s + 1) * per_site])
            pg = dist.new_group(members)
            if me in members:
                inner, site = pg, s
        for j in range(per_site):
            members = [group_ranks[s * per_site + j] for s in range(num_sites)]
            pg = dist.new_group(members)
            if me in members:
                outer = pg
    return inner, outer, site


def split_fragments(sizes: Sequence[Tuple[str, int]], num_fragments: int) -> List[List[str]]:
    """Split ``(fqn, numel)`` pairs, in the given order, into contiguous fragments balanced
    by element count; every parameter lands in exactly one fragment (some may be empty when
    one parameter outweighs a fragment's share)."""
    total = sum(n for _, n in sizes)
    out: List[List[str]] = [[] for _ in range(num_fragments)]
    start = 0
    for fqn, n in sizes:
        mid2 = 2 * start + n  # twice the midpoint, kept in integers
        k = min(num_fragments - 1, (mid2 * num_fragments) // (2 * max(total, 1)))
        out[k].append(fqn)
        start += n
    return out


def fragment_due(steps_taken: int, interval: int, num_fragments: int) -> List[int]:
    """The fragments synchronized once ``steps_taken`` (>= 1) inner steps are done."""
    phase = steps_taken % interval
    return [i for i in range(num_fragments) if (i * interval) // num_fragments == phase]
