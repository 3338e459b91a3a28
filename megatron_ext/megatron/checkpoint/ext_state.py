"""megatron_ext's per-rank state in a checkpoint, and whether a saved one can be loaded.

What it does:
    megatron_ext state differs across ranks (error-feedback residuals differ across DP
    ranks), so it is stored as one ``ShardedObject`` per global rank
    (:func:`sharded_state_object`, under :data:`STATE_KEY` / :data:`SHARDED_OBJECT_KEY`); a
    copy of its layout and settings fingerprint (:func:`ext_meta`) goes into the common
    (rank-0) state under :data:`META_KEY`, so a mismatch is detected before loading and
    handled by ``--ext-state-on-mismatch`` (:func:`decide_load`: error, or reset with a
    warning).

Why apart:
    Both hosts store megatron_ext state this way: the driver's checkpoints and Megatron-LM's
    (:mod:`megatron_ext.megatron.lm.checkpoint` re-exports these names), so the keys and the
    layout/fingerprint check are written once.

Constraints:
    The keys are part of the checkpoint format: changing one makes existing checkpoints
    unreadable. An elastic resume (another data-parallel size) remaps the state instead of
    calling :func:`decide_load` when the settings agree (:mod:`.reshard`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron_ext.logging import print_rank_0
from megatron_ext.state import StateMismatch, fingerprint

META_KEY = "megatron_ext_meta"
"""Common-state key: layout, settings and their fingerprint of the saved megatron-ext state."""

STATE_KEY = "megatron_ext_state"
"""State-dict key of the per-rank ShardedObject (torch_dist)."""

SHARDED_OBJECT_KEY = "megatron_ext/rank_state"
"""dist_checkpointing key of the ShardedObject (also Megatron-LM checkpoints')."""


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tensors(v) for v in obj)
    return obj


def sharded_state_object(runtime: Any, *, snapshot: bool = False) -> Any:
    """This rank's state as a dist_checkpointing ``ShardedObject``.

    Args:
        runtime: the installed :class:`~megatron_ext.megatron.runtime.ExtRuntime`.
        snapshot: copy the tensors (asynchronous saves write after training continues).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = runtime.state.state_dict()
    if snapshot:
        state = _clone_tensors(state)
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    return ShardedObject(SHARDED_OBJECT_KEY, state, (world,), (rank,), replica_id=0)


def ext_meta(runtime: Any) -> Dict[str, Any]:
    """Layout (without the rank) and settings fingerprint of megatron_ext's state: stored in
    a checkpoint's common part so a mismatch is seen before loading."""
    state = runtime.state
    layout = {k: v for k, v in state.layout.items() if k != "rank"}
    return {
        "layout": layout,
        "fingerprint": fingerprint(state.settings),
        "settings": state.settings,
    }


def decide_load(
    saved_meta: Optional[Dict[str, Any]], runtime: Any, on_mismatch: str, where: str
) -> bool:
    """Whether megatron-ext state saved with ``saved_meta`` can be loaded into ``runtime``.

    Shared by the driver's checkpoints and Megatron-LM's (``megatron_ext.megatron.lm``).

    Args:
        saved_meta: the checkpoint's ``megatron_ext_meta`` (None: saved without megatron-ext).
        runtime: this run's runtime.
        on_mismatch: ``--ext-state-on-mismatch`` (``error`` or ``reset``).
        where: checkpoint path for messages.

    Returns:
        True to load, False to start megatron-ext's state fresh (after a warning).

    Raises:
        StateMismatch: mismatch and ``on_mismatch == 'error'``.
    """
    meta = ext_meta(runtime)
    if saved_meta is None:
        problem = f"{where} holds no megatron-ext state (saved without megatron-ext)"
    elif saved_meta.get("layout") != meta["layout"] or runtime.state.settings_diff(saved_meta):
        problem = (
            f"megatron-ext state in {where} was saved with layout {saved_meta.get('layout')} "
            f"and settings {saved_meta.get('settings')}; this run has {meta['layout']} and "
            f"{meta['settings']}"
        )
    else:
        return True
    if on_mismatch == "error":
        raise StateMismatch(
            problem + ". Pass --ext-state-on-mismatch reset to start the megatron-ext state "
            "from scratch (model and optimizer load as usual)."
        )
    print_rank_0(
        f"megatron-ext: WARNING: {problem}; starting megatron-ext state from scratch (reset)."
    )
    return False
