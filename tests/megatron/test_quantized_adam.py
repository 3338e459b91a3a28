"""QuantizedAdam inside real megatron-core on CPU/gloo: PP=2 x DP=2, one launch of 4 ranks.

Through the production driver (``Trainer``), tiny GPT with tied embeddings, warm-up 2 of 6
steps. Checked: DP replicas bit-identical; the tied word embedding (first stage) and output
layer (last stage) bit-identical too (each gets a momentum buffer of its own, quantized the
same way on both stages); Adam's variance frozen after the warm-up while the step counter
runs on; the bytes the seam reports equal what reached the process groups, about 1/8 of
dense in the compressed steps (4-bit codes); a checkpoint saved during the run after step 4
(compressed phase) resumes bit-exactly (parameters, Adam state, residuals, the warm-up
count). The refusals (an optimizer that is not AdamW, gradient clipping with the
distributed optimizer) are checked without a launch; the distributed optimizer itself is
tests/megatron/test_quantized_adam_distopt.py.
"""

import pytest

from tests.helpers.dist import run_ranks

WARMUP, STEPS = 2, 6
FLAGS = [
    "--grad-compression",
    "quantized-adam",
    "--quantized-adam-warmup-steps",
    str(WARMUP),
    "--pipeline-model-parallel-size",
    "2",
    "--global-batch-size",
    "8",
]


def _run(rank, world, root):
    import torch

    from tests.helpers.mcore import (
        build,
        first_difference,
        load_checkpoint,
        make_trainer,
        optimizer_state,
        params,
        save_checkpoint,
        teardown,
        train,
    )

    trainer = make_trainer(FLAGS)
    build(trainer, stock=False)
    runtime = trainer.runtime
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    save_at = 4  # a checkpoint in the compressed phase, resumed below
    losses, per_step, v, steps = [], [], [], []
    for it in range(STEPS):
        if it == save_at:
            save_checkpoint(trainer, root, save_at)
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        assert ok
        traffic = runtime.end_step()
        tagged = runtime.last_pg_tagged
        g = traffic["dp-grad"]
        per_step.append((g.sent, g.dense_sent, tagged["dp-grad"].sent))
        losses.append(None if loss is None else float(loss))
        state = optimizer_state(trainer)
        v.append({k: t for k, t in state.items() if k.endswith("/exp_avg_sq")})
        steps.append(sorted({float(t) for k, t in state.items() if k.endswith("/step")}))
    full_params, full_opt = params(trainer), optimizer_state(trainer)
    full_ext = runtime.state.state_dict()["objects"]["optimizer_hook.quantized_adam"]
    ps = trainer.ps
    flat = torch.cat([p.float().reshape(-1) for p in full_params.values()])
    gathered = [torch.empty_like(flat) for _ in range(ps.get_data_parallel_world_size())]
    torch.distributed.all_gather(gathered, flat, group=ps.get_data_parallel_group())
    tied = [t for k, t in full_params.items() if k.endswith("word_embeddings.weight")]
    tied += [t for k, t in full_params.items() if k.endswith("output_layer.weight")]
    assert len(tied) == 1, sorted(full_params)
    tied_all = [torch.empty_like(tied[0]) for _ in range(world)]
    torch.distributed.all_gather(tied_all, tied[0].contiguous())
    out = {
        "losses": losses,
        "per_step": per_step,
        "replicas_equal": all(torch.equal(x, gathered[0]) for x in gathered),
        "tied_equal": all(torch.equal(x, tied_all[0]) for x in tied_all),
        "v_frozen": all(
            torch.equal(v[t][k], v[WARMUP - 1][k]) for t in range(WARMUP, STEPS) for k in v[t]
        ),
        "v_moved_in_warmup": any(not torch.equal(v[0][k], v[1][k]) for k in v[0]),
        "steps": steps,
        "keys": sorted(full_ext),
    }
    teardown(trainer)

    # Resume from the checkpoint of step 4 against the uninterrupted run.
    build(trainer, stock=False)
    load_checkpoint(trainer, root)
    second = train(trainer, STEPS - save_at, start=save_at)
    out["resumed_losses"] = losses[:save_at] + second
    out["param_diff"] = first_difference(full_params, params(trainer))
    out["opt_diff"] = first_difference(full_opt, optimizer_state(trainer))
    ext = trainer.runtime.state.state_dict()["objects"]["optimizer_hook.quantized_adam"]
    out["ext_diff"] = first_difference(
        {k: t for k, t in full_ext.items() if k != "applied_steps"},
        {k: t for k, t in ext.items() if k != "applied_steps"},
    )
    out["applied_steps"] = (full_ext["applied_steps"], ext["applied_steps"])
    teardown(trainer)
    return out


def test_quantized_adam_pp2_dp2_replicas_bytes_and_resume(tmp_path):
    results = run_ranks(_run, 4, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert out["replicas_equal"], where
        assert out["tied_equal"], where
        assert out["v_moved_in_warmup"] and out["v_frozen"], where
        # One step counter for every parameter, counting on after the warm-up.
        assert out["steps"] == [[float(t + 1)] for t in range(STEPS)], (where, out["steps"])
        for t, (sent, dense, pg) in enumerate(out["per_step"]):
            assert sent == pg, (where, t, sent, pg)
            if t < WARMUP:
                assert sent == dense, (where, t)  # megatron's own all-reduce
            else:
                # 4-bit codes + an fp16 scale per 512 values (all-to-all and all-gather)
                # against an fp32 all-reduce, plus the 4-byte flag.
                assert 7.0 < dense / sent < 8.0, (where, t, dense / sent)
        assert any(k.startswith("worker_error/decoder.layers.") for k in out["keys"]), where
        assert "applied_steps" in out["keys"], where
        assert out["resumed_losses"] == out["losses"], (where, out["resumed_losses"])
        assert out["param_diff"] is None, (where, out["param_diff"])
        assert out["opt_diff"] is None, (where, out["opt_diff"])
        assert out["ext_diff"] is None, (where, out["ext_diff"])
        assert out["applied_steps"] == (STEPS, STEPS), where
    losses = [l for l in results[-1]["losses"] if l is not None]
    assert losses[-1] < losses[0], losses


def test_refuses_clipping_with_the_distributed_optimizer_and_non_adamw_optimizers():
    import torch

    from megatron_ext.config import (
        ConfigError,
        ParallelLayout,
        ext_config_from_flags,
        validate_ext_config,
    )
    from megatron_ext.methods.quantized_adam import check_adam

    cfg = ext_config_from_flags(["--grad-compression", "quantized-adam"])
    validate_ext_config(cfg, ParallelLayout(data_parallel_size=2))
    validate_ext_config(cfg, ParallelLayout(data_parallel_size=2, use_distributed_optimizer=True))
    with pytest.raises(ConfigError, match="--quantized-adam-warmup-steps"):
        ext_config_from_flags(
            ["--grad-compression", "quantized-adam", "--quantized-adam-warmup-steps", "0"]
        )

    class Leaf:  # the attribute megatron-core's optimizers hold their torch optimizer in
        def __init__(self, inner):
            self.optimizer = inner

    class Config:
        clip_grad = 1.0

    class DistLeaf(Leaf):  # what identifies megatron-core's DistributedOptimizer
        config = Config()
        model_param_group_index_map = {}

    w = [torch.nn.Parameter(torch.zeros(2))]
    check_adam(Leaf(torch.optim.AdamW(w)))
    with pytest.raises(
        ConfigError, match="--grad-compression, --use-distributed-optimizer, --clip-grad: "
    ):
        check_adam(DistLeaf(torch.optim.AdamW(w)))
    Config.clip_grad = 0.0
    check_adam(DistLeaf(torch.optim.AdamW(w)))
    with pytest.raises(ConfigError, match="--grad-compression, --optimizer: .*SGD"):
        check_adam(Leaf(torch.optim.SGD(w, lr=0.1)))
    with pytest.raises(ConfigError, match="--grad-compression, --optimizer: .*L2"):
        check_adam(Leaf(torch.optim.Adam(w, weight_decay=0.1)))
