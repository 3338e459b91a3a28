"""Reading a torch_dist checkpoint so that a failure names the file.

What it does:
    :func:`load_common_state` reads dist_checkpointing's common (rank-0) state; when it or a
    sharded load fails (:data:`LOAD_ERRORS`), :func:`read_error` turns the failure into a
    :class:`~megatron_ext.megatron.checkpoint.errors.CheckpointError` naming the first file
    that cannot be read (:func:`unreadable_file`: ``metadata.json``, ``common.pt``,
    ``.metadata``, then every stored item's byte range), or the directory and the error when
    every file reads.

Why:
    dist_checkpointing's errors do not name the file; the user needs to know which file is
    damaged, or which earlier iteration to load.

Constraints:
    :func:`unreadable_file` runs only after a load failed: it reads every stored item once.
    The Megatron-LM adapter uses the same functions for Megatron-LM's torch_dist checkpoints.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint.api

from megatron_ext.megatron.checkpoint.errors import CheckpointError


def _read_metadata(directory: str) -> Any:
    """The torch_dist ``.metadata`` of ``directory`` (CheckpointError naming the file)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(directory, ".metadata")
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as exc:  # noqa: BLE001 (any failure to read: named, re-raised)
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def unreadable_file(directory: str) -> Optional[str]:
    """The first file of a torch_dist checkpoint that cannot be read, with why (or None).

    Called after a load failed: dist_checkpointing's errors do not name the file. Checks
    ``metadata.json``, ``common.pt`` (megatron-core 0.16), ``.metadata``, then every stored
    item (``__R_N.distcp`` byte ranges, each a ``torch.save`` of one tensor or object).
    """
    meta_json = os.path.join(directory, "metadata.json")
    try:
        with open(meta_json) as f:
            json.load(f)
    except Exception as exc:  # noqa: BLE001
        return f"{meta_json}: {type(exc).__name__}: {exc}"
    common = os.path.join(directory, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            return f"{common}: {type(exc).__name__}: {exc}"
    try:
        metadata = _read_metadata(directory)
    except CheckpointError as exc:
        return str(exc).split(": ", 1)[1]
    sizes: Dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        path = os.path.join(directory, info.relative_path)
        if path not in sizes:
            sizes[path] = os.path.getsize(path) if os.path.isfile(path) else -1
        if sizes[path] < 0:
            return f"{path} is missing (the checkpoint's .metadata lists it)"
        if info.offset + info.length > sizes[path]:
            return (
                f"{path} is truncated: {sizes[path]} bytes, but {index.fqn} is stored at bytes "
                f"{info.offset}-{info.offset + info.length}"
            )
    for index, info in metadata.storage_data.items():
        path = os.path.join(directory, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            return f"{path}: {index.fqn} cannot be read ({type(exc).__name__}: {exc})"
    return None


# torch.distributed.checkpoint's CheckpointException (the per-rank failures of a load) is a
# BaseException.
LOAD_ERRORS = (Exception, torch.distributed.checkpoint.api.CheckpointException)


def read_error(directory: str, what: str, exc: BaseException) -> CheckpointError:
    """A CheckpointError naming the file of torch_dist ``directory`` that failed to load
    ``what`` (or the directory and ``exc`` when every file reads)."""
    bad = unreadable_file(directory)
    if bad is not None:
        return CheckpointError(f"cannot load {what} from {directory}: {bad}")
    return CheckpointError(f"cannot load {what} from {directory}: {type(exc).__name__}: {exc}")


def load_common_state(directory: str) -> Dict[str, Any]:
    """dist_checkpointing's common (rank-0) state of ``directory``, naming a bad file."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(directory)
    except LOAD_ERRORS as exc:  # named and re-raised
        raise read_error(directory, "the common state", exc) from exc
