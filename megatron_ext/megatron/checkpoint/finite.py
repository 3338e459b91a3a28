"""Finiteness of what a load reads: a non-finite value stops the resume, naming tensor and file.

What it does:
    :func:`check_finite` (collective) stops unless every floating value loaded on every rank
    is finite; the error names the checkpoint key, the path in the state dict, how many
    values are not finite and the ``__R_N.distcp`` file holding the first one
    (:func:`_stored_file`, from the load template's sharded objects collected by
    :func:`sharded_leaves` before the load).

Why:
    A corrupted byte range can read back as NaN; training on from it fails much later, or
    silently. Saves refuse non-finite values too (:mod:`megatron_ext.megatron.save_checks`),
    so a non-finite value at load means a corrupted or older checkpoint.

Constraints:
    Python floats are not checked (some legitimately hold inf). Every rank takes part in
    the check, so every rank raises the same error. Shared with the Megatron-LM adapter.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from megatron_ext.megatron.checkpoint.errors import CheckpointError
from megatron_ext.megatron.checkpoint.reading import _read_metadata
from megatron_ext.megatron.state_tree import leaves_with_paths


def sharded_leaves(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple, Any]]:
    """``(path, leaf)`` of every dist_checkpointing object (ShardedTensor, ShardedObject,
    factory) of a load template (``dict(sharded_leaves(template))`` for
    :func:`check_finite`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    for sub, leaf in leaves_with_paths(tree, path):
        if isinstance(leaf, ShardedBase):
            yield sub, leaf


def _non_finite_values(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple, Any]]:
    """``(path, tensor)`` of every floating tensor in ``tree`` with a value that is not finite
    (Python floats are not checked: some legitimately hold inf)."""
    for sub, value in leaves_with_paths(tree, path):
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            if not bool(torch.isfinite(value).all()):
                yield sub, value


def _stored_file(directory: str, sharded: Any, value: Any) -> str:
    """The ``__R_N.distcp`` file holding ``sharded``'s first non-finite element."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    metadata = _read_metadata(directory)
    files = []
    if isinstance(sharded, ShardedObject):
        files = [
            i.relative_path for k, i in metadata.storage_data.items() if k.fqn == sharded.unique_key
        ]
    elif isinstance(sharded, ShardedTensor) and isinstance(value, torch.Tensor):
        bad = int((~torch.isfinite(value.reshape(-1))).nonzero()[0])
        start = sharded.flattened_range.start if sharded.flattened_range is not None else 0
        shape = tuple(sharded.local_shape)
        local = np.unravel_index(start + bad, shape) if shape else ()
        index = tuple(sharded.global_offset[: sharded.prepend_axis_num]) + tuple(
            int(o) + int(i)
            for o, i in zip(sharded.global_offset[sharded.prepend_axis_num :], local)
        )
        md = metadata.state_dict_metadata.get(sharded.key)
        for chunk in getattr(md, "chunks", []):
            if all(o <= x < o + n for o, n, x in zip(chunk.offsets, chunk.sizes, index)):
                files = [
                    i.relative_path
                    for k, i in metadata.storage_data.items()
                    if k.fqn == sharded.key and tuple(k.offset) == tuple(chunk.offsets)
                ]
                break
    if not files:
        key = getattr(sharded, "key", "")
        files = sorted(
            {i.relative_path for k, i in metadata.storage_data.items() if k.fqn.startswith(key)}
        )
    return ", ".join(os.path.join(directory, f) for f in files) or directory


def check_finite(
    named: Dict[Tuple, Any], state: Dict[str, Any], directory: str, file: Optional[str] = None
) -> None:
    """Stop unless every floating value loaded on every rank is finite (collective).

    ``named`` maps the paths of the load template's sharded objects to them (taken before
    the load, which may change the template in place), ``state`` is what the load
    returned (model, optimizer, scheduler, megatron-ext state). A non-finite value in a
    checkpoint (a corrupted byte range reads as NaN) would otherwise train on silently.
    ``file`` names where values outside the template come from (default: the torch_dist
    checkpoint's ``common.pt``, or the directory).

    Raises:
        CheckpointError: on every rank, naming the tensor (checkpoint key and path in the
            state dict), how many values are not finite, and the file holding it.
    """
    problem = ""
    for path, value in _non_finite_values(state):
        prefix = next((path[:n] for n in range(len(path), -1, -1) if path[:n] in named), None)
        sharded = named.get(prefix)
        where = ".".join(map(str, path))
        count = int((~torch.isfinite(value)).sum())
        what = f"{count} of {value.numel()} values are not finite (NaN or inf)"
        if sharded is not None:
            key = sharded.key
            source = _stored_file(directory, sharded, value)
        else:
            common = os.path.join(directory, "common.pt")
            key = where
            source = file or (common if os.path.isfile(common) else directory)
        problem = (
            f"non-finite values in {source}: tensor {key!r} (state {where}): {what}; the "
            "checkpoint is corrupt, load an earlier iteration (--load DIR/iter_XXXXXXX)"
        )
        break
    problems: List[str] = [""] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise CheckpointError(first)
