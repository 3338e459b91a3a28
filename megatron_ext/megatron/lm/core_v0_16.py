"""Hooks of megatron-ext into Megatron-LM core_v0.16.x (``megatron.training``).

What it does:
    :func:`install_hooks` replaces module globals of ``megatron.training`` that
    ``pretrain()`` looks up at call time, each with a wrapper that calls the original and
    a :class:`~megatron_ext.megatron.lm.session.MegatronLMSession` method:

    * ``initialize.parse_args`` (and ``arguments.parse_args``, which pretrain_gpt.py's
      in-process restart calls first): chain megatron-ext's flags after the
      ``extra_args_provider`` pretrain_gpt passes, and make a parse error one line;
    * ``initialize.validate_args``: after Megatron's checks, build and check megatron-ext's
      config (exit code 2 and a message naming the flag);
    * ``training.setup_model_and_optimizer``: the model provider ``get_model`` calls per
      chunk is followed by the methods' model transforms (Grass's virtual parameters),
      before the chunk is moved, converted to fp16/bf16 and wrapped in DDP;
    * ``training.get_megatron_optimizer`` (and the muon variant): install every seam once
      the DDP chunks and the optimizer exist, before Megatron-LM loads a checkpoint;
    * ``training.train_step``: begin and end of an iteration (step, sample ids, bytes);
    * ``training.build_pretraining_data_loader``: the training loader of fixed-sample mode
      (``--fixed-samples``, which ``--p2p-compression aqsgd`` needs);
    * ``training.get_forward_backward_func``: the schedule gets ``p2p_communicator=`` and
      ``pg_collection=``; evaluation calls restart the microbatch counters;
    * ``training.training_log`` and ``training.print_rank_last``: bytes per category in the
      iteration line, TensorBoard and W&B scalars;
    * ``training.train``: the JSON communication report at the end of training;
    * ``training.save_checkpoint``: the torch format's per-rank state files, and its
      checksum manifest once Megatron-LM's save returned;
    * ``training.load_checkpoint``: verify the checkpoint's checksums first; load
      megatron-ext's state after Megatron-LM's own;
    * ``checkpointing.generate_state_dict``: the torch_dist per-rank ShardedObject (save
      dict and load template) and the metadata in the common state;
    * ``checkpointing._load_base_checkpoint``: read the metadata and the loaded object back;
    * ``megatron.core.dist_checkpointing.save`` (called by ``save_checkpoint``): the
      checksum manifest of a torch_dist checkpoint, before Megatron-LM moves its
      ``latest_checkpointed_iteration.txt`` (:mod:`megatron_ext.megatron.checksums`).

    Every target is checked before anything is replaced: it must exist and take the
    parameters this module relies on, otherwise the checkout is refused (it is not the
    release it claims to be). ``remove()`` restores every original.

    The wrappers themselves are :mod:`megatron_ext.megatron.lm.hooks` (shared with the other
    releases), with the targets every supported release has at one place
    (``SHARED_TARGETS``); this module adds where the others go in core_v0.16.x.

Why module globals:
    ``pretrain()`` and ``train()`` look these names up in their modules at call time, so
    rebinding them hooks an unmodified checkout (the zero-touch launcher) as well as a
    patched ``pretrain_gpt.py``, without subclassing or editing Megatron-LM classes.

Constraints:
    Verified on core_v0.16.1. From 0.18 arguments are parsed in ``pretrain_gpt.py``'s
    ``__main__`` through ``arguments.parse_and_validate_args``, so the argument hooks move
    to ``megatron.training.arguments`` (:mod:`megatron_ext.megatron.lm.core_v0_19`). A
    table per release keeps those differences out of the session and the wrappers.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from megatron_ext.megatron.lm import hooks
from megatron_ext.megatron.lm.session import MegatronLMSession

HookTarget = hooks.HookTarget
MegatronLMHooks = hooks.MegatronLMHooks  # re-exported

__all__ = ["install_hooks", "MegatronLMHooks", "HOOK_TARGETS", "RELEASE_LABEL"]

RELEASE_LABEL = "core_v0.16.x"

_TRAINING = "megatron.training.training"

HOOK_TARGETS: Tuple[HookTarget, ...] = hooks.SHARED_TARGETS + (
    HookTarget(
        "megatron.training.initialize",
        "parse_args",
        "parse_args",
        ("extra_args_provider", "ignore_unknown_args"),
    ),
    # pretrain_gpt.py's inprocess_restart parses the command line first, through the module
    # global: its errors too are one line (megatron-ext's flags are known to it then).
    HookTarget(
        "megatron.training.arguments",
        "parse_args",
        "parse_args",
        ("extra_args_provider", "ignore_unknown_args"),
    ),
    HookTarget(
        "megatron.training.initialize", "validate_args", "validate_args", ("args", "defaults")
    ),
    HookTarget(_TRAINING, "setup_model_and_optimizer", "setup_model", ("model_provider_func",)),
    HookTarget(
        _TRAINING, "get_megatron_muon_optimizer", "build_optimizer", ("config", "model_chunks")
    ),
    HookTarget(_TRAINING, "train_step", "train_step", ("iteration",)),
    HookTarget(_TRAINING, "train", "train", ()),
)


def _check_targets() -> List[Tuple[Any, HookTarget, Any, Any]]:
    return hooks.check_targets(HOOK_TARGETS, RELEASE_LABEL)


def install_hooks(session: MegatronLMSession) -> MegatronLMHooks:
    """:func:`~megatron_ext.megatron.lm.hooks.install_targets` of this release's table."""
    return hooks.install_targets(session, HOOK_TARGETS, RELEASE_LABEL)
