"""AQ-SGD's codec as a sender / receiver pair, without a process group.

Both sides of one pipeline boundary run in this process: the sender encodes each
microbatch's activations, the receiver sizes its buffer from the same context and decodes.
What AQ-SGD promises, checked here: a first visit travels in full precision; both buffers
stay bit-identical after every step; later visits send packed low-bit deltas whose error
shrinks as activations settle; 8-bit deltas stay within rounding of the true activations;
gradients are quantized with no buffer; a checkpoint either saves the buffers or forces
full-precision first visits again.
"""

import pytest
import torch

from megatron_ext.collectives.aqsgd import AQSGDCodec, DirectQCodec, SampleBuffers
from megatron_ext.collectives.p2p import P2PContext
from megatron_ext.compressors.quantize import packed_nbytes
from megatron_ext.methods.aqsgd import AQSGDConfig
from megatron_ext.methods.registry import SampleSpace

SEQ, HIDDEN, MBS, NMB, NUM = 16, 32, 2, 4, 16


def _samples():
    return SampleSpace(
        fixed=True,
        num_samples=NUM,
        dp_rank=0,
        dp_size=1,
        micro_batch_size=MBS,
        num_microbatches=NMB,
        seq_length=SEQ,
    )


def _pair(tmp_path=None, **options):
    cfg = AQSGDConfig(**options)
    sender, receiver = AQSGDCodec(cfg, None), AQSGDCodec(cfg, None)
    sender.allocate(
        _samples(), SEQ, HIDDEN, stage=0, num_stages=2, device=torch.device("cpu"), file_tag="a"
    )
    receiver.allocate(
        _samples(), SEQ, HIDDEN, stage=1, num_stages=2, device=torch.device("cpu"), file_tag="b"
    )
    return sender, receiver


def _activation(ids, step, drift):
    """[seq, mbs, hidden]: a fixed pattern per sample plus a drift that shrinks over steps."""
    rows = []
    for i in ids.tolist():
        base = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(i))
        noise = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(1000 * step + i))
        rows.append(base + drift(step) * noise)
    return torch.stack(rows, dim=1)


def _epochs(sender, receiver, epochs, drift=lambda step: 0.5 / (1 + step)):
    """Run epochs of NUM samples (NMB microbatches of MBS per step); returns per-step records."""
    order = torch.arange(NUM)
    records = []
    step = 0
    for epoch in range(epochs):
        perm = order[torch.randperm(NUM, generator=torch.Generator().manual_seed(epoch))]
        for s in range(NUM // (MBS * NMB)):
            errors, nbytes = [], 0
            for mb in range(NMB):
                ids = perm[(s * NMB + mb) * MBS : (s * NMB + mb + 1) * MBS]
                ctx = P2PContext("forward", mb, ids, step, False)
                x = _activation(ids, step, drift)
                spec_shape, spec_dtype = receiver.payload_spec(tuple(x.shape), x.dtype, ctx)
                payload = sender.encode(x, ctx)
                assert tuple(payload.shape) == tuple(spec_shape) and payload.dtype == spec_dtype
                out = receiver.decode(payload, ctx, tuple(x.shape), x.dtype)
                errors.append((out - x).abs().max().item())
                nbytes += payload.numel()
            sender.end_step()
            receiver.end_step()
            records.append(
                {
                    "epoch": epoch,
                    "error": max(errors),
                    "bytes": nbytes,
                    "same": sender.send.checksum() == receiver.recv.checksum()
                    and torch.equal(sender.send.contents(), receiver.recv.contents()),
                }
            )
            step += 1
    return records


def test_first_visit_exact_then_low_bit_deltas_and_identical_buffers():
    sender, receiver = _pair(fw_bits=4)
    records = _epochs(sender, receiver, epochs=4)
    steps_per_epoch = NUM // (MBS * NMB)
    raw = NMB * MBS * SEQ * HIDDEN * 4
    delta = NMB * MBS * (packed_nbytes(SEQ * HIDDEN, 4) + 2 * HIDDEN)
    for r in records:
        assert r["same"], r  # both sides hold the same m(xi), bit for bit, after every step
        if r["epoch"] == 0:
            assert r["error"] == 0.0 and r["bytes"] == raw  # first visits: full precision
        else:
            assert r["bytes"] == delta  # 4-bit codes plus one fp16 scale per channel
    # The error of later visits shrinks as the activations settle (the self-enforcing loop).
    second = max(r["error"] for r in records if r["epoch"] == 1)
    last = max(r["error"] for r in records if r["epoch"] == 3)
    assert last < second / 2, (second, last)
    assert len(records) == 4 * steps_per_epoch


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_every_width_keeps_the_buffers_identical(bits):
    sender, receiver = _pair(fw_bits=bits, rounding="stochastic", granularity="token")
    for r in _epochs(sender, receiver, epochs=3):
        assert r["same"], r


def test_eight_bit_deltas_stay_within_rounding():
    sender, receiver = _pair(fw_bits=8, buffer_dtype="fp32")
    records = _epochs(sender, receiver, epochs=3, drift=lambda step: 0.05)
    # The delta between visits is 0.05 x (difference of two standard normals): below 0.5 in
    # every channel (5 sigma), so one 8-bit step is below 0.5 / 128 = 0.0039.
    assert max(r["error"] for r in records if r["epoch"] > 0) < 0.5 / 128


def test_staged_updates_commit_only_at_step_end():
    sender, receiver = _pair()
    ids = torch.tensor([3, 5])
    ctx = P2PContext("forward", 0, ids, 0, False)
    sender.encode(_activation(ids, 0, lambda s: 0.0), ctx)
    assert not bool(sender.send.visited[ids].any())  # a replayed step would start from here
    sender.end_step()
    assert bool(sender.send.visited[ids].all())


def test_gradients_are_quantized_without_a_buffer():
    sender, receiver = _pair(bw_bits=4)
    g = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(7))
    ctx = P2PContext("backward", 0, torch.tensor([0, 1]), 0, False)
    shape, dtype = sender.payload_spec(tuple(g.shape), g.dtype, ctx)
    payload = receiver.encode(g, ctx)  # gradients travel from the later stage back
    assert tuple(payload.shape) == tuple(shape) and dtype == torch.uint8
    assert payload.numel() == MBS * (packed_nbytes(SEQ * HIDDEN, 4) + 2 * HIDDEN)
    out = sender.decode(payload, ctx, tuple(g.shape), g.dtype)
    scale = g.abs().amax(dim=0, keepdim=True)  # per sample and channel over the sequence
    assert bool(((out - g).abs() <= scale / 8 + 1e-2).all())
    assert sender.send.visited.sum() == 0 and receiver.recv.visited.sum() == 0


def test_evaluation_sends_full_precision_and_leaves_buffers_alone():
    sender, receiver = _pair()
    ids = torch.tensor([0, 1])
    x = _activation(ids, 0, lambda s: 0.0)
    ctx = P2PContext("forward", 0, ids, 0, True)
    assert receiver.payload_spec(tuple(x.shape), x.dtype, ctx) == (tuple(x.shape), x.dtype)
    assert torch.equal(receiver.decode(sender.encode(x, ctx), ctx, tuple(x.shape), x.dtype), x)
    sender.end_step(), receiver.end_step()
    assert sender.send.visited.sum() == 0


def test_rebuild_policy_forces_first_visits_after_a_resume():
    sender, receiver = _pair()
    _epochs(sender, receiver, epochs=2)
    state = receiver.state_dict()
    assert state == {"policy": "rebuild"}
    fresh_s, fresh_r = _pair()
    fresh_s.load_state_dict(sender.state_dict())
    fresh_r.load_state_dict(state)
    records = _epochs(fresh_s, fresh_r, epochs=1)
    raw = NMB * MBS * SEQ * HIDDEN * 4
    assert all(r["bytes"] == raw and r["error"] == 0.0 and r["same"] for r in records)


def test_saved_buffers_resume_bit_exactly(tmp_path):
    a_s, a_r = _pair(checkpoint_buffers=True)
    _epochs(a_s, a_r, epochs=2)
    saved_s, saved_r = a_s.state_dict(), a_r.state_dict()
    b_s, b_r = _pair(checkpoint_buffers=True, buffer="disk", buffer_dir=str(tmp_path))
    b_s.load_state_dict(saved_s)
    b_r.load_state_dict(saved_r)
    # Continue both the original and the restored pair: identical payloads and buffers.
    ids = torch.tensor([4, 9])
    ctx = P2PContext("forward", 0, ids, 99, False)
    x = _activation(ids, 99, lambda s: 0.1)
    assert torch.equal(a_s.encode(x, ctx), b_s.encode(x, ctx))
    a_s.end_step(), b_s.end_step()
    assert torch.equal(a_s.send.contents(), b_s.send.contents())
    with pytest.raises(ValueError):
        b_r.load_state_dict({"policy": "rebuild"})


@pytest.mark.parametrize("where", ["host", "disk"])
def test_host_and_disk_buffers_behave_like_device_buffers(tmp_path, where):
    ref = _epochs(*_pair(), epochs=3)
    other = _epochs(*_pair(buffer=where, buffer_dir=str(tmp_path)), epochs=3)
    assert [(r["error"], r["bytes"]) for r in ref] == [(r["error"], r["bytes"]) for r in other]


def test_sample_buffers_prefetch_returns_what_read_would():
    buf = SampleBuffers(4, 2, 3, torch.float16, "host", torch.device("cpu"))
    buf.write(torch.tensor([1, 2]), torch.ones(2, 2, 3, dtype=torch.float16))
    buf.prefetch(torch.tensor([2, 1]))
    assert torch.equal(buf.read(torch.tensor([2, 1])), torch.ones(2, 2, 3, dtype=torch.float16))


def test_directq_quantizes_the_activations_themselves():
    codec = DirectQCodec(AQSGDConfig(fw_bits=2), None)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(3))
    ctx = P2PContext("forward", 0, None, 0, False)
    payload = codec.encode(x, ctx)
    assert codec.payload_spec(tuple(x.shape), x.dtype, ctx) == ((payload.numel(),), torch.uint8)
    assert payload.numel() == MBS * (packed_nbytes(SEQ * HIDDEN, 2) + 2 * HIDDEN)
    out = codec.decode(payload, ctx, tuple(x.shape), x.dtype)
    # Two bits of the activation itself: a coarse copy (the baseline that diverges).
    assert 0.05 < (out - x).abs().mean() < 1.0
