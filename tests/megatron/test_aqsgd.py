"""AQ-SGD and DirectQ through megatron-core's 1F1B pipeline on CPU/gloo.

Through the production driver with a tiny GPT in fixed-sample mode (32 samples, 4 steps an
epoch): both sides of every pipeline boundary hold bit-identical buffers after training
(and a step the runtime is told was skipped changes neither): the buffers and visit flags
are gathered across ranks and compared element by element, bitwise (a swap of two rows,
which a checksum cannot see, fails the comparison). The default warm-up epoch (the
authors' ``--warmup-epochs 1``) sends activations and gradients in full precision and keeps
the data-parallel exchange dense; later epochs send packed low-bit deltas of the expected
size. 8-bit AQ-SGD stays within rounding of uncompressed training, PP=2 x DP=2 keeps each
replica's buffers for its own samples, and checkpoints either restore the buffers
bit-exactly or force first visits.
The fit check's reserve for optimizer state still to come is measured on megatron-core's
optimizer (Adam's two fp32 moments per main parameter before the first step, nothing
after), and the buffers' tokens per sample follow megatron-core's P2P shape under
context and sequence parallelism.
"""

import math

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import (
    build,
    load_checkpoint,
    make_trainer,
    save_checkpoint,
    teardown,
)

FIXED = ["--fixed-samples", "32", "--global-batch-size", "8"]
PP2 = ["--pipeline-model-parallel-size", "2"]
STEPS = 12  # three epochs of the 32 fixed samples


def _main_numel(optimizer):
    """Elements of the parameters megatron's optimizer steps (its fp32 main copies)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(p.numel() for o in opts for g in o.optimizer.param_groups for p in g["params"])


def _run(rank, world, flags, steps, stock=False, skipped_step=False):
    import torch

    from megatron_ext.optim.memory import pending_optimizer_state_nbytes

    trainer = make_trainer(flags)
    build(trainer, stock=stock)
    pending = (pending_optimizer_state_nbytes(trainer.optimizer), _main_numel(trainer.optimizer))
    runtime = trainer.runtime
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    losses, act, grad, dp = [], [], [], []
    for it in range(steps):
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        traffic = runtime.end_step()
        losses.append(None if loss is None else float(loss))
        for key, out in (("pp-act", act), ("pp-grad", grad), ("dp-grad", dp)):
            if key in traffic:
                out.append((traffic[key].sent, traffic[key].dense_sent))
    codec = None if stock else runtime.communicator.codec
    sums = _contents(codec) if hasattr(codec, "checksums") else {}
    unchanged = None
    if skipped_step:
        # One more step that the runtime is told was skipped: nothing of it is committed.
        trainer.train_step(steps, steps * gbs, iterator)
        runtime.end_step(update_successful=False)
        unchanged = _same(_contents(codec), sums)
    ps = trainer.ps
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), sums)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    pending += (pending_optimizer_state_nbytes(trainer.optimizer),)
    teardown(trainer)
    return {
        "losses": losses,
        "act": act,
        "grad": grad,
        "dp": dp,
        "sums": everyone,
        "pending": pending,
        "unchanged": unchanged,
    }


def _contents(codec):
    """This rank's buffers: side -> (rows as raw bytes, visit flags), on the CPU."""
    codec.checksums()  # settles the flags of the last commit
    out = {}
    for side in ("send", "recv"):
        buffers = getattr(codec, side)
        if buffers is not None:
            rows = buffers.contents()
            out[side] = (rows.contiguous().view(torch.uint8), buffers.visited.clone())
    return out


def _same(a, b):
    """Two ``_contents`` equal bitwise (every row in its slot, every visit flag)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a
    )


def _boundaries_identical(sums):
    """Stage s's send buffer equals stage s+1's recv buffer bitwise, row by row (slot by
    slot) with the visit flags, per data-parallel replica; returns the pairs compared."""
    by = {(pp, dp): s for pp, dp, s in sums}
    pairs = 0
    for (pp, dp), s in by.items():
        if "send" in s:
            rows, visited = s["send"]
            peer_rows, peer_visited = by[(pp + 1, dp)]["recv"]
            assert rows.shape == peer_rows.shape, (pp, dp)
            differ = (rows != peer_rows).flatten(1).any(dim=1).nonzero().view(-1).tolist()
            assert not differ, f"stage {pp} -> {pp + 1}, replica {dp}: slots {differ} differ"
            assert torch.equal(visited, peer_visited), (pp, dp)
            pairs += 1
    return pairs


def _swap_rows(sums, stage, a, b):
    """A copy of ``sums`` whose ``stage`` recv buffer has rows ``a`` and ``b`` swapped (the
    fault a checksum cannot see: same values, wrong slots)."""
    out = []
    for pp, dp, s in sums:
        s = dict(s)
        if pp == stage and "recv" in s:
            rows, visited = s["recv"]
            rows = rows.clone()
            rows[[a, b]] = rows[[b, a]]
            s["recv"] = (rows, visited)
        out.append((pp, dp, s))
    return out


def test_aqsgd_pp2_buffers_identical_and_deltas_low_bit():
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd"]
    results = run_ranks(_run, 2, flags, STEPS, False, True)
    assert all(r["unchanged"] for r in results)  # the skipped 13th step left no trace
    sums = results[0]["sums"]
    assert _boundaries_identical(sums) == 1
    # Two rows swapped on the receiving side: the same multiset of values (a checksum of
    # the buffer is unchanged), but the bitwise comparison names the slots.
    swapped = _swap_rows(sums, 1, 0, 1)
    good, bad = (
        {pp: s for pp, _, s in x}[1]["recv"][0].view(torch.float32) for x in (sums, swapped)
    )
    assert not torch.equal(good, bad)
    assert math.isclose(good.double().sum(), bad.double().sum(), rel_tol=1e-12)
    with pytest.raises(AssertionError, match=r"slots \[0, 1\] differ"):
        _boundaries_identical(swapped)
    sent = results[0]["act"]  # stage 0 sends the activations
    raw = 8 * 32 * 64 * 4  # 8 samples a step of seq 32 x hidden 64 in fp32
    delta = 8 * (32 * 64 // 2 + 2 * 64)  # 4-bit codes + an fp16 scale per channel
    assert [s for s, _ in sent[:4]] == [raw] * 4  # epoch 1: first visits, full precision
    assert [s for s, _ in sent[4:]] == [delta] * 8  # later epochs: 4-bit deltas
    assert all(d == raw for _, d in sent)
    # Gradients (stage 1 sends them): full precision in the warm-up epoch, then 8 bits.
    grads = results[1]["grad"]
    assert [s for s, _ in grads[:4]] == [raw] * 4, grads
    assert [s for s, _ in grads[4:]] == [8 * (32 * 64 + 2 * 64)] * 8, grads
    losses = [l for l in results[-1]["losses"] if l is not None]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    for r in results:  # Adam: two fp32 moments per main parameter, allocated at step 1
        before, numel, after = r["pending"]
        assert numel > 0 and before == 8 * numel and after == 0, r["pending"]


def test_aqsgd_8_bits_within_rounding_of_uncompressed():
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "8"]
    flags += ["--aqsgd-bw-bits", "8", "--aqsgd-buffer-dtype", "fp32"]
    ours = run_ranks(_run, 2, flags, STEPS)[-1]["losses"]
    stock = run_ranks(_run, 2, PP2 + FIXED, STEPS, True)[-1]["losses"]
    # Epoch 1 is the warm-up: uncompressed, the very losses of stock training. Then 8-bit
    # deltas of activations that change little: the loss curves agree to a few 1e-3.
    assert ours[:4] == stock[:4], (ours, stock)
    for a, b in zip(ours, stock):
        assert abs(a - b) / abs(b) < 5e-3, (ours, stock)


@pytest.mark.parametrize(
    "dp",
    [
        ["--grad-compression", "quantized", "--quantized-bits", "4"],
        # QuantizedAdam's own warm-up (1 applied step) ends inside AQ-SGD's: its momentum
        # exchange must wait for AQ-SGD's, or step 2 would send the momentum on top of the
        # densely reduced gradient.
        ["--grad-compression", "quantized-adam", "--quantized-adam-warmup-steps", "1"],
    ],
    ids=["quantized", "quantized-adam"],
)
def test_aqsgd_pp2_dp2_each_replica_keeps_its_samples_and_warms_up_dp_too(dp):
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "2"]
    flags += ["--global-batch-size", "16"]  # 2 steps an epoch per replica pair
    flags += dp
    results = run_ranks(_run, 4, flags, 6)
    assert _boundaries_identical(results[0]["sums"]) == 2
    # The warm-up epoch (2 steps) reduces the gradients densely, whatever the DP method;
    # from step 3 on they (QuantizedAdam: the momenta) travel as 4-bit partitions.
    for r in results:
        dense = [d for _, d in r["dp"]]
        assert [s for s, _ in r["dp"][:2]] == dense[:2], r["dp"]
        assert all(s < d / 4 for s, d in r["dp"][2:]), r["dp"]


def test_aqsgd_pp4_every_boundary_stays_identical():
    flags = ["--pipeline-model-parallel-size", "4", "--num-layers", "4"] + FIXED
    flags += ["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "3"]
    flags += ["--aqsgd-warmup-epochs", "0"]  # compressed from the first step
    results = run_ranks(_run, 4, flags, 6)
    assert _boundaries_identical(results[0]["sums"]) == 3
    # No warm-up: gradients are 8-bit from step 1, activations deltas from epoch 2.
    assert all(s < d / 3 for s, d in results[1]["grad"]), results[1]["grad"]
    losses = [l for l in results[-1]["losses"] if l is not None]
    assert len(losses) == 6 and all(l == l for l in losses)


def test_aqsgd_tp2_pp2_bf16_keeps_boundaries_identical():
    """Tensor parallelism without sequence parallelism: each TP rank holds and sends the
    replicated activation; bf16 activations, bf16 buffers (the default: the activations'
    dtype); the bf16 optimizer's fp32 main parameters exist already, only Adam's moments
    are pending before the first step."""
    flags = PP2 + FIXED + ["--tensor-model-parallel-size", "2", "--bf16"]
    flags += ["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "4", "--aqsgd-bw-bits", "6"]
    results = run_ranks(_run, 4, flags, 6)
    sums = results[0]["sums"]
    assert _boundaries_identical(sums) == 1
    # Both TP ranks of a stage hold the same buffers (the activation is replicated).
    by_stage = {}
    for pp, _, s in sums:
        by_stage.setdefault(pp, []).append(s)
    assert all(len(v) == 2 and _same(v[0], v[1]) for v in by_stage.values())
    raw = 8 * 32 * 64 * 2  # bf16 first visits
    assert [s for s, _ in results[0]["act"][:4]] == [raw] * 4
    for r in results:
        before, numel, after = r["pending"]
        assert before == 8 * numel and after == 0, r["pending"]
    assert all(s < raw / 3 for s, _ in results[0]["act"][4:])


def test_directq_pp2_warms_up_then_quantizes_the_activations():
    flags = PP2 + FIXED + ["--p2p-compression", "directq", "--aqsgd-granularity", "microbatch"]
    results = run_ranks(_run, 2, flags, 6)
    raw = 8 * 32 * 64 * 4
    # 4 warm-up steps in full precision, then 4-bit codes with one fp16 scale per channel
    # per microbatch (the authors' granularity: 4 microbatches of 2 samples a step).
    assert results[0]["act"] == [(raw, raw)] * 4 + [(8 * 32 * 64 // 2 + 4 * 2 * 64, raw)] * 2
    assert [s for s, _ in results[1]["grad"]] == [raw] * 4 + [8 * 32 * 64 + 4 * 2 * 64] * 2


def _resume(rank, world, flags, root, save_at=5):
    trainer = make_trainer(flags)
    gbs = trainer.sizes["gbs"]

    def run(start, steps):
        iterator = trainer._iterator(trainer.train_ds, start * gbs)
        out = []
        for it in range(start, start + steps):
            loss, _, _ = trainer.train_step(it, it * gbs, iterator)
            traffic = trainer.runtime.end_step()
            out.append(
                (
                    None if loss is None else float(loss),
                    traffic["pp-act"].sent if "pp-act" in traffic else None,
                )
            )
        return out

    build(trainer, stock=False)
    full = run(0, 8)
    full_sums = _contents(trainer.runtime.communicator.codec)
    teardown(trainer)
    build(trainer, stock=False)
    first = run(0, save_at)
    save_checkpoint(trainer, root, save_at)
    teardown(trainer)
    build(trainer, stock=False)
    load_checkpoint(trainer, root)
    second = run(save_at, 8 - save_at)
    sums = _contents(trainer.runtime.communicator.codec)
    teardown(trainer)
    return {"full": full, "resumed": first + second, "same": _same(full_sums, sums)}


def test_resume_with_saved_buffers_is_bit_exact_across_the_warmup(tmp_path):
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd", "--aqsgd-checkpoint-buffers"]
    # Saved after step 3 of the 4 warm-up steps: the resumed run finishes the warm-up in
    # full precision, then compresses, exactly as the uninterrupted one (the phase follows
    # from the iteration).
    outs = run_ranks(_resume, 2, flags, str(tmp_path / "ckpt"), 3)
    for out in outs:
        assert out["full"] == out["resumed"]
        assert out["same"]
    raw = 8 * 32 * 64 * 4
    sent = [s for _, s in outs[0]["resumed"]]  # stage 0 sends
    assert sent[:4] == [raw] * 4 and all(s < raw / 4 for s in sent[4:]), sent


def test_resume_by_default_rebuilds_the_buffers_with_first_visits(tmp_path):
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd"]
    out = run_ranks(_resume, 2, flags, str(tmp_path / "ckpt"))[0]  # stage 0 sends
    raw = 8 * 32 * 64 * 4
    # Steps 5-7 are second-epoch revisits: compressed in the uninterrupted run, full
    # precision after the resume (the buffers were not saved, so they are rebuilt).
    assert all(sent < raw for _, sent in out["full"][5:8])
    assert [sent for _, sent in out["resumed"][5:8]] == [raw] * 3


def test_buffer_rows_follow_megatron_cores_p2p_shape():
    """With context parallelism each rank sends seq / cp tokens of a sample (and / tp with
    sequence parallelism): the buffers hold that shard, as megatron-core's
    ``get_tensor_shapes`` computes it (context parallelism itself needs Transformer
    Engine's attention, so it cannot train on CPU here)."""
    import inspect

    import pytest
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.collectives.aqsgd import local_rows
    from megatron_ext.config import ConfigError

    class _Group:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    for cp, tp, sp in ((1, 1, False), (2, 1, False), (4, 2, True), (2, 2, False)):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            context_parallel_size=cp,
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
        )
        kwargs = dict(seq_length=256, micro_batch_size=2, config=config)
        kwargs.update(tp_group=_Group(tp), cp_group=_Group(cp), decoder_seq_length=None)
        names = inspect.signature(schedules.get_tensor_shapes).parameters
        (shape,) = schedules.get_tensor_shapes(**{k: v for k, v in kwargs.items() if k in names})
        assert local_rows(256, config) == shape[0], (cp, tp, sp)
    odd = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=3
    )
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        local_rows(256, odd)
