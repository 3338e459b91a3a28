"""Grass inside megatron-core on CPU/gloo, through the production driver.

With every row selected (Top-r, r = the projected dimension, alpha 1, no re-warm-up, no
reselection) Grass is dense training written differently, so it must reproduce stock
megatron-core step for step at DP=2, DP=2 with overlapped reduction, TP=2 and PP=2: that
checks the row-sparse backward (and its tensor-parallel communication), the virtual
parameters' gradient path through DDP and the row write-back. With r smaller: the projected
weights have no gradient buffer, optimizer state or main parameter (inspected), only the
selected rows move, every data-parallel rank selects the same rows, the data-parallel
gradient bytes shrink to r rows, and a resumed run is bit-exact across a reselection.
"""

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import (
    assert_resumed_exactly,
    build,
    make_trainer,
    optimizer_state,
    resume_matches_uninterrupted,
    teardown,
    train,
)

# hidden 64, ffn 256: every default layer projects a 64-wide dimension. (A smaller rank is
# not dense training: the gradient norm that megatron clips by changes.)
FULL = [
    "--grass-method",
    "topr",
    "--grass-scale",
    "1",
    "--grass-rewarmup-steps",
    "0",
    "--grass-update-interval",
    "0",
]
LAYOUTS = {
    "dp2": [],
    "dp2-overlap": ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"],
    # column-parallel QKV (Q, K, V: 64 rows each, 32 on each rank), fc1 (its 64 input
    # columns, shared by the ranks), row-parallel fc2 (its 64 rows, shared): all 64 wide
    "tp2": ["--tensor-model-parallel-size", "2", "--grass-layers", "linear_(qkv|fc1|fc2)$"],
    # the row-parallel attention output is 64 x 64 (64 x 32 on each rank): its 64 rows
    "tp2-proj": ["--tensor-model-parallel-size", "2", "--grass-layers", "linear_proj$"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
}
FULL_RANK = {"dp2": 64, "dp2-overlap": 64, "tp2": 64, "tp2-proj": 64, "pp2": 64}


def _stock_vs_grass(rank, world, flags, steps):
    trainer = make_trainer(flags)
    build(trainer, stock=True)
    stock = train(trainer, steps)
    teardown(trainer)
    build(trainer, stock=False)
    grass = train(trainer, steps)
    layers = trainer.runtime.components["linear"].optimizer_hooks[0].layers
    teardown(trainer)
    return {"stock": stock, "grass": grass, "layers": len(layers)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_full_rank_top_r_reproduces_dense_training(layout):
    flags = FULL + ["--grass-rank", str(FULL_RANK[layout])] + LAYOUTS[layout]
    results = run_ranks(_stock_vs_grass, 2, flags, 5)
    for out in results:
        assert out["layers"] > 0
        stock, grass = out["stock"], out["grass"]
        if stock[0] is None:  # not the last pipeline stage
            continue
        for a, b in zip(stock, grass):
            assert b == pytest.approx(a, rel=2e-5), (stock, grass)


def _sparse_run(rank, world, flags, steps):
    import torch

    from megatron_ext.megatron.naming import global_param_names

    trainer = make_trainer(flags)
    build(trainer, stock=False)
    hooks = trainer.runtime.components["linear"].optimizer_hooks
    layers = hooks[0].layers if hooks else {}  # none: the dense baseline
    chunk = trainer.model[0]
    names = global_param_names(chunk)
    buffered = {names[p] for buf in chunk.buffers for p in buf.params}
    opt_fqns = set(optimizer_state(trainer))
    frozen = {fqn: layer.weight for fqn, layer in layers.items()}
    checks = {
        "no_grad_buffer": all(f"{f}.weight" not in buffered for f in frozen),
        "virtual_buffered": all(f"{f}.grass_weight" in buffered for f in frozen),
        "no_optimizer_state": all(
            not k.startswith(f"{f}.weight/") for f in frozen for k in opt_fqns
        ),
        "no_main_grad": all(not hasattr(w, "main_grad") for w in frozen.values()),
        "grad_numel": sum(buf.grad_data.numel() for buf in chunk.buffers),
        "trainable_numel": sum(p.numel() for p in chunk.parameters() if p.requires_grad),
    }
    before = {f: w.detach().clone() for f, w in frozen.items()}
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    losses, traffic, moved, selections = [], [], [], []
    for it in range(steps):
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        step_traffic = trainer.runtime.end_step()
        losses.append(None if loss is None else float(loss))
        traffic.append(step_traffic["dp-grad"].sent if "dp-grad" in step_traffic else 0)
        # rows changed by this step, against the rows selected for it
        changed = {}
        for f, w in frozen.items():
            layer = layers[f]
            diff = (w.detach() - before[f]).abs()
            diff = diff.sum(1) if layer.mode == "row" else diff.sum(0)
            changed[f] = sorted(torch.nonzero(diff).flatten().tolist())
            before[f] = w.detach().clone()
        moved.append(changed)
        selections.append({f: sorted(set(lay.index.tolist())) for f, lay in layers.items()})
    teardown(trainer)
    return {
        "checks": checks,
        "losses": losses,
        "traffic": traffic,
        "moved": moved,
        "selections": selections,
    }


SPARSE = ["--grass-method", "topr", "--grass-rank", "8", "--grass-update-interval", "3"]
SPARSE += ["--grass-rewarmup-steps", "2", "--grass-sketch-size", "16"]


def test_sparse_rows_buffers_bytes_and_same_selection_dp2():
    steps = 7
    results = run_ranks(_sparse_run, 2, SPARSE, steps)
    a, b = results
    for out in results:
        checks = out["checks"]
        assert checks["no_grad_buffer"] and checks["virtual_buffered"], checks
        assert checks["no_optimizer_state"] and checks["no_main_grad"], checks
        # the gradient buffer holds exactly the trainable parameters (V, not W)
        assert checks["grad_numel"] >= checks["trainable_numel"]
        assert checks["grad_numel"] - checks["trainable_numel"] < 64 * 4  # bucket padding
    assert a["selections"] == b["selections"], "data-parallel ranks selected different rows"
    # step 0 sketches and selects; the projected weights first move at step 1
    assert all(not rows for rows in a["moved"][0].values())
    for step in range(1, steps):
        sel = a["selections"][step - 1]  # selection made at the end of the previous step
        for fqn, rows in a["moved"][step].items():
            assert set(rows) <= set(sel[fqn]), (step, fqn, rows, sel[fqn])
            assert rows, (step, fqn)
    # reselection at steps 0, 3, 6: a new set of rows after step 3
    assert a["selections"][2] == a["selections"][0]
    assert a["selections"][3] != a["selections"][2]
    # the selection step adds one sketch all-reduce; other steps move the same bytes
    assert a["traffic"][1] == a["traffic"][2] == a["traffic"][4]
    assert a["traffic"][3] > a["traffic"][2]
    assert a["losses"][-1] < a["losses"][0]


def test_dp_grad_bytes_shrink_to_selected_rows():
    def run(flags):
        results = run_ranks(_sparse_run, 2, flags, 3)
        return results[0]

    dense = run(["--grass-method", "none"])
    sparse = run(SPARSE)
    ratio = sparse["traffic"][1] / dense["traffic"][1]
    trainable = sparse["checks"]["trainable_numel"] / dense["checks"]["trainable_numel"]
    # wire bytes follow the trainable (reduced) numel: r rows instead of the whole weights
    assert ratio == pytest.approx(trainable, rel=0.02)
    assert ratio < 0.5


def _resume(rank, world, flags, root):
    out = resume_matches_uninterrupted(rank, world, flags, root)
    del out["components"]  # not picklable across ranks' results
    return out


@pytest.mark.parametrize("layout", ["dp2", "tp2-bf16"])
def test_resume_bit_exact_across_reselection(layout, tmp_path):
    extra = {
        "dp2": ["--grass-method", "norm2"],
        # moments carried with their rows: the per-slot counts must resume too
        "tp2-bf16": ["--grass-method", "topr", "--tensor-model-parallel-size", "2", "--bf16"]
        + ["--no-grass-reset-state"],
    }[layout]
    flags = SPARSE[2:] + extra  # reselection at steps 0 and 3; the save after step 3
    results = run_ranks(_resume, 2, flags, str(tmp_path / "ckpt"))
    for out in results:
        assert_resumed_exactly(out)


def _set_tp_invariant_params(trainer, tp, tp_rank):
    """Give every parameter this rank's shard of one seeded unsharded model (the same at
    every tensor-parallel size; megatron-core's own initialization draws per shard)."""
    import zlib

    import torch

    from megatron_ext.megatron.naming import global_param_names

    for chunk in trainer.model:
        for p, name in global_param_names(chunk).items():
            if name.endswith(".grass_weight"):
                continue
            split = getattr(p, "tensor_model_parallel", False)
            dim = p.partition_dim if split else 0
            shape = list(p.shape)
            shape[dim] *= tp if split else 1
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
            if "norm" in name and name.endswith("weight"):
                full += 1
            if not split:
                local = full
            elif "linear_fc1" in name:  # SwiGLU: each rank holds [gate shard; up shard]
                size = p.shape[0] // 2
                gate, up = full.chunk(2)
                rows = slice(tp_rank * size, (tp_rank + 1) * size)
                local = torch.cat([gate[rows], up[rows]])
            else:
                local = full.narrow(dim, tp_rank * p.shape[dim], p.shape[dim])
            with torch.no_grad():
                p.copy_(local.to(p.dtype))


def _qkv_layout(trainer):
    """Rows of Q, K and V in linear_qkv as megatron-core's attention splits them: a marker
    weight whose row i outputs i + 1 through ``get_query_key_value_tensors``."""
    import torch

    from megatron_ext.megatron.naming import global_module_names

    for name, module in global_module_names(trainer.model[0]):
        if name.endswith("layers.0.self_attention"):
            qkv = module.linear_qkv
            saved = {k: v.detach().clone() for k, v in qkv.named_parameters()}
            with torch.no_grad():
                for v in qkv.parameters():
                    v.zero_()
                qkv.weight[:, 0] = torch.arange(1, qkv.weight.shape[0] + 1)
                hidden = torch.zeros(1, 1, qkv.weight.shape[1])
                hidden[..., 0] = 1
                q, k, v = module.get_query_key_value_tensors(hidden)[:3]
                for key, value in qkv.named_parameters():
                    value.copy_(saved[key])
            return {
                part: sorted((t.flatten().round().long() - 1).tolist())
                for part, t in (("query", q), ("key", k), ("value", v))
            }, f"{name}.linear_qkv"
    raise AssertionError("no self-attention module")


def _tp_selection_run(rank, world, flags):
    from megatron.core import parallel_state

    trainer = make_trainer(flags)
    build(trainer, stock=False)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    _set_tp_invariant_params(trainer, tp, tp_rank)
    layers = trainer.runtime.components["linear"].optimizer_hooks[0].layers
    layout, qkv_fqn = _qkv_layout(trainer)
    part_rows = [sorted(p.tolist()) for p in layers[qkv_fqn].part_rows]
    train(trainer, 1)  # step 0 sketches and selects
    out = {
        "layout": layout,
        "part_rows": part_rows,
        "layers": {
            fqn: {
                "mode": lay.mode,
                "shared": lay.tp_shared,
                "parts": lay.num_parts,
                "rank": lay.rank,
                "index": lay.index.tolist(),
                "virtual_shape": tuple(lay.param.shape),
                # what the selection keeps on the device (the pre-flight's selection bytes)
                "selection_bytes": sum(
                    t.untyped_storage().nbytes()
                    for t in (
                        lay.index, lay.rho, lay.unique, lay.slots, lay.base,
                        lay._slot_col, lay._unit_block, lay._unit_col,
                    )
                    if t is not None
                ),  # fmt: skip
            }
            for fqn, lay in layers.items()
        },
    }
    return out


def _optimizer_refusals(rank, world, flags):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.config import ConfigError

    trainer = make_trainer(flags)
    trainer.seed()
    trainer.build_model(stock=False)
    out = {}
    others = {
        "sgd": {"optimizer": "sgd"},
        "adam-l2": {"optimizer": "adam", "decoupled_weight_decay": False},
    }
    for name, kwargs in others.items():
        config = OptimizerConfig(lr=1e-3, weight_decay=0.1, **kwargs)
        trainer.optimizer = get_megatron_optimizer(config, list(trainer.model))
        trainer.scheduler = None
        try:
            trainer.install_ext()
            out[name] = None
            trainer.runtime.remove()
        except ConfigError as err:
            out[name] = (err.flags, str(err))
    trainer.build_optimizer()  # the driver's: megatron's adam, decoupled
    trainer.install_ext()
    out["adamw"] = train(trainer, 2)
    teardown(trainer)
    return out


def test_tp1_and_tp2_choose_the_same_dimension_and_rows():
    """The projected dimension comes from the unsharded shape: at TP=1 and TP=2 every layer
    projects the same dimension (the paper's rule on the unsharded part shapes), and where
    the TP ranks share it they select exactly the rows/columns TP=1 selects from the same
    model and data (the sketch, Omega included, sums to the unsharded one). Fused layers
    select per part (SwiGLU gate/up, GQA Q/K/V), r per part in all, split r / TP where the
    ranks hold disjoint rows; the Q/K/V rows are those megatron-core's attention splits."""
    flags = SPARSE + ["--swiglu", "--group-query-attention", "--num-query-groups", "2"]
    flags += ["--global-batch-size", "4"]
    tp1 = run_ranks(_tp_selection_run, 2, flags)  # DP=2
    tp2 = run_ranks(_tp_selection_run, 2, flags + ["--tensor-model-parallel-size", "2"])
    # hidden 64, ffn 256 (gate and up 256 x 64 each), Q 64 x 64, K and V 32 x 64
    expected = {"linear_qkv": "row", "linear_proj": "row", "linear_fc1": "col"}
    expected["linear_fc2"] = "row"
    r = 8
    for out in tp1 + tp2:
        assert out["layout"] and [sorted(v) for v in out["layout"].values()] == out["part_rows"]
    a = tp1[0]["layers"]
    assert set(a) == set(tp2[0]["layers"]) and len(a) == 8
    for fqn, lay in a.items():
        kind = fqn.rsplit(".", 1)[-1]
        parts = {"linear_qkv": 3, "linear_fc1": 2}.get(kind, 1)
        assert lay["mode"] == expected[kind] and lay["parts"] == parts and lay["rank"] == r
        for out in tp2:
            other = out["layers"][fqn]
            assert other["mode"] == lay["mode"] and other["parts"] == parts, (fqn, other)
            if other["shared"]:  # fc1 columns, fc2 and proj rows
                assert kind != "linear_qkv" and other["rank"] == r
                assert other["index"] == lay["index"], (fqn, other["index"], lay["index"])
            else:  # Q, K, V rows: r / 2 on each rank, of its own shard of each part
                assert kind == "linear_qkv" and other["rank"] == r // 2
                assert len(other["index"]) == 3 * r // 2
    # The pre-flight's plan (megatron_ext.state_plan), from the shape alone, is what the
    # layers hold: the same weights, parts, V and selection buffers at TP=1 and TP=2.
    from megatron_ext.config import DEFAULT_LINEAR_LAYERS
    from megatron_ext.state_plan import ModelShape, grass_plan

    shape = ModelShape(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn=256, vocab=512, seq=32,
                       swiglu=True)  # fmt: skip
    for tp, out in ((1, tp1[0]), (2, tp2[0])):
        plan = grass_plan(shape, rank=r, sketch_size=16, layers=DEFAULT_LINEAR_LAYERS,
                          tensor_parallel=tp)  # fmt: skip
        planned = {w.fqn: w for w in plan.weights}
        assert set(planned) == set(out["layers"]), (tp, sorted(planned))
        selection = 0
        for fqn, lay in out["layers"].items():
            w = planned[fqn]
            assert (w.mode, w.parts, w.rank) == (lay["mode"], lay["parts"], lay["rank"]), fqn
            assert w.virtual_shape == tuple(lay["virtual_shape"]), (tp, fqn)
            selection += lay["selection_bytes"]
        assert plan.selection_bytes == selection, tp


def test_optimizers_other_than_decoupled_adamw_are_refused_at_install():
    """megatron-core's SGD and Adam with L2 decay are refused naming the flag before any
    step, in the driver and any script that installs megatron-ext."""
    out = run_ranks(_optimizer_refusals, 1, SPARSE + ["--no-grass-reset-state"])[0]
    for name, what in (("sgd", "torch.optim.sgd.SGD"), ("adam-l2", "decoupled_weight_decay")):
        assert out[name] is not None, f"{name} was accepted"
        flags, message = out[name]
        assert flags == ("--grass-method", "--optimizer"), message
        assert what in message, message
    assert len(out["adamw"]) == 2
