"""Elastic resume: loading a checkpoint saved with another data-parallel size (same TP and PP).

What it does:
    From the topology record the save wrote (:mod:`.topology`), :func:`_reshard_plan` decides
    how this rank loads: megatron-core's dist_checkpointing reshards the model and the
    optimizer (``dp_reshardable`` allows resharding along DP); the RNG states are restored
    from the old rank with the same TP/PP coordinates when the saved states agree across DP
    ranks (the driver seeds them alike, as Megatron-LM saves one RNG state per TP/PP rank),
    and otherwise kept as seeded with one log line (Megatron-LM's ``--no-load-rng``);
    megatron_ext's per-rank state is remapped by :mod:`megatron_ext.elastic`
    (:func:`_can_remap`, :func:`_reshard_template`, :func:`_finish_reshard`: error-feedback
    mass preserved and spread over the new ranks, replicated state taken from one old rank,
    the rest reset and named in one log line).

Why apart:
    Only a resume on another DP size takes this path; the plain load (:mod:`.load`) calls
    these functions at four points and is otherwise unchanged.

Constraints:
    A changed TP or PP size remains a layout mismatch (``StateMismatch``). The old ranks' RNG
    and megatron_ext states are loaded without dist_checkpointing's access-integrity check
    (some old shards are read by several new ranks, others by none); the model and optimizer
    keep it. Checkpoints older than the topology record load with RNG states not restored and
    megatron_ext state not remapped.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_ext import elastic
from megatron_ext.logging import print_rank_0
from megatron_ext.megatron.checkpoint.ext_state import (
    META_KEY,
    SHARDED_OBJECT_KEY,
    decide_load,
)
from megatron_ext.megatron.checkpoint.state_dict import _RNG_KEY
from megatron_ext.megatron.checkpoint.topology import (
    TOPOLOGY_KEY,
    _coordinates,
    _grad_reduce_op,
    _sizes,
)
from megatron_ext.state import StateMismatch

_OLD_STATE_KEY = "megatron_ext_old_ranks"


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
        if not runtime.state.settings_diff(saved):
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
