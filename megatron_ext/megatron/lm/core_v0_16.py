"""Hooks of megatron-ext into Megatron-LM core_v0.16.x (``megatron.training``).

What it does:
    :func:`install_hooks` replaces module globals of ``megatron.training`` that
    ``pretrain()`` looks up at call time, each with a wrapper that calls the original and
    a :class:`~megatron_ext.megatron.lm.session.MegatronLMSession` method:

    * ``initialize.parse_args``: chain megatron-ext's flags after the
      ``extra_args_provider`` pretrain_gpt passes;
    * ``initialize.validate_args``: after Megatron's checks, build and check megatron-ext's
      config (exit code 2 and a message naming the flag);
    * ``training.get_megatron_optimizer`` (and the muon variant): install every seam once
      the DDP chunks and the optimizer exist, before Megatron-LM loads a checkpoint;
    * ``training.train_step``: begin and end of an iteration (step, sample ids, bytes);
    * ``training.get_forward_backward_func``: the schedule gets ``p2p_communicator=`` and
      ``pg_collection=``; evaluation calls restart the microbatch counters;
    * ``training.training_log`` and ``training.print_rank_last``: bytes per category in the
      iteration line, TensorBoard and W&B scalars;
    * ``training.train``: the JSON communication report at the end of training;
    * ``training.save_checkpoint``: the torch format's per-rank state files;
    * ``training.load_checkpoint``: load megatron-ext's state after Megatron-LM's own;
    * ``checkpointing.generate_state_dict``: the torch_dist per-rank ShardedObject (save
      dict and load template) and the metadata in the common state;
    * ``checkpointing._load_base_checkpoint``: read the metadata and the loaded object back.

    Every target is checked before anything is replaced: it must exist and take the
    parameters this module relies on, otherwise the checkout is refused (it is not the
    release it claims to be). ``remove()`` restores every original.

Why module globals:
    ``pretrain()`` and ``train()`` look these names up in their modules at call time, so
    rebinding them hooks an unmodified checkout (the zero-touch launcher) as well as a
    patched ``pretrain_gpt.py``, without subclassing or editing Megatron-LM classes.

Constraints:
    Verified on core_v0.16.1. From 0.18 arguments are parsed in ``pretrain_gpt.py``'s
    ``__main__`` through ``arguments.parse_and_validate_args``, so the argument hooks move
    to ``megatron.training.arguments``; 0.19 passes ``p2p_communicator`` to ``train_step``
    itself. A hook module per release keeps those differences out of the session.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.megatron.lm.releases import UnsupportedReleaseError
from megatron_ext.megatron.lm.session import MegatronLMSession
from megatron_ext.megatron.patching import AttributePatches

__all__ = ["install_hooks", "MegatronLMHooks", "HOOK_TARGETS"]


@dataclass(frozen=True)
class _Target:
    """One module global of megatron.training that megatron-ext replaces."""

    module: str
    """Module holding the name (the one whose callers look it up)."""

    name: str
    """The global's name."""

    params: Tuple[str, ...]
    """Parameters the wrapper reads by name (checked against the original's signature)."""


HOOK_TARGETS: Tuple[_Target, ...] = (
    _Target(
        "megatron.training.initialize", "parse_args", ("extra_args_provider", "ignore_unknown_args")
    ),
    _Target("megatron.training.initialize", "validate_args", ("args", "defaults")),
    _Target("megatron.training.training", "get_megatron_optimizer", ("config", "model_chunks")),
    _Target(
        "megatron.training.training", "get_megatron_muon_optimizer", ("config", "model_chunks")
    ),
    _Target("megatron.training.training", "train_step", ("iteration",)),
    _Target("megatron.training.training", "get_forward_backward_func", ()),
    _Target("megatron.training.training", "training_log", ("iteration", "is_first_iteration")),
    _Target("megatron.training.training", "print_rank_last", ("message",)),
    _Target("megatron.training.training", "train", ()),
    _Target("megatron.training.training", "save_checkpoint", ("iteration", "release")),
    _Target("megatron.training.training", "load_checkpoint", ()),
    _Target("megatron.training.checkpointing", "generate_state_dict", ("args",)),
    _Target("megatron.training.checkpointing", "_load_base_checkpoint", ("rank0", "args")),
)


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


def _check_targets() -> List[Tuple[Any, _Target, Callable, inspect.Signature]]:
    checked = []
    for target in HOOK_TARGETS:
        module = importlib.import_module(target.module)
        original = getattr(module, target.name, None)
        if original is None or not callable(original):
            raise UnsupportedReleaseError(
                f"{target.module}.{target.name} not found: this Megatron-LM is not core_v0.16.x "
                "as its package_info.py says (megatron-ext hooks it by name)"
            )
        signature = inspect.signature(original)
        missing = [p for p in target.params if p not in signature.parameters]
        if missing:
            raise UnsupportedReleaseError(
                f"{target.module}.{target.name}{signature} lacks {missing}: this Megatron-LM "
                "differs from core_v0.16.x, whose hooks megatron-ext installs"
            )
        checked.append((module, target, original, signature))
    return checked


def _args():
    from megatron.training.global_vars import get_args

    return get_args()


def _wrap(session: MegatronLMSession, target: _Target, original: Callable, sig: inspect.Signature):
    """The wrapper of one target (see the table in the module docstring)."""
    name = target.name

    def bound(args, kwargs):
        binding = sig.bind_partial(*args, **kwargs)
        binding.apply_defaults()
        return binding.arguments

    if name == "parse_args":
        from megatron_ext.megatron.lm import megatron_lm_extra_args

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            arguments["extra_args_provider"] = megatron_lm_extra_args(
                arguments["extra_args_provider"]
            )
            return original(**arguments)

    elif name == "validate_args":

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            with session.clean_errors():
                session.configure(bound(args, kwargs)["args"])
            return result

    elif name in ("get_megatron_optimizer", "get_megatron_muon_optimizer"):

        def wrapper(*args, **kwargs):
            optimizer = original(*args, **kwargs)
            with session.clean_errors():
                session.install_runtime(bound(args, kwargs)["model_chunks"], optimizer, _args())
            return optimizer

    elif name == "train_step":

        def wrapper(*args, **kwargs):
            session.begin_train_step(bound(args, kwargs)["iteration"], _args())
            result = original(*args, **kwargs)
            session.end_train_step()
            return result

    elif name == "get_forward_backward_func":

        def wrapper(*args, **kwargs):
            schedule = original(*args, **kwargs)

            @functools.wraps(schedule)
            def forward_backward(*f_args, **f_kwargs):
                extra = session.before_forward_backward(
                    bool(f_kwargs.get("forward_only", False)), _args()
                )
                for key, value in extra.items():
                    f_kwargs.setdefault(key, value)
                return schedule(*f_args, **f_kwargs)

            return forward_backward

    elif name == "training_log":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            session.pending_log_field = session.interval_log_field(
                arguments["iteration"], bool(arguments["is_first_iteration"]), _args()
            )
            try:
                return original(*args, **kwargs)
            finally:
                session.pending_log_field = ""

    elif name == "print_rank_last":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            arguments["message"] = session.decorate_log_line(arguments["message"])
            return original(**arguments)

    elif name == "train":

        def wrapper(*args, **kwargs):
            with session.clean_errors():
                session.check_installed()
            try:
                result = original(*args, **kwargs)
            except SystemExit as exc:
                # train() exits the process itself at --exit-interval / --exit-duration-in-mins.
                if exc.code in (None, 0):
                    session.write_report(_args())
                raise
            session.write_report(_args())
            return result

    elif name == "save_checkpoint":

        def wrapper(*args, **kwargs):
            arguments = bound(args, kwargs)
            session.before_save(arguments["iteration"], bool(arguments["release"]), _args())
            # Checkpoint I/O collectives are not training communication.
            with ProcessGroupTrafficMeter.untracked():
                return original(*args, **kwargs)

    elif name == "load_checkpoint":

        def wrapper(*args, **kwargs):
            session.begin_load()
            try:
                with session.clean_errors(), ProcessGroupTrafficMeter.untracked():
                    result = original(*args, **kwargs)
            finally:
                ctx = session.end_load()
            with session.clean_errors(), ProcessGroupTrafficMeter.untracked():
                session.finish_load(ctx, _args())
            return result

    elif name == "generate_state_dict":

        def wrapper(*args, **kwargs):
            state_dict = original(*args, **kwargs)
            session.extend_state_dict(state_dict, bound(args, kwargs)["args"])
            return state_dict

    elif name == "_load_base_checkpoint":

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            arguments = bound(args, kwargs)
            session.on_base_checkpoint(result, bool(arguments["rank0"]), arguments["args"])
            return result

    else:
        raise AssertionError(f"no wrapper for {target.module}.{name}")
    functools.update_wrapper(wrapper, original)
    wrapper.__megatron_ext_hook__ = True
    return wrapper


def install_hooks(session: MegatronLMSession) -> MegatronLMHooks:
    """Check every target, then replace them all (see module docstring).

    Raises:
        UnsupportedReleaseError: a target is missing or has another signature.
    """
    checked = _check_targets()
    hooks = MegatronLMHooks(session)
    for module, target, original, signature in checked:
        hooks._set(module, target.name, _wrap(session, target, original, signature))
    session.hook_names = hooks.names
    return hooks
