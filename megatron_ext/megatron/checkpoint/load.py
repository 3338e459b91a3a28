"""Loading a ``megatron-ext train`` checkpoint so that a resumed run continues bit for bit.

What it does:
    :func:`load_checkpoint` (collective) restores what the save wrote: the model, the
    optimizer, the LR scheduler, the iteration and consumed samples, every rank's RNG states
    and megatron_ext's per-rank state. In order: resolve ``--load`` (:mod:`.paths`), verify
    the checksums (:mod:`megatron_ext.megatron.checksums`), read the common state naming a
    bad file (:mod:`.reading`), refuse a toggled distributed optimizer
    (:mod:`.optimizer_state`) and a differing LR schedule (:mod:`.schedule`), decide about
    megatron_ext's state (:mod:`.ext_state`) or plan an elastic resume (:mod:`.reshard`),
    load the sharded state with every value checked finite (:mod:`.finite`), then restore
    torch Adam's steps, the LR bounds, the scheduler and the RNG states. With ``model_only``
    (``--finetune``) only the model weights load (:func:`_load_model`), also from a
    Megatron-LM torch_dist checkpoint.

Why apart:
    It is the one entry point of a resume; each check it runs lives in its own module.

Constraints:
    Loading a distributed-optimizer checkpoint needs initialized optimizer state to build
    the load template (:func:`init_optimizer_state_for_load` of :mod:`.optimizer_state`).
    The optimizer loads under ``torch.no_grad()``: megatron-core 0.16's
    ``dp_reshardable`` load copies into views of leaf parameters.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from megatron_ext.megatron import checksums
from megatron_ext.megatron.checkpoint.ext_state import META_KEY, STATE_KEY, decide_load
from megatron_ext.megatron.checkpoint.finite import check_finite, sharded_leaves
from megatron_ext.megatron.checkpoint.optimizer_state import (
    _init_dist_opt_state,
    _restore_torch_adam_steps,
    check_optimizer_kind,
)
from megatron_ext.megatron.checkpoint.paths import resolve_load
from megatron_ext.megatron.checkpoint.reading import LOAD_ERRORS, load_common_state, read_error
from megatron_ext.megatron.checkpoint.reshard import (
    _can_remap,
    _finish_reshard,
    _reshard_plan,
    _reshard_template,
)
from megatron_ext.megatron.checkpoint.schedule import (
    align_lr_bounds_for_load,
    apply_lr_bounds,
    check_scheduler,
)
from megatron_ext.megatron.checkpoint.state_dict import (
    _FORMAT,
    _set_rng_state,
    _sharded_state_dict,
)
from megatron_ext.megatron.naming import unwrap
from megatron_ext.state import StateMismatch


def _load_sharded(template: Dict[str, Any], directory: str, what: str) -> Dict[str, Any]:
    """``dist_checkpointing.load`` naming the file that fails, then :func:`check_finite`."""
    from megatron.core import dist_checkpointing

    named = dict(sharded_leaves(template))
    try:
        state = dist_checkpointing.load(template, directory)
    except LOAD_ERRORS as exc:  # named and re-raised
        raise read_error(directory, what, exc) from exc
    check_finite(named, state, directory)
    return state


def _load_model(directory: str, model_chunks: Sequence[torch.nn.Module]) -> Dict[str, Any]:
    """Model weights only, from a megatron-ext train or a Megatron-LM torch_dist checkpoint."""
    from megatron.core import parallel_state as ps

    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    template = {
        key: unwrap(chunk).sharded_state_dict(metadata=metadata)
        for key, chunk in zip(keys, model_chunks)
    }
    state = _load_sharded(template, directory, "the model weights")
    for key, chunk in zip(keys, model_chunks):
        unwrap(chunk).load_state_dict(state[key], strict=True)
    torch.distributed.barrier()
    return {"iteration": 0, "consumed_samples": 0, "finetune_from": directory}


def load_checkpoint(
    root: str,
    *,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    runtime: Any,
    on_mismatch: str = "error",
    model_only: bool = False,
    save: Optional[str] = None,
    verify_checksums: bool = True,
) -> Optional[Dict[str, Any]]:
    """Restore the checkpoint ``root`` names (collective); see :func:`resolve_load`.

    Every value loaded is checked to be finite (:func:`check_finite`), and every read error
    names the file.

    Args:
        root: ``--load``: a directory with ``latest_checkpointed_iteration.txt`` (its latest
            iteration) or an ``iter_XXXXXXX`` directory (that iteration).
        model_only: load the model weights only (fine-tuning); the checkpoint may also be
            a Megatron-LM torch_dist one, whose model state has the same layout.
        save: ``--save``: when ``root`` is the same directory and holds no checkpoint yet,
            None is returned (a first run) instead of an error.
        verify_checksums: check the files against the checksums written at save first
            (:mod:`megatron_ext.megatron.checksums`; off with
            ``--no-verify-checkpoint-checksums``).

    Returns:
        The common state (``iteration``, ``consumed_samples``, ...), or None (see
        ``save``); with ``model_only`` iteration and consumed samples are 0.

    Raises:
        CheckpointError: no checkpoint at ``root``, an unreadable file, a file that does
            not match its checksum, a non-finite value.
        ConfigError: the learning-rate schedule or ``--use-distributed-optimizer`` differs.
        StateMismatch: megatron_ext state saved with another layout or settings and
            ``on_mismatch == 'error'``.
    """
    resolved = resolve_load(root, save=save)
    if resolved is None:
        return None
    directory, _ = resolved
    checksums.verify_checkpoint(directory, verify=verify_checksums)
    common = load_common_state(directory)
    if model_only:
        return _load_model(directory, model_chunks)
    if common.get("checkpoint_version") != _FORMAT:
        raise StateMismatch(
            f"{directory} is not a megatron-ext train checkpoint "
            f"(version {common.get('checkpoint_version')!r})"
        )
    check_optimizer_kind(common, optimizer, directory)
    check_scheduler(common["opt_param_scheduler"], scheduler, directory)
    plan = _reshard_plan(common, directory)
    if plan is None:
        include_ext = decide_load(common.get(META_KEY), runtime, on_mismatch, directory)
    else:
        include_ext = False
        plan.remap_ext = _can_remap(common, runtime, plan, on_mismatch, directory)
    _init_dist_opt_state(optimizer)
    template = _sharded_state_dict(
        model_chunks, optimizer, scheduler, runtime, is_loading=True, include_ext=include_ext
    )
    extra = _reshard_template(template, plan) if plan is not None else {}
    state = _load_sharded(template, directory, "the checkpoint")
    if extra:
        # The old ranks' megatron_ext state (elastic resume), checked like the rest. The
        # result also holds the common state: keep only the requested entries.
        from megatron.core import dist_checkpointing

        named = dict(sharded_leaves(extra))
        try:
            loaded = dist_checkpointing.load(extra, directory, validate_access_integrity=False)
        except LOAD_ERRORS as exc:  # named and re-raised
            raise read_error(directory, "the old ranks' megatron_ext state", exc) from exc
        check_finite(named, loaded, directory)
        state.update({key: loaded[key] for key in extra})
    if len(model_chunks) == 1:
        unwrap(model_chunks[0]).load_state_dict(state["model"], strict=True)
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
    # megatron-core 0.16's DistributedOptimizer.load_parameter_state_from_dp_reshardable
    # copies into views of leaf parameters without @torch.no_grad(); loading is no autograd.
    align_lr_bounds_for_load(state["optimizer"], scheduler)
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
        _restore_torch_adam_steps(optimizer, common["torch_adam_steps"])
    apply_lr_bounds(optimizer, scheduler, state["opt_param_scheduler"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if "rng_state" in state:
        _set_rng_state(state["rng_state"])
    if include_ext:
        runtime.state.load_state_dict(state[STATE_KEY])
    if plan is not None:
        _finish_reshard(state, plan, runtime, model_chunks)
    torch.distributed.barrier()
    return {k: v for k, v in common.items() if not isinstance(v, dict) or k == META_KEY}
