"""A save that fails leaves no torn checkpoint behind, and says why in one line.

What it does:
    :func:`_save_failed` runs when megatron-core's save raised on a rank: it measures the
    free space, rank 0 removes the incomplete ``iter_XXXXXXX`` directory, and it returns a
    :class:`~megatron_ext.megatron.checkpoint.errors.CheckpointSaveError` whose one line
    gives the reason (:func:`_failure_reason`: the last line of torch's multi-rank traceback
    that states an error), says when the disk is full, and names the checkpoint that stays
    the latest (the marker still names it: it is written only after a complete save).

Why:
    torch's zip writer reports a full disk only as ``enforce fail at inline_container.cc ...
    unexpected pos``; without this a full disk reads as a torch bug and leaves a directory
    that a later ``--load DIR/iter_XXXXXXX`` would try to read.

Constraints:
    Only rank 0 removes the directory, after it measured the free space (a removal by
    another rank would race with that measure, the only sign of a full disk when torch's
    zip writer fails). Below :data:`_FULL_BELOW` free bytes the failure is reported as a
    full disk.
"""

from __future__ import annotations

import errno
import os
import shutil

import torch

from megatron_ext.megatron.checkpoint.errors import CheckpointSaveError
from megatron_ext.megatron.checkpoint.paths import latest_iteration
from megatron_ext.megatron.checkpoint.space import _format_bytes

_FULL_BELOW = 64 * 2**20
"""Free bytes under which a failed save is reported as a full disk: torch's zip writer
reports ENOSPC only as ``enforce fail at inline_container.cc ... unexpected pos``."""


def _failure_reason(exc: BaseException) -> str:
    """The last line of ``exc`` that states an error (torch's CheckpointException carries
    every rank's traceback in its message)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    stated = [
        line
        for line in lines
        if line and not line.startswith(("Traceback", "File ", "^", "~")) and ":" in line
    ]
    if stated:
        return stated[-1]
    return f"{type(exc).__name__}: {next((line for line in lines if line), '')}".rstrip(": ")


def _save_failed(root: str, iteration: int, directory: str, exc: BaseException) -> Exception:
    """On rank 0, remove the torn ``directory``; describe the failure in one line.

    Only rank 0 removes it: megatron-core's torch_dist save raises on every rank once any
    write failed, and a removal by another rank would race with rank 0's measure of the
    free space (the only sign of a full disk when torch's zip writer fails).
    """
    existing = root if os.path.isdir(root) else os.path.dirname(root) or "."
    # Measured before the torn directory is removed (which frees its space).
    free = shutil.disk_usage(existing).free
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    reason = _failure_reason(exc)
    chain, enospc = exc, False
    while chain is not None:
        if isinstance(chain, OSError) and chain.errno == errno.ENOSPC:
            enospc = True
        chain = chain.__cause__ or chain.__context__
    if enospc or "No space left" in str(exc) or free < _FULL_BELOW:
        reason = f"no space left on the device ({_format_bytes(free)} free); {reason}"
    latest = latest_iteration(root)
    kept = "no earlier checkpoint" if latest is None else f"latest checkpoint: iteration {latest}"
    return CheckpointSaveError(
        f"--save: the checkpoint of iteration {iteration} could not be written to {directory} "
        f"({reason}); removed the incomplete directory, {kept}",
        detailed=rank == 0,
    )
