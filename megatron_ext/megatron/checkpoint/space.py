"""Free space: a save that cannot fit is refused before anything is written.

What it does:
    :func:`check_free_space` (collective) estimates the bytes of the next checkpoint
    (:func:`_estimate_bytes`: the latest checkpoint's size on disk, or for a first save the
    state's tensors summed over all ranks), adds :data:`SPACE_MARGIN`, and compares that with
    the free space of the file system holding ``--save`` plus what a replaced checkpoint of
    the same iteration frees. Rank 0 decides and tells every rank, so all refuse alike with
    one ``--save`` line naming the directory and both byte counts.

Why:
    A save that runs out of space fails inside megatron-core after minutes of writing, with
    an error that does not say the disk is full (:mod:`.save_failure` handles that case when
    the disk fills after this check).

Constraints:
    The estimate leaves out metadata and the common state, hence the margin. The free space
    is read with ``shutil.disk_usage`` of the nearest existing directory above ``--save``
    (the tests fake it through this module's ``shutil``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from megatron_ext.megatron.checkpoint.paths import checkpoint_dir, latest_iteration

SPACE_MARGIN = 1.05
"""Free space a save requires, as a multiple of its estimated size (the estimate leaves out
metadata and the common state; the next checkpoint can be slightly larger than the last)."""


def _format_bytes(num: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num >= scale:
            return f"{num / scale:.2f} {unit} ({num} bytes)"
    return f"{num} bytes"


def _directory_bytes(path: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def _state_bytes(sharded_state: Any) -> int:
    """Bytes of the tensors this rank writes (main replicas of its shards)."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        is_main_replica,
    )

    total = 0
    stack = [sharded_state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, (ShardedTensor, ShardedTensorFactory)):
            data = obj.data
            if isinstance(data, torch.Tensor) and is_main_replica(obj.replica_id):
                total += data.numel() * data.element_size()
        elif isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
    return total


def _estimate_bytes(root: str, sharded_state: Any) -> tuple:
    """``(bytes, basis)``: the size of the latest checkpoint under ``root``, or (first save)
    the state's tensors summed over all ranks (collective in that case on every rank)."""
    latest = latest_iteration(root)
    if latest is not None and os.path.isdir(checkpoint_dir(root, latest)):
        if torch.distributed.get_rank() == 0:
            size = _directory_bytes(checkpoint_dir(root, latest))
            return size, f"the size of iteration {latest}'s checkpoint"
        return 0, ""
    from megatron_ext.accounting import collective_device

    local = torch.tensor([_state_bytes(sharded_state)], dtype=torch.int64)
    local = local.to(collective_device())
    torch.distributed.all_reduce(local)
    return int(local.item()), "the size of the model, optimizer and RNG state"


def check_free_space(root: str, iteration: int, sharded_state: Any) -> None:
    """Refuse a save that cannot fit on ``root``'s file system (collective).

    Rank 0 compares the estimated size (:func:`_estimate_bytes` times
    :data:`SPACE_MARGIN`) with the free space of the file system holding ``root`` (plus the
    space a checkpoint of the same iteration being replaced frees) and tells every rank.

    Raises:
        ConfigError: naming ``--save``, the directory, the bytes needed and the bytes free.
    """
    from megatron_ext.config import ConfigError

    needed, basis = _estimate_bytes(root, sharded_state)
    problem = [None]
    if torch.distributed.get_rank() == 0:
        existing = root
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing) or "."
        free = shutil.disk_usage(existing).free
        replaced = checkpoint_dir(root, iteration)
        if os.path.isdir(replaced):
            free += _directory_bytes(replaced)
        wanted = int(needed * SPACE_MARGIN)
        if free < wanted:
            problem[0] = (
                f"not enough free space in {root} for the checkpoint of iteration "
                f"{iteration}: about {_format_bytes(wanted)} needed ({basis} plus "
                f"{round((SPACE_MARGIN - 1) * 100)}%), {_format_bytes(free)} free"
            )
    torch.distributed.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ConfigError("--save", problem[0])
