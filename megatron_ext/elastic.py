"""Remapping megatron_ext's per-rank state onto a different data-parallel size.

What it does:
    A checkpoint holds one megatron_ext state dict per global rank
    (:class:`~megatron_ext.state.ExtState`: ``objects[name][key]``, keys ``role/fqn`` or a
    bare ``role``). When a run resumes with another data-parallel (DP) size, but the same
    tensor- and pipeline-parallel sizes, each new rank builds its state from the old ranks
    that held the same model part (same TP and PP coordinates), role by role:

    * ``sum``: rank-local error-feedback mass in the units of the rank's own input to the
      gradient reduction (SEPARATE ``residual``, PowerSGD ``error``, quantized
      ``worker_error``, Radius ``residual``). What the reduction has not applied yet is
      ``M = sum_r e_r`` under SUM (megatron pre-scales every rank's gradient by
      ``gradient_scaling_factor = 1/dp``, so the reduced value is the sum of the inputs and
      a residual enters it unscaled) and ``M = (1/dp) sum_r e_r`` under AVG
      (``average_in_collective``: inputs are unscaled, the collective divides). Every new
      rank gets the same ``e' = M / dp_new`` under SUM and ``e' = M`` under AVG, so the new
      ranks' residuals reduce to exactly the old pending mass ``M``. With
      ``S = sum_r e_r`` (old ranks): SUM -> SUM gives ``S / dp_new``, AVG -> AVG ``S / dp_old``
      (:func:`spread_scale` covers a change of the op too);
    * ``mean``: error-feedback mass of an exchange that always averages, whatever the
      gradient op (QuantizedAdam's momentum ``worker_error``): the pending mass is
      ``M = (1/dp) sum_r e_r`` and every new rank gets ``e' = M = S / dp_old``;
    * ``total``: state that a plain SUM all-reduce combines regardless of the gradient op
      (Protocol Models' accumulated ``A = sum G^T G``): ``e' = S / dp_new``;
    * ``partition``: state that lives on the rank owning a partition of the bucket and is
      zero elsewhere (quantized ``server_error``, in the units of the reduced value): the
      old ranks' values add up to the whole bucket's state, and every new rank is given
      that sum, of which the reducer's ``load_state_dict`` keeps its own new partition;
    * ``same``: replicated across DP ranks (computed from all-reduced values: G-SEPARATE's
      ``ratio`` / ``beta_scale``, PowerSGD's warm start ``q``, Radius's ``mask`` and
      ``selections``, Grass's selection, Protocol's basis ``u``): taken from old DP rank 0;
    * ``reset``: cannot be remapped (AQ-SGD's per-sample activation buffers belong to the
      samples of one DP rank): the new rank keeps its freshly built value. Every reset
      ``object: role`` is returned so that the caller prints it in one log line.

    Every state object declares its rules itself: the class attribute ``elastic_rules``
    (role -> rule, :class:`~megatron_ext.protocols.ElasticStateful`), read from the live
    objects of the new run. An object without rules cannot be registered for checkpointing,
    and a saved or fresh role without a rule stops the remap with an error naming it: a
    role is never reset or guessed silently.

Why a separate module:
    The rules are the only place that knows what each method's state *means* across ranks;
    the reducers' own ``state_dict`` stays rank-local and unaware of resharding.

Constraints:
    Pure torch; never imports Megatron. The caller supplies the old states its new rank
    is assigned and the DP sum (an all-reduce over the new DP group, or the identity when
    every old state is on hand), so the same function serves the distributed load and the
    unit tests.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_ext.protocols import MEAN, PARTITION, RESET, SAME, SUM, TOTAL, elastic_rules_of

__all__ = [
    "role_of",
    "rule_for",
    "rules_of",
    "spread_scale",
    "assigned_old_dp_ranks",
    "remap_objects",
]


def role_of(key: str) -> str:
    """The role of a state key: the part before the first ``/`` (the key itself if none)."""
    return key.split("/", 1)[0]


def rules_of(objects: Mapping[str, Any]) -> Dict[str, Mapping[str, str]]:
    """Object name -> its class's ``elastic_rules`` (raises TypeError for an object whose
    class declares none: see :func:`~megatron_ext.protocols.elastic_rules_of`)."""
    return {name: elastic_rules_of(obj) for name, obj in objects.items()}


def rule_for(rules: Mapping[str, str], key: str, *, name: str = "") -> str:
    """The rule for ``key`` of an object whose rules are ``rules``.

    Raises:
        ValueError: the key's role has no rule (``name``: the object, for the message).
    """
    role = role_of(key)
    if role not in rules:
        raise ValueError(
            f"megatron-ext: elastic resume: state object {name!r} has role {role!r} (key "
            f"{key!r}) but its class declares no elastic rule for it (elastic_rules: "
            f"{sorted(rules)}); nothing is reset silently"
        )
    return rules[role]


def spread_scale(rule: str, *, old_dp: int, new_dp: int, old_op: str, new_op: str) -> float:
    """The factor ``c`` that gives every new rank ``c * S``, ``S`` the old ranks' sum.

    Args:
        rule: :data:`SUM`, :data:`MEAN`, :data:`TOTAL` or :data:`PARTITION`.
        old_dp: DP size the state was saved with.
        new_dp: DP size of this run.
        old_op: gradient reduction op of the saved run, ``"sum"`` or ``"avg"``.
        new_op: the same for this run.

    Returns:
        For :data:`SUM`: the pending mass is ``M = S`` (old SUM) or ``S / old_dp`` (old
        AVG); a new rank's share is ``M / new_dp`` (new SUM) or ``M`` (new AVG). For
        :data:`MEAN` ``1 / old_dp``; for :data:`TOTAL` ``1 / new_dp``; for :data:`PARTITION` 1.
    """
    for name, op in (("old_op", old_op), ("new_op", new_op)):
        if op not in ("sum", "avg"):
            raise ValueError(f"{name} must be 'sum' or 'avg', got {op!r}")
    if old_dp < 1 or new_dp < 1:
        raise ValueError(f"DP sizes must be positive, got {old_dp} and {new_dp}")
    if rule == TOTAL:
        return 1.0 / new_dp
    if rule == MEAN:
        return 1.0 / old_dp
    if rule == PARTITION:
        return 1.0
    if rule != SUM:
        raise ValueError(f"no spreading for rule {rule!r}")
    pending = 1.0 if old_op == "sum" else 1.0 / old_dp
    return pending / new_dp if new_op == "sum" else pending


def assigned_old_dp_ranks(old_dp: int, new_dp: int, new_dp_rank: int) -> List[int]:
    """Old DP ranks whose state new DP rank ``new_dp_rank`` reads and adds up (round robin:
    every old rank is read by exactly one new rank, so the all-reduce of the partial sums
    counts each once and no rank holds more than ``ceil(old_dp / new_dp)`` of them)."""
    return [j for j in range(old_dp) if j % new_dp == new_dp_rank]


def _is_mass(rule: str) -> bool:
    return rule in (SUM, MEAN, TOTAL, PARTITION)


def remap_objects(
    assigned: Sequence[Mapping[str, Mapping[str, Any]]],
    first: Mapping[str, Mapping[str, Any]],
    fresh: Mapping[str, Mapping[str, Any]],
    rules: Mapping[str, Mapping[str, str]],
    *,
    old_dp: int,
    new_dp: int,
    old_op: str = "sum",
    new_op: str = "sum",
    dp_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """This new rank's ``objects`` (see module docstring).

    Args:
        assigned: ``objects`` of the old ranks this rank adds up (same TP/PP coordinates).
        first: ``objects`` of old DP rank 0 of the same TP/PP coordinates (``same`` roles).
        fresh: this rank's freshly built ``objects`` (key sets, shapes, reset values).
        rules: object name -> its rules (role -> rule; :func:`rules_of` of the live objects).
        old_dp: DP size of the saved run.
        new_dp: DP size of this run.
        old_op: gradient reduction op of the saved run (``"sum"`` / ``"avg"``).
        new_op: that of this run.
        dp_sum: sums a flat float64 tensor over the new DP group (an all-reduce); None:
            identity (``assigned`` already holds every old rank).

    Returns:
        ``(objects, reset)``: the state to load and the ``"name: role"`` entries reset.

    Raises:
        ValueError: the old ranks' objects or key sets differ, a summed tensor's shape
            differs (another model), or a role has no rule. The objects' ``load_state_dict`` checks the result's
            keys as on any load.
    """
    names = sorted(fresh)
    for old in list(assigned) + [first]:
        if sorted(old) != names:
            raise ValueError(f"state objects differ: saved {sorted(old)}, this run {names}")
        for name in names:
            if set(old[name]) != set(first[name]):
                raise ValueError(f"the saved DP ranks hold different {name!r} state keys")
    out: Dict[str, Dict[str, Any]] = {name: {} for name in names}
    reset: Dict[str, None] = {}
    mass: List[Tuple[str, str, str]] = []
    for name in names:
        saved_keys, fresh_keys = set(first[name]), set(fresh[name])
        # Key sets may differ where a method adds state as it goes (Radius's masks exist
        # after its first selection, Protocol Models' ``a`` after its first accumulation):
        # replicated and reset roles follow the saved or the fresh keys; a summed key
        # missing on the saved side adds nothing, and its template (shape, dtype, device)
        # is the fresh value or else the saved one.
        for key in sorted(saved_keys | fresh_keys):
            rule = rule_for(rules[name], key, name=name)
            if _is_mass(rule):
                mass.append((name, key, rule))
            elif rule == SAME:
                value = first[name][key] if key in saved_keys else fresh[name][key]
                out[name][key] = value.clone() if isinstance(value, torch.Tensor) else value
            else:
                assert rule == RESET, rule
                if key in fresh_keys:
                    out[name][key] = fresh[name][key]
                if key in saved_keys:
                    reset[f"{name}: {role_of(key)}"] = None
    if mass:
        parts = []
        templates = []
        for name, key, _ in mass:
            template = fresh[name][key] if key in fresh[name] else first[name][key]
            if not isinstance(template, torch.Tensor):
                raise ValueError(f"{name} {key}: summed state must be a tensor")
            templates.append(template)
            total = torch.zeros(template.shape, dtype=torch.float64, device=template.device)
            for old in assigned:
                if key not in old[name]:
                    continue
                value = old[name][key]
                if tuple(value.shape) != tuple(template.shape):
                    raise ValueError(
                        f"{name} {key}: saved shape {tuple(value.shape)}, this run "
                        f"{tuple(template.shape)}"
                    )
                total += value.to(device=template.device, dtype=torch.float64)
            parts.append(total.reshape(-1))
        flat = torch.cat(parts)
        if dp_sum is not None:
            flat = dp_sum(flat)
        offset = 0
        for (name, key, rule), template in zip(mass, templates):
            scale = spread_scale(rule, old_dp=old_dp, new_dp=new_dp, old_op=old_op, new_op=new_op)
            n = template.numel()
            value = flat[offset : offset + n].view(template.shape) * scale
            out[name][key] = value.to(template.dtype)
            offset += n
    return out, list(reset)
