"""AQ-SGD's kernels on the whole buffer (megatron_ext/kernels/quant.py): fused vs the chain.

Device buffers are no longer gathered (``index_select``) and scattered back (``index_copy_``)
around the codec: ``aqsgd_encode_rows`` (sender), ``aqsgd_decode_rows`` (receiver) and
``aqsgd_commit_rows`` (both sides, at the end of the step, in place) take the whole buffer
and the slots. Here:

* eager, each op equals the chain it replaces (the gathered rows through ``quant_pack`` /
  ``aqsgd_decode_stage``, then ``index_copy_``) bit for bit, in every dtype the codec
  accepts (fp32, bf16, fp16 activations; buffers of each), with a sample beyond the fp16
  range (clamped, flagged) and a non-finite one (its row kept, flagged);
* compiled (``on``: C++ on this CPU) against eager: payloads, activations, buffer rows and
  flags bit for bit (tolerance 0, as in test_kernels_quant.py: the CPU compiler contracts
  no multiply-add), bf16 and fp16 buffers with the non-finite and out-of-range samples, and
  untouched rows untouched;
* a whole boundary compiled against eager over steps (fp32, first visits then revisits,
  stochastic rounding, a non-finite sample, a skipped step): payloads, activations, both
  buffers and visit flags bit-identical;
* a slot written twice in one step (fewer fixed samples than a step's batch): device buffers
  (deferred in-place updates) end as host buffers (the gathered and staged chain) do.

Compiles cost seconds each on this machine; the compiled cases are few and small.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext import kernels
from megatron_ext.collectives.aqsgd import AQSGDCodec
from megatron_ext.collectives.p2p import P2PContext
from megatron_ext.kernels import quant as Q
from megatron_ext.methods.aqsgd import AQSGDConfig
from tests.helpers.aqsgd_samples import fixed_samples
from tests.helpers.fused_modes import assert_same, seeded_randn

pytestmark = pytest.mark.usefixtures("fresh_kernel_mode")


def _same_payload(a, b, k, rows, cols, bits, granularity, what):
    """Payloads equal where the quantizer specifies them: the decoded values (NaN == NaN),
    the code bytes of every sample decoded finite, the scales' values. A group holding a
    non-finite value has a non-finite scale; its codes and the NaN's bits are not specified
    (module docstring of megatron_ext/kernels/quant.py)."""
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8, what
    va = Q._unpack_samples(a, bits, granularity, k, rows, cols)
    assert_same(va, Q._unpack_samples(b, bits, granularity, k, rows, cols), f"{what} values")
    n = Q._sample_codes_nbytes(k, rows, cols, bits)
    per = n // k
    for i in range(k):
        if torch.isfinite(va[i]).all():
            assert torch.equal(a[i * per : (i + 1) * per], b[i * per : (i + 1) * per]), what
    if torch.isfinite(va).all():
        assert torch.equal(a, b), what
    scales = [Q._from_bytes(p[n:].reshape(1, -1), torch.float16) for p in (a, b)]
    assert_same(*scales, f"{what} scales")


def _case(dtype, buffer_dtype, seed=0):
    """A buffer of 8 slots of [5, 7] rows (35 values: not a multiple of 8), 3 revisited
    samples at slots 6, 1, 4 given as strided [k, rows, cols] activations (transposed from
    [s, b, h] as the codec passes them); slot 4's row holds a NaN (its new value is not
    finite); bf16 activations over fp16 buffers: sample 1 moves past fp16's range."""
    table = seeded_randn(NUM, SEQ, HIDDEN, seed=seed, dtype=buffer_dtype)
    index = torch.tensor([6, 1, 4])
    x = seeded_randn(SEQ, 3, HIDDEN, seed=seed + 1, dtype=dtype).transpose(0, 1)
    table[4, 0, 0] = float("nan")
    if _clamps(dtype, buffer_dtype):
        x = x.clone()
        x[1, 2, 3] = 1e5  # the delta (6e4) fits the fp16 scale, the new value (1e5) does not
        table[1, 2, 3] = 4e4
    return x, table, index


def _clamps(dtype, buffer_dtype):
    return dtype == torch.bfloat16 and buffer_dtype == torch.float16


def _reference(x, table, index, seed, bits, granularity, out_dtype):
    """The chain the fused ops replace: gather, quant_pack, decode_stage, index_copy_."""
    m = table.index_select(0, index)
    payload = Q.quant_pack(x, m, seed, bits, granularity)
    staged, finite, clamped, out = Q.aqsgd_decode_stage(payload, m, bits, granularity, out_dtype)
    after = table.clone()
    after.index_copy_(0, index, staged)
    return payload, out, after, finite, clamped


def _fused(x, table, index, seed, bits, granularity, out_dtype):
    payload = Q.aqsgd_encode_rows(x, table, index, seed, bits, granularity)
    out = Q.aqsgd_decode_rows(payload, table, index, bits, granularity, out_dtype)
    after = table.clone()
    finite, clamped = Q.aqsgd_commit_rows(payload, after, index, bits, granularity)
    return payload, out, after, finite, clamped


SEQ, HIDDEN, MBS, NMB, NUM = 5, 7, 2, 2, 8

_CASES = [
    # (activation dtype, buffer dtype, bits, granularity, stochastic)
    (torch.float32, torch.float32, 4, "channel", True),
    (torch.bfloat16, torch.bfloat16, 3, "token", False),
    (torch.float16, torch.float16, 4, "microbatch", True),
    (torch.bfloat16, torch.float16, 2, "channel", False),
]


@pytest.mark.parametrize("dtype, buffer_dtype, bits, granularity, stochastic", _CASES)
def test_fused_ops_equal_the_gathered_chain(dtype, buffer_dtype, bits, granularity, stochastic):
    x, table, index = _case(dtype, buffer_dtype)
    seed = Q.draw_seed(x.device, torch.Generator().manual_seed(3)) if stochastic else None
    ref = _reference(x, table, index, seed, bits, granularity, dtype)
    fused = _fused(x, table, index, seed, bits, granularity, dtype)
    assert_same(ref, fused, f"{dtype} {buffer_dtype} {bits} bits {granularity}")
    finite, clamped = fused[3], fused[4]
    # a scale per channel over the micro-batch: slot 4's NaN reaches every sample
    assert finite.tolist() == [granularity != "microbatch"] * 2 + [False]
    assert clamped.tolist() == [False, _clamps(dtype, buffer_dtype), False]
    after = fused[2]
    if _clamps(dtype, buffer_dtype):
        assert float(after[1, 2, 3]) == torch.finfo(torch.float16).max
        assert float(fused[1][1, 2, 3]) > 65504.0  # the activation delivered: not clamped
    assert torch.isfinite(after[[6, 1]]).all()
    if granularity == "microbatch":
        assert torch.equal(after[[6, 1]], table[[6, 1]])
    assert torch.equal(after[4], table[4]) or torch.equal(after[4].isnan(), table[4].isnan())
    assert torch.equal(after[4][1:], table[4][1:])  # the non-finite sample's row kept
    untouched = [i for i in range(NUM) if i not in index.tolist()]
    assert torch.equal(fused[2][untouched], table[untouched])


def test_an_index_off_the_buffers_device_is_refused():
    table = torch.zeros(4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="buffer's device"):
        Q.aqsgd_decode_rows(
            torch.empty(16, dtype=torch.uint8, device="meta"),
            table,
            torch.tensor([1]),
            4,
            "channel",
            torch.float32,
        )


def test_fused_ops_compiled_equal_eager():
    """fp32 (4 bits per channel, stochastic: the boundary test below reuses these compiles)
    and fp16 buffers under bf16 activations (2 bits per channel), with the clamped and the
    non-finite sample: one compile per op and dtype (bf16 buffers differ from fp16 ones
    only in the cast: compiled in test_kernels_quant.py's aqsgd_decode_stage)."""
    for dtype, buffer_dtype, bits, granularity, stochastic in _CASES[0:4:3]:
        x, table, index = _case(dtype, buffer_dtype, seed=10)
        seed = Q.draw_seed(x.device, torch.Generator().manual_seed(4)) if stochastic else None
        kernels.set_mode("off")
        eager = _fused(x, table, index, seed, bits, granularity, torch.float32)
        kernels.set_mode("on")
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            compiled = _fused(x, table, index, seed, bits, granularity, torch.float32)
        kernels.set_mode(None)
        what = f"{buffer_dtype} compiled vs eager"
        _same_payload(eager[0], compiled[0], 3, SEQ, HIDDEN, bits, granularity, what)
        assert_same(eager[1:], compiled[1:], what)
        assert compiled[3].tolist() == [True, True, False]
        assert compiled[4].tolist() == [False, _clamps(dtype, buffer_dtype), False]


def _pair(where="device", num=NUM, tmp=None, **options):
    samples = fixed_samples(num, MBS, NMB, SEQ)
    cfg = AQSGDConfig(buffer=where, buffer_dir=str(tmp) if tmp else "", **options)
    codecs = AQSGDCodec(cfg, None), AQSGDCodec(cfg, None)
    for codec, stage, tag in zip(codecs, (0, 1), "ab"):
        codec.allocate(
            samples,
            SEQ,
            HIDDEN,
            stage=stage,
            num_stages=2,
            device=torch.device("cpu"),
            file_tag=tag,
        )
    return codecs


def _run(schedule, spikes=(), skipped=(), where="device", num=NUM, tmp=None, **options):
    """Steps of ``schedule`` (per step, per microbatch: sample ids), announced by
    ``begin_step``; ``spikes``: (step, sample) whose activation holds an inf; ``skipped``:
    steps not committed. Returns every payload and output, and the codecs."""
    sender, receiver = _pair(where, num, tmp, **options)
    records = []
    for step, microbatches in enumerate(schedule):
        for codec in (sender, receiver):
            codec.begin_step(lambda mb, step=step: torch.tensor(schedule[step][mb]))
        for mb, ids in enumerate(microbatches):
            ids = torch.tensor(ids)
            gen = torch.Generator().manual_seed(100 * step + mb)
            x = torch.randn(SEQ, MBS, HIDDEN, generator=gen) + ids.view(1, -1, 1).float()
            for i, sample in enumerate(ids.tolist()):
                if (step, sample) in spikes:
                    x[2, i, 3] = float("inf")
            ctx = P2PContext("forward", mb, ids, step, False)
            receiver.payload_spec(tuple(x.shape), x.dtype, ctx)
            payload = sender.encode(x, ctx)
            records.append((payload, receiver.decode(payload, ctx, tuple(x.shape), x.dtype)))
        for codec in (sender, receiver):
            codec.end_step(commit=step not in skipped)
    return records, sender, receiver


def _rows(codec, side):
    buffers = getattr(codec, side)
    return buffers.contents(), buffers.visited.clone()


@pytest.mark.filterwarnings("ignore:aqsgd")
def test_boundary_compiled_equals_eager():
    """fp32, 4 bits per channel, stochastic rounding: first visits, revisits (one of them
    non-finite), a skipped step; everything bit for bit, both sides identical."""
    schedule = [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[1, 0], [3, 2]],
        [[5, 4], [7, 6]],
        [[2, 3], [0, 1]],
    ]
    runs = []
    for mode in ("off", "on"):
        kernels.set_mode(mode)
        runs.append(_run(schedule, spikes={(2, 3)}, skipped={3}, rounding="stochastic"))
    kernels.set_mode(None)
    (eager, e_s, e_r), (compiled, c_s, c_r) = runs
    for i, ((pa, oa), (pb, ob)) in enumerate(zip(eager, compiled)):
        if i < 2 * NMB:  # first visits: raw activations
            assert_same(pa, pb, f"transfer {i}")
        else:
            _same_payload(pa, pb, MBS, SEQ, HIDDEN, 4, "channel", f"transfer {i}")
        assert_same(oa, ob, f"activation {i}")
    _e, _c = _rows(e_s, "send"), _rows(c_s, "send")
    assert_same(_e, _c, "sender buffer")
    assert_same(_rows(e_r, "recv"), _c, "receiver buffer (compiled) vs sender (eager)")
    assert_same(_rows(c_r, "recv"), _c, "both sides compiled")
    assert torch.isfinite(_c[0]).all() and _c[1].all()


@pytest.mark.filterwarnings("ignore:aqsgd")
def test_a_slot_written_twice_in_a_step_ends_as_with_staged_rows(tmp_path):
    """4 fixed samples, 2 microbatches of 2 per step, every slot twice in step 2 (revisits
    of step 1's first visits), once with a non-finite second visit: device buffers (deferred
    in-place updates) end as host buffers (rows gathered, updates staged) do."""
    schedule = [[[0, 1], [2, 3]], [[1, 0], [1, 0]], [[2, 3], [3, 2]], [[0, 1], [2, 3]]]
    spikes = {(1, 1), (2, 2)}  # step 1: sample 1's second visit; step 2: 2's second one
    device = _run(schedule, spikes, where="device", num=4)
    host = _run(schedule, spikes, where="host", num=4)
    for i, (a, b) in enumerate(zip(device[0], host[0])):
        assert_same(a, b, f"transfer {i}")
    for d, h, side in ((device[1], host[1], "send"), (device[2], host[2], "recv")):
        assert_same(_rows(d, side), _rows(h, side), side)
    assert torch.equal(device[1].send.contents(), device[2].recv.contents())
