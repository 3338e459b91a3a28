"""What a ``megatron-ext train`` checkpoint holds: the sharded state dict, saved and loaded alike.

What it does:
    :func:`_sharded_state_dict` builds the dist_checkpointing state dict of a save, or the
    template of a load (the same keys): the model (``model.sharded_state_dict()`` of the bare
    model, ``model<i>`` per virtual pipeline chunk), the optimizer (the distributed optimizer
    in ``dp_reshardable`` form, as Megatron-LM saves it), the LR scheduler, every rank's RNG
    states (:func:`_rng_state` / :func:`_set_rng_state`) and megatron_ext's per-rank state
    (:mod:`.ext_state`). The save adds the common entries (iteration, consumed samples, the
    format :data:`_FORMAT`, ...; see :mod:`.save`).

Why apart:
    The save, the load and the elastic resume (which reads one old rank's RNG states) must
    agree on these keys; one function builds both sides.

Constraints:
    The layout is Megatron-LM's (``model``, ``optimizer``, ``opt_param_scheduler``,
    ``rng_state``), so a Megatron-LM torch_dist checkpoint's model weights load with
    ``--finetune``. RNG states are per global rank: a resume on another data-parallel size
    restores them only when the saved ones agree across DP ranks (:mod:`.reshard`).
"""

from __future__ import annotations

import random
from typing import Any, Dict, Sequence

import numpy as np
import torch

from megatron_ext.megatron.checkpoint.ext_state import STATE_KEY, sharded_state_object
from megatron_ext.megatron.naming import unwrap

_FORMAT = "megatron_ext-driver-1"
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


_RNG_KEY = "rng_state_per_rank"


def _rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    runtime: Any,
    *,
    is_loading: bool,
    include_ext: bool,
) -> Dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    sd: Dict[str, Any] = {}
    # As Megatron-LM: state of the bare GPTModel, without DDP / Float16Module prefixes.
    if len(model_chunks) == 1:
        sd["model"] = unwrap(model_chunks[0]).sharded_state_dict(metadata=metadata)
    else:
        for i, chunk in enumerate(model_chunks):
            sd[f"model{i}"] = unwrap(chunk).sharded_state_dict(metadata=metadata)
    model_sd = {}
    for key, value in sd.items():
        model_sd.update(value)
    sd["optimizer"] = optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=dict(_OPTIM_METADATA)
    )
    sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["rng_state"] = ShardedObject(_RNG_KEY, _rng_state(), (world,), (rank,), replica_id=0)
    if include_ext:
        sd[STATE_KEY] = sharded_state_object(runtime)
    return sd
