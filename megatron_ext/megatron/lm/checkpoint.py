"""megatron-ext's per-rank state inside Megatron-LM checkpoints (``torch_dist`` and ``torch``).

What it does:
    megatron-ext state (:class:`~megatron_ext.state.ExtState`: error-feedback residuals,
    warm starts, selected indices) differs across ranks, so it is stored once per global
    rank next to Megatron-LM's own state:

    * ``--ckpt-format torch_dist``: one ``ShardedObject`` ``megatron_ext/rank_state`` per
      rank (global shape ``(world,)``, offset ``(rank,)``), added to the dict that
      ``checkpointing.generate_state_dict`` builds. That function also builds the load
      template, so the same object is read back on ``--load``.
    * ``--ckpt-format torch``: only data-parallel rank 0 writes Megatron-LM's legacy file,
      so every rank writes ``<iter dir>/megatron_ext/rank_XXXXX.pt`` itself, before
      Megatron-LM moves the ``latest_checkpointed_iteration.txt`` tracker.

    Both formats also carry a copy of the state's layout and settings fingerprint
    (``megatron_ext_meta``) in the common state, checked before anything is loaded: a
    mismatch (other TP/PP/DP, other compression settings, a checkpoint without megatron-ext
    state) stops the run (``--ext-state-on-mismatch error``) or starts megatron-ext's state
    fresh with a warning (``reset``).

Why not through the optimizer:
    Megatron-LM's checkpoint keys are fixed and its optimizer wrappers are built inside
    ``get_megatron_optimizer``; a plugin key in the state dict keeps Megatron's own state
    untouched and loads the same way in every optimizer configuration.

Constraints:
    The layout/fingerprint check is ``megatron_ext.megatron.checkpoint.decide_load``, the
    one our own driver's checkpoints use (re-exported here).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from megatron_ext.megatron.checkpoint import (  # noqa: F401 (re-exported: shared keys)
    LOAD_ERRORS,
    META_KEY,
    SHARDED_OBJECT_KEY,
    STATE_KEY,
    CheckpointError,
    CheckpointSaveError,
    check_finite,
    checkpoint_dir,
    decide_load,
    ext_meta,
    init_optimizer_state_for_load,
    latest_iteration,
    read_error,
    sharded_leaves,
    sharded_state_object,
    unreadable_file,
)

__all__ = [
    "META_KEY",
    "STATE_KEY",
    "SHARDED_OBJECT_KEY",
    "RANK_FILE_DIR",
    "ext_meta",
    "sharded_state_object",
    "rank_file",
    "iteration_dir_of",
    "save_rank_file",
    "load_rank_file",
    "decide_load",
    "LOAD_ERRORS",
    "read_error",
    "unreadable_file",
    "CheckpointError",
    "iteration_dir_to_load",
    "iteration_dir_to_verify",
    "check_finite",
    "sharded_leaves",
    "init_optimizer_state_for_load",
    "saved_adam_step",
    "restore_adam_steps",
]

RANK_FILE_DIR = "megatron_ext"
"""Folder inside an iteration directory holding the per-rank files (torch format)."""


def rank_file(iteration_dir: str, rank: int) -> str:
    """``<iteration_dir>/megatron_ext/rank_XXXXX.pt``."""
    return os.path.join(iteration_dir, RANK_FILE_DIR, f"rank_{rank:05d}.pt")


def iteration_dir_of(checkpoint_name: str) -> str:
    """The ``iter_XXXXXXX`` directory of a Megatron-LM checkpoint name.

    ``torch_dist`` names the directory itself; ``torch`` names
    ``<iter dir>/mp_rank_XX[_YYY]/model_optim_rng.pt``.
    """
    if os.path.isdir(checkpoint_name):
        return checkpoint_name
    return os.path.dirname(os.path.dirname(checkpoint_name))


def iteration_dir_to_load(args: Any) -> Optional[str]:
    """The ``iter_XXXXXXX`` directory Megatron-LM's ``--load`` / ``--ckpt-step`` name (None
    without a tracker)."""
    if not args.load:
        return None
    step = getattr(args, "ckpt_step", None)
    iteration = step if step is not None else latest_iteration(args.load)
    return None if iteration is None else checkpoint_dir(args.load, iteration)


def iteration_dir_to_verify(args: Any, load_arg: str = "load") -> Optional[str]:
    """The directory Megatron-LM's ``load_checkpoint(load_arg=...)`` will read, as it picks
    it (``--ckpt-step``, the marker's iteration or ``release``, ``--pretrained-checkpoint``
    when the load directory has no marker); None when there is none to name."""
    load_dir = getattr(args, load_arg, None)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained and _marker(load_dir) is None:
        load_dir = pretrained
    if not load_dir:
        return None
    step = getattr(args, "ckpt_step", None)
    if step is not None:
        return checkpoint_dir(load_dir, step)
    text = _marker(load_dir)
    if text == "release":
        return os.path.join(load_dir, "release")
    if text is None or not text.isdigit():
        return None  # Megatron-LM reports a missing or bad marker itself.
    return checkpoint_dir(load_dir, int(text))


def _marker(load_dir: Optional[str]) -> Optional[str]:
    """The stripped text of ``<load_dir>/latest_checkpointed_iteration.txt`` (None)."""
    if not load_dir:
        return None
    try:
        with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt"), "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None


def save_rank_file(iteration_dir: str, runtime: Any, state: Optional[Dict[str, Any]] = None) -> str:
    """Write this rank's state file (atomically; ``state``: the runtime's state dict, if
    already taken); returns its path."""
    path = rank_file(iteration_dir, torch.distributed.get_rank())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    if state is None:
        state = runtime.state.state_dict()
    torch.save({META_KEY: ext_meta(runtime), "state": state}, tmp)
    os.replace(tmp, path)
    return path


def load_rank_file(path: str) -> Dict[str, Any]:
    """The state stored by :func:`save_rank_file`."""
    # Written by save_rank_file: tensors, primitives and dicts only.
    return torch.load(path, map_location="cpu", weights_only=False)["state"]


def saved_adam_step(optimizer_state: Any) -> Optional[float]:
    """The torch Adam ``step`` stored in a loaded distributed-optimizer state (its param
    groups' common ``step``), or None."""
    if isinstance(optimizer_state, dict):
        groups = optimizer_state.get("param_groups")
        if isinstance(groups, list):
            steps = {float(g["step"]) for g in groups if isinstance(g, dict) and "step" in g}
            if len(steps) == 1:
                return steps.pop()
        for value in optimizer_state.values():
            found = saved_adam_step(value)
            if found is not None:
                return found
    return None


def restore_adam_steps(optimizer: Any, step: Optional[float]) -> int:
    """Give every parameter's torch Adam state its own ``step`` tensor holding ``step`` (the
    loaded value where None); returns how many were set.

    megatron-core 0.16's ``DistributedOptimizer`` (torch Adam, no TE/Apex: CPU) loads with
    one *shared* ``step`` tensor, and the load template's dummy value (1) rather than the
    checkpoint's: torch's Adam then increments the shared tensor once per parameter per
    step, and bias correction is wrong from the first resumed step (measured on CPU,
    iteration 4 of a resumed run: grad norm 0.900 or 0.904 instead of 0.902).
    """
    count = 0
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            old = state.get("step")
            if isinstance(old, torch.Tensor):
                value = old.detach().clone()
                if step is not None:
                    value.fill_(step)
                state["step"] = value
                count += 1
    return count
