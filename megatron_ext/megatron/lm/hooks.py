"""The wrappers megatron-ext puts around Megatron-LM functions, shared by every release.

What it does:
    A release module (:mod:`~megatron_ext.megatron.lm.core_v0_16`,
    :mod:`~megatron_ext.megatron.lm.core_v0_19`) lists its :class:`HookTarget` table: which
    module global of ``megatron.training`` plays which *role* (parse the arguments, build
    the optimizer, run one training step, ...) and which parameters the wrapper reads by
    name. :func:`install_targets` checks every target of the table (it must exist and take
    those parameters, otherwise the checkout is refused as not being the release it
    claims), then replaces each with the wrapper of its role, which calls the original and a
    :class:`~megatron_ext.megatron.lm.session.MegatronLMSession` method. ``remove()`` on the
    returned :class:`MegatronLMHooks` restores every original.

Why roles:
    What has to happen at each seam does not change between releases; where the seam lives
    does (0.16 parses arguments through ``initialize.parse_args``, 0.18+ through
    ``arguments.parse_args`` called by ``parse_and_validate_args``). A release module is then
    a table, and a wrapper fixed for one release is fixed for all.

Constraints:
    Wrappers bind the original's signature, so positional and keyword calls both work; a
    target whose signature lacks a parameter the wrapper reads is refused at install time.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

from torch import no_grad

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.config import ConfigError
from megatron_ext.megatron.lm.checkpoint import LOAD_ERRORS
from megatron_ext.megatron.lm.releases import UnsupportedReleaseError
from megatron_ext.megatron.lm.session import MegatronLMSession
from megatron_ext.megatron.patching import AttributePatches

__all__ = [
    "HookTarget",
    "MegatronLMHooks",
    "ROLES",
    "SHARED_TARGETS",
    "check_targets",
    "install_targets",
]

ROLES = (
    "parse_args",
    "validate_args",
    "setup_model",
    "build_optimizer",
    "train_step",
    "data_loader",
    "num_samples",
    "schedule",
    "training_log",
    "print_log_line",
    "train",
    "save_checkpoint",
    "load_checkpoint",
    "generate_state_dict",
    "load_base_checkpoint",
    "dist_checkpointing_save",
)
"""What a wrapper does (see :func:`_wrap`)."""


@dataclass(frozen=True)
class HookTarget:
    """One module global of megatron.training that megatron-ext replaces."""

    module: str
    """Module holding the name (the one whose callers look it up)."""

    name: str
    """The global's name."""

    role: str
    """Which wrapper (one of :data:`ROLES`)."""

    params: Tuple[str, ...]
    """Parameters the wrapper reads by name (checked against the original's signature)."""


_TRAINING = "megatron.training.training"
_CHECKPOINTING = "megatron.training.checkpointing"

SHARED_TARGETS: Tuple[HookTarget, ...] = (
    HookTarget(_TRAINING, "get_megatron_optimizer", "build_optimizer", ("config", "model_chunks")),
    HookTarget(
        _TRAINING,
        "build_pretraining_data_loader",
        "data_loader",
        ("dataset", "consumed_samples"),
    ),
    HookTarget(_TRAINING, "get_train_valid_test_num_samples", "num_samples", ()),
    HookTarget(_TRAINING, "get_forward_backward_func", "schedule", ()),
    HookTarget(_TRAINING, "training_log", "training_log", ("iteration", "is_first_iteration")),
    HookTarget(_TRAINING, "print_rank_last", "print_log_line", ("message",)),
    HookTarget(_TRAINING, "save_checkpoint", "save_checkpoint", ("iteration", "release")),
    HookTarget(_TRAINING, "load_checkpoint", "load_checkpoint", ("load_arg",)),
    HookTarget(_CHECKPOINTING, "generate_state_dict", "generate_state_dict", ("args", "optimizer")),
    HookTarget(_CHECKPOINTING, "_load_base_checkpoint", "load_base_checkpoint", ("rank0", "args")),
    HookTarget(
        "megatron.core.dist_checkpointing",
        "save",
        "dist_checkpointing_save",
        ("sharded_state_dict", "checkpoint_dir"),
    ),
)
"""The targets at the same place, with the same parameters, in every supported release; each
release's table (``core_v0_16.py``, ``core_v0_19.py``) adds what differs."""


class MegatronLMHooks:
    """The installed hooks; ``remove()`` restores every original function."""

    def __init__(self, session: MegatronLMSession):
        self.session = session
        self.on_remove: List[Callable[[], None]] = []
        self._patches = AttributePatches()

    @property
    def names(self) -> List[str]:
        """``module.name`` of every hooked function."""
        return [f"{m.__name__.rsplit('.', 1)[-1]}.{n}" for m, n in self._patches.targets]

    def _set(self, module: Any, name: str, value: Any) -> None:
        self._patches.set(module, name, value)

    def remove(self) -> None:
        """Restore the original functions."""
        self._patches.restore()
        for callback in self.on_remove:
            callback()
        self.on_remove.clear()


def check_targets(
    targets: Sequence[HookTarget], release: str
) -> List[Tuple[Any, HookTarget, Callable, inspect.Signature]]:
    """Import and check every target (``release``: e.g. ``core_v0.16.x``, for messages).

    Raises:
        UnsupportedReleaseError: a target is missing or lacks a parameter.
    """
    checked = []
    for target in targets:
        if target.role not in ROLES:
            raise AssertionError(f"unknown hook role {target.role!r}")
        module = importlib.import_module(target.module)
        original = getattr(module, target.name, None)
        if original is None or not callable(original):
            raise UnsupportedReleaseError(
                f"{target.module}.{target.name} not found: this Megatron-LM is not {release} "
                "as its package_info.py says (megatron-ext hooks it by name)"
            )
        signature = inspect.signature(original)
        missing = [p for p in target.params if p not in signature.parameters]
        if missing:
            raise UnsupportedReleaseError(
                f"{target.module}.{target.name}{signature} lacks {missing}: this Megatron-LM "
                f"differs from {release}, whose hooks megatron-ext installs"
            )
        checked.append((module, target, original, signature))
    return checked


def _args():
    from megatron.training.global_vars import get_args

    return get_args()


def _fill_schedule_kwargs(f_kwargs: dict, extra: dict) -> None:
    """Put megatron-ext's schedule kwargs where the caller passed none (absent or None).

    0.16's ``train_step`` passes no ``p2p_communicator``; 0.19's passes the one ``pretrain``
    got, None from ``pretrain_gpt.py``. A communicator of the caller's own would bypass
    megatron-ext's pipeline codec, so it is refused.
    """
    for key, value in extra.items():
        current = f_kwargs.get(key)
        if current is None:
            f_kwargs[key] = value
        elif current is not value and key == "p2p_communicator":
            raise ConfigError(
                "--p2p-compression",
                "the caller passed its own p2p_communicator to the pipeline schedule; "
                "megatron-ext's pipeline communicator would be bypassed",
            )


def _wrap(session: MegatronLMSession, target: HookTarget, original: Callable, sig):
    """The wrapper of one target, by role."""
    role = target.role

    def bound(args, kwargs):
        binding = sig.bind_partial(*args, **kwargs)
        binding.apply_defaults()
        return binding.arguments

    if role == "parse_args":
        from megatron_ext.megatron.lm import megatron_lm_extra_args

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            arguments["extra_args_provider"] = megatron_lm_extra_args(
                arguments["extra_args_provider"]
            )
            return original(**arguments)

    elif role == "validate_args":

        def wrapper(*args, **kwargs):
            with session.clean_errors():
                session.check_values(bound(args, kwargs)["args"])
            result = original(*args, **kwargs)
            with session.clean_errors():
                session.configure(bound(args, kwargs)["args"])
            return result

    elif role == "setup_model":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            container = arguments.get("cfg_container")
            model_cfg = getattr(container, "model", None)
            with session.clean_errors():
                if model_cfg is not None:
                    # 0.19's model builder: Megatron-LM's own list of pre-wrap hooks.
                    model_cfg.pre_wrap_hooks = [
                        *model_cfg.pre_wrap_hooks,
                        session.pre_wrap_hook(_args()),
                    ]
                elif arguments.get("model_provider_func") is not None:
                    arguments["model_provider_func"] = session.model_provider(
                        arguments["model_provider_func"], _args()
                    )
            return original(**arguments)

    elif role == "build_optimizer":

        def wrapper(*args, **kwargs):
            optimizer = original(*args, **kwargs)
            with session.clean_errors():
                session.install_runtime(bound(args, kwargs)["model_chunks"], optimizer, _args())
            return optimizer

    elif role == "train_step":

        def wrapper(*args, **kwargs):
            session.begin_train_step(bound(args, kwargs)["iteration"], _args())
            with session.stop_on_nonfinite():
                result = original(*args, **kwargs)
            # train_step returns (loss dict, skipped_iter, ...) in 0.16 and 0.19:
            # skipped_iter is 1 (or True, for a rerun) when the optimizer step was not taken.
            session.end_train_step(update_successful=not result[1])
            return result

    elif role == "data_loader":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            with session.clean_errors():
                loader = session.train_data_loader(
                    arguments["dataset"], arguments["consumed_samples"], _args()
                )
                if loader is not None:
                    return loader
                dataset = session.site_dataset(arguments["dataset"], _args())
            if dataset is arguments["dataset"]:
                return original(*args, **kwargs)
            return original(dataset, arguments["consumed_samples"])

    elif role == "num_samples":

        def wrapper(*args, **kwargs):
            return session.train_valid_test_num_samples(original(*args, **kwargs), _args())

    elif role == "schedule":

        def wrapper(*args, **kwargs):
            schedule = original(*args, **kwargs)

            @functools.wraps(schedule)
            def forward_backward(*f_args, **f_kwargs):
                extra = session.before_forward_backward(
                    bool(f_kwargs.get("forward_only", False)), _args()
                )
                with session.clean_errors():
                    _fill_schedule_kwargs(f_kwargs, extra)
                return schedule(*f_args, **f_kwargs)

            return forward_backward

    elif role == "training_log":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            session.pending_log_field = session.interval_log_field(
                arguments["iteration"], bool(arguments["is_first_iteration"]), _args()
            )
            try:
                return original(*args, **kwargs)
            finally:
                session.pending_log_field = ""

    elif role == "print_log_line":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            arguments["message"] = session.decorate_log_line(arguments["message"])
            return original(**arguments)

    elif role == "train":

        def wrapper(*args, **kwargs):
            with session.clean_errors():
                session.check_installed()
            try:
                result = original(*args, **kwargs)
            except SystemExit as exc:
                # train() exits the process itself at --exit-interval / --exit-duration-in-mins.
                if exc.code in (None, 0):
                    session.end_training(_args())
                raise
            session.end_training(_args())
            return result

    elif role == "save_checkpoint":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            iteration, release = arguments["iteration"], bool(arguments["release"])
            with session.stop_on_nonfinite():
                session.before_save(iteration, release, _args())
                # Checkpoint I/O collectives are not training communication.
                with ProcessGroupTrafficMeter.untracked():
                    with session.saving():
                        result = original(*args, **kwargs)
                    session.after_save(iteration, release, _args())
            return result

    elif role == "load_checkpoint":

        def wrapper(*args, **kwargs):
            session.begin_load()
            with session.clean_errors(), ProcessGroupTrafficMeter.untracked():
                session.verify_checksums(bound(args, kwargs).get("load_arg", "load"), _args())
            try:
                # No autograd in a load; megatron-core 0.16's distributed optimizer copies
                # into views of leaf parameters (fp32 on CPU) and fails under autograd.
                with session.clean_errors(), ProcessGroupTrafficMeter.untracked(), no_grad():
                    try:
                        result = original(*args, **kwargs)
                    except LOAD_ERRORS as exc:
                        session.name_load_error(exc, _args())
                        raise
            finally:
                ctx = session.end_load()
            with session.clean_errors(), ProcessGroupTrafficMeter.untracked():
                session.finish_load(ctx, _args())
            return result

    elif role == "generate_state_dict":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            session.before_generate_state_dict(arguments["optimizer"])
            state_dict = original(*args, **kwargs)
            session.extend_state_dict(state_dict, arguments["args"])
            return state_dict

    elif role == "load_base_checkpoint":

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            arguments = bound(args, kwargs)
            session.on_base_checkpoint(result, bool(arguments["rank0"]), arguments["args"])
            return result

    elif role == "dist_checkpointing_save":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            result = original(*args, **kwargs)
            return session.after_dist_checkpointing_save(str(arguments["checkpoint_dir"]), result)

    else:
        raise AssertionError(f"no wrapper for role {role!r}")
    functools.update_wrapper(wrapper, original)
    wrapper.__megatron_ext_hook__ = True
    return wrapper


def install_targets(
    session: MegatronLMSession, targets: Sequence[HookTarget], release: str
) -> MegatronLMHooks:
    """Check every target, then replace them all (see module docstring).

    Raises:
        UnsupportedReleaseError: a target is missing or has another signature.
    """
    checked = check_targets(targets, release)
    hooks = MegatronLMHooks(session)
    for module, target, original, signature in checked:
        hooks._set(module, target.name, _wrap(session, target, original, signature))
    session.hook_names = hooks.names
    return hooks
