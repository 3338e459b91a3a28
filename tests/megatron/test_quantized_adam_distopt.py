"""QuantizedAdam with megatron-core's distributed optimizer on CPU/gloo, through the driver.

One launch of 2 ranks (DP=2, tiny GPT, warm-up 2 of 6 steps, ``--clip-grad 0``), then one
launch of 1 rank for the elastic resume. Checked:

* the run with ``--use-distributed-optimizer`` gives the losses and parameters of the run
  without it, bit for bit (the warm-up's reduce-scatter adds the same two values as the
  all-reduce, and every later operation is elementwise on the same values: the momentum
  exchange sees the same buffer, each rank applies the update to its shards);
* the optimizer state is sharded: each rank holds about half of the Adam moments and fp32
  main parameters (measured bytes; the two ranks' shards add up to the whole), while the
  exchange buffer and the worker error stay whole, as without the distributed optimizer;
* the bytes: the seam's count equals what reached the process groups every step; the
  warm-up costs megatron's reduce-scatter; every compressed step costs what it costs
  without the distributed optimizer, except the first one, which adds the one all-reduce
  that assembles the whole momentum from the shards;
* a checkpoint saved in the compressed phase (driver save, after step 4) resumes bit for
  bit (parameters, sharded Adam state, residuals, the warm-up count);
* elastic resume DP 2 -> 1 of that checkpoint: the Adam state assembled from the shards
  is the saved one, the warm-up count carries over (the warm-up is not run again), the
  worker error is the mean of the saved ranks' (the pending momentum mass of an averaging
  exchange) and the server error the sum of their partitions; one more step keeps the
  frozen variance. The continued parameters are not compared with the DP=2 run: the
  quantized exchange of one rank is not that of two.
"""

import pytest

from tests.helpers.dist import run_ranks

WARMUP, STEPS, SAVE_AT = 2, 6, 4
FLAGS = [
    "--grad-compression",
    "quantized-adam",
    "--quantized-adam-warmup-steps",
    str(WARMUP),
    "--global-batch-size",
    "8",
    "--clip-grad",
    "0",
]
DIST = ["--use-distributed-optimizer"]
HOOK = "optimizer_hook.quantized_adam"


def _sibling(trainer, flags):
    """A Trainer for ``flags`` sharing ``trainer``'s process groups and data."""
    from megatron_ext.train import Trainer, parse_args
    from tests.helpers.mcore import TINY

    other = Trainer(parse_args(list(TINY) + list(flags)))
    other.ps, other.rank, other.world = trainer.ps, trainer.rank, trainer.world
    other.sizes = trainer.sizes
    other.build_data()
    return other


def _state_bytes(pieces):
    return sum(v.numel() * v.element_size() for _, _, v in pieces.values())


def _steps(trainer, start, stop, *, save=None):
    """Train ``start..stop``; per step the loss and (seam dp-grad sent, dense, process-group
    dp-grad sent, dp-param sent)."""
    runtime = trainer.runtime
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, start * gbs)
    losses, traffic = [], []
    for it in range(start, stop):
        if save is not None and it == save:
            trainer._save(it, it * gbs)
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        assert ok
        seam = runtime.end_step()
        tagged = runtime.last_pg_tagged
        g = seam["dp-grad"]
        param = seam.get("dp-param")
        traffic.append(
            (g.sent, g.dense_sent, tagged["dp-grad"].sent, 0 if param is None else param.sent)
        )
        losses.append(None if loss is None else float(loss))
    return losses, traffic


def _run(rank, world, root):
    from tests.helpers.mcore import (
        build,
        first_difference,
        make_trainer,
        optimizer_pieces,
        optimizer_state,
        params,
        teardown,
    )

    trainer = make_trainer(FLAGS + DIST + ["--save", root, "--load", root])
    ref = _sibling(trainer, FLAGS)
    out = {}

    build(ref, stock=False)
    out["ref_losses"], out["ref_traffic"] = _steps(ref, 0, STEPS)
    out["ref_params"] = params(ref)
    ref_pieces = optimizer_pieces(ref)
    out["ref_bytes"] = _state_bytes(ref_pieces)
    out["ref_numel"] = {k: v.numel() for k, (_, _, v) in ref_pieces.items()}
    teardown(ref)

    build(trainer, stock=False)
    hook = trainer.runtime.components["grad"].optimizer_hooks[0]
    losses, traffic = _steps(trainer, 0, SAVE_AT)
    out["saved_pieces"] = optimizer_pieces(trainer)
    out["saved_ext"] = trainer.runtime.state.state_dict()["objects"][HOOK]
    more, more_traffic = _steps(trainer, SAVE_AT, STEPS, save=SAVE_AT)
    out["losses"], out["traffic"] = losses + more, traffic + more_traffic
    trainer.sync_params()
    out["params"] = params(trainer)
    pieces = optimizer_pieces(trainer)
    out["bytes"] = _state_bytes(pieces)
    out["numel"] = {k: v.numel() for k, (_, _, v) in pieces.items()}
    out["buffer_bytes"] = [
        ex.buffer.numel() * ex.buffer.element_size()
        for exs in hook.exchanges.values()
        for ex in exs
    ]
    full_opt, full_ext = optimizer_state(trainer), trainer.runtime.state.state_dict()["objects"]
    teardown(trainer)

    build(trainer, stock=False)
    iteration, _ = trainer._resume()
    assert iteration == SAVE_AT
    out["resumed_losses"], out["resumed_traffic"] = _steps(trainer, SAVE_AT, STEPS)
    trainer.sync_params()
    out["resume_param_diff"] = first_difference(out["params"], params(trainer))
    out["resume_opt_diff"] = first_difference(full_opt, optimizer_state(trainer))
    out["resume_ext_diff"] = first_difference(
        {k: v for k, v in full_ext[HOOK].items() if k != "applied_steps"},
        {
            k: v
            for k, v in trainer.runtime.state.state_dict()["objects"][HOOK].items()
            if k != "applied_steps"
        },
    )
    teardown(trainer)
    return out


def _elastic(rank, world, root):
    from tests.helpers.mcore import build, make_trainer, optimizer_pieces, teardown

    trainer = make_trainer(FLAGS + DIST + ["--load", root])
    build(trainer, stock=False)
    iteration, _ = trainer._resume()
    assert iteration == SAVE_AT
    out = {"pieces": optimizer_pieces(trainer)}
    out["ext"] = trainer.runtime.state.state_dict()["objects"][HOOK]
    out["losses"], out["traffic"] = _steps(trainer, SAVE_AT, SAVE_AT + 1)
    out["after"] = optimizer_pieces(trainer)
    teardown(trainer)
    return out


def _assemble(reports, field):
    import torch

    full = {}
    for report in reports:
        for key, (lo, hi, values) in report[field].items():
            numel = report["params"][key.rsplit("/", 1)[0]].numel()
            target = full.setdefault(key, torch.full((numel,), float("nan")))
            target[lo:hi] = values
    return full


@pytest.mark.slow
def test_quantized_adam_distributed_optimizer(tmp_path):
    import torch

    from megatron_ext.accounting import collective_wire_bytes

    root = str(tmp_path / "ckpt")
    results = run_ranks(_run, 2, root)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        # Bitwise the run without the distributed optimizer.
        assert out["losses"] == out["ref_losses"], (where, out["losses"], out["ref_losses"])
        for name, value in out["ref_params"].items():
            assert torch.equal(out["params"][name], value), (where, name)
        # Sharded: about half of the moments and main parameters on each rank.
        assert out["bytes"] < 0.6 * out["ref_bytes"], (where, out["bytes"], out["ref_bytes"])
        # The bytes.
        for t, ((sent, dense, pg, param), (ref_sent, _, _, ref_param)) in enumerate(
            zip(out["traffic"], out["ref_traffic"])
        ):
            assert sent == pg, (where, t)
            assert param > 0 and ref_param == 0, (where, t, param, ref_param)
            if t < WARMUP:
                assert sent == dense and sent < ref_sent, (where, t)  # reduce-scatter
            elif t == WARMUP:
                # the compressed exchange plus one fp32 all-reduce of the whole momentum
                gather = sum(collective_wire_bytes("all_reduce", n, 2) for n in out["buffer_bytes"])
                assert sent == ref_sent + gather, (where, t, sent, ref_sent, gather)
            else:
                assert sent == ref_sent, (where, t, sent, ref_sent)
        # Exact resume (its first step assembles the momentum again: one all-reduce more).
        assert out["resumed_losses"] == out["losses"][SAVE_AT:], where
        assert out["resume_param_diff"] is None, (where, out["resume_param_diff"])
        assert out["resume_opt_diff"] is None, (where, out["resume_opt_diff"])
        assert out["resume_ext_diff"] is None, (where, out["resume_ext_diff"])
        r_sent = [s for s, *_ in out["resumed_traffic"]]
        assert r_sent[1:] == [s for s, *_ in out["traffic"][SAVE_AT + 1 :]], where
    # The shards of the two ranks add up to the whole state.
    total = {}
    for out in results:
        for key, n in out["numel"].items():
            total[key] = total.get(key, 0) + n
    assert total == results[0]["ref_numel"]

    saved = _assemble([dict(r, pieces=r["saved_pieces"]) for r in results], "saved_pieces")
    new = run_ranks(_elastic, 1, root)[0]
    new["params"] = results[0]["params"]
    loaded = _assemble([new], "pieces")
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert not value.isnan().any(), key
        assert torch.equal(loaded[key], value), key
    ext, old = new["ext"], [r["saved_ext"] for r in results]
    assert ext["applied_steps"] == SAVE_AT == old[0]["applied_steps"]
    workers = [k for k in ext if k.startswith("worker_error/")]
    assert workers and set(ext) == set(old[0])
    for key in ext:
        if key == "applied_steps":
            continue
        values = torch.stack([o[key].double() for o in old])
        want = values.mean(0) if key.startswith("worker_error/") else values.sum(0)
        torch.testing.assert_close(ext[key].double(), want, rtol=2.0**-23, atol=1e-12)
    assert any(bool(old[0][k].abs().max() > 0) for k in workers)
    # One more step: compressed (the warm-up is not run again), the variance frozen.
    after = _assemble([dict(new, pieces=new["after"])], "pieces")
    for key in saved:
        if key.endswith("/exp_avg_sq"):
            assert torch.equal(after[key], saved[key]), key
    assert new["losses"][0] is not None and new["losses"][0] == new["losses"][0]
