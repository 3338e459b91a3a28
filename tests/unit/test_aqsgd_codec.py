"""AQ-SGD's codec as a sender / receiver pair, without a process group.

Both sides of one pipeline boundary run in this process: the sender encodes each
microbatch's activations, the receiver sizes its buffer from the same context and decodes.
What AQ-SGD promises, checked here: a first visit travels in full precision; both buffers
stay bit-identical after every step; later visits send packed low-bit deltas whose error
shrinks as activations settle; 8-bit deltas stay within rounding of the true activations;
gradients are quantized with no buffer; a checkpoint either saves the buffers or forces
full-precision first visits again. Robustness: stochastic rounding draws on the tensor's
device; device buffers are indexed only with indices on their device; a value that does
not fit the buffer dtype is clamped, a non-finite one never stored, a skipped step never
committed; buffers hold this rank's context-parallel shard of the sequence; the buffers
default to the activations' dtype; a step announced by ``begin_step`` (indices prepared
once, visit flags read at the next step) gives the same bytes as one that is not.
Warm-up (``--aqsgd-warmup-epochs``): epochs convert to steps (refused without fixed samples
or when longer than training); its steps send activations and gradients in full precision
and leave each sample's exact activation in both buffers. Scales per channel over the
micro-batch (``--aqsgd-granularity microbatch``) are the public code's.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.collectives import aqsgd as aqsgd_module
from megatron_ext.collectives.aqsgd import (
    AQSGDCodec,
    DirectQCodec,
    SampleBuffers,
    codecs as aqsgd_codecs,
)
from megatron_ext.collectives.p2p import P2PContext
from megatron_ext.compressors.quantize import packed_nbytes
from megatron_ext.config import ConfigError
from megatron_ext.methods.aqsgd import AQSGDConfig
from megatron_ext.methods.registry import SampleSpace
from tests.helpers.aqsgd_samples import fixed_samples

SEQ, HIDDEN, MBS, NMB, NUM = 16, 32, 2, 4, 16


def _samples():
    return fixed_samples(NUM, MBS, NMB, SEQ)


def _pair(tmp_path=None, *, device="cpu", activation_dtype=torch.float32, **options):
    cfg = AQSGDConfig(**options)
    sender, receiver = AQSGDCodec(cfg, None), AQSGDCodec(cfg, None)
    for codec, stage, tag in ((sender, 0, "a"), (receiver, 1, "b")):
        codec.allocate(
            _samples(),
            SEQ,
            HIDDEN,
            stage=stage,
            num_stages=2,
            device=torch.device(device),
            file_tag=tag,
            activation_dtype=activation_dtype,
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


# Steps of NMB microbatches: samples 0-3 come back in the very next step (the commit's
# flags must be read before it starts), 4-7 two steps later (read while the step runs).
_SCHEDULE = [
    [[0, 1], [2, 3], [4, 5], [6, 7]],
    [[0, 1], [2, 3], [8, 9], [10, 11]],
    [[12, 13], [14, 15], [4, 5], [6, 7]],
    [[8, 9], [10, 11], [2, 3], [0, 1]],
    [[5, 4], [7, 6], [3, 2], [13, 12]],
]
_SPIKES = {(0, 2): float("inf"), (2, 5): float("nan"), (2, 14): float("inf"), (4, 12): float("inf")}


def _run_schedule(announce):
    """Run :data:`_SCHEDULE` (non-finite samples from :data:`_SPIKES`, step 3 skipped by the
    optimizer); returns each transfer's payload and output, and the codecs."""
    sender, receiver = _pair(fw_bits=4)
    records = []
    for step, microbatches in enumerate(_SCHEDULE):
        if announce:
            for codec in (sender, receiver):
                codec.begin_step(lambda mb, step=step: torch.tensor(_SCHEDULE[step][mb]))
        for mb, ids in enumerate(microbatches):
            ids = torch.tensor(ids)
            x = _activation(ids, step, lambda s: 0.3)
            for i, sample in enumerate(ids.tolist()):
                if (step, sample) in _SPIKES:
                    x[3, i, 5] = _SPIKES[(step, sample)]
            ctx = P2PContext("forward", mb, ids, step, False)
            shape, _ = receiver.payload_spec(tuple(x.shape), x.dtype, ctx)
            payload = sender.encode(x, ctx)
            assert tuple(payload.shape) == tuple(shape)
            records.append((payload, receiver.decode(payload, ctx, tuple(x.shape), x.dtype)))
        for codec in (sender, receiver):
            codec.end_step(commit=step != 3)
        if announce and step != 3:
            assert sender._pending and receiver._pending  # flags not read at the commit
    return records, sender, receiver


@pytest.mark.filterwarnings("ignore:aqsgd")
def test_announced_steps_read_visit_flags_late_with_the_same_result():
    """A step announced by ``begin_step`` commits device buffers on the device and
    reads the visit flags later; payloads, outputs, buffers and flags must be bit-identical
    to steps that read them at the commit, non-finite samples and a skipped step included."""
    late, a_s, a_r = _run_schedule(announce=True)
    now, b_s, b_r = _run_schedule(announce=False)
    assert len(late) == len(now)
    for (p1, o1), (p2, o2) in zip(late, now):
        assert torch.equal(p1, p2)
        torch.testing.assert_close(o1, o2, rtol=0, atol=0, equal_nan=True)
    assert a_s.checksums() == b_s.checksums() and a_r.checksums() == b_r.checksums()
    for x, y in ((a_s.send, b_s.send), (a_r.recv, b_r.recv), (a_s.send, a_r.recv)):
        assert torch.equal(x.contents(), y.contents()) and torch.isfinite(x.contents()).all()
        assert torch.equal(x.visited, y.visited)
    # 14's only visit was non-finite: never stored; 2's first visit too, its second not.
    assert not bool(a_s.send.visited[14]) and bool(a_s.send.visited[2])


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


def test_microbatch_scales_are_the_authors_per_channel_over_the_microbatch():
    codec = DirectQCodec(AQSGDConfig(fw_bits=4, granularity="microbatch"), None)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(5))
    ctx = P2PContext("forward", 0, None, 0, False)
    payload = codec.encode(x, ctx)
    assert codec.payload_spec(tuple(x.shape), x.dtype, ctx) == ((payload.numel(),), torch.uint8)
    assert payload.numel() == MBS * packed_nbytes(SEQ * HIDDEN, 4) + 2 * HIDDEN
    # The public code's scale: max |x| over dims (0, 1) of [micro-batch, seq, hidden].
    expected = x.transpose(0, 1).abs().amax(dim=(0, 1)).half()
    assert torch.equal(payload[-2 * HIDDEN :].view(torch.float16), expected)
    out = codec.decode(payload, ctx, tuple(x.shape), x.dtype)
    assert bool(((out - x).abs() <= expected.float() / 8 + 1e-3).all())  # one 4-bit step


def test_microbatch_granularity_keeps_the_buffers_identical():
    sender, receiver = _pair(fw_bits=3, granularity="microbatch")
    records = _epochs(sender, receiver, epochs=3)
    delta = NMB * (MBS * packed_nbytes(SEQ * HIDDEN, 3) + 2 * HIDDEN)
    assert all(r["same"] for r in records)
    assert all(r["bytes"] == delta for r in records if r["epoch"] > 0)


# -- warm-up (--aqsgd-warmup-epochs) ----------------------------------------------------------


def _steps_samples(num_samples, dp, train_iters=None, fixed=True):
    return SampleSpace(
        fixed=fixed,
        num_samples=num_samples,
        dp_rank=0,
        dp_size=dp,
        micro_batch_size=MBS,
        num_microbatches=NMB,
        seq_length=SEQ,
        train_iters=train_iters,
    )


def test_warmup_epochs_convert_to_steps_and_refuse_what_cannot_work():
    # An epoch is the fixed samples over the global batch (dp x MBS x NMB = 16 at dp 2).
    assert aqsgd_module.warmup_steps(1, _steps_samples(128, 2)) == 8
    assert aqsgd_module.warmup_steps(2, _steps_samples(100, 2)) == 13  # ceil(200 / 16)
    assert aqsgd_module.warmup_steps(0, None) == 0
    with pytest.raises(ConfigError, match="--aqsgd-warmup-epochs.*--fixed-samples"):
        aqsgd_module.warmup_steps(1, _steps_samples(0, 2, fixed=False))
    with pytest.raises(ConfigError, match="--aqsgd-warmup-epochs.*--train-iters"):
        aqsgd_module.warmup_steps(1, _steps_samples(128, 2, train_iters=8))
    assert aqsgd_module.warmup_steps(1, _steps_samples(128, 2, train_iters=9)) == 8
    with pytest.raises(ConfigError, match="--aqsgd-warmup-epochs"):
        AQSGDConfig(warmup_epochs=-1)


def test_warmup_sends_full_precision_and_fills_the_buffers_exactly():
    sender, receiver = _pair(fw_bits=2, bw_bits=4)
    steps = NUM // (MBS * NMB)
    for codec in (sender, receiver):
        codec.warmup_steps = 2 * steps  # two epochs
    records = _epochs(sender, receiver, epochs=3)
    raw = NMB * MBS * SEQ * HIDDEN * 4
    delta = NMB * MBS * (packed_nbytes(SEQ * HIDDEN, 2) + 2 * HIDDEN)
    # Revisits inside the warm-up travel in full precision too; then 2-bit deltas.
    assert [r["bytes"] for r in records] == [raw] * (2 * steps) + [delta] * steps
    assert all(r["error"] == 0.0 for r in records[: 2 * steps])
    assert all(r["same"] for r in records)
    # Both buffers hold each sample's exact activation of its last warm-up visit.
    last = {}
    order = torch.arange(NUM)
    for epoch in range(2):
        perm = order[torch.randperm(NUM, generator=torch.Generator().manual_seed(epoch))]
        for i, sample in enumerate(perm.tolist()):
            last[sample] = epoch * steps + i // (MBS * NMB)
    sender2, receiver2 = _pair(fw_bits=2, bw_bits=4)
    for codec in (sender2, receiver2):
        codec.warmup_steps = 2 * steps
    _epochs(sender2, receiver2, epochs=2)
    drift = lambda step: 0.5 / (1 + step)  # noqa: E731 (_epochs' default)
    for sample, step in last.items():
        x = _activation(torch.tensor([sample]), step, drift)[:, 0]
        assert torch.equal(sender2.send.contents()[sample], x), sample
        assert torch.equal(receiver2.recv.contents()[sample], x), sample
    assert bool(sender2.send.visited.all())
    # Gradients of a warm-up step: the tensor itself, exactly.
    g = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(7))
    ctx = P2PContext("backward", 0, torch.tensor([0, 1]), 2 * steps - 1, False)
    assert sender.payload_spec(tuple(g.shape), g.dtype, ctx) == (tuple(g.shape), g.dtype)
    out = sender.decode(receiver.encode(g, ctx), ctx, tuple(g.shape), g.dtype)
    assert torch.equal(out, g)
    late = P2PContext("backward", 0, torch.tensor([0, 1]), 2 * steps, False)
    assert sender.payload_spec(tuple(g.shape), g.dtype, late)[1] == torch.uint8


def test_directq_warmup_sends_the_activations_themselves():
    codec = DirectQCodec(AQSGDConfig(fw_bits=2), None)
    codec.warmup_steps = 3
    x = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(3))
    for step, exact in ((0, True), (2, True), (3, False)):
        ctx = P2PContext("forward", 0, None, step, False)
        out = codec.decode(codec.encode(x, ctx), ctx, tuple(x.shape), x.dtype)
        assert torch.equal(out, x) == exact, step


# -- robustness ------------------------------------------------------------------------------


def test_stochastic_rounding_draws_on_the_tensors_device(monkeypatch):
    """CUDA kernels take CUDA generators only: the codec seeds one on the tensor's device."""
    devices = []
    real = aqsgd_codecs.device_generator

    def record(device, *parts):
        devices.append(device)
        return real(device, *parts)

    monkeypatch.setattr(aqsgd_codecs, "device_generator", record)
    sender, receiver = _pair(rounding="stochastic")
    _epochs(sender, receiver, epochs=2)
    g = torch.randn(SEQ, MBS, HIDDEN)
    receiver.encode(g, P2PContext("backward", 0, torch.tensor([0, 1]), 0, False))
    DirectQCodec(AQSGDConfig(rounding="stochastic"), None).encode(
        g, P2PContext("forward", 0, None, 0, False)
    )
    # Forward deltas of the second epoch, the gradient and DirectQ's activation.
    assert len(devices) == NUM // MBS + 2
    assert all(d == g.device for d in devices), devices


class _DeviceIndexing(TorchFunctionMode):
    """Fails any indexing of a tensor on ``device`` with a host tensor or a Python list (an
    implicit synchronous host-to-device copy per access on a GPU)."""

    _OPS = {
        torch.Tensor.__getitem__,
        torch.Tensor.__setitem__,
        torch.Tensor.index_select,
        torch.index_select,
        torch.Tensor.index_copy_,
        torch.Tensor.index_put_,
    }

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.indexed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._OPS and isinstance(args[0], torch.Tensor):
            if args[0].device == self.device:
                self.indexed += 1
                for a in list(args[1:]) + list(kwargs.values()):
                    items = a if isinstance(a, (tuple, list)) else (a,)
                    for i in items:
                        if isinstance(i, list) or (
                            isinstance(i, torch.Tensor)
                            and i.dtype in (torch.int64, torch.bool)
                            and i.device != self.device
                        ):
                            raise AssertionError(f"{func.__name__}: index on {i!r:.40}")
        return func(*args, **(kwargs or {}))


def test_device_buffers_are_indexed_with_indices_on_their_device():
    """The steady state on a device (meta here: every host read of it raises) indexes
    activations and buffers with device indices only."""
    sender, receiver = _pair(device="meta")
    for codec, side in ((sender, "send"), (receiver, "recv")):
        getattr(codec, side).visited[:] = True  # later visits: buffers read and written
    ids = torch.tensor([3, 8])
    x = torch.empty(SEQ, MBS, HIDDEN, device="meta")
    ctx = P2PContext("forward", 0, ids, 5, False)
    mode = _DeviceIndexing("meta")
    with mode:
        shape, _ = receiver.payload_spec(tuple(x.shape), x.dtype, ctx)
        payload = sender.encode(x, ctx)
        receiver.decode(payload, ctx, tuple(x.shape), x.dtype)
        sender.send.write(torch.tensor([1, 2]), torch.empty(2, SEQ, HIDDEN, device="meta"))
    assert mode.indexed >= 6 and tuple(payload.shape) == tuple(shape)


def _spike(ids, value):
    """bf16 activations [seq, mbs, hidden], ``value`` at one element of each sample."""
    x = _activation(ids, 0, lambda s: 0.0).to(torch.bfloat16)
    x[3, :, 5] = value
    return x


def _send(sender, receiver, x, ids, step):
    ctx = P2PContext("forward", 0, ids, step, False)
    receiver.payload_spec(tuple(x.shape), x.dtype, ctx)
    out = receiver.decode(sender.encode(x, ctx), ctx, tuple(x.shape), x.dtype)
    sender.end_step(), receiver.end_step()
    return out


@pytest.mark.filterwarnings("ignore:aqsgd")
def test_out_of_range_and_non_finite_activations_never_stored_as_inf():
    """A bf16 70000 in fp16 buffers is clamped (the value delivered stays right),
    an inf activation is never written, and both sides stay bit-identical."""
    sender, receiver = _pair(buffer_dtype="fp16")
    big, bad = torch.tensor([2]), torch.tensor([9])
    with pytest.warns(UserWarning, match="beyond the range of the fp16 buffers"):
        _send(sender, receiver, _spike(big, 70000.0), big, 0)
    _send(sender, receiver, _spike(bad, float("inf")), bad, 0)
    for step in (1, 2):  # later visits of the big sample: deltas against the clamped row
        out = _send(sender, receiver, _spike(big, 70000.0), big, step)
        assert torch.isfinite(out).all() and abs(float(out[3, 0, 5]) - 70000.0) < 1000.0
        out = _send(sender, receiver, _spike(bad, float("nan")), bad, step)
    for codec, side in ((sender, "send"), (receiver, "recv")):
        rows = getattr(codec, side).contents()
        assert torch.isfinite(rows).all()
        assert float(rows[2, 3, 5]) == torch.finfo(torch.float16).max
        visited = getattr(codec, side).visited
        assert bool(visited[2]) and not bool(visited[9])  # never a stored non-finite row
    assert torch.equal(sender.send.contents(), receiver.recv.contents())
    assert torch.equal(sender.send.visited, receiver.recv.visited)


def test_buffers_default_to_the_activation_dtype():
    sender, receiver = _pair(activation_dtype=torch.bfloat16)
    assert sender.send.dtype == receiver.recv.dtype == torch.bfloat16
    sender, _ = _pair(activation_dtype=torch.float32, buffer_dtype="fp16")
    assert sender.send.dtype == torch.float16  # an explicit choice stays


def test_a_skipped_step_is_not_committed():
    sender, receiver = _pair()
    _epochs(sender, receiver, epochs=1)
    before = sender.send.contents(), sender.send.visited.clone()
    ids = torch.tensor([0, 1])
    ctx = P2PContext("forward", 0, ids, 7, False)
    x = _activation(ids, 7, lambda s: 1.0)
    receiver.decode(sender.encode(x, ctx), ctx, tuple(x.shape), x.dtype)
    sender.end_step(commit=False), receiver.end_step(commit=False)
    assert torch.equal(sender.send.contents(), before[0])
    assert torch.equal(sender.send.visited, before[1])
    assert torch.equal(receiver.recv.contents(), before[0])


def test_buffers_hold_this_ranks_context_parallel_shard():
    """Megatron sends [seq / cp, mbs, hidden] per rank; the buffers must hold that shard
    (a full-sequence buffer is refused at the first transfer, naming the flag)."""
    cfg = AQSGDConfig()
    codec = AQSGDCodec(cfg, None)
    codec.allocate(_samples(), SEQ, HIDDEN, stage=0, num_stages=2, device=torch.device("cpu"))
    ids = torch.tensor([0, 1])
    shard = torch.randn(SEQ // 2, MBS, HIDDEN)
    with pytest.raises(RuntimeError, match="--context-parallel-size"):
        codec.encode(shard, P2PContext("forward", 0, ids, 0, False))
    sender = AQSGDCodec(cfg, None)
    sender.allocate(_samples(), SEQ // 2, HIDDEN, stage=0, num_stages=2, device=torch.device("cpu"))
    sender.encode(shard, P2PContext("forward", 0, ids, 0, False))
    sender.end_step()
    assert bool(sender.send.visited[ids].all())


def test_the_fit_check_keeps_room_for_optimizer_state_to_come():
    import psutil

    codec = AQSGDCodec(AQSGDConfig(), None)
    free = psutil.virtual_memory().available
    # A quarter of the free memory fits alone (half may go to buffers), not once the
    # optimizer state still to come takes three quarters first (nothing is allocated).
    assert codec._check_fits(free // 4, "device") is None
    flags, message = codec._check_fits(free // 4, "device", reserve_nbytes=3 * free // 4)
    assert "optimizer state" in message and "--aqsgd-buffer" in flags
    # Host buffers do not share memory with the device's optimizer state.
    assert codec._check_fits(free // 4, "host", reserve_nbytes=3 * free // 4) is None
    with pytest.raises(ConfigError, match="optimizer state"):
        codec.allocate(
            _samples(),
            SEQ,
            HIDDEN,
            stage=1,
            num_stages=2,
            device=torch.device("cpu"),
            reserve_nbytes=2 * free,
        )
