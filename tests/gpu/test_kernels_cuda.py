"""Every compressor and codec on the device under test equals its CPU result.

Each test feeds the same inputs (drawn on the CPU from a seeded generator, then moved) to
megatron_ext's real code paths once on the CPU (the reference) and once on the device under
test (``tests/gpu/conftest.py``: CUDA, or the CPU in the dry run), and compares outputs and
the state carried between steps (error feedback, warm starts, selections, moments) by
``||out - ref|| / ||ref||``: fp32 within ``1e-5`` with TF32 off, bf16 within ``1e-2``.

Random draws: SEPARATE's projection, PowerSGD's initial ``Q`` and the Protocol subspace's
``T_fixed`` are drawn *on their device* by design (``compressors/seeding.py``
``device_generator``: CPU and CUDA generators give different numbers), so the end-to-end
comparisons draw them on the CPU for both runs (the functions are wrapped to draw on the
CPU and move the result) and the device's own draw is checked separately for its
properties (orthonormal columns scaled by ``sqrt(c)``, reproducible, identical for identical
arguments). Quantizers are compared with nearest rounding (the deterministic path);
stochastic rounding, whose noise comes from the device's generator, is checked for
unbiasedness statistically. Top-k selections are compared as index sets (ties tolerated up
to a small fraction).

Covered: the DP reducers (SEPARATE, PowerSGD, quantized, Radius; fp32 and bf16 buckets),
SEPARATE's and PowerSGD's own device draws, the k-bit quantizer, QuantizedAdam (reducer and
optimizer override), the AQ-SGD and DirectQ codecs, the Protocol subspace codec and
Grassmann step, Grass's backward, selection and optimizer write-back.

Reducers run their launch / wait / end_step path on a world-size-1 process group (gloo for
CPU tensors, NCCL for CUDA tensors), as training drives them. Every device run is recorded
by :class:`tests.gpu.syncs.SyncRecorder`: its steady steps (all but the steps strict-device
mode declares ``sync_ok``: Radius's and Grass's selections, the codecs' ``begin_step``,
QuantizedAdam's warm-up) must show no synchronization from megatron_ext code.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tests.gpu.syncs import SyncRecorder, append_report

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def rel(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64 on the CPU (0 when both are zero)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num if den == 0 else num / den


def assert_close(out, ref, dtype, what):
    err = rel(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e}"


def randn(*shape, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def step_(recorder, name, steady=True):
    """``recorder.step`` (the device run), or nothing (the CPU reference)."""
    return recorder.step(name, steady=steady) if recorder else contextlib.nullcontext()


def check_syncs(recorder):
    """Report the device run's syncs; its steady steps must show none from megatron_ext."""
    append_report(recorder.summary())
    syncs = recorder.ext_syncs()
    assert not syncs, f"{recorder.run}: megatron_ext synchronized:\n" + "\n".join(syncs)


def flat_state(state, prefix=""):
    """Tensors of a (nested) state dict keyed by path."""
    out = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_state(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat_state(v, f"{prefix}/{i}"))
    return out


@pytest.fixture
def cpu_draws(monkeypatch):
    """SEPARATE's projection and PowerSGD's initial Q drawn on the CPU, then moved: both
    devices then use the same matrices (their own draws are checked separately)."""
    from megatron_ext.collectives import powersgd, separate
    from megatron_ext.compressors import lowrank, separate as sep_math

    def projection_block(*args, device=None, **kwargs):
        return sep_math.projection_block(*args, device=None, **kwargs).to(device)

    def initial_q(seed, fqn, step, cols, rank, device):
        return lowrank.initial_q(seed, fqn, step, cols, rank, None).to(device)

    monkeypatch.setattr(separate, "projection_block", projection_block)
    monkeypatch.setattr(powersgd, "initial_q", initial_q)


# -- data-parallel reducers: bind, launch, wait, end_step ----------------------------------

PARAMS = [("w1", (8, 64)), ("b1", (64,)), ("w2", (16, 32)), ("ln", (32,))]
PAD = 24
DP_METHODS = {
    "separate": ({"ratio": 4, "block_size": 32, "reset_interval": 3}, 5),
    "powersgd": ({"approx_rank": 2, "start_step": 1}, 4),
    "quantized": ({"bits": 4, "block_size": 32}, 3),
    "radius": ({"density": 0.25, "interval": 3, "dense_steps": 1}, 6),
}


def _radius_view(slices, step, device):
    """AdamW moments of every parameter (Radius's selection input), seeded, on ``device``."""
    from megatron_ext.protocols import ParamOptimState
    from tests.helpers.views import SlicesView

    def state(i, fqn, n):
        return ParamOptimState(
            fqn=fqn,
            model_param=torch.zeros(n, device=device),
            main_param=randn(n, seed=1000 + 10 * step + i, device=device),
            state={
                "exp_avg": randn(n, seed=2000 + 10 * step + i, device=device),
                "exp_avg_sq": randn(n, seed=3000 + 10 * step + i, device=device).abs(),
                "step": torch.tensor(float(step + 1)),
            },
            group={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
        )

    return SlicesView(slices, step, state)


def _dp_run(method, device, dtype, recorder=None):
    """Reduced buckets of every step and the final state of ``method``'s reducer."""
    from tests.helpers.reducers import bind, make_reducer, param_slices

    kw, steps = DP_METHODS[method]
    slices, n = param_slices(PARAMS)
    grad = torch.zeros(n + PAD, dtype=dtype, device=device)
    reducer = make_reducer(method, **kw)
    bound = bind(reducer, grad, slices, key="bucket", async_op=True)
    outs = []
    for step in range(steps):
        grad.zero_()
        grad[:n].copy_(randn(n, seed=step, dtype=dtype, device=device))
        view = None
        selecting = method == "radius" and step >= kw["dense_steps"]
        selecting = selecting and (step - kw["dense_steps"]) % kw["interval"] == 0
        if selecting:
            view = _radius_view(slices, step, device)
        # As strict-device mode: every step is steady but Radius's selections.
        with step_(recorder, f"step{step}", not selecting):
            handle = bound.launch(step)
            if handle is not None:
                handle.wait()
            if selecting:
                reducer.select(view)
            reducer.end_step(True)
        outs.append(grad.detach().double().cpu().clone())
    state = {k: v.detach().cpu().clone() for k, v in flat_state(reducer.state_dict()).items()}
    return outs, state


def dp_run_against(method, dev, dtype, reference, tag=""):
    """Run ``method``'s reducer on ``dev`` (recorded as ``reducer METHOD DTYPE{tag}``) and
    compare each step's reduced bucket with ``reference`` (:func:`_dp_run`'s result); returns
    the final state, the reference's (the same keys) and the recorder."""
    ref_out, ref_state = reference
    recorder = SyncRecorder(f"reducer {method} {str(dtype)[6:]}{tag}", dev)
    out, state = _dp_run(method, dev, dtype, recorder)
    for step, (o, r) in enumerate(zip(out, ref_out)):
        assert_close(o, r, dtype, f"{method}{tag} step {step} reduced bucket")
    assert set(state) == set(ref_state)
    return state, ref_state, recorder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", list(DP_METHODS))
def test_dp_reducer_on_device_equals_cpu(method, dtype, dev, pg, cpu_draws):
    reference = _dp_run(method, torch.device("cpu"), dtype)
    state, ref_state, recorder = dp_run_against(method, dev, dtype, reference)
    for key, value in state.items():
        ref = ref_state[key]
        if ref.dtype == torch.bool or not ref.is_floating_point():
            # selections / masks / counters: identical up to ties (a few entries)
            mismatch = (value != ref).double().mean().item()
            assert mismatch <= 0.01, f"{method} state {key}: {mismatch:.2%} entries differ"
        else:
            if method == "powersgd" and key.startswith("/q/"):
                # The warm start Q's columns come out of a QR: a column's sign is the QR
                # library's convention (LAPACK vs cuSOLVER), and P Q^T does not depend on it.
                sign = torch.sign((value.double() * ref.double()).sum(-2, keepdim=True))
                value = value * torch.where(sign == 0, 1.0, sign).to(value.dtype)
            # error feedback, warm start, moments: fp32 state even for bf16 gradients
            assert_close(value, ref, dtype, f"{method} state {key}")
    check_syncs(recorder)


def test_separate_projection_drawn_on_device_is_an_orthonormal_block(dev):
    """The device's own draw of Omega (no CPU copy): columns orthonormal scaled by sqrt(c),
    reproducible for the same arguments, fresh for another step."""
    from megatron_ext.compressors.separate import projection_block

    c, k = 64, 16
    omega = projection_block(7, 3, "bucket#0/r4", c, k, device=dev).double()
    assert omega.device.type == dev.type and omega.shape == (c, k)
    gram = omega.t() @ omega / c
    assert rel(gram, torch.eye(k, dtype=torch.float64)) < 1e-5
    again = projection_block(7, 3, "bucket#0/r4", c, k, device=dev)
    assert torch.equal(again.double(), omega)
    other = projection_block(7, 4, "bucket#0/r4", c, k, device=dev).double()
    assert rel(other, omega) > 0.5


def test_powersgd_initial_q_drawn_on_device_is_orthonormal(dev):
    from megatron_ext.compressors.lowrank import initial_q

    q = initial_q(5, "w1", 0, 48, 4, dev).double()
    assert rel(q.t() @ q, torch.eye(4, dtype=torch.float64)) < 1e-5
    assert torch.equal(initial_q(5, "w1", 0, 48, 4, dev).double(), q)


# -- QuantizedAdam: momentum exchange and the optimizer override --------------------------

QA_SHAPES = [("w1", (24, 40)), ("b1", (40,)), ("w2", (16, 24))]
QA_WARMUP, QA_STEPS = 2, 6


def _quantized_adam_run(device, recorder=None):
    """QuantizedAdam's reducer and optimizer hook on an AdamW over three parameters
    (as ``tests/distributed/test_quantized_adam.py`` drives them): parameters and moments
    after every step."""
    from megatron_ext.collectives.quantized_adam import QuantizedAdamHook
    from megatron_ext.protocols import ParamOptimState
    from megatron_ext.state import StepClock
    from tests.helpers.reducers import bind, make_reducer, param_slices

    slices, n = param_slices(QA_SHAPES)
    params = {
        fqn: torch.nn.Parameter(randn(*shape, seed=i, device=device))
        for i, (fqn, shape) in enumerate(QA_SHAPES)
    }
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    reducer = make_reducer("quantized-adam", bits=2, block_size=64, warmup_steps=QA_WARMUP)
    buffer = torch.zeros(n, device=device)
    bound = bind(reducer, buffer, slices)
    hook = QuantizedAdamHook(reducer.cfg, reducer)
    clock = StepClock()

    class View:
        def fqns(self):
            return sorted(params)

        def param_state(self, fqn):
            p = params[fqn]
            return ParamOptimState(
                fqn=fqn,
                model_param=p,
                main_param=p,
                state=opt.state[p],
                group=opt.param_groups[0],
            )

        @property
        def step(self):
            return clock.step

    view = View()
    outs, compressed = [], 0
    for t in range(QA_WARMUP + QA_STEPS):
        clock.step = t
        buffer.copy_(randn(n, seed=100 + t, device=device))
        compressing = reducer.compressing()
        compressed += compressing
        # the warm-up and the first compressed step (moments frozen, residuals allocated)
        # are not steady
        with step_(recorder, f"step{t}", compressing and t > QA_WARMUP):
            handle = bound.launch(t)
            if handle is not None:
                handle.wait()
            bound.end_step(True)
            for sl in slices:
                params[sl.fqn].grad = buffer[sl.start : sl.end].view(sl.shape).clone()
            override = hook.update_override(view)
            if override is None:
                opt.step()
            else:
                override(view.fqns())
            hook.post_step(view, True)
        for fqn in view.fqns():
            st = opt.state[params[fqn]]
            outs += [params[fqn].detach().cpu().clone(), st["exp_avg"].detach().cpu().clone()]
    return outs, compressed


def test_quantized_adam_on_device_equals_cpu(dev, pg):
    ref, compressed = _quantized_adam_run(torch.device("cpu"))
    assert compressed == QA_STEPS
    recorder = SyncRecorder("quantized-adam (reducer + optimizer hook)", dev)
    out, _ = _quantized_adam_run(dev, recorder)
    for i, (o, r) in enumerate(zip(out, ref)):
        # the momentum travels as 2-bit codes: a code on a rounding boundary may differ
        assert rel(o, r) <= 1e-4, f"quantized-adam output {i}: {rel(o, r):.3e}"
    check_syncs(recorder)


# -- quantizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("granularity", ["channel", "token"])
def test_quantize_nearest_on_device_equals_cpu(bits, granularity, dev):
    from megatron_ext.compressors.quantize import dequantize, quantize

    x = randn(6, 32, 48, seed=bits)
    ref = quantize(x, bits, granularity=granularity)
    q = quantize(x.to(dev), bits, granularity=granularity)
    assert torch.equal(q.scales.cpu(), ref.scales)
    # codes: equal but for values on a rounding boundary where the fp32 division differs
    mismatch = (q.codes.cpu() != ref.codes).double().mean().item()
    assert mismatch <= 1e-3, f"{mismatch:.2%} codes differ"
    assert rel(dequantize(q), dequantize(ref)) <= 1e-3


def test_quantize_stochastic_on_device_is_unbiased(dev):
    """Stochastic rounding draws its noise from the device's generator (CPU and CUDA draws
    differ), so it is checked statistically: the mean of many roundings is ``x``."""
    from megatron_ext.compressors.quantize import dequantize, quantize

    x = randn(4, 64, seed=3, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    draws = torch.stack(
        [
            dequantize(quantize(x, 4, granularity="token", stochastic=True, generator=gen))
            for _ in range(400)
        ]
    )
    nearest = dequantize(quantize(x, 4, granularity="token"))
    level = x.abs().amax(-1, keepdim=True) / 8
    # The mean is within ~4 standard errors of x (each draw errs by at most one level),
    # except above the top code (7 levels), where the codes clamp: biased by design.
    inside = x < 7 * level
    error = (draws.mean(0) - x).abs()
    assert (error <= 4 * level / math.sqrt(400) + 1e-6)[inside].all()
    assert ((draws - nearest).abs() > 0).any()  # it is not nearest rounding


# -- AQ-SGD and DirectQ codecs (pipeline activations), both directions -----------------------

SEQ, HIDDEN, MBS, NMB, NUM = 8, 16, 2, 2, 8


def _codec_run(method, device, recorder=None):
    """Decoded activations and gradients of two epochs of steps (first visits, then
    quantized deltas for AQ-SGD) and the codecs' final state."""
    from megatron_ext.collectives.aqsgd import AQSGDCodec, DirectQCodec
    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.methods.aqsgd import AQSGDConfig
    from tests.helpers.aqsgd_samples import fixed_samples

    cfg = AQSGDConfig(rounding="nearest")
    cls = AQSGDCodec if method == "aqsgd" else DirectQCodec
    sender, receiver = cls(cfg, None), cls(cfg, None)
    if method == "aqsgd":
        samples = fixed_samples(NUM, MBS, NMB, SEQ)
        for codec, stage in ((sender, 0), (receiver, 1)):
            codec.allocate(samples, SEQ, HIDDEN, stage=stage, num_stages=2, device=device)
    outs = []
    for step in range(2 * NUM // (NMB * MBS)):
        base = (step * NMB * MBS) % NUM

        def ids_of(mb, base=base):
            return torch.arange(base + mb * MBS, base + (mb + 1) * MBS)

        # begin_step may copy the step's sample ids to the device and read the previous
        # commit's visit flags (AQ-SGD; declared in strict-device mode): not steady.
        with step_(recorder, f"begin_step{step}", False):
            sender.begin_step(ids_of)
            receiver.begin_step(ids_of)
        for mb in range(NMB):
            seed = 100 * step + mb
            x = randn(SEQ, MBS, HIDDEN, seed=seed, device=device)
            g = randn(SEQ, MBS, HIDDEN, seed=seed + 50, device=device)
            fwd = P2PContext("forward", mb, ids_of(mb), step, False)
            bwd = P2PContext("backward", mb, ids_of(mb), step, False)
            with step_(recorder, f"microbatch{step}.{mb}"):
                receiver.payload_spec(tuple(x.shape), x.dtype, fwd)
                y = receiver.decode(sender.encode(x, fwd), fwd, tuple(x.shape), x.dtype)
                gy = sender.decode(receiver.encode(g, bwd), bwd, tuple(g.shape), g.dtype)
            outs += [y.detach().cpu().clone(), gy.detach().cpu().clone()]
        with step_(recorder, f"end_step{step}"):
            sender.end_step()
            receiver.end_step()
    state = {}
    for name, codec in (("sender", sender), ("receiver", receiver)):
        for k, v in flat_state(codec.state_dict()).items():
            state[name + k] = v.detach().cpu().clone()
    return outs, state


@pytest.mark.parametrize("method", ["aqsgd", "directq"])
def test_pipeline_codec_on_device_equals_cpu(method, dev):
    ref_out, ref_state = _codec_run(method, torch.device("cpu"))
    recorder = SyncRecorder(f"codec {method}", dev)
    out, state = _codec_run(method, dev, recorder)
    assert len(out) == len(ref_out)
    for i, (o, r) in enumerate(zip(out, ref_out)):
        # quantized payloads: a code on a rounding boundary may differ by one level
        assert rel(o, r) <= 1e-3, f"{method} payload {i}: {rel(o, r):.3e}"
    assert set(state) == set(ref_state)
    for key, value in state.items():
        if value.is_floating_point():
            assert rel(value, ref_state[key]) <= 1e-3, key
        else:
            assert torch.equal(value, ref_state[key]), key
    check_syncs(recorder)


# -- Protocol Models: subspace codec and Grassmann step --------------------------------------

D, K, VOCAB = 32, 4, 16


def test_subspace_codec_and_grassmann_step_on_device_equal_cpu(dev):
    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.collectives.subspace import SubspaceCodec
    from megatron_ext.compressors.subspace import Subspace, grassmann_step, project

    def run(device, recorder=None):
        sub = Subspace(D, K, seed=0)
        sub.make_fixed(VOCAB, 0.02, torch.float32, "cpu")  # T_fixed from the CPU generator
        sub.on(device)
        first = SubspaceCodec(sub, sends_forward=True, accumulate=False)
        last = SubspaceCodec(sub, sends_forward=False, accumulate=True)
        shape = (8, 2, D)
        outs = []
        for step in range(3):
            first.begin_step(None)
            last.begin_step(None)
            for mb in range(2):
                fwd = P2PContext("forward", mb, None, step, False)
                bwd = P2PContext("backward", mb, None, step, False)
                ids = torch.randint(
                    VOCAB, shape[:2], generator=torch.Generator().manual_seed(step * 10 + mb)
                ).to(device)
                x = project(randn(*shape, seed=step * 10 + mb, device=device), sub.u, 2)
                g = randn(*shape, seed=500 + step * 10 + mb, device=device)
                with step_(recorder, f"microbatch{step}.{mb}"):
                    first.push_token_ids(ids)
                    last.payload_spec(shape, x.dtype, fwd)
                    y = last.decode(first.encode(x, fwd), fwd, shape, x.dtype)
                    gx = first.decode(last.encode(g, bwd), bwd, shape, g.dtype)
                outs += [y.cpu(), gx.cpu()]
        a = sub.a if sub.a is not None else torch.zeros(D, D, device=device)
        outs += [a.cpu(), grassmann_step(sub.u, a, 0.5).cpu()]
        return outs

    recorder = SyncRecorder("codec protocol", dev)
    ref, out = run(torch.device("cpu")), run(dev, recorder)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert_close(o, r, torch.float32, f"protocol output {i}")
    check_syncs(recorder)


# -- Grass: forward/backward with the selection, sketch selection, optimizer write-back -----

from tests.helpers.grass import GRASS_K, GrassView, grass_setup  # noqa: E402


def _grass_run(method, reset, device, recorder=None):
    from megatron_ext.autograd.grass import grass_linear

    layers, hook = grass_setup(
        method, reset, device, lambda i, shape: randn(*shape, seed=i, device=device)
    )
    view = GrassView(layers)
    outs = []
    for step in range(2 * GRASS_K + 1):
        view.step = step
        xs = [randn(4, 16, seed=100 * step + mb, device=device).requires_grad_() for mb in (0, 1)]
        # Selection steps (every GRASS_K) are declared sync_ok in strict-device mode.
        with step_(recorder, f"step{step}", not hook.schedule.is_selection_step(step)):
            hook.begin_step(step)
            for x in xs:
                h = grass_linear(x, layers["l0.weight"].weight, None, layers["l0.weight"])
                y = grass_linear(h, layers["l1.weight"].weight, None, layers["l1.weight"])
                (y * y).sum().backward()
            hook.pre_step(view)
            for st in view.states.values():  # Adam's update of V, on the device
                p, s = st.main_param, st.state
                if p.grad is not None:
                    s["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                    s["exp_avg_sq"].mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                    p.data.addcdiv_(s["exp_avg"], s["exp_avg_sq"].sqrt().add_(1e-8), value=-1e-2)
                    p.grad = None
                s["step"] += 1
            hook.post_step(view, True)
        outs += [x.grad.detach().cpu() for x in xs]
        outs += [layer.weight.detach().cpu().clone() for layer in layers.values()]
    state = {k: v.detach().cpu().clone() for k, v in flat_state(hook.state_dict()).items()}
    return outs, state


@pytest.mark.parametrize(
    "method, reset",
    [("topr", True), ("norm", True), ("topr", False)],
    ids=["topr", "norm", "topr-keep"],
)
def test_grass_on_device_equals_cpu(method, reset, dev, pg):
    ref_out, ref_state = _grass_run(method, reset, torch.device("cpu"))
    recorder = SyncRecorder(f"grass {method}{'' if reset else ' keep-moments'}", dev)
    out, state = _grass_run(method, reset, dev, recorder)
    for i, (o, r) in enumerate(zip(out, ref_out)):
        assert_close(o, r, torch.float32, f"grass {method} output {i}")
    assert set(state) == set(ref_state)
    for key, value in state.items():
        if value.is_floating_point():
            assert_close(value, ref_state[key], torch.float32, f"grass state {key}")
        else:  # the selected rows: the same set (ties aside)
            assert torch.equal(value.sort(-1).values, ref_state[key].sort(-1).values), key
    check_syncs(recorder)
