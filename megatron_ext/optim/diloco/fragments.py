"""Streaming DiLoCo's fragments: which parameters form a fragment, and when it syncs.

What it does:
    :func:`split_fragments` splits the parameters (in FQN order) into contiguous fragments
    balanced by element count, every parameter in exactly one; :func:`fragment_due` says
    which fragments synchronize after a given count of inner steps (fragment ``i`` after the
    steps ``t`` with ``t % H == (i * H) // F``).

Why:
    Streaming DiLoCo (Douillard et al., 2025) spreads the outer exchange over the interval:
    one fragment at a time instead of every parameter at once.

Constraints:
    Pure Python: the same answer on every rank and site (the schedule is by iteration).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["split_fragments", "fragment_due"]


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
