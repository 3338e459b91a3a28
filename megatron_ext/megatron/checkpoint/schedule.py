"""The learning-rate schedule across a resume: refused when it differs, bounds set as asked.

What it does:
    * :func:`check_scheduler` refuses a schedule that differs from the checkpoint's, as
      Megatron-LM does, before anything is loaded: the refusal names the flags and both
      values, and ``--override-opt-param-scheduler`` / ``--use-checkpoint-opt-param-scheduler``
      allow it (this run's values / the checkpoint's).
    * LR bounds: :func:`align_lr_bounds_for_load` gives the loaded param groups this run's
      ``max_lr`` / ``min_lr`` before the optimizer loads (megatron-core 0.19 matches groups
      by keys that include them), and :func:`apply_lr_bounds` sets the bounds the flag asks
      for after it (megatron-core 0.16 restores the checkpoint's, so an override would not
      move the bounds: Megatron-LM issue #1138).

Why apart:
    The scheduler's state and the optimizer's param groups both carry the bounds; the rules
    for which one wins are one idea. Only the driver uses them.

Constraints:
    Steps are in samples (iterations x global batch size), as megatron-core's
    ``OptimizerParamScheduler`` counts them. Without either flag the bounds are equal, and
    the functions change nothing.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

from megatron_ext.config import ConfigError

# OptimizerParamScheduler.state_dict() keys that its load_state_dict checks (_check_and_set), and
# the driver flags that set them.
_SCHEDULER_FLAGS = {
    "max_lr": ("--lr",),
    "min_lr": ("--min-lr",),
    "lr_warmup_steps": ("--lr-warmup-iters",),
    "lr_decay_steps": ("--lr-decay-iters", "--train-iters"),
    "lr_decay_style": ("--lr-decay-style",),
    "start_wd": ("--weight-decay",),
    "end_wd": ("--weight-decay",),
    "wd_incr_steps": ("--lr-decay-iters", "--train-iters"),
    "wd_incr_style": ("--weight-decay",),
}
_OVERRIDE_FLAG = "--override-opt-param-scheduler"
_USE_CHECKPOINT_FLAG = "--use-checkpoint-opt-param-scheduler"


def check_scheduler(saved: Dict[str, Any], scheduler: Any, where: str) -> None:
    """Refuse a learning-rate schedule that differs from the checkpoint's, as Megatron-LM does.

    megatron-core's ``OptimizerParamScheduler.load_state_dict`` keeps the checkpoint's values
    with ``use_checkpoint_opt_param_scheduler``, this run's with
    ``override_opt_param_scheduler``, and asserts equality otherwise (Megatron-LM's default);
    this check runs first, so the refusal names the flags and both values before anything
    is loaded. Steps are in samples (iterations x global batch size).

    Raises:
        ConfigError: a value differs and neither flag is given.
    """
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    now = scheduler.state_dict()
    diffs, flags = [], []
    for key, key_flags in _SCHEDULER_FLAGS.items():
        if key in saved and saved[key] != now.get(key):
            diffs.append(
                f"{key} ({' / '.join(key_flags)}): checkpoint {saved[key]}, "
                f"this run {now.get(key)}"
            )
            flags += [f for f in key_flags if f not in flags]
    if diffs:
        raise ConfigError(
            flags + [_OVERRIDE_FLAG, _USE_CHECKPOINT_FLAG],
            f"the learning-rate schedule differs from the one saved in {where} (steps in "
            f"samples): {'; '.join(diffs)}. Pass {_USE_CHECKPOINT_FLAG} to continue the saved "
            f"schedule, or {_OVERRIDE_FLAG} to use this run's values (Megatron-LM's flags)",
        )


def _param_group_lists(tree: Any) -> Iterator[List[Dict[str, Any]]]:
    """Every ``param_groups`` list inside a loaded optimizer state."""
    if isinstance(tree, dict):
        groups = tree.get("param_groups")
        if isinstance(groups, list):
            yield groups
        for key, value in tree.items():
            if key != "param_groups":
                yield from _param_group_lists(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _param_group_lists(value)


def _set_lr_bounds(groups: Any, bounds: Tuple[float, float]) -> None:
    for group in groups:
        if "max_lr" in group:
            group["max_lr"] = bounds[0]
        if "min_lr" in group:
            group["min_lr"] = bounds[1]


def align_lr_bounds_for_load(optimizer_state: Any, scheduler: Any) -> None:
    """Before loading the optimizer with a scheduler flag: give the loaded param groups this
    run's ``max_lr`` / ``min_lr``.

    megatron-core 0.19 matches loaded distributed-optimizer param groups to this run's by
    keys that include ``max_lr`` and ``min_lr`` (a ``KeyError`` otherwise), so a new
    ``--lr`` allowed by the scheduler flags would not load; :func:`apply_lr_bounds` then
    sets the bounds the flag asks for.
    """
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        for groups in _param_group_lists(optimizer_state):
            _set_lr_bounds(groups, (scheduler.max_lr, scheduler.min_lr))


def apply_lr_bounds(optimizer: Any, scheduler: Any, saved: Dict[str, Any]) -> None:
    """After loading the optimizer, before the scheduler: the param groups' ``max_lr`` /
    ``min_lr`` the scheduler flag asks for.

    megatron-core's scheduler takes a group's ``max_lr`` / ``min_lr`` before its own. With
    ``--override-opt-param-scheduler`` they become this run's: megatron-core 0.16 restores
    the checkpoint's groups, so the override would change the schedule's shape but not its
    bounds (Megatron-LM issue #1138, still so in core_v0.16 and core_v0.19; upstream later
    fixed it the same way). With ``--use-checkpoint-opt-param-scheduler`` they are the
    checkpoint's (``saved``: its scheduler state). Without either flag they are equal.
    """
    if scheduler.override_opt_param_scheduler:
        _set_lr_bounds(optimizer.param_groups, (scheduler.max_lr, scheduler.min_lr))
    elif scheduler.use_checkpoint_opt_param_scheduler:
        _set_lr_bounds(optimizer.param_groups, (saved["max_lr"], saved["min_lr"]))
