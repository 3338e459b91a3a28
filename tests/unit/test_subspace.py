"""Protocol Models' pure-torch pieces: the subspace, the Grassmann step, the codec, the optimizer.

The codec is lossless on a subspace-confined stream in fp32, and costs about one bf16 rounding
per hop in bf16 (token ids survive bf16 packing); the
Grassmann step keeps ``U`` orthonormal and lowers the missed gradient energy, and repeated
steps find the gradients' top-k subspace; the modified AdamW keeps constrained weights in
``S`` over many steps and equals a direct implementation of AdamW with a second moment
averaged along ``d``; bad flag combinations are refused naming the flags.
"""

import pytest
import torch

from megatron_ext.collectives.p2p import P2PContext
from megatron_ext.collectives.subspace import SubspaceCodec
from megatron_ext.compressors.subspace import (
    Subspace,
    grassmann_step,
    orthonormal_basis,
    project,
    residual_energy,
)
from megatron_ext.config import ConfigError, ExtConfig, ParallelLayout, validate_ext_config
from megatron_ext.methods.protocol import SubspaceConfig
from megatron_ext.optim.subspace import SubspaceOptimizerHook
from megatron_ext.protocols import OptimizerView, ParamOptimState

FWD = P2PContext("forward", 0, None, 0, False)
BWD = P2PContext("backward", 0, None, 0, False)


def _orthonormal(u):
    eye = torch.eye(u.shape[1])
    return float((u.t() @ u - eye).abs().max())


def test_basis_is_orthonormal_and_seeded():
    u = orthonormal_basis(64, 8, seed=3)
    assert u.shape == (64, 8) and _orthonormal(u) < 1e-6
    assert torch.equal(u, orthonormal_basis(64, 8, seed=3))
    assert not torch.equal(u, orthonormal_basis(64, 8, seed=4))


def test_project_along_either_axis():
    u = orthonormal_basis(32, 4, 0)
    w = torch.randn(32, 10)  # a writer: d x n
    pw = project(w, u, 0)
    assert torch.allclose(project(pw, u, 0), pw, atol=1e-6)
    assert torch.allclose(pw, u @ (u.t() @ w), atol=1e-6)
    t = torch.randn(7, 32)  # an embedding table: vocab x d
    assert torch.allclose(project(t, u, 1), (t @ u) @ u.t(), atol=1e-6)


def _structured_a(d=32, k=4, seed=0):
    """A = sum of G^T G with a dominant k-dimensional part (not the initial subspace)."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    spectrum = torch.cat([torch.full((k,), 10.0), torch.rand(d - k, generator=gen)])
    return basis @ torch.diag(spectrum) @ basis.t(), basis[:, :k]


@pytest.mark.parametrize("lr", [0.05, 0.5])
def test_grassmann_step_keeps_u_orthonormal_and_lowers_the_objective(lr):
    a, _ = _structured_a()
    u = orthonormal_basis(32, 4, 1)
    new = grassmann_step(u, a, lr)
    assert _orthonormal(new) < 1e-5
    assert residual_energy(a, new) < residual_energy(a, u)
    assert torch.equal(grassmann_step(u, torch.zeros(32, 32), lr), u)


def test_repeated_grassmann_steps_find_the_top_k_subspace():
    a, top = _structured_a()
    u = orthonormal_basis(32, 4, 1)
    for _ in range(30):
        u = grassmann_step(u, a, 0.5)
    # the principal angles between span(u) and the top-4 eigenvectors vanish
    cosines = torch.linalg.svdvals(top.t() @ u)
    assert float(cosines.min()) > 0.999


def _subspace(d=32, k=4, vocab=50304, dtype=torch.float32):
    sub = Subspace(d, k, seed=0)
    sub.make_fixed(vocab, 0.02, dtype, "cpu")
    return sub


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_is_lossless_on_a_confined_stream_and_carries_token_ids(dtype):
    sub = _subspace(dtype=dtype)
    s, b, d, k = 16, 3, 32, 4
    ids = torch.randint(0, 50304, (s, b))
    ids[0, 0] = 50303  # the largest id survives the bit packing
    x = (sub.fixed[ids].float() + torch.randn(s, b, k) @ sub.u.t()).to(dtype)
    sender = SubspaceCodec(sub)
    sender.check_residual = True
    sender.push_token_ids(ids)
    payload = sender.encode(x, FWD)
    shape, pdtype = sender.payload_spec((s, b, d), dtype, FWD)
    ids_elems = 4 // torch.empty((), dtype=dtype).element_size()
    assert payload.shape == shape == (s * b * (k + ids_elems),) and payload.dtype == pdtype
    receiver = SubspaceCodec(sub, sends_forward=True)
    out = receiver.decode(payload, FWD, (s, b, d), dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), x.float(), atol=tol, rtol=tol)
    assert sender.max_residual < (1e-5 if dtype == torch.float32 else 1e-2)
    # the middle stage sends the ids on with its own activation
    again = receiver.encode(out, FWD)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaN patterns != NaN
    assert torch.equal(again[s * b * k :].view(bits), payload[s * b * k :].view(bits))


def test_bf16_round_trip_costs_about_one_bf16_rounding():
    """In bf16 the codec is lossless only up to rounding: the ``k`` coordinates and the
    rebuilt stream are rounded to the wire dtype. Against the exact (fp32) stream, a round
    trip's relative error is 1.43x that of the bf16 stream itself (forward: 2.36e-3 vs
    1.66e-3) and 1.42x a bf16 rounding of the projected gradient (backward), measured at
    d 256, k 32 (the same at d 64 / 1024, k 3 / 8 / 160): about one more bf16 rounding
    per hop. The bound (2x) fails if that error grows."""
    d, k, s, b = 256, 32, 64, 4
    sub = Subspace(d, k, seed=0)
    sub.make_fixed(1000, 0.02, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (s, b), generator=gen)
    exact = sub.fixed[ids].float() + torch.randn(s, b, k, generator=gen) @ sub.u.t()
    x = exact.to(torch.bfloat16)
    sender = SubspaceCodec(sub)
    sender.push_token_ids(ids)
    payload = sender.encode(x, FWD)
    out = SubspaceCodec(sub, sends_forward=True).decode(payload, FWD, (s, b, d), x.dtype)
    stream = float((x.float() - exact).norm() / exact.norm())
    trip = float((out.float() - exact).norm() / exact.norm())
    assert 1e-3 < stream < 2.5e-3 and trip < 2 * stream, (stream, trip)
    g = torch.randn(s, b, d, generator=gen).to(torch.bfloat16)
    codec = SubspaceCodec(sub, sends_forward=False)
    back = codec.decode(codec.encode(g, BWD), BWD, (s, b, d), g.dtype)
    pg = project(g.float(), sub.u, 2)
    rounding = float((pg.to(torch.bfloat16).float() - pg).norm() / pg.norm())
    trip = float((back.float() - pg).norm() / pg.norm())
    assert trip < 2 * rounding, (rounding, trip)


def test_codec_backward_sends_g_u_and_accumulates_the_gradients():
    sub = _subspace(vocab=16)
    g = torch.randn(8, 2, 32)
    codec = SubspaceCodec(sub, sends_forward=False, accumulate=True)
    payload = codec.encode(g, BWD)
    assert payload.shape == codec.payload_spec((8, 2, 32), torch.float32, BWD)[0] == (64,)
    out = codec.decode(payload, BWD, (8, 2, 32), torch.float32)
    assert torch.allclose(out, project(g, sub.u, 2), atol=1e-6)
    assert sub.a is None  # staged until the optimizer applies the step
    sub.end_step(True)
    flat = g.reshape(-1, 32)
    assert torch.allclose(sub.a, flat.t() @ flat, atol=1e-5)
    # the objective is the energy outside S of the gradients sent
    missed = float(((g - out) ** 2).sum())
    assert residual_energy(sub.a, sub.u) == pytest.approx(missed, rel=1e-4)


def test_codec_refuses_a_send_without_token_ids():
    codec = SubspaceCodec(_subspace(vocab=16))
    with pytest.raises(RuntimeError, match="no token ids"):
        codec.encode(torch.randn(4, 1, 32), FWD)


class _View(OptimizerView):
    def __init__(self, params, opt):
        self.params, self.opt, self._step = params, opt, 0

    def fqns(self):
        return sorted(self.params)

    def param_state(self, fqn):
        p = self.params[fqn]
        group = self.opt.param_groups[0]
        return ParamOptimState(fqn, p, p, self.opt.state.get(p, {}), None, group)

    @property
    def step(self):
        return self._step


def _reference_adamw(w, grads, u, axis, lr, wd, betas=(0.9, 0.999), eps=1e-8):
    """AdamW with projected gradients and a second moment averaged along ``d``, directly."""
    m = torch.zeros_like(w)
    v = torch.zeros_like(w.mean(dim=axis, keepdim=True))
    for t, g in enumerate(grads, 1):
        g = project(g, u, axis)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * (g * g).mean(dim=axis, keepdim=True)
        mh, vh = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        w = w * (1 - lr * wd) - lr * mh / (vh.sqrt() + eps)
    return w


@pytest.mark.parametrize("axis", [0, 1])
def test_modified_adamw_keeps_weights_in_s_and_matches_the_direct_form(axis):
    torch.manual_seed(0)
    sub = Subspace(32, 4, seed=0)
    shape = (32, 12) if axis == 0 else (12, 32)
    w0 = project(torch.randn(shape), sub.u, axis)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
    hook = SubspaceOptimizerHook(sub, {"w": axis}, update_interval=0, reproject_interval=0)
    view = _View({"w": p}, opt)
    grads = [torch.randn(shape) for _ in range(200)]
    for t, g in enumerate(grads):
        view._step = t
        p.grad = g.clone()
        hook.pre_step(view)
        opt.step()
        hook.post_step(view, True)
    drift = (p.detach() - project(p.detach(), sub.u, axis)).norm() / p.detach().norm()
    assert float(drift) < 1e-5
    ref = _reference_adamw(w0, grads, sub.u, axis, 1e-2, 0.1)
    assert torch.allclose(p.detach(), ref, atol=1e-5, rtol=1e-4)
    # the plain AdamW step (elementwise second moment) would leave S
    q = torch.nn.Parameter(w0.clone())
    plain = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for g in grads[:5]:
        q.grad = project(g, sub.u, axis)
        plain.step()
    assert float((q.detach() - project(q.detach(), sub.u, axis)).norm()) > 1e-3


def test_subspace_update_reprojects_weights_and_first_moments():
    sub = Subspace(32, 4, seed=0)
    new_u = orthonormal_basis(32, 4, seed=9)
    p = torch.nn.Parameter(project(torch.randn(32, 6), sub.u, 0))
    opt = torch.optim.AdamW([p], lr=1e-2)
    hook = SubspaceOptimizerHook(
        sub, {"w": 0}, update_interval=2, reproject_interval=0, update_basis=lambda: new_u
    )
    view = _View({"w": p}, opt)
    for t in range(2):
        view._step = t
        p.grad = torch.randn(32, 6)
        hook.pre_step(view)
        opt.step()
        hook.post_step(view, True)
    assert torch.equal(sub.u, new_u) and sub.updates == 1
    for t in (p.detach(), opt.state[p]["exp_avg"]):
        assert float((t - project(t, new_u, 0)).norm()) < 1e-5 * float(t.norm())


def test_a_skipped_step_leaves_the_grassmann_objective_as_it_was():
    """An fp16 step that overflows sends infinite boundary gradients; the optimizer skips it,
    and A (from which the next subspace is computed) must not absorb them."""
    sub = Subspace(32, 4, seed=0)
    g = torch.randn(5, 32)
    sub.accumulate(g)
    sub.end_step(True)
    before = sub.a.clone()
    sub.accumulate(torch.full((5, 32), float("inf")))
    sub.end_step(False)
    assert torch.equal(sub.a, before) and sub.accumulated == 1
    sub.accumulate(g)
    sub.end_step(True)
    assert torch.allclose(sub.a, 2 * before) and sub.accumulated == 2


def test_subspace_state_round_trip_and_mismatch():
    sub = Subspace(32, 4, seed=0)
    sub.accumulate(torch.randn(5, 32))
    sub.end_step(True)
    sub.set_basis(orthonormal_basis(32, 4, 5))
    sub.accumulate(torch.randn(5, 32))
    sub.end_step(True)
    other = Subspace(32, 4, seed=0)
    other.load_state_dict(sub.state_dict())
    assert torch.equal(other.u, sub.u) and torch.equal(other.a, sub.a)
    assert other.updates == 1 and other.accumulated == 1
    with pytest.raises(ValueError, match="rank 4 seed 0"):
        Subspace(32, 5, seed=0).load_state_dict(sub.state_dict())


def _cfg(**opts):
    return ExtConfig.of(
        subspace="protocol", **opts.pop("methods", {}), options=[SubspaceConfig(**opts)]
    )


def _layout(tp=1, pp=2, dp=1, **kw):
    return ParallelLayout(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp, **kw
    )


@pytest.mark.parametrize(
    "cfg, layout, flags",
    [
        (_cfg(), _layout(2, 2, 1, use_distributed_optimizer=True), "--use-distributed"),
        (_cfg(), _layout(1, 2, 1, virtual_pipeline_model_parallel_size=2), "--num-layers"),
        (_cfg(methods={"p2p": "aqsgd"}), _layout(1, 2, 1), "--p2p-compression"),
        (_cfg(methods={"linear": "topr"}), _layout(1, 2, 1), "--grass-method"),
        (_cfg(update_interval=10), _layout(1, 1, 2), "--subspace-update-interval"),
        (_cfg(), _layout(1, 2, 1, transformer_impl="transformer_engine"), "--transf"),
    ],
)
def test_unsupported_combinations_are_refused_naming_the_flags(cfg, layout, flags):
    with pytest.raises(ConfigError, match="--subspace-") as err:
        validate_ext_config(cfg, layout)
    assert flags in str(err.value)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"compression_rate": 0.5}, "--subspace-compression-rate"),
        ({"min_rank": -1}, "--subspace-min-rank"),
        ({"lr": 0.0}, "--subspace-lr"),
        ({"rank": -1}, "--subspace-rank"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        SubspaceConfig(**kwargs)


def test_rank_from_the_compression_rate():
    assert SubspaceConfig().rank_for(4096) == 41  # the paper's rate where it gives >= 32
    assert SubspaceConfig().rank_for(8192) == 82
    # small models: at least --subspace-min-rank, at most a quarter of d
    assert SubspaceConfig().rank_for(256) == 32
    assert SubspaceConfig().rank_for(1024) == 32
    assert SubspaceConfig().rank_for(64) == 16
    assert SubspaceConfig(min_rank=0).rank_for(256) == 3  # the rate alone
    assert SubspaceConfig(min_rank=0).rank_for(64) == 1
    assert SubspaceConfig(compression_rate=4).rank_for(256) == 64
    assert SubspaceConfig(rank=5).rank_for(256) == 5


def test_optimizer_step_keeps_no_full_size_copy_of_a_constrained_weight():
    """The hook keeps the k coordinates of a weight before the step, not a clone
    (2 GB for a 128k x 4096 fp32 embedding), and projects gradients, first moments and
    weights in place: no op in pre_step / post_step (with a re-projection) allocates a
    tensor the size of the weight."""
    from tests.helpers.dispatch import OpRecorder

    torch.manual_seed(0)
    sub = Subspace(32, 4, seed=0)
    shapes = {"embedding": ((512, 32), 1), "writer": ((32, 512), 0), "bias": ((32,), 0)}
    params = {
        fqn: torch.nn.Parameter(project(torch.randn(shape), sub.u, axis).contiguous())
        for fqn, (shape, axis) in shapes.items()
    }
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    constrained = {fqn: axis for fqn, (_, axis) in shapes.items()}
    hook = SubspaceOptimizerHook(sub, constrained, update_interval=0, reproject_interval=2)
    view = _View(params, opt)
    recorders = []
    for t in range(2):  # the second step re-projects
        view._step = t
        for p in params.values():
            p.grad = torch.randn(p.shape)
        with OpRecorder() as rec:
            hook.pre_step(view)
        opt.step()
        with rec:
            hook.post_step(view, True)
        recorders.append(rec)
    for rec in recorders:
        # the coordinates (512 x 4) are allowed; nothing of the weights' 512 x 32
        assert rec.ops and not rec.fresh_allocations(512 * 32), rec.fresh_allocations(512 * 32)
    for fqn, (shape, axis) in shapes.items():
        p = params[fqn].detach()
        assert p.shape == shape
        assert float((p - project(p, sub.u, axis)).norm()) < 1e-5 * float(p.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_embedding_is_drawn_in_the_model_dtype_on_its_device(dtype):
    """T_fixed comes from the device's own generator in the model's dtype: no fp32
    table and no copy (formerly drawn in fp32 on the CPU, then copied and cast), and two
    subspaces of the same seed (two pipeline stages) hold the same bits."""
    from tests.helpers.dispatch import OpRecorder

    rows, d = 1000, 32
    sub = Subspace(d, 4, seed=7)
    with OpRecorder() as rec:
        fixed = sub.make_fixed(rows, 0.02, dtype, "cpu")
    assert fixed.dtype == dtype and fixed.device.type == "cpu" and fixed.shape == (rows, d)
    assert rec.ops and "_to_copy" not in rec.names() and "copy_" not in rec.names()
    assert {dt for _, dt in rec.fresh_allocations(rows * d)} == {dtype}
    other = Subspace(d, 4, seed=7).make_fixed(rows, 0.02, dtype, "cpu")
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(fixed.view(bits), other.view(bits))
    assert float(fixed.float().std()) == pytest.approx(0.02, rel=0.05)
    assert not torch.equal(fixed, Subspace(d, 4, seed=8).make_fixed(rows, 0.02, dtype, "cpu"))


def test_codec_and_hook_used_before_the_model_transform_name_the_cause():
    # The method builds both before the model exists; its model transform sets the subspace.
    codec = SubspaceCodec(sends_forward=True)
    hook = SubspaceOptimizerHook(None, {}, update_interval=0, reproject_interval=0)
    with pytest.raises(RuntimeError, match="SubspaceCodec used before the model transform"):
        codec.encode(torch.zeros(2, 1, 8), BWD)
    with pytest.raises(RuntimeError, match="SubspaceOptimizerHook used before the model"):
        hook.subspace
    sub = Subspace(8, 2, seed=1)
    codec.subspace = hook.subspace = sub
    assert codec.encode(torch.zeros(2, 1, 8), BWD).numel() == 2 * 2  # k coordinates a token
    # A subspace without T_fixed cannot encode a forward activation.
    codec.push_token_ids(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no T_fixed"):
        codec.encode(torch.zeros(2, 1, 8), FWD)
