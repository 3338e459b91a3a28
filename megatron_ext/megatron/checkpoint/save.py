"""Saving a ``megatron-ext train`` checkpoint: all or nothing, in Megatron-LM's layout.

What it does:
    :func:`save_checkpoint` (collective) writes ``<save>/iter_XXXXXXX/`` (torch_dist format)
    and ``<save>/latest_checkpointed_iteration.txt``: the sharded state dict of
    :mod:`.state_dict` plus the common entries (format, iteration, consumed samples,
    megatron_ext's metadata, the topology record, torch Adam's steps, the optimizer kind)
    and the checksum manifest (:mod:`megatron_ext.megatron.checksums`).

Why in this order:
    Before anything is written every rank learns whether a value is not finite
    (:func:`~megatron_ext.megatron.save_checks.check_finite_for_save`) and whether the
    checkpoint fits (:func:`~megatron_ext.megatron.checkpoint.space.check_free_space`). A
    write that fails anyway removes its directory (:mod:`.save_failure`). The checksums are
    written before the marker, and the marker (written to a temporary file and renamed) is
    last, so the checkpoint it names is always complete and checksummed.

Constraints:
    Every rank calls it with the same arguments. The two checks are looked up in this
    module's namespace when the save runs (tests switch them off here).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Optional, Sequence

import torch

from megatron_ext.megatron import checksums
from megatron_ext.megatron.checkpoint.ext_state import META_KEY, ext_meta
from megatron_ext.megatron.checkpoint.optimizer_state import (
    _torch_adam_steps,
    _uses_distributed_optimizer,
)
from megatron_ext.megatron.checkpoint.paths import _TRACKER, checkpoint_dir
from megatron_ext.megatron.checkpoint.save_failure import _save_failed
from megatron_ext.megatron.checkpoint.space import check_free_space
from megatron_ext.megatron.checkpoint.state_dict import _FORMAT, _sharded_state_dict
from megatron_ext.megatron.checkpoint.topology import TOPOLOGY_KEY, _topology
from megatron_ext.megatron.save_checks import check_finite_for_save


def save_checkpoint(
    root: str,
    iteration: int,
    *,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    runtime: Any,
    consumed_samples: int,
    extra_common: Optional[Dict[str, Any]] = None,
) -> str:
    """Save iteration ``iteration`` under ``root`` on every rank (collective).

    Returns:
        The checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    directory = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    sd = _sharded_state_dict(
        model_chunks, optimizer, scheduler, runtime, is_loading=False, include_ext=True
    )
    # Collective: no NaN or Inf is ever written (megatron_ext.megatron.save_checks).
    check_finite_for_save(sd, root, iteration)
    # Collective: every rank learns whether there is room before anything is written.
    check_free_space(root, iteration, sd)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.makedirs(directory)
    torch.distributed.barrier()
    sd.update(
        {
            "checkpoint_version": _FORMAT,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            META_KEY: ext_meta(runtime),
            TOPOLOGY_KEY: _topology(model_chunks),
            "torch_adam_steps": _torch_adam_steps(optimizer),
            "use_distributed_optimizer": _uses_distributed_optimizer(optimizer),
        }
    )
    sd.update(extra_common or {})
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(sd, directory)
        # Before the marker names the checkpoint: one it names has its checksums.
        checksums.write_manifest(directory)
    # torch's CheckpointException (what megatron-core's torch_dist save raises for a failed
    # write) derives from BaseException.
    except (Exception, CheckpointException) as exc:
        # Rank 0 removes the torn directory; the latest marker still names the previous,
        # complete checkpoint.
        raise _save_failed(root, iteration, directory, exc) from exc
    torch.distributed.barrier()
    if rank == 0:
        tmp = os.path.join(root, _TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, _TRACKER))
    torch.distributed.barrier()
    return directory
