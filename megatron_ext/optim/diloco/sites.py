"""DiLoCo's sites as process groups: a rank's site and the outer group across sites.

What it does:
    :func:`site_groups` splits every data-parallel group into runs of consecutive ranks (the
    sites) and builds, for this rank, the group of its site (the gradient seam reduces over
    it every step) and the outer group of the ranks at its position in every site (the
    outer exchange).

Why:
    Inside a site training is ordinary data parallelism; only the outer step crosses sites.

Constraints:
    torch.distributed only; never imports Megatron. Collective: every rank of the world
    calls it, in the same order (``new_group`` is collective).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

__all__ = ["site_groups"]


def site_groups(dp_group: Any, num_sites: int) -> Tuple[Any, Any, int]:
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
