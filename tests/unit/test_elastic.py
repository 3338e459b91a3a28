"""The remap rules of megatron_ext.elastic as pure functions (no process group).

The invariant checked: the error-feedback mass that the gradient reduction has not applied
yet (the reduction of the ranks' residuals: their sum under SUM, their mean under AVG) is
the same before and after a change of the data-parallel size.
"""

import pytest
import torch

from megatron_ext import elastic
from megatron_ext.protocols import RESET, SUM


def _pending(residuals, op):
    total = torch.stack(list(residuals)).double().sum(0)
    return total if op == "sum" else total / len(residuals)


@pytest.mark.parametrize("old_op", ["sum", "avg"])
@pytest.mark.parametrize("new_op", ["sum", "avg"])
@pytest.mark.parametrize("old_dp,new_dp", [(2, 1), (2, 4), (3, 2), (1, 3), (4, 4)])
def test_spread_preserves_pending_mass(old_dp, new_dp, old_op, new_op):
    gen = torch.Generator().manual_seed(old_dp * 10 + new_dp)
    old = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(old_dp)]
    scale = elastic.spread_scale(SUM, old_dp=old_dp, new_dp=new_dp, old_op=old_op, new_op=new_op)
    new = [torch.stack(old).sum(0) * scale for _ in range(new_dp)]
    # float64 throughout: only the rounding of a handful of additions and one product.
    torch.testing.assert_close(_pending(new, new_op), _pending(old, old_op), rtol=1e-12, atol=0)


def test_spread_scale_values():
    assert elastic.spread_scale("sum", old_dp=2, new_dp=4, old_op="sum", new_op="sum") == 0.25
    assert elastic.spread_scale("sum", old_dp=2, new_dp=4, old_op="avg", new_op="avg") == 0.5
    assert elastic.spread_scale("total", old_dp=2, new_dp=4, old_op="avg", new_op="avg") == 0.25
    assert elastic.spread_scale("partition", old_dp=2, new_dp=4, old_op="sum", new_op="sum") == 1
    # QuantizedAdam's momentum exchange averages whatever the gradient op: the old mean
    for ops in (("sum", "sum"), ("avg", "sum"), ("sum", "avg")):
        assert (
            elastic.spread_scale("mean", old_dp=4, new_dp=2, old_op=ops[0], new_op=ops[1]) == 0.25
        )
    from megatron_ext.collectives.quantized_adam import QuantizedAdamHook

    rules = QuantizedAdamHook.elastic_rules
    assert elastic.rule_for(rules, "worker_error/a.weight") == "mean"
    assert elastic.rule_for(rules, "server_error/a.weight") == "partition"
    assert elastic.rule_for(rules, "applied_steps") == "same"
    with pytest.raises(ValueError, match="new_op"):
        elastic.spread_scale("sum", old_dp=2, new_dp=1, old_op="sum", new_op="mean")
    with pytest.raises(ValueError, match="rule"):
        elastic.spread_scale("same", old_dp=2, new_dp=1, old_op="sum", new_op="sum")


@pytest.mark.parametrize("old_dp,new_dp", [(2, 1), (2, 4), (5, 2), (3, 3)])
def test_every_old_rank_is_read_exactly_once(old_dp, new_dp):
    read = [j for i in range(new_dp) for j in elastic.assigned_old_dp_ranks(old_dp, new_dp, i)]
    assert sorted(read) == list(range(old_dp))


def test_rules_are_declared_by_the_state_classes():
    from megatron_ext.collectives.aqsgd import AQSGDCodec
    from megatron_ext.collectives.powersgd import PowerSGDReducer
    from megatron_ext.collectives.quantized import QuantizedReducer
    from megatron_ext.collectives.radius import RadiusReducer
    from megatron_ext.collectives.separate import SeparateReducer

    assert elastic.rule_for(SeparateReducer.elastic_rules, "residual/decoder.layers.0.w") == "sum"
    assert elastic.rule_for(SeparateReducer.elastic_rules, "ratio/decoder.layers.0.w") == "same"
    assert elastic.rule_for(PowerSGDReducer.elastic_rules, "q/x") == "same"
    assert elastic.rule_for(QuantizedReducer.elastic_rules, "server_error/x") == "partition"
    assert elastic.rule_for(RadiusReducer.elastic_rules, "selections") == "same"
    assert elastic.rule_for(AQSGDCodec.elastic_rules, "send/rows") == "reset"
    # A role without a rule is an error naming it, never a silent reset.
    with pytest.raises(ValueError, match="'grad_reducer' has role 'momentum'"):
        elastic.rule_for(SeparateReducer.elastic_rules, "momentum/x", name="grad_reducer")


def test_an_object_without_rules_cannot_be_registered_or_remapped():
    from megatron_ext.state import ExtState

    class Undeclared:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    class Inherits(_Probe):  # a subclass's roles may differ: it declares its own
        pass

    for obj in (Undeclared(), Inherits()):
        with pytest.raises(TypeError, match=f"{type(obj).__qualname__} is checkpointed but"):
            ExtState({}, {}).register("x", obj)
        with pytest.raises(TypeError, match="declares no elastic_rules"):
            elastic.rules_of({"x": obj})

    class Unknown(_Probe):
        elastic_rules = {"value": "average"}

    with pytest.raises(TypeError, match="unknown rules"):
        ExtState({}, {}).register("x", Unknown())


class _Probe:
    elastic_rules = {"value": RESET}


def _objects(residual, ratio, probe, server=None):
    out = {
        "grad_reducer": {"residual/w": residual, "ratio/w": ratio},
        "probe": {"value": probe},
    }
    if server is not None:
        out["grad_reducer"]["server_error/w"] = server
    return out


def _rules(reducer="SeparateReducer"):
    from megatron_ext.collectives.quantized import QuantizedReducer
    from megatron_ext.collectives.separate import SeparateReducer

    cls = {"SeparateReducer": SeparateReducer, "QuantizedReducer": QuantizedReducer}[reducer]
    return {"grad_reducer": cls.elastic_rules, "probe": _Probe.elastic_rules}


def test_remap_objects_dp2_to_dp4_all_on_hand():
    old = [
        _objects(torch.tensor([1.0, -2.0]), 8, torch.tensor([1.0])),
        _objects(torch.tensor([3.0, 0.5]), 8, torch.tensor([2.0])),
    ]
    fresh = _objects(torch.zeros(2), 16, torch.tensor([-7.0]))
    objects, reset = elastic.remap_objects(
        old, old[0], fresh, _rules(), old_dp=2, new_dp=4, old_op="sum", new_op="sum"
    )
    # S = [4, -1.5] spread as S / 4 under SUM: four new ranks reduce to S again.
    assert torch.equal(objects["grad_reducer"]["residual/w"], torch.tensor([1.0, -0.375]))
    assert objects["grad_reducer"]["residual/w"].dtype == torch.float32
    assert objects["grad_reducer"]["ratio/w"] == 8  # same: old DP rank 0's, not fresh
    assert torch.equal(objects["probe"]["value"], torch.tensor([-7.0]))  # reset: fresh
    assert reset == ["probe: value"]


def test_remap_objects_partial_sums_through_dp_sum():
    """Two new ranks each add their assigned old rank; ``dp_sum`` stands in for the
    all-reduce over the new DP group."""
    old = [
        _objects(torch.tensor([float(j)]), 4, torch.tensor([0.0]), torch.tensor([j + 0.5]))
        for j in range(4)
    ]
    fresh = _objects(torch.zeros(1), 4, torch.zeros(1), torch.zeros(1))
    # Quantized's rules, and the saved roles residual and ratio (declared reset here).
    rules = _rules("QuantizedReducer")
    rules["grad_reducer"] = dict(rules["grad_reducer"], residual="reset", ratio="reset")
    partials = []
    for new_rank in range(2):
        assigned = [old[j] for j in elastic.assigned_old_dp_ranks(4, 2, new_rank)]
        captured = {}

        def fake_sum(flat, captured=captured):
            captured["flat"] = flat.clone()
            return flat

        elastic.remap_objects(assigned, old[0], fresh, rules, old_dp=4, new_dp=2, dp_sum=fake_sum)
        partials.append(captured["flat"])
    total = partials[0] + partials[1]
    objects, reset = elastic.remap_objects(
        [], old[0], fresh, rules, old_dp=4, new_dp=2, dp_sum=lambda flat: total.clone()
    )
    # keys in sorted order: residual/w (reset), server_error/w
    assert torch.equal(objects["grad_reducer"]["server_error/w"], torch.tensor([8.0]))
    assert set(reset) == {"grad_reducer: residual", "grad_reducer: ratio", "probe: value"}


def test_remap_objects_refuses_another_model():
    old = [_objects(torch.zeros(2), 8, torch.zeros(1))]
    fresh = _objects(torch.zeros(3), 8, torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        elastic.remap_objects(old, old[0], fresh, _rules(), old_dp=1, new_dp=2)
    other = _objects(torch.zeros(2), 8, torch.zeros(1))
    del other["grad_reducer"]["ratio/w"]
    with pytest.raises(ValueError, match="different"):
        elastic.remap_objects([old[0], other], old[0], fresh, _rules(), old_dp=2, new_dp=1)


def test_remap_objects_state_built_as_training_goes():
    """Radius keeps masks only after its first selection: a fresh reducer has none."""
    from megatron_ext.collectives.radius import RadiusReducer

    mask = torch.tensor([True, False])
    old = [{"r": {"residual/w": torch.ones(2), "mask/w": mask, "selections": 1}}]
    fresh = {"r": {"residual/w": torch.zeros(2), "selections": 0}}
    objects, reset = elastic.remap_objects(
        old * 2, old[0], fresh, {"r": RadiusReducer.elastic_rules}, old_dp=2, new_dp=1
    )
    assert torch.equal(objects["r"]["mask/w"], mask) and objects["r"]["selections"] == 1
    assert torch.equal(objects["r"]["residual/w"], torch.full((2,), 2.0)) and reset == []


def test_batch_change_warning():
    from megatron_ext.train import batch_change_warning

    assert batch_change_warning(None, 8) is None  # checkpoints without the record
    assert batch_change_warning(8, 8) is None
    assert "--global-batch-size 8" in batch_change_warning(8, 4)


def test_remap_objects_summed_state_only_on_one_side():
    """Protocol Models' ``a`` exists once boundary gradients were accumulated: a fresh
    subspace has none (the saved one is the template); a saved one without it adds 0."""
    from megatron_ext.compressors.subspace import Subspace

    old = [{"s": {"u": torch.eye(2), "a": torch.full((2, 2), float(j + 1))}} for j in range(2)]
    fresh = {"s": {"u": torch.zeros(2, 2)}}
    objects, _ = elastic.remap_objects(
        old, old[0], fresh, {"s": Subspace.elastic_rules}, old_dp=2, new_dp=3
    )
    assert torch.equal(objects["s"]["u"], torch.eye(2))
    torch.testing.assert_close(objects["s"]["a"], torch.full((2, 2), 1.0))  # 3 / 3 ranks
    saved_without = [{"s": {"u": torch.eye(2)}}]
    fresh = {"s": {"u": torch.zeros(2, 2), "a": torch.ones(2, 2)}}
    objects, _ = elastic.remap_objects(
        saved_without, saved_without[0], fresh, {"s": Subspace.elastic_rules}, old_dp=1, new_dp=2
    )
    assert torch.equal(objects["s"]["a"], torch.zeros(2, 2))
