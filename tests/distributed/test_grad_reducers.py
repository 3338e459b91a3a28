"""SEPARATE, Radius and PowerSGD reducers on real gloo process groups (2 ranks).

Buckets are built like megatron-core's (a flat buffer with parameter slices and padding),
gradients are pre-scaled by 1/world as megatron's DDP does, and every rank regenerates
every rank's input from a seed so the reference is computed locally.
"""

import pytest

from tests.helpers.dist import run_ranks

# (fqn, shape) in bucket order; 1-D parameters travel densely in every method.
PARAMS = [("w1", (8, 64)), ("b1", (64,)), ("w2", (16, 32)), ("ln", (32,))]
PAD = 24  # trailing padding, as the distributed optimizer's bucket alignment adds


def _layout():
    from tests.helpers.reducers import param_slices

    slices, n = param_slices(PARAMS)
    return slices, n + PAD


def _grads(rank, step, world):
    import torch

    slices, n = _layout()
    g = torch.zeros(n)
    gen = torch.Generator().manual_seed(1000 * step + rank)
    for s in slices:
        g[s.start : s.end] = torch.randn(s.end - s.start, generator=gen)
    return g / world


def _run(rank, world, method, kw, reduce_scatter, async_op, steps, optimizer_states=None):
    import torch
    import torch.distributed as dist

    from megatron_ext.accounting import CommMeter
    from tests.helpers.reducers import bind, make_reducer, reduce

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    slices, n = _layout()
    grad = torch.zeros(n)
    reducer = make_reducer(method, **kw)
    meter = CommMeter()
    bound = bind(
        reducer,
        grad,
        slices,
        key="w1..ln",
        distributed_optimizer=reduce_scatter,
        async_op=async_op,
        meter=meter,
    )
    outs = []
    for step in range(steps):
        grad.copy_(_grads(rank, step, world))
        reduce(bound, step)
        outs.append(grad.clone())
        meter.end_step()
        if optimizer_states is not None:
            optimizer_states(reducer, step)
    totals = meter.totals()["dp-grad"]
    return {
        "outs": outs,
        "sent": totals.sent,
        "dense": totals.dense_sent,
        "state": reducer.state_dict(),
    }


def _dense_mean(step, world):
    return sum(_grads(r, step, world) for r in range(world))


def _region(reduce_scatter, rank, world):
    _, n = _layout()
    live = sum(s.end - s.start for s in _layout()[0])
    if reduce_scatter:
        lo, hi = rank * n // world, (rank + 1) * n // world
        return lo, min(hi, live)
    return 0, live


@pytest.mark.parametrize("reduce_scatter", [False, True])
@pytest.mark.parametrize("async_op", [False, True])
def test_separate_ratio_1_reproduces_dense(reduce_scatter, async_op):
    results = run_ranks(
        _run, 2, "separate", {"ratio": 1, "block_size": 64}, reduce_scatter, async_op, 3
    )
    for rank, out in enumerate(results):
        lo, hi = _region(reduce_scatter, rank, 2)
        for step, got in enumerate(out["outs"]):
            want = _dense_mean(step, 2)
            # An orthogonal 64x64 Q: Q Q^T = I up to float32 rounding in two matmuls.
            assert (got[lo:hi] - want[lo:hi]).abs().max() < 1e-5


def test_separate_compresses_agrees_across_ranks_and_matches_reference():
    import torch

    from megatron_ext.compressors.separate import projection_block, reconstruct

    kw = {"ratio": 8, "block_size": 64, "reset_interval": 1}  # reset every step: e = 0
    results = run_ranks(_run, 2, "separate", kw, False, False, 3)
    slices, n = _layout()
    mats = [s for s in slices if len(s.shape) == 2]
    for step in range(3):
        a, b = results[0]["outs"][step], results[1]["outs"][step]
        assert torch.equal(a, b)  # replicas agree bit for bit
        mean = _dense_mean(step, 2)
        packed = torch.cat([mean[s.start : s.end] for s in mats]).view(-1, 64)
        omega = projection_block(42, step, "w1..ln#0/r8", 64, 8)
        est = reconstruct(packed @ omega, omega).view(-1)
        pos = 0
        for s in mats:
            k = s.end - s.start
            assert torch.allclose(a[s.start : s.end], est[pos : pos + k], atol=1e-5)
            pos += k
        for s in slices:
            if len(s.shape) == 1:  # 1-D parameters are reduced densely
                assert torch.allclose(a[s.start : s.end], mean[s.start : s.end], atol=1e-6)
    # Bytes: (2*512/8 projections + 96 dense) floats all-reduced vs the 1144-float bucket.
    out = results[0]
    assert out["sent"] == 3 * (2 * 512 // 8 + 96 + 1) * 4
    assert out["dense"] == 3 * (1120 + PAD) * 4


def _reference(mean, blocks, step, refresh=1):
    """SEPARATE's estimate of ``mean`` with no error feedback, built from the math module."""
    import torch

    from megatron_ext.compressors.separate import projection_block, reconstruct

    slices, _ = _layout()
    mats = [s for s in slices if len(s.shape) == 2]
    out = mean.clone()
    if blocks == "layer":  # each matrix by its own rows, keyed by its name
        for s in mats:
            c = s.shape[-1]
            omega = projection_block(42, step // refresh, f"{s.fqn}/r8", c, c // 8)
            m = mean[s.start : s.end].view(-1, c)
            out[s.start : s.end] = reconstruct(m @ omega, omega).view(-1)
        return out
    packed = torch.cat([mean[s.start : s.end] for s in mats]).view(-1, 64)
    omega = projection_block(42, step // refresh, "w1..ln#0/r8", 64, 8)
    est, pos = reconstruct(packed @ omega, omega).view(-1), 0
    for s in mats:
        out[s.start : s.end] = est[pos : pos + s.end - s.start]
        pos += s.end - s.start
    return out


@pytest.mark.parametrize("blocks,refresh", [("layer", 1), ("bucket", 2), ("bucket", 0)])
def test_separate_readings_match_their_reference(blocks, refresh):
    """--separate-blocks layer projects each matrix row by row with its own projection;
    --separate-refresh-interval N reuses a draw for N steps (0: until the error reset)."""
    import torch

    kw = {"ratio": 8, "block_size": 64, "reset_interval": 1, "blocks": blocks}
    kw["refresh_interval"] = refresh
    results = run_ranks(_run, 2, "separate", kw, False, False, 4)
    every = refresh or 1  # reset_interval 1: refresh 0 draws afresh every step
    for step in range(4):
        a, b = results[0]["outs"][step], results[1]["outs"][step]
        assert torch.equal(a, b)
        want = _reference(_dense_mean(step, 2), blocks, step, every)
        live = sum(s.end - s.start for s in _layout()[0])
        assert torch.allclose(a[:live], want[:live], atol=1e-5), step
    # Same bytes in every reading: 1024 matrix entries / 8 plus 96 dense floats a step, plus
    # the non-finite flag.
    assert results[0]["sent"] == 4 * (1024 // 8 + 96 + 1) * 4


def test_separate_refresh_interval_reuses_then_redraws():
    import torch

    kw = {"ratio": 8, "block_size": 64, "reset_interval": 1, "refresh_interval": 2}
    outs = run_ranks(_run, 2, "separate", kw, False, False, 4)[0]["outs"]
    # Steps 0 and 1 share a projection, step 2 draws a new one: the estimate of a fixed
    # vector differs from step 1 to step 2 only.
    fixed = _dense_mean(0, 2)
    est = [_reference(fixed, "bucket", s, 2) for s in range(4)]
    assert torch.equal(est[0], est[1]) and not torch.equal(est[1], est[2])
    want = _reference(_dense_mean(2, 2), "bucket", 2, 2)
    assert torch.allclose(outs[2][:1120], want[:1120], atol=1e-5)


def _bind_layer(rank, world, ratio):
    import torch
    import torch.distributed as dist

    from tests.helpers.reducers import bind, make_reducer

    dist.init_process_group("gloo")
    slices, n = _layout()
    try:
        bind(
            make_reducer("separate", ratio=ratio, block_size=64, blocks="layer"),
            torch.zeros(n),
            slices,
            key="w1..ln",
        )
    except ValueError as exc:
        return str(exc)
    return None


def test_separate_layer_blocks_refuse_a_ratio_not_dividing_a_row():
    # w2's rows hold 32 entries: ratio 64 divides the block size 64 but not them.
    message = run_ranks(_bind_layer, 2, 64)[0]
    assert message and "--separate-ratio 64" in message and "w2" in message


def test_separate_layer_blocks_refuse_g_separate():
    from megatron_ext.config import ConfigError
    from megatron_ext.methods.separate import SeparateConfig

    with pytest.raises(ConfigError, match="--separate-adaptive.*--separate-blocks"):
        SeparateConfig(adaptive=True, blocks="layer")


def test_separate_shard_reconstruction_equals_full():
    import torch

    kw = {"ratio": 4, "block_size": 64}
    full = run_ranks(_run, 2, "separate", kw, False, False, 3)
    shard = run_ranks(_run, 2, "separate", kw, True, False, 3)
    for rank in range(2):
        lo, hi = _region(True, rank, 2)
        for step in range(3):
            a = full[rank]["outs"][step][lo:hi]
            b = shard[rank]["outs"][step][lo:hi]
            assert torch.allclose(a, b, atol=1e-6)
    # Error-feedback state is keyed by parameter name, one residual per weight matrix.
    assert set(full[0]["state"]) == {"residual/w1", "residual/w2"}


def _state_round_trip(rank, world):
    import torch
    import torch.distributed as dist

    from tests.helpers.reducers import bind, make_reducer

    dist.init_process_group("gloo")
    out = _run(rank, world, "separate", {"ratio": 4, "block_size": 64}, False, False, 4)
    slices, n = _layout()
    fresh = make_reducer("separate", ratio=4, block_size=64)
    bind(fresh, torch.zeros(n), slices, key="w1..ln")
    fresh.load_state_dict(out["state"])
    again = fresh.state_dict()
    try:
        fresh.load_state_dict({"residual/w1": again["residual/w1"]})
        missing_detected = False
    except ValueError:
        missing_detected = True
    return all(torch.equal(again[k], out["state"][k]) for k in again), missing_detected


def test_separate_state_round_trip():
    for equal, missing_detected in run_ranks(_state_round_trip, 2):
        assert equal and missing_detected


def _fake_optimizer_view(step_of_selection):
    """An OptimizerView whose moments make the corrected gradient equal a known score."""
    import torch

    from megatron_ext.compressors.seeding import stable_seed
    from megatron_ext.protocols import ParamOptimState
    from tests.helpers.views import SlicesView

    def state(i, fqn, n):
        gen = torch.Generator().manual_seed(stable_seed(fqn) % 1000)
        m = torch.randn(n, generator=gen)
        return ParamOptimState(
            fqn=fqn,
            model_param=torch.zeros(n),
            main_param=torch.zeros(n),
            state={"exp_avg": m, "exp_avg_sq": torch.ones(n), "step": torch.tensor(1.0)},
            group={"lr": 0.0, "betas": (0.9, 0.95), "eps": 0.0, "weight_decay": 0.0},
        )

    return SlicesView(_layout()[0], step_of_selection, state)


def _radius_run(rank, world, kw, reduce_scatter):
    def hook(reducer, step):
        if reducer.phase(step) == "select":
            reducer.select(_fake_optimizer_view(step))

    out = _run(rank, world, "radius", kw, reduce_scatter, False, 6, optimizer_states=hook)
    return out


@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_radius_density_1_reproduces_dense(reduce_scatter):
    import torch

    kw = {"density": 1.0, "interval": 3, "dense_steps": 1}
    results = run_ranks(_radius_run, 2, kw, reduce_scatter)
    for rank, out in enumerate(results):
        lo, hi = _region(reduce_scatter, rank, 2)
        for step, got in enumerate(out["outs"]):
            assert torch.equal(got[lo:hi], _dense_mean(step, 2)[lo:hi]), step


def test_radius_sparse_steps_send_only_selected_entries_and_keep_the_rest():
    import torch

    kw = {"density": 0.25, "interval": 3, "dense_steps": 1}
    results = run_ranks(_radius_run, 2, kw, False)
    a, b = results
    slices, n = _layout()
    for step in range(6):
        assert torch.equal(a["outs"][step], b["outs"][step])
    # Steps 0 (dense) 1 and 4 (select: dense + residual) are dense; 2, 3, 5 are sparse.
    masks = {k[5:]: v for k, v in a["state"].items() if k.startswith("mask/")}
    assert {k: int(v.sum()) for k, v in masks.items()} == {"w1": 128, "w2": 128}
    for step in (2, 3, 5):
        got, mean = a["outs"][step], _dense_mean(step, 2)
        for s in slices:
            if len(s.shape) == 1:
                assert torch.allclose(got[s.start : s.end], mean[s.start : s.end])
            else:
                m = masks[s.fqn]
                assert torch.equal(got[s.start : s.end][m], mean[s.start : s.end][m])
                assert got[s.start : s.end][~m].abs().sum() == 0
    # Step 4 is a selection step: it carries the residual of the unselected entries of
    # steps 2 and 3, so over steps 1..4 every entry's full sum arrived exactly once.
    for s in slices:
        if len(s.shape) == 2:
            total = sum(a["outs"][t][s.start : s.end] for t in (2, 3, 4))
            want = sum(_dense_mean(t, 2)[s.start : s.end] for t in (2, 3, 4))
            assert torch.allclose(total, want, atol=1e-5)
    # Bytes on sparse steps: 2 x 128 selected + 96 dense floats (+ the non-finite flag)
    # instead of the bucket.
    dense_steps = 3 * (1120 + PAD) * 4
    sparse_steps = 3 * (256 + 96 + 1) * 4
    assert a["sent"] == dense_steps + sparse_steps


def _powersgd_low_rank(rank, world):
    import torch
    import torch.distributed as dist

    from tests.helpers.reducers import bind, make_reducer, reduce

    dist.init_process_group("gloo")
    slices, n = _layout()
    grad = torch.zeros(n)
    red = make_reducer("powersgd", approx_rank=2, start_step=0, error_feedback=False)
    bound = bind(red, grad, slices, key="b")
    gen = torch.Generator().manual_seed(5)
    lowrank = {}
    for s in slices:
        if len(s.shape) == 2:
            r, c = s.shape
            lowrank[s.fqn] = torch.randn(r, 2, generator=gen) @ torch.randn(2, c, generator=gen)
            grad[s.start : s.end] = lowrank[s.fqn].reshape(-1) / world
    reduce(bound, 0)
    return {
        f: (grad[s.start : s.end].view(s.shape) - lowrank[f]).abs().max().item()
        for s in slices
        for f in [s.fqn]
        if f in lowrank
    }


def test_powersgd_is_exact_on_rank_r_gradients():
    for errs in run_ranks(_powersgd_low_rank, 2):
        assert max(errs.values()) < 1e-4, errs


def test_powersgd_agrees_across_ranks_and_counts_two_rounds():
    import torch

    kw = {"approx_rank": 2, "start_step": 1, "min_compression_rate": 1.0}
    a, b = run_ranks(_run, 2, "powersgd", kw, False, True, 3)
    for step in range(3):
        assert torch.equal(a["outs"][step], b["outs"][step])
    # Step 0 dense; steps 1-2: P (8x2 + 16x2) + dense 96 + the non-finite flag, then Q
    # (64x2 + 32x2).
    dense = (1120 + PAD) * 4
    per_step = (48 + 96 + 1) * 4 + (192) * 4
    assert a["sent"] == dense + 2 * per_step
    assert {k.split("/")[0] for k in a["state"]} == {"q", "error"}


def test_g_separate_adapts_per_parameter_and_ranks_agree():
    import torch

    kw = {
        "ratio": 8,
        "block_size": 64,
        "adaptive": True,
        "adapt_interval": 2,
        "min_ratio": 2,
        "max_ratio": 32,
    }
    a, b = run_ranks(_run, 2, "separate", kw, False, False, 5)
    for step in range(5):
        assert torch.equal(a["outs"][step], b["outs"][step])
    ratios = {k: v for k, v in a["state"].items() if k.startswith("ratio/")}
    scales = {k: v for k, v in a["state"].items() if k.startswith("beta_scale/")}
    assert set(ratios) == {"ratio/w1", "ratio/w2"} and set(scales) == {
        "beta_scale/w1",
        "beta_scale/w2",
    }
    # Two adaptations (steps 2 and 4) moved every weight off the initial ratio 8 (random
    # gradients: the estimate is never much better than a plain projection, so ratios fall).
    assert all(v != 8 for v in ratios.values()), ratios
    assert all(2 <= v <= 32 for v in ratios.values())
    assert all(0.5 <= v <= 1.5 for v in scales.values())
    # Ratios and scales are decided from all-reduced values: identical on every rank (the
    # residuals are rank-local and differ).
    assert ratios == {k: v for k, v in b["state"].items() if k.startswith("ratio/")}
    assert scales == {k: v for k, v in b["state"].items() if k.startswith("beta_scale/")}
