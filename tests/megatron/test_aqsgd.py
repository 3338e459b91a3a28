"""AQ-SGD and DirectQ through megatron-core's 1F1B pipeline on CPU/gloo.

Through the production driver with a tiny GPT in fixed-sample mode (32 samples, 4 steps an
epoch): both sides of every pipeline boundary hold bit-identical buffers after training
(and a step the runtime is told was skipped changes neither)
(checksums exchanged across ranks), first-epoch activations travel in full precision and
later ones as packed low-bit deltas of the expected size, 8-bit AQ-SGD stays within
rounding of uncompressed training, PP=2 x DP=2 keeps each replica's buffers for its own
samples, and checkpoints either restore the buffers bit-exactly or force first visits.
The fit check's reserve for optimizer state still to come is measured on megatron-core's
optimizer (Adam's two fp32 moments per main parameter before the first step, nothing
after), and the buffers' tokens per sample follow megatron-core's P2P shape under
context and sequence parallelism.
"""

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

    from megatron_ext.megatron.memory import pending_optimizer_state_nbytes

    trainer = make_trainer(flags)
    build(trainer, stock=stock)
    pending = (pending_optimizer_state_nbytes(trainer.optimizer), _main_numel(trainer.optimizer))
    runtime = trainer.runtime
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    losses, act = [], []
    for it in range(steps):
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        traffic = runtime.end_step()
        losses.append(None if loss is None else float(loss))
        if "pp-act" in traffic:
            act.append((traffic["pp-act"].sent, traffic["pp-act"].dense_sent))
    codec = None if stock else runtime.communicator.codec
    sums = codec.checksums() if hasattr(codec, "checksums") else {}
    unchanged = None
    if skipped_step:
        # One more step that the runtime is told was skipped: nothing of it is committed.
        trainer.train_step(steps, steps * gbs, iterator)
        runtime.end_step(update_successful=False)
        unchanged = codec.checksums() == sums
    ps = trainer.ps
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), sums)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    pending += (pending_optimizer_state_nbytes(trainer.optimizer),)
    teardown(trainer)
    return {
        "losses": losses,
        "act": act,
        "sums": everyone,
        "pending": pending,
        "unchanged": unchanged,
    }


def _boundaries_identical(sums):
    """Stage s's send buffer equals stage s+1's recv buffer, per data-parallel replica."""
    by = {(pp, dp): s for pp, dp, s in sums}
    pairs = 0
    for (pp, dp), s in by.items():
        if "send" in s:
            assert s["send"] == by[(pp + 1, dp)]["recv"], (pp, dp, s, by[(pp + 1, dp)])
            pairs += 1
    return pairs


def test_aqsgd_pp2_buffers_identical_and_deltas_low_bit():
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd"]
    results = run_ranks(_run, 2, flags, STEPS, False, True)
    assert all(r["unchanged"] for r in results)  # the skipped 13th step left no trace
    assert _boundaries_identical(results[0]["sums"]) == 1
    sent = results[0]["act"]  # stage 0 sends the activations
    raw = 8 * 32 * 64 * 4  # 8 samples a step of seq 32 x hidden 64 in fp32
    delta = 8 * (32 * 64 // 2 + 2 * 64)  # 4-bit codes + an fp16 scale per channel
    assert [s for s, _ in sent[:4]] == [raw] * 4  # epoch 1: first visits, full precision
    assert [s for s, _ in sent[4:]] == [delta] * 8  # later epochs: 4-bit deltas
    assert all(d == raw for _, d in sent)
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
    # Epoch 1 is exact except for the 8-bit activation gradients; then 8-bit deltas of
    # activations that change little: the loss curves agree to a few 1e-3.
    for a, b in zip(ours, stock):
        assert abs(a - b) / abs(b) < 5e-3, (ours, stock)


def test_aqsgd_pp2_dp2_each_replica_keeps_its_samples():
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "2"]
    flags += ["--global-batch-size", "16"]  # 2 steps an epoch per replica pair
    results = run_ranks(_run, 4, flags, 6)
    assert _boundaries_identical(results[0]["sums"]) == 2


def test_aqsgd_pp4_every_boundary_stays_identical():
    flags = ["--pipeline-model-parallel-size", "4", "--num-layers", "4"] + FIXED
    flags += ["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "3"]
    results = run_ranks(_run, 4, flags, 6)
    assert _boundaries_identical(results[0]["sums"]) == 3
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
    assert all(len(v) == 2 and v[0] == v[1] for v in by_stage.values()), by_stage
    raw = 8 * 32 * 64 * 2  # bf16 first visits
    assert [s for s, _ in results[0]["act"][:4]] == [raw] * 4
    for r in results:
        before, numel, after = r["pending"]
        assert before == 8 * numel and after == 0, r["pending"]
    assert all(s < raw / 3 for s, _ in results[0]["act"][4:])


def test_directq_pp2_sends_quantized_activations_from_the_start():
    results = run_ranks(_run, 2, PP2 + FIXED + ["--p2p-compression", "directq"], 3)
    assert results[0]["act"] == [(8 * (32 * 64 // 2 + 2 * 64), 8 * 32 * 64 * 4)] * 3


def _resume(rank, world, flags, root):
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
    full_sums = trainer.runtime.communicator.codec.checksums()
    teardown(trainer)
    build(trainer, stock=False)
    first = run(0, 5)
    save_checkpoint(trainer, root, 5)
    teardown(trainer)
    build(trainer, stock=False)
    load_checkpoint(trainer, root)
    second = run(5, 3)
    sums = trainer.runtime.communicator.codec.checksums()
    teardown(trainer)
    return {"full": full, "resumed": first + second, "sums": (full_sums, sums)}


def test_resume_with_saved_buffers_is_bit_exact(tmp_path):
    flags = PP2 + FIXED + ["--p2p-compression", "aqsgd", "--aqsgd-checkpoint-buffers"]
    for out in run_ranks(_resume, 2, flags, str(tmp_path / "ckpt")):
        assert out["full"] == out["resumed"]
        assert out["sums"][0] == out["sums"][1]


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
