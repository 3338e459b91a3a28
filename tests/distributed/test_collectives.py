"""Multi-rank gloo tests of the accounting meter and the pass-through gradient reducer.

Two ranks; each regenerates every rank's input from a seed so the reference is computed
locally. No megatron: these are the torch.distributed layers under the seams.
"""

import pytest

from tests.helpers.dist import run_ranks


def _inputs(rank, n=1000, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(n, generator=g)


def _meter_counts(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes

    dist.init_process_group("gloo")
    meter = ProcessGroupTrafficMeter().install()
    try:
        meter.keep_records = True
        x = torch.ones(250)  # 1000 bytes
        dist.all_reduce(x)
        out = torch.empty(500)
        dist.all_gather_into_tensor(out, x)
        shard = torch.empty(125)
        dist.reduce_scatter_tensor(shard, x)
        from torch.distributed.distributed_c10d import _coalescing_manager

        with _coalescing_manager(None, async_ops=True) as cm:
            dist.all_reduce(x, async_op=True)
            dist.all_reduce(torch.ones(50), async_op=True)
        cm.wait()
        peer = 1 - rank
        ops = [
            dist.P2POp(dist.isend, torch.ones(10), peer),
            dist.P2POp(dist.irecv, torch.empty(10), peer),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            dist.all_reduce(torch.ones(100))
        with ProcessGroupTrafficMeter.untracked():
            dist.all_reduce(torch.ones(100))
        untagged, tagged = meter.end_step()
        expected_sent = (
            collective_wire_bytes("all_reduce", 1000, 2)
            + collective_wire_bytes("all_gather", 2000, 2)
            + collective_wire_bytes("reduce_scatter", 1000, 2)
            + collective_wire_bytes("all_reduce", 1200, 2)  # coalesced 1000 + 200 bytes
            + 40  # isend of 10 floats
        )
        return {
            "other_sent": untagged["other"].sent,
            "other_recv": untagged["other"].recv,
            "expected_sent": expected_sent,
            "expected_recv": expected_sent,  # ring: received == sent; p2p: 40 each way
            "tagged_dp": tagged["dp-grad"].sent,
            "kinds": sorted({r.kind for r in meter.records}),
        }
    finally:
        meter.remove()


def test_process_group_meter_counts_every_transfer():
    for out in run_ranks(_meter_counts, 2):
        assert out["other_sent"] == out["expected_sent"]
        assert out["other_recv"] == out["expected_recv"]
        assert out["tagged_dp"] == 400  # 2 (p-1)/p * 400 bytes
        assert out["kinds"] == ["all_gather", "all_reduce", "recv", "reduce_scatter", "send"]


def _dense_reducer(rank, world, reduce_scatter, async_op):
    import torch
    import torch.distributed as dist

    from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter
    from megatron_ext.collectives.grad_reducer import DenseGradReducer, ParamSlice
    from tests.helpers.reducers import bind

    dist.init_process_group("gloo")
    pg_meter = ProcessGroupTrafficMeter().install()
    try:
        grads = [_inputs(r, 1000) for r in range(world)]
        reference = sum(grads)
        grad = grads[rank].clone()
        meter = CommMeter()
        bound = bind(
            DenseGradReducer(),
            grad,
            [ParamSlice("w", 0, 1000, (10, 100))],
            key="w..w",
            distributed_optimizer=reduce_scatter,
            async_op=async_op,
            meter=meter,
        )
        handle = bound.launch(0)
        if async_op:
            handle.wait()
        else:
            assert handle is None
        if reduce_scatter:
            lo, hi = bound.spec.buckets[0].shard
            assert (lo, hi) == (rank * 500, (rank + 1) * 500)
            equal = torch.equal(grad[lo:hi], reference[lo:hi])
        else:
            equal = torch.equal(grad, reference)
        seam = meter.end_step()["dp-grad"]
        _, tagged = pg_meter.end_step()
        return {"equal": equal, "seam": seam.sent, "pg": tagged["dp-grad"].sent}
    finally:
        pg_meter.remove()


@pytest.mark.parametrize("reduce_scatter", [False, True])
@pytest.mark.parametrize("async_op", [False, True])
def test_dense_reducer_equals_the_stock_collective(reduce_scatter, async_op):
    for out in run_ranks(_dense_reducer, 2, reduce_scatter, async_op):
        assert out["equal"]
        assert out["seam"] == out["pg"] == (2000 if reduce_scatter else 4000)


def _rank_totals(rank, world):
    import torch.distributed as dist

    from megatron_ext.accounting import (
        Traffic,
        all_ranks_totals,
        gather_rank_totals,
        sum_rank_totals,
    )

    dist.init_process_group("gloo")
    counts = {"dp-grad": Traffic(sent=10 * (rank + 1), recv=1, dense_sent=100, num_ops=1)}
    total, peak = all_ranks_totals(counts, with_max=True)
    assert all_ranks_totals(counts)[1] is None  # the max only when asked (a second all-reduce)
    per_rank = gather_rank_totals(counts)
    assert sum_rank_totals(per_rank) == total  # the same sums without another collective
    return total["dp-grad"].sent, peak["dp-grad"].sent, [r["dp-grad"]["sent"] for r in per_rank]


def test_cross_rank_totals():
    for total, peak, per_rank in run_ranks(_rank_totals, 2):
        assert (total, peak, per_rank) == (30, 20, [10, 20])
