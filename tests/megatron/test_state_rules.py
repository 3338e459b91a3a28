"""Every state object every registered method creates declares its elastic-resume rules.

The methods are enumerated from the registry (every family's methods, ``none`` included), so a
new method is covered without editing this file. Each is built through the driver's Trainer
(tiny model, CPU/gloo, two ranks: DP=2 for the gradient, linear and outer families, PP=2 for
the pipeline and subspace families; one launch per layout, the methods one after another in
it) and trained three steps, so that state a method adds as it goes (Radius's masks after its
first selection, Grass's selection counts, AQ-SGD's buffers) is there. Checked on every rank:

* every object registered for checkpointing declares ``elastic_rules`` in its own class body
  (registration itself refuses one that does not: the build would fail);
* every role of every object's ``state_dict`` has a rule, so an elastic resume never meets a
  role it must refuse;
* the object names are stable: none carries a position (``optimizer_hook.<name>``).
"""

import re

import pytest

from tests.helpers.dist import run_ranks

STEPS = 3

LAYOUTS = {
    "dp2": ["--global-batch-size", "8"],
    # fixed samples for AQ-SGD's per-sample buffers (the data is built once per launch)
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    + ["--fixed-samples", "32"],
}
FAMILY_LAYOUT = {"grad": "dp2", "linear": "dp2", "outer": "dp2", "p2p": "pp2", "subspace": "pp2"}
EXTRA = {
    "grad": {
        "powersgd": ["--powersgd-start-step", "1"],
        "quantized-adam": ["--quantized-adam-warmup-steps", "1"],
    },
    "p2p": {
        "aqsgd": ["--aqsgd-warmup-epochs", "0", "--aqsgd-checkpoint-buffers"],
        "directq": ["--aqsgd-warmup-epochs", "0"],
    },
    "linear": {"*": ["--grass-rank", "8", "--grass-update-interval", "2"]},
    "subspace": {
        "*": ["--subspace-rank", "8", "--position-embedding-type", "rope"]
        + ["--untie-embeddings-and-output-weights"]
    },
    "outer": {"*": ["--outer-interval", "2", "--outer-delay", "1"]},
}
"""Flags that make each method reach its compressed steps within the run."""


def _runs(layout):
    from megatron_ext.methods import registry

    out = []
    for fam in registry.families():
        if FAMILY_LAYOUT[fam.name] != layout:
            continue
        for name in registry.methods(fam.name):
            extra = EXTRA.get(fam.name, {})
            flags = [fam.flag, name] + extra.get(name, extra.get("*", []) if name != "none" else [])
            out.append((f"{fam.name}:{name}", flags))
    return out


def _check(rank, world, layout):
    from megatron_ext.elastic import role_of
    from megatron_ext.protocols import elastic_rules_of
    from megatron_ext.train import parse_args
    from tests.helpers.mcore import TINY, build, make_trainer, teardown, train

    trainer = None
    report = {}
    for label, flags in _runs(layout):
        if trainer is None:
            trainer = make_trainer(LAYOUTS[layout] + flags)
        else:
            trainer.cfg = parse_args(list(TINY) + LAYOUTS[layout] + flags)
        build(trainer, stock=False)
        train(trainer, STEPS)
        problems = []
        objects = trainer.runtime.state.objects
        for name, state in trainer.runtime.state.state_dict()["objects"].items():
            rules = elastic_rules_of(objects[name])
            missing = sorted({role_of(k) for k in state} - set(rules))
            if missing:
                problems.append(f"{name} ({type(objects[name]).__name__}): no rule for {missing}")
            if re.search(r"\.\d+\.", name):
                problems.append(f"{name}: a positional name")
        report[label] = {"names": sorted(objects), "problems": problems}
        teardown(trainer)
    return report


# The state objects and their rules are megatron-ext's own classes, whatever megatron-core
# release builds the model around them.
@pytest.mark.release_independent
def test_every_state_object_of_every_method_declares_its_rules():
    from megatron_ext.methods import registry

    reports = {}
    for layout in LAYOUTS:
        for rank_report in run_ranks(_check, 2, layout):
            for label, entry in rank_report.items():
                reports.setdefault(label, []).append(entry)
    every = {
        f"{fam.name}:{name}" for fam in registry.families() for name in registry.methods(fam.name)
    }
    assert set(reports) == every
    problems = {
        label: e["problems"] for label, ranks in reports.items() for e in ranks if e["problems"]
    }
    assert not problems, problems
    # Methods that checkpoint optimizer-hook state are among those checked.
    names = {n for ranks in reports.values() for e in ranks for n in e["names"]}
    assert {"optimizer_hook.diloco", "optimizer_hook.grass", "p2p_codec"} <= names, names
