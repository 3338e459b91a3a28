"""Hooks of megatron-ext into Megatron-LM core_v0.19.x (``megatron.training``).

What it does:
    :func:`install_hooks` replaces the module globals of ``megatron.training`` that
    ``pretrain_gpt.py`` and ``pretrain()`` look up at call time, with the wrappers of
    :mod:`megatron_ext.megatron.lm.hooks` (the same as for core_v0.16.x; the targets at the
    same place in both, ``SHARED_TARGETS``, are listed there). What moved since 0.16:

    * arguments: ``pretrain_gpt.py``'s ``__main__`` calls
      ``arguments.parse_and_validate_args(extra_args_provider=..., args_defaults=...)``,
      which calls the module globals ``arguments.parse_args`` and ``arguments.validate_args``
      (then ``set_global_variables``); ``pretrain(cfg_container, ...)`` no longer parses. So
      the argument hooks sit in ``megatron.training.arguments``, and megatron-ext's config
      is checked before ``pretrain()`` starts (before ``torch.distributed`` exists);
    * the optimizer: ``setup_model_and_optimizer`` builds the DDP chunks through the
      config container's model builder (``cfg_container.model`` set by
      ``pretrain_gpt.py``), not ``get_model``, then calls ``get_megatron_optimizer`` (there
      is no ``get_megatron_muon_optimizer`` any more: Muon goes through it too);
    * the model: ``setup_model_and_optimizer`` gets the config container; megatron-ext adds
      a hook to its model config's ``pre_wrap_hooks`` (run on the built chunks before they
      are moved, converted to fp16/bf16 and wrapped in DDP) for the methods' model
      transforms (Grass's virtual parameters); without a model config, the model provider
      is wrapped as in 0.16;
    * the schedule: ``train_step(..., p2p_communicator=None)`` now passes the communicator
      ``pretrain()`` received (None from ``pretrain_gpt.py``) to the schedule; the schedule
      wrapper puts megatron-ext's communicator there (and in evaluation, which gets it the
      same way), since the communicator only exists once the model is built, after
      ``pretrain()`` started;
    * logging, ``train``, ``save_checkpoint``, ``load_checkpoint``,
      ``generate_state_dict``, ``_load_base_checkpoint``, ``dist_checkpointing.save``: same
      names, same parameters (``_load_base_checkpoint`` returns a 4-tuple, of which the
      session reads the first three).

Why module globals:
    As for 0.16: ``parse_and_validate_args``, ``pretrain()``, ``setup_model_and_optimizer``
    and ``train()`` look these names up in their modules at call time, and
    ``pretrain_gpt.py`` imports ``parse_and_validate_args`` by name *after* the hooks are
    installed (the patch and the launcher install them first), so both the zero-touch
    launcher and the patched script reach them.

Constraints:
    Verified on core_v0.19.0 (whose ``package_info.py`` says 0.19.1) with ``megatron.core``
    from the checkout, and with the megatron-core 0.19.2 wheel (which also ships
    ``megatron/training``, identical to the tag's). Megatron-LM 0.19 declares Python >= 3.12;
    on 3.11 :mod:`megatron_ext.megatron.lm.compat` supplies ``typing.override``, the one
    3.12 name its training package imports.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from megatron_ext.megatron.lm import hooks
from megatron_ext.megatron.lm.session import MegatronLMSession

HookTarget = hooks.HookTarget
MegatronLMHooks = hooks.MegatronLMHooks  # re-exported

__all__ = ["install_hooks", "MegatronLMHooks", "HOOK_TARGETS", "RELEASE_LABEL"]

RELEASE_LABEL = "core_v0.19.x"

_ARGUMENTS = "megatron.training.arguments"
_TRAINING = "megatron.training.training"

HOOK_TARGETS: Tuple[HookTarget, ...] = hooks.SHARED_TARGETS + (
    HookTarget(
        _ARGUMENTS, "parse_args", "parse_args", ("extra_args_provider", "ignore_unknown_args")
    ),
    HookTarget(_ARGUMENTS, "validate_args", "validate_args", ("args", "defaults")),
    HookTarget(
        _TRAINING,
        "setup_model_and_optimizer",
        "setup_model",
        ("model_provider_func", "cfg_container"),
    ),
    HookTarget(_TRAINING, "train_step", "train_step", ("iteration", "p2p_communicator")),
    HookTarget(_TRAINING, "train", "train", ("p2p_communicator",)),
)


def _check_targets() -> List[Tuple[Any, HookTarget, Any, Any]]:
    return hooks.check_targets(HOOK_TARGETS, RELEASE_LABEL)


def install_hooks(session: MegatronLMSession) -> MegatronLMHooks:
    """:func:`~megatron_ext.megatron.lm.hooks.install_targets` of this release's table."""
    return hooks.install_targets(session, HOOK_TARGETS, RELEASE_LABEL)
