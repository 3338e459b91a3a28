"""Checkpoints of the ``megatron-ext train`` driver through megatron-core dist_checkpointing.

What it does:
    :func:`save_checkpoint` writes ``<save>/iter_XXXXXXX/`` (torch_dist format) and
    ``<save>/latest_checkpointed_iteration.txt``, Megatron-LM's layout. The sharded state
    dict holds the model (``model.sharded_state_dict()``), the optimizer (the distributed
    optimizer in ``dp_reshardable`` form, as Megatron-LM saves it), the LR scheduler, the
    iteration and consumed samples, every rank's RNG states, and megatron_ext's per-rank
    state (:class:`~megatron_ext.state.ExtState`). :func:`load_checkpoint` restores all of
    it so that a resumed run continues bit for bit.

    megatron_ext state differs across ranks (error-feedback residuals differ across DP
    ranks), so it is stored as one ``ShardedObject`` per global rank; a copy of its layout
    and settings fingerprint goes into the common (rank-0) state so a mismatch is detected
    before loading, and handled by ``--ext-state-on-mismatch`` (error, or reset with a
    warning).

    Resume semantics are Megatron-LM's (:func:`resolve_load`: ``--load`` a directory or
    one ``iter_XXXXXXX`` of it, refused when it holds no checkpoint unless it is
    ``--save``; :func:`check_scheduler`: a differing learning-rate schedule refused unless
    ``--override-opt-param-scheduler`` / ``--use-checkpoint-opt-param-scheduler``), and
    what a load reads is checked: the distributed optimizer toggled is refused
    (:func:`check_optimizer_kind`), a file that cannot be read is named
    (:func:`load_common_state`, :func:`read_error`), and every loaded tensor must be finite
    (:func:`check_finite`, shared with the Megatron-LM adapter).

Elastic resume (another data-parallel size, same TP and PP):
    The common state also records the topology (:data:`TOPOLOGY_KEY`: sizes, the gradient
    reduction op and, per global rank, its TP / PP / DP coordinates and a digest of its RNG
    states). On a load with another DP size, megatron-core's dist_checkpointing reshards
    the model and the optimizer (``dp_reshardable`` allows resharding along DP); the RNG
    states are restored from the old rank with the same TP/PP coordinates when the saved
    states agree across DP ranks (the driver seeds them alike, as Megatron-LM saves one RNG
    state per TP/PP rank), and otherwise kept as seeded with one log line (Megatron-LM's
    ``--no-load-rng``); megatron_ext's per-rank state is remapped by
    :mod:`megatron_ext.elastic` (error-feedback mass preserved and spread over the new
    ranks, replicated state taken from one old rank, the rest reset and named in one log
    line). A changed TP or PP size remains a layout mismatch.

Why not Megatron-LM's checkpointing:
    The driver runs on megatron-core alone; Megatron-LM's checkpoint integration lives in
    the Megatron-LM adapter (issue: Megatron-LM integration).

Constraints:
    Loading a distributed-optimizer checkpoint needs initialized optimizer state to build
    the load template; megatron-core's Adam path without TE/Apex has none before the first
    step, so :func:`load_checkpoint` initializes it with megatron's own
    ``_init_optimizer_states_with_dummy_values`` (every value is then overwritten by the
    load).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed.checkpoint.api

from megatron_ext import elastic
from megatron_ext.config import ConfigError
from megatron_ext.logging import print_rank_0
from megatron_ext.megatron import checksums
from megatron_ext.megatron.naming import unwrap
from megatron_ext.megatron.save_checks import check_finite_for_save
from megatron_ext.state import StateMismatch, fingerprint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "check_free_space",
    "CheckpointSaveError",
    "resolve_load",
    "CheckpointError",
    "check_scheduler",
    "align_lr_bounds_for_load",
    "apply_lr_bounds",
    "check_optimizer_kind",
    "load_common_state",
    "read_error",
    "unreadable_file",
    "LOAD_ERRORS",
    "check_finite",
    "sharded_leaves",
    "latest_iteration",
    "checkpoint_dir",
    "ext_meta",
    "decide_load",
    "init_optimizer_state_for_load",
    "sharded_state_object",
    "META_KEY",
    "STATE_KEY",
    "SHARDED_OBJECT_KEY",
    "TOPOLOGY_KEY",
]


_TRACKER = "latest_checkpointed_iteration.txt"
_FORMAT = "megatron_ext-driver-1"
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


META_KEY = "megatron_ext_meta"
"""Common-state key: layout, settings and their fingerprint of the saved megatron-ext state."""

STATE_KEY = "megatron_ext_state"
"""State-dict key of the per-rank ShardedObject (torch_dist)."""

SHARDED_OBJECT_KEY = "megatron_ext/rank_state"
"""dist_checkpointing key of the ShardedObject (also Megatron-LM checkpoints')."""

TOPOLOGY_KEY = "megatron_ext_topology"
"""Common-state key: parallel sizes, gradient reduction op and every rank's coordinates
and RNG digest (for a resume on another data-parallel size)."""

_RNG_KEY = "rng_state_per_rank"
_OLD_STATE_KEY = "megatron_ext_old_ranks"


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


class CheckpointError(ConfigError):
    """A checkpoint that ``--load`` names cannot be used: absent, unreadable, truncated,
    saved with other settings, or holding non-finite values. The message names the path
    (file or directory) and, for values, the tensor."""

    def __init__(self, message: str, flags: Sequence[str] = ("--load",)):
        super().__init__(list(flags), message)


def checkpoint_dir(root: str, iteration: int) -> str:
    """``<root>/iter_XXXXXXX`` (Megatron-LM's naming)."""
    return os.path.join(root, f"iter_{iteration:07d}")


_ITER_DIR = re.compile(r"^iter_(\d+)$")


def latest_iteration(root: str) -> Optional[int]:
    """Iteration in ``<root>/latest_checkpointed_iteration.txt``, or None without one.

    Raises:
        CheckpointError: the tracker is unreadable or does not hold an iteration number
            (naming the file).
    """
    path = os.path.join(root, _TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
        text = raw.decode("ascii").strip()
        iteration = int(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot read the latest iteration from {path}: {raw[:32]!r} is not an iteration "
            f"number ({type(exc).__name__}); write the number of an iter_XXXXXXX directory "
            "there, or pass that directory as --load"
        ) from None
    if iteration < 0:
        raise CheckpointError(f"{path} holds a negative iteration ({iteration})")
    return iteration


def _is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` is a dist_checkpointing checkpoint (it has metadata.json)."""
    return os.path.isfile(os.path.join(directory, "metadata.json"))


def resolve_load(load: str, *, save: Optional[str] = None) -> Optional[Tuple[str, int]]:
    """The checkpoint ``--load`` names: ``(iteration directory, iteration)``.

    * ``--load DIR/iter_XXXXXXX``: that iteration;
    * ``--load DIR``: the iteration in ``DIR/latest_checkpointed_iteration.txt``;
    * ``--load DIR`` that does not exist or holds no checkpoint: None (start from scratch)
      only when ``DIR`` is also ``--save`` (Megatron-LM's auto-resume convention: an empty
      or absent save directory means a first run); otherwise refused, so a typo never
      trains from scratch and overwrites the checkpoints it was meant to resume.

    Raises:
        CheckpointError: naming the path (see above; also an unreadable tracker, or a
            tracker naming an iteration whose directory is missing).
    """
    path = os.path.normpath(load)
    match = _ITER_DIR.match(os.path.basename(path))
    if match and os.path.isdir(path):
        if not _is_checkpoint(path):
            raise CheckpointError(f"{path} holds no checkpoint (no metadata.json)")
        return path, int(match.group(1))
    iteration = latest_iteration(path) if os.path.isdir(path) else None
    if iteration is not None:
        directory = checkpoint_dir(path, iteration)
        if not _is_checkpoint(directory):
            raise CheckpointError(
                f"{os.path.join(path, _TRACKER)} names iteration {iteration}, but {directory} "
                "holds no checkpoint"
            )
        return directory, iteration
    if save is not None and os.path.abspath(path) == os.path.abspath(os.path.normpath(save)):
        return None
    if not os.path.exists(path):
        problem = f"{path} does not exist"
    else:
        names = os.listdir(path) if os.path.isdir(path) else []
        found = sorted(n for n in names if _ITER_DIR.match(n))
        problem = f"{path} holds no checkpoint (no {_TRACKER})" + (
            f"; it has {', '.join(found)}: pass one of them as --load" if found else ""
        )
    raise CheckpointError(
        f"{problem}. To start from scratch drop --load; --load equal to --save resumes when "
        "that directory holds a checkpoint and starts from scratch when it does not"
    )


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
    elif (
        saved_meta.get("layout") != meta["layout"]
        or saved_meta.get("fingerprint") != meta["fingerprint"]
    ):
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


def save_checkpoint(
    root: str,
    iteration: int,
    *,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    runtime: Any,
    consumed_samples: int,
    extra_common: Optional[Dict[str, Any]] = None,
) -> str:
    """Save iteration ``iteration`` under ``root`` on every rank (collective).

    Returns:
        The checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    directory = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    sd = _sharded_state_dict(
        model_chunks, optimizer, scheduler, runtime, is_loading=False, include_ext=True
    )
    # Collective: no NaN or Inf is ever written (megatron_ext.megatron.save_checks).
    check_finite_for_save(sd, root, iteration)
    # Collective: every rank learns whether there is room before anything is written.
    check_free_space(root, iteration, sd)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.makedirs(directory)
    torch.distributed.barrier()
    sd.update(
        {
            "checkpoint_version": _FORMAT,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            META_KEY: ext_meta(runtime),
            TOPOLOGY_KEY: _topology(model_chunks),
            "torch_adam_steps": _torch_adam_steps(optimizer),
            "use_distributed_optimizer": _uses_distributed_optimizer(optimizer),
        }
    )
    sd.update(extra_common or {})
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(sd, directory)
        # Before the marker names the checkpoint: one it names has its checksums.
        checksums.write_manifest(directory)
    # torch's CheckpointException (what megatron-core's torch_dist save raises for a failed
    # write) derives from BaseException.
    except (Exception, CheckpointException) as exc:
        # Rank 0 removes the torn directory; the latest marker still names the previous,
        # complete checkpoint.
        raise _save_failed(root, iteration, directory, exc) from exc
    torch.distributed.barrier()
    if rank == 0:
        tmp = os.path.join(root, _TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, _TRACKER))
    torch.distributed.barrier()
    return directory


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; rank 0 removed its incomplete directory.

    Attributes:
        detailed: raised on rank 0, whose error holds every rank's failure (megatron-core's
            torch_dist save gathers them there); other ranks' errors may say only that the
            save failed, so they leave the report to rank 0.
    """

    def __init__(self, message: str, detailed: bool):
        super().__init__(message)
        self.detailed = detailed


SPACE_MARGIN = 1.05
"""Free space a save requires, as a multiple of its estimated size (the estimate leaves out
metadata and the common state; the next checkpoint can be slightly larger than the last)."""


def _format_bytes(num: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num >= scale:
            return f"{num / scale:.2f} {unit} ({num} bytes)"
    return f"{num} bytes"


def _directory_bytes(path: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def _state_bytes(sharded_state: Any) -> int:
    """Bytes of the tensors this rank writes (main replicas of its shards)."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        is_main_replica,
    )

    total = 0
    stack = [sharded_state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, (ShardedTensor, ShardedTensorFactory)):
            data = obj.data
            if isinstance(data, torch.Tensor) and is_main_replica(obj.replica_id):
                total += data.numel() * data.element_size()
        elif isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
    return total


def _estimate_bytes(root: str, sharded_state: Any) -> tuple:
    """``(bytes, basis)``: the size of the latest checkpoint under ``root``, or (first save)
    the state's tensors summed over all ranks (collective in that case on every rank)."""
    latest = latest_iteration(root)
    if latest is not None and os.path.isdir(checkpoint_dir(root, latest)):
        if torch.distributed.get_rank() == 0:
            size = _directory_bytes(checkpoint_dir(root, latest))
            return size, f"the size of iteration {latest}'s checkpoint"
        return 0, ""
    from megatron_ext.accounting import collective_device

    local = torch.tensor([_state_bytes(sharded_state)], dtype=torch.int64)
    local = local.to(collective_device())
    torch.distributed.all_reduce(local)
    return int(local.item()), "the size of the model, optimizer and RNG state"


def check_free_space(root: str, iteration: int, sharded_state: Any) -> None:
    """Refuse a save that cannot fit on ``root``'s file system (collective).

    Rank 0 compares the estimated size (:func:`_estimate_bytes` times
    :data:`SPACE_MARGIN`) with the free space of the file system holding ``root`` (plus the
    space a checkpoint of the same iteration being replaced frees) and tells every rank.

    Raises:
        ConfigError: naming ``--save``, the directory, the bytes needed and the bytes free.
    """
    from megatron_ext.config import ConfigError

    needed, basis = _estimate_bytes(root, sharded_state)
    problem = [None]
    if torch.distributed.get_rank() == 0:
        existing = root
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing) or "."
        free = shutil.disk_usage(existing).free
        replaced = checkpoint_dir(root, iteration)
        if os.path.isdir(replaced):
            free += _directory_bytes(replaced)
        wanted = int(needed * SPACE_MARGIN)
        if free < wanted:
            problem[0] = (
                f"not enough free space in {root} for the checkpoint of iteration "
                f"{iteration}: about {_format_bytes(wanted)} needed ({basis} plus "
                f"{round((SPACE_MARGIN - 1) * 100)}%), {_format_bytes(free)} free"
            )
    torch.distributed.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ConfigError("--save", problem[0])


_FULL_BELOW = 64 * 2**20
"""Free bytes under which a failed save is reported as a full disk: torch's zip writer
reports ENOSPC only as ``enforce fail at inline_container.cc ... unexpected pos``."""


def _failure_reason(exc: BaseException) -> str:
    """The last line of ``exc`` that states an error (torch's CheckpointException carries
    every rank's traceback in its message)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    stated = [
        line
        for line in lines
        if line and not line.startswith(("Traceback", "File ", "^", "~")) and ":" in line
    ]
    if stated:
        return stated[-1]
    return f"{type(exc).__name__}: {next((line for line in lines if line), '')}".rstrip(": ")


def _save_failed(root: str, iteration: int, directory: str, exc: BaseException) -> Exception:
    """On rank 0, remove the torn ``directory``; describe the failure in one line.

    Only rank 0 removes it: megatron-core's torch_dist save raises on every rank once any
    write failed, and a removal by another rank would race with rank 0's measure of the
    free space (the only sign of a full disk when torch's zip writer fails).
    """
    existing = root if os.path.isdir(root) else os.path.dirname(root) or "."
    # Measured before the torn directory is removed (which frees its space).
    free = shutil.disk_usage(existing).free
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    reason = _failure_reason(exc)
    chain, enospc = exc, False
    while chain is not None:
        if isinstance(chain, OSError) and chain.errno == errno.ENOSPC:
            enospc = True
        chain = chain.__cause__ or chain.__context__
    if enospc or "No space left" in str(exc) or free < _FULL_BELOW:
        reason = f"no space left on the device ({_format_bytes(free)} free); {reason}"
    latest = latest_iteration(root)
    kept = "no earlier checkpoint" if latest is None else f"latest checkpoint: iteration {latest}"
    return CheckpointSaveError(
        f"--save: the checkpoint of iteration {iteration} could not be written to {directory} "
        f"({reason}); removed the incomplete directory, {kept}",
        detailed=rank == 0,
    )


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


# -- checks of what a load reads -----------------------------------------------------------------

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


def _read_metadata(directory: str) -> Any:
    """The torch_dist ``.metadata`` of ``directory`` (CheckpointError naming the file)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(directory, ".metadata")
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as exc:  # noqa: BLE001 (any failure to read: named, re-raised)
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def unreadable_file(directory: str) -> Optional[str]:
    """The first file of a torch_dist checkpoint that cannot be read, with why (or None).

    Called after a load failed: dist_checkpointing's errors do not name the file. Checks
    ``metadata.json``, ``common.pt`` (megatron-core 0.16), ``.metadata``, then every stored
    item (``__R_N.distcp`` byte ranges, each a ``torch.save`` of one tensor or object).
    """
    meta_json = os.path.join(directory, "metadata.json")
    try:
        with open(meta_json) as f:
            json.load(f)
    except Exception as exc:  # noqa: BLE001
        return f"{meta_json}: {type(exc).__name__}: {exc}"
    common = os.path.join(directory, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            return f"{common}: {type(exc).__name__}: {exc}"
    try:
        metadata = _read_metadata(directory)
    except CheckpointError as exc:
        return str(exc).split(": ", 1)[1]
    sizes: Dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        path = os.path.join(directory, info.relative_path)
        if path not in sizes:
            sizes[path] = os.path.getsize(path) if os.path.isfile(path) else -1
        if sizes[path] < 0:
            return f"{path} is missing (the checkpoint's .metadata lists it)"
        if info.offset + info.length > sizes[path]:
            return (
                f"{path} is truncated: {sizes[path]} bytes, but {index.fqn} is stored at bytes "
                f"{info.offset}-{info.offset + info.length}"
            )
    for index, info in metadata.storage_data.items():
        path = os.path.join(directory, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            return f"{path}: {index.fqn} cannot be read ({type(exc).__name__}: {exc})"
    return None


# torch.distributed.checkpoint's CheckpointException (the per-rank failures of a load) is a
# BaseException.
LOAD_ERRORS = (Exception, torch.distributed.checkpoint.api.CheckpointException)


def read_error(directory: str, what: str, exc: BaseException) -> CheckpointError:
    """A CheckpointError naming the file of torch_dist ``directory`` that failed to load
    ``what`` (or the directory and ``exc`` when every file reads)."""
    bad = unreadable_file(directory)
    if bad is not None:
        return CheckpointError(f"cannot load {what} from {directory}: {bad}")
    return CheckpointError(f"cannot load {what} from {directory}: {type(exc).__name__}: {exc}")


def load_common_state(directory: str) -> Dict[str, Any]:
    """dist_checkpointing's common (rank-0) state of ``directory``, naming a bad file."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(directory)
    except LOAD_ERRORS as exc:  # named and re-raised
        raise read_error(directory, "the common state", exc) from exc


def sharded_leaves(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple, Any]]:
    """``(path, leaf)`` of every dist_checkpointing object (ShardedTensor, ShardedObject,
    factory) of a load template (``dict(sharded_leaves(template))`` for
    :func:`check_finite`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(tree, ShardedBase):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from sharded_leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from sharded_leaves(v, path + (i,))


def _non_finite_values(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple, Any]]:
    """``(path, tensor)`` of every floating tensor in ``tree`` with a value that is not finite
    (Python floats are not checked: some legitimately hold inf)."""
    if isinstance(tree, torch.Tensor):
        if (tree.is_floating_point() or tree.is_complex()) and not bool(torch.isfinite(tree).all()):
            yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _non_finite_values(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _non_finite_values(v, path + (i,))


def _stored_file(directory: str, sharded: Any, value: Any) -> str:
    """The ``__R_N.distcp`` file holding ``sharded``'s first non-finite element."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    metadata = _read_metadata(directory)
    files = []
    if isinstance(sharded, ShardedObject):
        files = [
            i.relative_path for k, i in metadata.storage_data.items() if k.fqn == sharded.unique_key
        ]
    elif isinstance(sharded, ShardedTensor) and isinstance(value, torch.Tensor):
        bad = int((~torch.isfinite(value.reshape(-1))).nonzero()[0])
        start = sharded.flattened_range.start if sharded.flattened_range is not None else 0
        shape = tuple(sharded.local_shape)
        local = np.unravel_index(start + bad, shape) if shape else ()
        index = tuple(sharded.global_offset[: sharded.prepend_axis_num]) + tuple(
            int(o) + int(i)
            for o, i in zip(sharded.global_offset[sharded.prepend_axis_num :], local)
        )
        md = metadata.state_dict_metadata.get(sharded.key)
        for chunk in getattr(md, "chunks", []):
            if all(o <= x < o + n for o, n, x in zip(chunk.offsets, chunk.sizes, index)):
                files = [
                    i.relative_path
                    for k, i in metadata.storage_data.items()
                    if k.fqn == sharded.key and tuple(k.offset) == tuple(chunk.offsets)
                ]
                break
    if not files:
        key = getattr(sharded, "key", "")
        files = sorted(
            {i.relative_path for k, i in metadata.storage_data.items() if k.fqn.startswith(key)}
        )
    return ", ".join(os.path.join(directory, f) for f in files) or directory


def check_finite(
    named: Dict[Tuple, Any], state: Dict[str, Any], directory: str, file: Optional[str] = None
) -> None:
    """Stop unless every floating value loaded on every rank is finite (collective).

    ``named`` maps the paths of the load template's sharded objects to them (taken before
    the load, which may change the template in place), ``state`` is what the load
    returned (model, optimizer, scheduler, megatron-ext state). A non-finite value in a
    checkpoint (a corrupted byte range reads as NaN) would otherwise train on silently.
    ``file`` names where values outside the template come from (default: the torch_dist
    checkpoint's ``common.pt``, or the directory).

    Raises:
        CheckpointError: on every rank, naming the tensor (checkpoint key and path in the
            state dict), how many values are not finite, and the file holding it.
    """
    problem = ""
    for path, value in _non_finite_values(state):
        prefix = next((path[:n] for n in range(len(path), -1, -1) if path[:n] in named), None)
        sharded = named.get(prefix)
        where = ".".join(map(str, path))
        count = int((~torch.isfinite(value)).sum())
        what = f"{count} of {value.numel()} values are not finite (NaN or inf)"
        if sharded is not None:
            key = sharded.key
            source = _stored_file(directory, sharded, value)
        else:
            common = os.path.join(directory, "common.pt")
            key = where
            source = file or (common if os.path.isfile(common) else directory)
        problem = (
            f"non-finite values in {source}: tensor {key!r} (state {where}): {what}; the "
            "checkpoint is corrupt, load an earlier iteration (--load DIR/iter_XXXXXXX)"
        )
        break
    problems: List[str] = [""] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise CheckpointError(first)


def _load_sharded(template: Dict[str, Any], directory: str, what: str) -> Dict[str, Any]:
    """``dist_checkpointing.load`` naming the file that fails, then :func:`check_finite`."""
    from megatron.core import dist_checkpointing

    named = dict(sharded_leaves(template))
    try:
        state = dist_checkpointing.load(template, directory)
    except LOAD_ERRORS as exc:  # named and re-raised
        raise read_error(directory, what, exc) from exc
    check_finite(named, state, directory)
    return state


def init_optimizer_state_for_load(optimizer: Any) -> None:
    """Give a distributed optimizer without state (torch Adam before its first step) the
    dummy state megatron-core's load template needs (see module docstring; Megatron-LM's
    checkpoints need it too)."""
    _init_dist_opt_state(optimizer)


def _load_model(directory: str, model_chunks: Sequence[torch.nn.Module]) -> Dict[str, Any]:
    """Model weights only, from a megatron-ext train or a Megatron-LM torch_dist checkpoint."""
    from megatron.core import parallel_state as ps

    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    template = {
        key: unwrap(chunk).sharded_state_dict(metadata=metadata)
        for key, chunk in zip(keys, model_chunks)
    }
    state = _load_sharded(template, directory, "the model weights")
    for key, chunk in zip(keys, model_chunks):
        unwrap(chunk).load_state_dict(state[key], strict=True)
    torch.distributed.barrier()
    return {"iteration": 0, "consumed_samples": 0, "finetune_from": directory}


class _ReshardPlan:
    """How this rank loads a checkpoint saved with another data-parallel size."""

    def __init__(self, old: Dict[str, Any], new: Dict[str, int], old_op: str):
        self.old = old
        """Saved sizes (``tp``, ``pp``, ``dp``, ``world``)."""
        self.new = new
        """This run's sizes."""
        self.old_op = old_op
        """Gradient reduction op of the saved run."""
        self.by_dp: Optional[List[int]] = None
        """Old global ranks with this rank's TP/PP coordinates, by old DP rank (None: the
        checkpoint predates the topology record)."""
        self.rng_rank: Optional[int] = None
        """Old global rank whose RNG states this rank restores (None: keep the seeded ones)."""
        self.remap_ext = False
        """Remap megatron_ext's per-rank state (:mod:`megatron_ext.elastic`)."""
        self.assigned: List[int] = []
        """Old DP ranks whose megatron_ext state this rank adds up."""


def _reshard_plan(common: Dict[str, Any], directory: str) -> Optional[_ReshardPlan]:
    """None when the checkpoint has this run's sizes; a plan when only DP differs.

    Raises:
        StateMismatch: the tensor- or pipeline-parallel size differs.
    """
    new = _sizes()
    topology = common.get(TOPOLOGY_KEY)
    if topology is not None:
        old = {k: topology[k] for k in ("tp", "pp", "dp", "world")}
    else:  # checkpoints written before the topology record: the megatron_ext layout
        layout = (common.get(META_KEY) or {}).get("layout") or {}
        if not all(k in layout for k in ("tp", "pp", "dp", "world")):
            return None
        old = {k: layout[k] for k in ("tp", "pp", "dp", "world")}
    if old == new:
        return None
    if (old["tp"], old["pp"]) != (new["tp"], new["pp"]):
        raise StateMismatch(
            f"{directory} was saved with TP {old['tp']}, PP {old['pp']}; this run has TP "
            f"{new['tp']}, PP {new['pp']}: only the data-parallel size may change on resume "
            "(--tensor-model-parallel-size, --pipeline-model-parallel-size)"
        )
    plan = _ReshardPlan(old, new, (topology or {}).get("grad_reduce_op", "sum"))
    if topology is None:
        print_rank_0(
            f"megatron-ext: WARNING: {directory} predates the topology record: RNG states not "
            "restored (as --no-load-rng); megatron-ext state cannot be remapped"
        )
        return plan
    me = _coordinates()
    group = sorted(
        (r["dp"], g)
        for g, r in enumerate(topology["ranks"])
        if (r["tp"], r["pp"]) == (me["tp"], me["pp"])
    )
    plan.by_dp = [g for _, g in group]
    if len(plan.by_dp) != old["dp"]:
        raise StateMismatch(f"{directory}: topology record has {len(plan.by_dp)} DP ranks here")
    # Restored only if the saved DP replicas agree in every TP/PP group: the decision is
    # the same on every rank, so every rank takes part in the same loads.
    groups: Dict[tuple, set] = {}
    for r in topology["ranks"]:
        groups.setdefault((r["tp"], r["pp"]), set()).add(r["rng"])
    if all(len(digests) == 1 for digests in groups.values()):
        plan.rng_rank = plan.by_dp[0]
        rng = "RNG states restored (they agree across the saved DP ranks)"
    else:
        rng = (
            "RNG states not restored: they differ across the saved DP ranks (as "
            "--no-load-rng: kept as seeded)"
        )
    print_rank_0(
        f"megatron-ext: resuming on data-parallel size {new['dp']} from {directory} saved "
        f"with {old['dp']} (TP {new['tp']}, PP {new['pp']}): model and optimizer resharded by "
        f"dist_checkpointing; {rng}"
    )
    return plan


def _can_remap(
    common: Dict[str, Any], runtime: Any, plan: _ReshardPlan, on_mismatch: str, where: str
) -> bool:
    """Whether megatron_ext's state is remapped onto the new DP size (same settings and a
    topology record); otherwise :func:`decide_load` handles the mismatch (raises, or
    warns and this returns False)."""
    saved = common.get(META_KEY)
    # TP and PP are the same (checked by _reshard_plan); the settings must be too.
    if plan.by_dp is not None and saved is not None:
        if saved.get("fingerprint") == ext_meta(runtime)["fingerprint"]:
            from megatron.core import parallel_state as ps

            dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
            plan.assigned = elastic.assigned_old_dp_ranks(plan.old["dp"], plan.new["dp"], dp_rank)
            return True
    decide_load(saved, runtime, on_mismatch, where)
    return False


def _reshard_template(template: Dict[str, Any], plan: _ReshardPlan) -> Dict[str, Any]:
    """Take the RNG entry out of a load template; returns the template of the old ranks'
    objects this rank reads (RNG states, megatron_ext state).

    They are loaded separately without dist_checkpointing's access-integrity check, which
    requires every saved shard to be read exactly once: here some old shards are read by
    several new ranks (old DP rank 0's) and others by none (the RNG states of the other
    old DP ranks). The model and optimizer keep the check.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = plan.old["world"]
    del template["rng_state"]
    extra: Dict[str, Any] = {}
    if plan.rng_rank is not None:
        extra["rng_state"] = ShardedObject(_RNG_KEY, {}, (world,), (plan.rng_rank,), replica_id=0)
    if plan.remap_ext:
        wanted = sorted(set(plan.assigned) | {0})
        extra[_OLD_STATE_KEY] = {
            f"dp{j}": ShardedObject(SHARDED_OBJECT_KEY, {}, (world,), (plan.by_dp[j],), 0)
            for j in wanted
        }
    return extra


def _finish_reshard(
    state: Dict[str, Any], plan: _ReshardPlan, runtime: Any, model_chunks: Sequence[Any]
) -> None:
    """Remap the old ranks' megatron_ext state onto this rank and log what was reset."""
    if not plan.remap_ext:
        return
    from megatron.core import parallel_state as ps

    # Saved at an older format: brought to the current one first (raises on an unknown one).
    olds = {key: runtime.state.upgrade(old) for key, old in state[_OLD_STATE_KEY].items()}
    fresh = runtime.state.state_dict()
    rules = elastic.rules_of(runtime.state.objects)
    group = ps.get_data_parallel_group(with_context_parallel=True)

    def dp_sum(flat: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(flat, group=group)
        return flat

    objects, reset = elastic.remap_objects(
        [olds[f"dp{j}"]["objects"] for j in plan.assigned],
        olds["dp0"]["objects"],
        fresh["objects"],
        rules,
        old_dp=plan.old["dp"],
        new_dp=plan.new["dp"],
        old_op=plan.old_op,
        new_op=_grad_reduce_op(model_chunks),
        dp_sum=dp_sum,
    )
    runtime.state.load_state_dict(dict(fresh, objects=objects))
    everywhere: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everywhere, reset)
    names = sorted({entry for entries in everywhere for entry in entries})
    print_rank_0(
        f"megatron-ext: state remapped from {plan.old['dp']} to {plan.new['dp']} data-parallel "
        "ranks (error-feedback residual mass preserved, replicated state taken from old DP "
        "rank 0)"
    )
    if names:
        print_rank_0(
            "megatron-ext: WARNING: elastic resume reset megatron-ext state that cannot be "
            f"remapped to another data-parallel size: {', '.join(names)}"
        )


def load_checkpoint(
    root: str,
    *,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    runtime: Any,
    on_mismatch: str = "error",
    model_only: bool = False,
    save: Optional[str] = None,
    verify_checksums: bool = True,
) -> Optional[Dict[str, Any]]:
    """Restore the checkpoint ``root`` names (collective); see :func:`resolve_load`.

    Every value loaded is checked to be finite (:func:`check_finite`), and every read error
    names the file.

    Args:
        root: ``--load``: a directory with ``latest_checkpointed_iteration.txt`` (its latest
            iteration) or an ``iter_XXXXXXX`` directory (that iteration).
        model_only: load the model weights only (fine-tuning); the checkpoint may also be
            a Megatron-LM torch_dist one, whose model state has the same layout.
        save: ``--save``: when ``root`` is the same directory and holds no checkpoint yet,
            None is returned (a first run) instead of an error.
        verify_checksums: check the files against the checksums written at save first
            (:mod:`megatron_ext.megatron.checksums`; off with
            ``--no-verify-checkpoint-checksums``).

    Returns:
        The common state (``iteration``, ``consumed_samples``, ...), or None (see
        ``save``); with ``model_only`` iteration and consumed samples are 0.

    Raises:
        CheckpointError: no checkpoint at ``root``, an unreadable file, a file that does
            not match its checksum, a non-finite value.
        ConfigError: the learning-rate schedule or ``--use-distributed-optimizer`` differs.
        StateMismatch: megatron_ext state saved with another layout or settings and
            ``on_mismatch == 'error'``.
    """
    resolved = resolve_load(root, save=save)
    if resolved is None:
        return None
    directory, _ = resolved
    checksums.verify_checkpoint(directory, verify=verify_checksums)
    common = load_common_state(directory)
    if model_only:
        return _load_model(directory, model_chunks)
    if common.get("checkpoint_version") != _FORMAT:
        raise StateMismatch(
            f"{directory} is not a megatron-ext train checkpoint "
            f"(version {common.get('checkpoint_version')!r})"
        )
    check_optimizer_kind(common, optimizer, directory)
    check_scheduler(common["opt_param_scheduler"], scheduler, directory)
    plan = _reshard_plan(common, directory)
    if plan is None:
        include_ext = decide_load(common.get(META_KEY), runtime, on_mismatch, directory)
    else:
        include_ext = False
        plan.remap_ext = _can_remap(common, runtime, plan, on_mismatch, directory)
    _init_dist_opt_state(optimizer)
    template = _sharded_state_dict(
        model_chunks, optimizer, scheduler, runtime, is_loading=True, include_ext=include_ext
    )
    extra = _reshard_template(template, plan) if plan is not None else {}
    state = _load_sharded(template, directory, "the checkpoint")
    if extra:
        # The old ranks' megatron_ext state (elastic resume), checked like the rest. The
        # result also holds the common state: keep only the requested entries.
        from megatron.core import dist_checkpointing

        named = dict(sharded_leaves(extra))
        try:
            loaded = dist_checkpointing.load(extra, directory, validate_access_integrity=False)
        except LOAD_ERRORS as exc:  # named and re-raised
            raise read_error(directory, "the old ranks' megatron_ext state", exc) from exc
        check_finite(named, loaded, directory)
        state.update({key: loaded[key] for key in extra})
    if len(model_chunks) == 1:
        unwrap(model_chunks[0]).load_state_dict(state["model"], strict=True)
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
    # megatron-core 0.16's DistributedOptimizer.load_parameter_state_from_dp_reshardable
    # copies into views of leaf parameters without @torch.no_grad(); loading is no autograd.
    align_lr_bounds_for_load(state["optimizer"], scheduler)
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
        _restore_torch_adam_steps(optimizer, common["torch_adam_steps"])
    apply_lr_bounds(optimizer, scheduler, state["opt_param_scheduler"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if "rng_state" in state:
        _set_rng_state(state["rng_state"])
    if include_ext:
        runtime.state.load_state_dict(state[STATE_KEY])
    if plan is not None:
        _finish_reshard(state, plan, runtime, model_chunks)
    torch.distributed.barrier()
    return {k: v for k, v in common.items() if not isinstance(v, dict) or k == META_KEY}
