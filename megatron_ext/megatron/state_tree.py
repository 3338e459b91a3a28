"""The values of a nested state dict with their paths, for the checks that walk one.

What it does:
    :func:`leaves_with_paths` yields ``(path, value)`` for every value of a tree of dicts,
    lists and tuples that is not itself one of them, depth first and in order; a dict's key
    or a sequence's index extends the path.

Why:
    The finiteness checks of a save (:mod:`megatron_ext.megatron.save_checks`) and of a load
    (:mod:`megatron_ext.megatron.checkpoint.finite`) walk the same trees (dist_checkpointing
    state dicts and what a load returns) and name what they find by its path; each picks the
    values it looks at.

Constraints:
    Pure Python: no torch or megatron import, so both checks can import it at module level.
"""

from __future__ import annotations

from typing import Any, Iterator, Tuple

__all__ = ["leaves_with_paths"]


def leaves_with_paths(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple, Any]]:
    """``(path, value)`` of every value of ``tree`` that is not a dict, list or tuple.

    Args:
        tree: nested dicts, lists and tuples (a value of another type is its own leaf).
        path: the path of ``tree`` itself, prefixed to every path yielded.
    """
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves_with_paths(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves_with_paths(v, path + (i,))
    else:
        yield path, tree
