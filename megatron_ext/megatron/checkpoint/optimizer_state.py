"""The optimizer's state across a save and a load: its kind, torch Adam's step, a first load.

What it does:
    * :func:`check_optimizer_kind` refuses a resume with the distributed optimizer toggled
      (its state is flat per-bucket shards, the other one's per parameter: neither loads
      into the other); the save records the kind (:func:`_uses_distributed_optimizer`).
    * The Adam-step workaround: the save records torch Adam(W)'s per-parameter ``step``
      (:func:`_torch_adam_steps`) and the load sets it back, one tensor per parameter
      (:func:`_restore_torch_adam_steps`), because megatron-core 0.16's
      ``DistributedOptimizer.load_state_dict`` gives every parameter the same shared
      ``step`` tensor, which torch's Adam then increments once per parameter per step.
    * :func:`init_optimizer_state_for_load`: loading a distributed-optimizer checkpoint needs
      initialized optimizer state to build the load template; megatron-core's Adam path
      without TE/Apex has none before the first step, so it is initialized with megatron's
      own ``_init_optimizer_states_with_dummy_values`` (every value is then overwritten by
      the load). Megatron-LM's checkpoints need it too.

Why apart:
    These are megatron-core optimizer behaviours a bit-exact resume works around; the save
    records what the load then checks or restores.

Constraints:
    With TE/Apex FusedAdam the step lives in the param group and is unaffected; the recorded
    steps are per leaf optimizer of a chained optimizer and must agree across parameters.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from megatron_ext.config import ConfigError
from megatron_ext.megatron.checkpoint.reading import _read_metadata
from megatron_ext.state import StateMismatch


def _torch_adam_steps(optimizer: Any) -> List[Optional[float]]:
    """Per leaf optimizer: the common per-parameter ``step`` of torch Adam(W) state."""
    steps: List[Optional[float]] = []
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        values = set()
        if inner is not None:
            for st in inner.state.values():
                if "step" in st:
                    values.add(float(st["step"]))
        if len(values) > 1:
            raise ValueError(f"optimizer steps differ across parameters: {sorted(values)}")
        steps.append(values.pop() if values else None)
    return steps


def _restore_torch_adam_steps(optimizer: Any, steps: List[Optional[float]]) -> None:
    """Set torch Adam's per-parameter ``step`` back to the saved value.

    megatron-core 0.16's ``DistributedOptimizer.load_state_dict`` gives every parameter's
    torch Adam state the *same* ``step`` tensor; torch's Adam then increments that shared
    tensor once per parameter per step, so bias correction races ahead and a resumed run
    drifts from the uninterrupted one. (Its ``dp_reshardable`` path can also copy the load
    template's dummy step.) With TE/Apex FusedAdam the step lives in the param group and is
    unaffected.
    """
    leaves = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if len(steps) != len(leaves):
        raise StateMismatch(f"checkpoint has {len(steps)} optimizers, this run {len(leaves)}")
    for leaf, step in zip(leaves, steps):
        inner = getattr(leaf, "optimizer", None)
        if inner is None or step is None:
            continue
        for st in inner.state.values():
            if "step" in st:
                old = st["step"]
                # One tensor per parameter: megatron's load assigns a single shared tensor,
                # which torch's Adam would then increment once per parameter per step.
                if isinstance(old, torch.Tensor):
                    st["step"] = torch.full_like(old, step)
                else:
                    st["step"] = step


def _init_dist_opt_state(optimizer: Any) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(leaf, DistributedOptimizer) and not leaf.optimizer.state:
            leaf._init_optimizer_states_with_dummy_values()


def init_optimizer_state_for_load(optimizer: Any) -> None:
    """Give a distributed optimizer without state (torch Adam before its first step) the
    dummy state megatron-core's load template needs (see module docstring; Megatron-LM's
    checkpoints need it too)."""
    _init_dist_opt_state(optimizer)


def _uses_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(leaf, DistributedOptimizer) for leaf in leaves)


def _saved_distributed_optimizer(common: Dict[str, Any], directory: str) -> bool:
    """Whether the checkpoint holds distributed-optimizer state (recorded since this check
    exists; older checkpoints are recognized by the distributed optimizer's tensor keys)."""
    if "use_distributed_optimizer" in common:
        return bool(common["use_distributed_optimizer"])
    keys = _read_metadata(directory).state_dict_metadata
    return any(k.startswith("optimizer.distributed.") for k in keys)


def check_optimizer_kind(common: Dict[str, Any], optimizer: Any, directory: str) -> None:
    """Refuse to resume a checkpoint saved with the distributed optimizer toggled.

    The distributed optimizer stores its state as flat per-bucket shards, the other one
    per parameter: neither loads into the other (megatron-core raises a ``KeyError``).

    Raises:
        ConfigError: naming ``--use-distributed-optimizer``.
    """
    saved = _saved_distributed_optimizer(common, directory)
    now = _uses_distributed_optimizer(optimizer)
    if saved != now:
        raise ConfigError(
            "--use-distributed-optimizer",
            f"{directory} was saved with the distributed optimizer {'on' if saved else 'off'}, "
            f"this run has it {'on' if now else 'off'}; its optimizer state cannot be loaded. "
            f"Resume {'with' if saved else 'without'} --use-distributed-optimizer (or pass "
            "--finetune to load the model weights only)",
        )
