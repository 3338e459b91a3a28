"""The topology record a save writes, so that a resume on another data-parallel size can reshard.

What it does:
    :func:`_topology` gathers, at every save, the parallel sizes (:func:`_sizes`), the
    gradient reduction op (:func:`_grad_reduce_op`) and, per global rank, its TP / PP / DP
    coordinates (:func:`_coordinates`) and a digest of its RNG states (:func:`_digest`); the
    save stores it in the common state under :data:`TOPOLOGY_KEY`.

Why apart:
    It is the save's half of the elastic resume; :mod:`.reshard` reads it back (and reads this
    run's sizes and coordinates with the same functions) to plan the load.

Constraints:
    :func:`_topology` is collective (``all_gather_object``): every rank calls it. Digests
    compare RNG states by content (equal states, equal digests), not by identity.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from megatron_ext.megatron.checkpoint.state_dict import _rng_state

TOPOLOGY_KEY = "megatron_ext_topology"
"""Common-state key: parallel sizes, gradient reduction op and every rank's coordinates
and RNG digest (for a resume on another data-parallel size)."""


def _digest(obj: Any, h: Any = None) -> str:
    """Content hash of a (nested) RNG state: equal states give equal digests."""
    top = h is None
    h = hashlib.sha256() if top else h
    if isinstance(obj, torch.Tensor):
        h.update(obj.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(obj.tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            h.update(str(key).encode())
            _digest(obj[key], h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        for value in obj:
            _digest(value, h)
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16] if top else ""


def _grad_reduce_op(model_chunks: Sequence[torch.nn.Module]) -> str:
    """``"avg"`` with megatron's ``average_in_collective``, else ``"sum"``."""
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    return "avg" if getattr(ddp_config, "average_in_collective", False) else "sum"


def _coordinates() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=True),
    }


def _sizes() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "world": torch.distributed.get_world_size(),
    }


def _topology(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, Any]:
    """The common-state record of :data:`TOPOLOGY_KEY` (collective: gathers every rank's
    coordinates and RNG digest)."""
    mine = dict(_coordinates(), rng=_digest(_rng_state()))
    ranks: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    return dict(_sizes(), grad_reduce_op=_grad_reduce_op(model_chunks), ranks=ranks)
