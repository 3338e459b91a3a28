"""With every megatron_ext seam installed and compression off, training equals stock.

Real megatron-core on CPU/gloo, 2 ranks. Each case builds the same tiny GPT twice in one
process, once stock and once with ``megatron_ext.megatron.runtime.install`` (gradient seam
with the dense reducer, P2P communicator with the identity codec, linear hooks, optimizer
hooks, accounting meters), trains 10 iterations from the same seed and data, and requires
losses and parameters to be *bitwise* equal (no tolerance: the seams must issue exactly
megatron's computations and collectives). The same runs also check what the seams report:
every bucket group reduced through the seam, DP replicas identical, P2P contexts carrying
the right microbatch and sample ids, and the seams' byte counts equal to what the
process-group meter saw.
"""

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.flag_sets import DISTOPT_OVERLAP
from tests.helpers.mcore import build, first_difference, make_trainer, params, teardown, train

STEPS = 10


def _parity(rank, world, flags):
    import torch

    from megatron_ext.megatron.data import sample_indices

    trainer = make_trainer(flags)
    out = {}
    build(trainer, stock=True)
    stock_losses = train(trainer, STEPS)
    trainer.sync_params()
    stock_params = params(trainer)
    teardown(trainer)

    build(trainer, stock=False)
    runtime = trainer.runtime
    runtime.pg_meter.keep_records = True
    launches = []

    def counting(bound):
        launch = bound.launch

        def counting_launch(step, force_all_reduce=False):
            reduce_scatter = bound.spec.distributed_optimizer and not force_all_reduce
            launches.append((step, tuple(b.key for b in bound.spec.buckets), reduce_scatter))
            return launch(step, force_all_reduce)

        return counting_launch

    for bound in runtime.reducer.bound:
        bound.launch = counting(bound)
    seen_batches = []
    trainer.on_step_batch = lambda batch: seen_batches.append(batch["sample_index"].tolist())
    if runtime.communicator is not None:
        runtime.communicator.trace = []
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    ext_losses = []
    seam_dp = seam_pp = pg_dp = pg_pp = 0
    for it in range(STEPS):
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        traffic = runtime.end_step()
        ext_losses.append(None if loss is None else float(loss))
        seam_dp += traffic.get("dp-grad").sent if "dp-grad" in traffic else 0
        seam_pp += sum(
            traffic[c].sent + traffic[c].recv for c in ("pp-act", "pp-grad") if c in traffic
        )
        tagged = runtime.last_pg_tagged
        pg_dp += tagged["dp-grad"].sent if "dp-grad" in tagged else 0
        pg_pp += (tagged["pp"].sent + tagged["pp"].recv) if "pp" in tagged else 0
    trainer.sync_params()
    ext_params = params(trainer)

    out["loss_diff"] = None if stock_losses == ext_losses else (stock_losses, ext_losses)
    out["param_diff"] = first_difference(stock_params, ext_params)
    out["losses"] = ext_losses
    out["seam_dp"], out["pg_dp"], out["seam_pp"], out["pg_pp"] = seam_dp, pg_dp, seam_pp, pg_pp

    # Every bucket group of every iteration went through the reducer exactly once.
    num_groups = len(runtime.grad_handle.bucket_groups)
    out["launches_per_step"] = [sum(1 for l in launches if l[0] == it) for it in range(STEPS)]
    out["num_groups"] = num_groups
    out["reduce_scatter"] = {l[2] for l in launches}

    # DP replicas hold identical parameters.
    ps = trainer.ps
    flat = torch.cat([p.detach().float().reshape(-1) for p in ext_params.values()])
    gathered = [torch.empty_like(flat) for _ in range(ps.get_data_parallel_world_size())]
    torch.distributed.all_gather(gathered, flat, group=ps.get_data_parallel_group())
    out["dp_replicas_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)

    # P2P contexts: microbatch order and sample ids of the data this stage would read.
    comm = runtime.communicator
    if comm is not None:
        mbs = trainer.cfg.training.micro_batch_size
        nmb = trainer.sizes["num_microbatches"]
        expected = {}
        for it in range(STEPS):
            for m in range(nmb):
                expected[(it, m)] = sample_indices(
                    it * gbs, m, mbs, trainer.dp_rank, trainer.dp_size
                ).tolist()
        by_kind = {}
        for direction, counter, microbatch, ids in comm.trace:
            by_kind.setdefault(counter, []).append((microbatch, ids))
        out["trace_kinds"] = {k: len(v) for k, v in by_kind.items()}
        ok = True
        for counter, entries in by_kind.items():
            assert len(entries) == STEPS * nmb, (counter, len(entries))
            for i, (microbatch, ids) in enumerate(entries):
                it, m = divmod(i, nmb)
                ok &= microbatch == m and ids == expected[(it, m)]
        out["p2p_ids_match_sampler"] = ok
        # And the sampler's ids are what the stages that read data actually read.
        if seen_batches:
            flat_expected = [expected[(it, m)] for it in range(STEPS) for m in range(nmb)]
            out["batches_match_sampler"] = seen_batches == flat_expected
    teardown(trainer)
    return out


# LLaMA style: RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, no linear biases.
LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
CASES = {
    "dp2": [],
    "dp2-overlap-small-buckets": ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"],
    "dp2-distopt-overlap": DISTOPT_OVERLAP,
    "dp2-bf16": ["--bf16"],
    "pp2": PP2,
    "tp2": ["--tensor-model-parallel-size", "2"],
    "llama-dp2": LLAMA,
    "llama-pp2": LLAMA + PP2,
}
WORLD = {"pp2-dp2-distopt": 4}
CASES["pp2-dp2-distopt"] = [
    "--pipeline-model-parallel-size",
    "2",
    "--global-batch-size",
    "8",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
]


@pytest.mark.parametrize("case", list(CASES))
def test_all_seams_installed_is_bit_identical_to_stock(case):
    results = run_ranks(_parity, WORLD.get(case, 2), CASES[case])
    for rank, out in enumerate(results):
        assert out["loss_diff"] is None, f"rank {rank}: losses differ {out['loss_diff']}"
        assert out["param_diff"] is None, f"rank {rank}: {out['param_diff']}"
        assert out["dp_replicas_equal"], f"rank {rank}: DP replicas differ"
        # One launch per bucket group per iteration: nothing bypassed the seam.
        assert out["launches_per_step"] == [out["num_groups"]] * STEPS
        # The seams' byte counts equal what reached the process groups.
        assert out["seam_dp"] == out["pg_dp"]
        assert out["seam_pp"] == out["pg_pp"]
    last = results[-1]
    losses = [l for l in last["losses"] if l is not None]
    assert losses and losses[-1] < losses[0], f"loss did not go down: {losses}"
    if case.startswith("dp2"):
        assert all(r["seam_dp"] > 0 for r in results)
    if "distopt" in case:
        assert all(r["reduce_scatter"] == {True} for r in results)
    if case.startswith("pp2-dp2"):
        assert all(r["seam_dp"] > 0 and r["seam_pp"] > 0 for r in results)
        assert all(r["p2p_ids_match_sampler"] for r in results)
    if case in ("pp2", "llama-pp2"):
        for out in results:
            assert out["p2p_ids_match_sampler"], out["trace_kinds"]
            assert out.get("batches_match_sampler", True)
            assert out["seam_pp"] > 0
        # First stage sends activations and receives gradients; the last stage the reverse.
        assert set(results[0]["trace_kinds"]) == {"fwd_send", "bwd_recv"}
        assert set(results[1]["trace_kinds"]) == {"fwd_recv", "bwd_send"}
