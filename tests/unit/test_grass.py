"""Grass's algorithm without Megatron: selection rules, the row-sparse backward, the rows.

The projected gradient equals the rho-scaled selected rows (or columns) of the full weight
gradient for every rule; the backward passes gradcheck in float64 against the explicit
parametrization ``W = W0 + P V``; the with-replacement rules are unbiased
(``E[P P^T G] = G``); the sketch ranks rows like the exact norms; folding ``V`` into the
weight keeps the fp32 values of rows that stay selected. Fused weights (Q/K/V interleaved
per query group with GQA; SwiGLU gate/up) select each part by the paper's rule from that
part's own gradient, checked in float64 against the rule written out from the paper; and
Uniform-NR draws r distinct rows uniformly, alike on every replica.
"""

import math

import pytest
import torch

from megatron_ext.autograd.grass import (
    SELECTION_METHODS,
    GrassLayer,
    grass_linear,
    needs_sketch,
    projected_dim,
    select,
)


def _grass_layer(fqn, weight, shape, mode, rank, method, sketch_size, seed, **kw):
    """A GrassLayer over ``weight`` whose trainable parameter (``shape``) starts at zero."""
    param = torch.zeros(shape, dtype=weight.dtype, requires_grad=True)
    return GrassLayer(
        fqn=fqn,
        weight=weight,
        param=param,
        mode=mode,
        rank=rank,
        method=method,
        sketch_size=sketch_size,
        seed=seed,
        **kw,
    )


def _layer(m, n, rank, method, sketch_size=0, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    weight = torch.randn(m, n, dtype=dtype)
    mode, _ = projected_dim((m, n))
    shape = (rank, n) if mode == "row" else (m, rank)
    fqn = "decoder.layers.0.mlp.linear_fc1"
    return _grass_layer(fqn, weight, shape, mode, rank, method, sketch_size, seed)


def _projection(layer):
    """Dense P (size x r): column i is rho_i e_{index_i}."""
    p = torch.zeros(layer.size, layer.rank, dtype=torch.float64)
    p[layer.index, torch.arange(layer.rank)] = layer.rho.double()
    return p


def _full_grad(weight, x, dy):
    return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


@pytest.mark.parametrize("method", SELECTION_METHODS)
@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
def test_projected_grad_is_selected_rows_of_full_grad(method, shape):
    m, n = shape
    layer = _layer(m, n, 4, method)
    x = torch.randn(3, 7, n, dtype=torch.float64)
    dy = torch.randn(3, 7, m, dtype=torch.float64)
    g = _full_grad(layer.weight, x, dy)
    gen = torch.Generator().manual_seed(1)
    norms = (g.pow(2).sum(1) if layer.mode == "row" else g.pow(2).sum(0)).float()
    index, rho = select(norms, layer.size, 4, method, gen)
    layer.set_selection(index, rho, layer.param.data)
    out = grass_linear(x.requires_grad_(), layer.weight, None, layer)
    out.backward(dy)
    if layer.mode == "row":
        expected = g[index] * rho.double()[:, None]
    else:
        expected = g[:, index] * rho.double()[None, :]
    torch.testing.assert_close(layer.param.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, dy.matmul(layer.weight), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 8), (8, 5)])
def test_gradcheck_against_explicit_parametrization(shape):
    m, n = shape
    layer = _layer(m, n, 3, "norm2")
    gen = torch.Generator().manual_seed(2)
    index, rho = select(torch.rand(layer.size), layer.size, 3, "norm2", gen)
    layer.set_selection(index, rho, layer.param.data)
    w0 = layer.weight.clone()
    p = _projection(layer)
    bias = torch.randn(m, dtype=torch.float64, requires_grad=True)

    def f(x, v, b):
        layer.param = v
        # The weight the forward sees is W0 + P V; its gradient reaches V only through
        # Grass's backward (the projected gradient), which gradcheck compares with the
        # numerical derivative of this explicit function.
        w = w0 + (p.matmul(v) if layer.mode == "row" else v.matmul(p.t()))
        return grass_linear(x, w.detach(), b, layer)

    x = torch.randn(2, 3, n, dtype=torch.float64, requires_grad=True)
    v = torch.randn(layer.param.shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, v, bias))


@pytest.mark.parametrize("method", ["norm", "norm2", "uniform"])
def test_with_replacement_rules_are_unbiased(method):
    torch.manual_seed(0)
    m, n, r = 8, 5, 3
    g = (
        torch.randn(m, n, dtype=torch.float64)
        * torch.linspace(0.2, 3, m, dtype=torch.float64)[:, None]
    )
    norms = g.pow(2).sum(1)
    draws = 20000
    acc = torch.zeros_like(g)
    gen = torch.Generator().manual_seed(3)
    for _ in range(draws):
        index, rho = select(norms, m, r, method, gen)
        # P P^T G: row index_i receives rho_i^2 G[index_i].
        acc.index_add_(0, index, g[index] * rho.double().pow(2)[:, None])
    mean = acc / draws
    err = (mean - g).norm() / g.norm()
    assert err < 0.03, err


def test_top_r_and_without_replacement_rules():
    norms = torch.tensor([0.5, 9.0, 0.1, 4.0, 0.0, 7.0])
    gen = torch.Generator().manual_seed(0)
    index, rho = select(norms, 6, 3, "topr", gen)
    assert index.tolist() == [1, 3, 5] and rho.tolist() == [1, 1, 1]
    for method in ("norm-nr", "norm2-nr"):
        index, rho = select(norms, 6, 5, method, gen)
        assert len(set(index.tolist())) == 5 and torch.all(rho == 1)
    # every row: no sketch needed, any rule without replacement takes them all
    assert not needs_sketch("topr", 6, 6) and needs_sketch("topr", 5, 6)
    assert select(None, 6, 6, "norm2-nr", gen)[0].tolist() == list(range(6))
    with pytest.raises(ValueError, match="exceeds"):
        select(norms, 6, 7, "topr", gen)


@pytest.mark.parametrize("mode_shape", [(16, 200), (200, 16)])
def test_sketch_ranks_rows_like_exact_norms(mode_shape):
    m, n = mode_shape
    layer = _layer(m, n, 4, "topr", sketch_size=256, dtype=torch.float32)
    exact = _layer(m, n, 4, "topr", sketch_size=0, dtype=torch.float32)
    scale = torch.logspace(0, 2, layer.size)
    x = torch.randn(64, n)
    dy = torch.randn(64, m)
    if layer.mode == "row":
        dy = dy * scale
    else:
        x = x * scale
    for lay in (layer, exact):
        lay.start_sketch(0)
        for half in (slice(0, 32), slice(32, 64)):  # two microbatches sum exactly
            lay.projected_grad(dy[half], x[half])
    g = dy.t().matmul(x)
    true = g.pow(2).sum(1 if layer.mode == "row" else 0)
    torch.testing.assert_close(exact.sketch_norms(), true, rtol=1e-4, atol=1e-3)
    est = layer.sketch_norms() / layer.sketch_size
    assert (est / true - 1).abs().max() < 0.5
    # the largest rows are found by both
    top_true = set(torch.topk(true, 4).indices.tolist())
    assert set(torch.topk(est, 4).indices.tolist()) == top_true


def test_set_selection_folds_v_and_keeps_fp32_rows():
    layer = _layer(6, 9, 3, "norm", dtype=torch.bfloat16)
    v = torch.zeros(3, 9, dtype=torch.float32)
    layer.set_selection(torch.tensor([1, 4, 1]), torch.tensor([0.5, 1.0, 2.0]), v)
    assert layer.unique.tolist() == [1, 4] and layer.base.dtype == torch.float32
    v += 1e-3  # smaller than bf16 resolution of the weights around 1
    expected = layer.base.clone()
    expected[0] += (0.5 + 2.0) * 1e-3  # row 1 picked twice
    expected[1] += 1.0 * 1e-3
    torch.testing.assert_close(layer.current_rows(v), expected)
    layer.write_rows(v)
    torch.testing.assert_close(layer.weight[[1, 4]].float(), expected, rtol=1e-2, atol=1e-2)
    # row 4 stays selected: its fp32 value survives; row 0 is new: taken from the weight
    layer.set_selection(torch.tensor([0, 4, 5]), torch.ones(3), v)
    assert torch.all(v == 0)
    torch.testing.assert_close(layer.base[1], expected[1], rtol=0, atol=0)
    torch.testing.assert_close(layer.base[0], layer.weight[0].float(), rtol=0, atol=0)


def test_state_round_trip():
    layer = _layer(6, 9, 3, "norm", dtype=torch.float32)
    v = torch.zeros(3, 9)
    layer.set_selection(torch.tensor([2, 2, 5]), torch.tensor([1.0, 0.5, 0.25]), v)
    state = layer.state_dict()
    other = _layer(6, 9, 3, "norm", dtype=torch.float32)
    other.load_state_dict(state)
    assert other.index.tolist() == [2, 2, 5] and other.unique.tolist() == [2, 5]
    torch.testing.assert_close(other.base, layer.base, rtol=0, atol=0)
    bad = dict(state, base=torch.zeros(3, 9))
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(bad)


def test_rho_of_uniform_is_sqrt_size_over_rank():
    gen = torch.Generator().manual_seed(0)
    _, rho = select(None, 12, 3, "uniform", gen)
    assert torch.allclose(rho, torch.full((3,), math.sqrt(12 / 3)))


class _View:
    """An OptimizerView over one torch AdamW parameter."""

    def __init__(self, fqn, param, optimizer):
        self.fqn, self.param, self.optimizer = fqn, param, optimizer
        self.step = 0

    def param_state(self, fqn):
        from megatron_ext.protocols import ParamOptimState

        if fqn != self.fqn:
            return None
        return ParamOptimState(
            fqn=fqn,
            model_param=self.param,
            main_param=self.param,
            state=self.optimizer.state.get(self.param, {}),
            group=self.optimizer.param_groups[0],
        )


def test_subspace_adamw_with_scale_rewarmup_and_reset_matches_reference():
    """The selected rows follow AdamW on P^T G with lr * alpha * warm(t), moments restarted
    (with their own bias correction) at each selection, decoupled decay on those rows only."""
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule

    torch.manual_seed(0)
    m, n, r = 10, 12, 4  # rows 10 <= columns 12: rows are selected
    layer = _layer(m, n, r, "uniform", dtype=torch.float64)
    v = torch.nn.Parameter(torch.zeros(r, n, dtype=torch.float64))
    layer.param = v
    lr, wd, b1, b2, eps = 0.05, 0.1, 0.9, 0.99, 1e-14
    opt = torch.optim.AdamW([v], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    sched = GrassSchedule(update_interval=3, rewarmup=2, scale=0.5)
    hook = GrassOptimizerHook(
        {"w": layer}, sched, lambda flat: None, reset_state=True, param_fqn=lambda f: "v"
    )
    hook.initial_selection()
    view = _View("v", v, opt)
    ref = layer.weight.clone()
    mom = vel = None
    k = 0
    active = 0
    for step in range(8):
        view.step = step
        hook.begin_step(step)
        index, rho = layer.index.clone(), layer.rho.double()
        g = torch.randn(r, n, dtype=torch.float64)
        v.grad = g.clone()
        # reference: AdamW on the slots, restarted at each selection
        if mom is None:
            mom, vel, k = torch.zeros_like(g), torch.zeros_like(g), 0
        k += 1
        mom = b1 * mom + (1 - b1) * g
        vel = b2 * vel + (1 - b2) * g * g
        u = (mom / (1 - b1**k)) / ((vel / (1 - b2**k)).sqrt() + eps)
        lr_eff = lr * sched.lr_scale(step, active)
        unique = torch.unique(index)
        ref[unique] *= 1 - lr_eff * wd
        ref.index_add_(0, index, -lr_eff * rho[:, None] * u)
        hook.pre_step(view)
        opt.step()
        hook.post_step(view, True)
        torch.testing.assert_close(layer.weight, ref, rtol=1e-9, atol=1e-12, msg=f"step {step}")
        if step > 0 and step % 3 == 0:
            # uniform selects before step 0, then at the end of steps 3 and 6
            assert hook.selections == 1 + step // 3
            mom = None
            active = step + 1


def test_format_1_state_with_one_count_for_every_slot_loads_as_per_slot_counts():
    """A state saved at megatron-ext state format 1 before the per-slot counts (``reset_at``)
    is upgraded to ``since/<fqn>`` (megatron_ext.state.ExtState.upgrade) and loads as the
    state whose every slot has that count; the current format has no ``reset_at``."""
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule

    def hook():
        layer = _layer(10, 12, 4, "uniform", dtype=torch.float64)
        layer.param = torch.nn.Parameter(torch.zeros(4, 12, dtype=torch.float64))
        sched = GrassSchedule(update_interval=3, rewarmup=2, scale=0.5)
        out = GrassOptimizerHook(
            {"w": layer}, sched, lambda flat: None, reset_state=True, param_fqn=lambda f: "v"
        )
        out.initial_selection()
        return out

    saved = hook().state_dict()
    since = saved.pop("since/w")
    legacy = {**saved, "reset_at": 3}
    target = hook()
    with pytest.raises(ValueError, match="reset_at"):
        target.load_state_dict(legacy)
    upgraded = target.upgrade_state(legacy, 1)
    assert "reset_at" not in upgraded
    assert torch.equal(upgraded["since/w"], torch.full_like(since, 3))
    target.load_state_dict(upgraded)
    assert torch.equal(target.state_dict()["since/w"], torch.full_like(since, 3))
    assert target.upgrade_state({**saved, "since/w": since}, 2)["since/w"] is since


# -- on a GPU: the device, determinism, overflow -----------------------------------------------


class _DeviceView:
    """An OptimizerView over one parameter with no optimizer state (megatron's step done)."""

    step = 0

    def __init__(self, fqn, param, lr=0.1, weight_decay=0.1):
        self.fqn, self.param = fqn, param
        self.group = {"lr": lr, "weight_decay": weight_decay}

    def param_state(self, fqn):
        from megatron_ext.protocols import ParamOptimState

        if fqn != self.fqn:
            return None
        return ParamOptimState(fqn, self.param, self.param, {}, None, self.group)


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_steady_state_stays_on_the_device_with_no_host_sync(shape):
    """The selection lives on the weight's device: run the layer on the meta device, where
    any copy from a CPU tensor shows as an op mixing two devices and any host read raises;
    the forward, the backward and the optimizer's row write must have neither."""
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule
    from tests.helpers.dispatch import OpRecorder

    m, n = shape
    r = 4
    mode, _ = projected_dim(shape)
    weight = torch.empty(m, n, device="meta")
    v = torch.nn.Parameter(torch.zeros((r, n) if mode == "row" else (m, r), device="meta"))
    # uniform: selected from the CPU generator before step 0, with repeated rows
    layer = GrassLayer("w", weight, v, mode, r, "uniform", 0, seed=3)
    hook = GrassOptimizerHook(
        {"w": layer},
        GrassSchedule(5, 0, 0.5),
        lambda flat: None,
        reset_state=False,
        param_fqn=lambda f: "v",
    )
    hook.initial_selection()
    for t in (layer.index, layer.rho, layer.unique, layer.slots, layer.base):
        assert t.device.type == "meta"
    view = _DeviceView("v", v)
    x = torch.empty(3, 5, n, device="meta", requires_grad=True)
    with OpRecorder() as rec:
        for step in (1, 2):  # not selection steps
            view.step = step
            hook.begin_step(step)
            out = grass_linear(x, weight, None, layer)
            out.backward(torch.empty_like(out))
            hook.pre_step(view)
            hook.post_step(view, True)
    assert rec.ops, "nothing recorded"
    assert not rec.mixed_devices(), [(o.name, o.devices) for o in rec.mixed_devices()]
    assert not rec.syncs(), rec.syncs()
    assert not rec.atomics(), rec.atomics()


def test_duplicate_rows_sum_deterministically_and_equal_index_add():
    """Rows picked several times are summed without an atomic op (index_add_ is atomic and
    nondeterministic on CUDA), in slot order: bit-identical to the CPU's index_add_."""
    from tests.helpers.dispatch import OpRecorder

    torch.manual_seed(0)
    layer = _layer(8, 16, 7, "norm", dtype=torch.float32)
    index = torch.tensor([5, 1, 5, 0, 5, 1, 7])
    rho = torch.rand(7) + 0.5
    layer.set_selection(index, rho, torch.zeros(7, 16))
    v = torch.randn(7, 16)
    unique, inverse = torch.unique(index, return_inverse=True)
    reference = layer.base + torch.zeros_like(layer.base).index_add_(0, inverse, v * rho[:, None])
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with OpRecorder() as rec:
            rows = layer.current_rows(v)
            layer.write_rows(v)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert torch.equal(rows, reference)
    assert torch.equal(layer.weight[unique], reference)
    assert rec.names() and not rec.atomics(), rec.atomics()


@pytest.mark.parametrize("method", ["topr", "norm", "norm2-nr"])
def test_select_refuses_norms_that_are_not_finite(method):
    gen = torch.Generator().manual_seed(0)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not finite"):
            select(torch.tensor([1.0, bad, 2.0, 0.5]), 4, 2, method, gen)


def _grass_run(steps, *, nan_step=None, skip_step=None, selection_steps=None):
    """A Top-r layer trained by AdamW through Grass's hook: weights and selections per step.

    ``nan_step``: a NaN enters the sketch (as an fp16 overflow does); ``skip_step``: the
    optimizer skips the update (megatron's overflow handling); ``selection_steps``: replace
    the schedule's selection steps."""
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule

    torch.manual_seed(0)
    layer = _layer(10, 12, 4, "topr", sketch_size=5, dtype=torch.float64)
    v = torch.nn.Parameter(torch.zeros(4, 12, dtype=torch.float64))
    layer.param = v
    opt = torch.optim.AdamW([v], lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
    sched = GrassSchedule(update_interval=3, rewarmup=2, scale=0.5)
    if selection_steps is not None:
        sched.is_selection_step = lambda step: step in selection_steps
    hook = GrassOptimizerHook(
        {"w": layer}, sched, lambda flat: None, reset_state=True, param_fqn=lambda f: "v"
    )
    hook.initial_selection()
    view = _View("v", v, opt)
    gen = torch.Generator().manual_seed(1)
    history = []
    for step in range(steps):
        view.step = step
        hook.begin_step(step)
        x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
        dy = torch.randn(2, 5, 10, generator=gen, dtype=torch.float64) * torch.linspace(
            0.1, 2, 10, dtype=torch.float64
        )
        v.grad = None
        grass_linear(x, layer.weight, None, layer).backward(dy)
        if step == nan_step:
            layer.sketch[3, 0] = float("nan")
        hook.pre_step(view)
        if step != skip_step:
            opt.step()
        hook.post_step(view, step != skip_step)
        index = None if layer.index is None else layer.index.tolist()
        history.append({"index": index, "weight": layer.weight.clone(), "pending": hook.pending})
    return history


@pytest.mark.parametrize("skip", [False, True])
def test_selection_on_a_non_finite_sketch_is_postponed_to_the_next_step(skip):
    """A NaN in the sketch of selection step 3 keeps the rows chosen at step 0, and step 4
    selects: the run equals one whose selection steps are 0, 4 and 6, bit for bit (also
    when the overflowing step's update is skipped, as megatron does under fp16)."""
    skip_step = 3 if skip else None
    run = _grass_run(8, nan_step=3, skip_step=skip_step)
    reference = _grass_run(8, skip_step=skip_step, selection_steps={0, 4, 6})
    assert run[3]["index"] == run[2]["index"] and run[3]["pending"]
    assert run[4]["index"] != run[3]["index"] and not run[4]["pending"]
    for step, (a, b) in enumerate(zip(run, reference)):
        assert a["index"] == b["index"], step
        assert torch.equal(a["weight"], b["weight"]), step
        assert not torch.isnan(a["weight"]).any(), step


# -- the paper's rules, stated independently of megatron_ext -----------------------------------
#
# Grass (section 3.2) selects, for each projected matrix G (m x n, rows projected):
#   Top-r: the r rows of largest norm, rho = 1;
#   Multinomial-Norm(2) with replacement: sigma_j iid with q_k = ||G_k|| / sum_i ||G_i||
#     (squared norms for Norm2), rho_jj = 1 / sqrt(r q_{sigma_j});
#   Uniform-R: q_k = 1/m, the same rho; Uniform-NR and every -NR rule: distinct rows, rho = 1.
# In the paper's LLaMA every q/k/v/gate/up projection is its own layer with its own rows.


def _paper_top_r(g, r):
    """Indices of the r rows of ``g`` with the largest norms (set)."""
    return set(torch.topk(g.norm(dim=1), r).indices.tolist())


def _paper_rho(g, rows, r, squared):
    """rho_jj = 1 / sqrt(r q_sigma_j), q from the row norms of ``g`` alone."""
    norms = g.norm(dim=1)
    q = norms.pow(2) if squared else norms
    q = q / q.sum()
    return 1.0 / torch.sqrt(r * q[rows])


def _fused_qkv(groups=2, q_heads_per_group=2, hn=3, n=16):
    """Separate Q, K, V and their fused weight, interleaved per query group as megatron-core
    lays out linear_qkv: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]."""
    torch.manual_seed(1)
    q_rows = q_heads_per_group * hn
    mats = {
        "q": torch.randn(groups * q_rows, n, dtype=torch.float64),
        "k": torch.randn(groups * hn, n, dtype=torch.float64),
        "v": torch.randn(groups * hn, n, dtype=torch.float64),
    }
    where = {"q": [], "k": [], "v": []}  # fused row of each part's row
    blocks, row = [], 0
    for g in range(groups):
        for name, size in (("q", q_rows), ("k", hn), ("v", hn)):
            blocks.append(mats[name][g * size : (g + 1) * size])
            where[name] += list(range(row, row + size))
            row += size
    return mats, torch.cat(blocks), {k: torch.tensor(v) for k, v in where.items()}


def _parts_layer(weight, mode, r, method, **kw):
    m, n = weight.shape
    parts = len(kw["part_rows"]) if "part_rows" in kw else kw.get("num_col_parts", 1)
    shape = (parts * r, n) if mode == "row" else (m // parts, parts * r)
    fqn = "decoder.layers.0.self_attention.linear_qkv"
    return _grass_layer(fqn, weight, shape, mode, r, method, 0, 5, **kw)


def _select_from_gradient(layer, x, dy):
    layer.start_sketch(0)
    layer.projected_grad(dy, x)
    layer.reselect(0, layer.param.data)


@pytest.mark.parametrize("method", ["topr", "norm", "norm2", "norm2-nr", "uniform-nr"])
def test_fused_qkv_selects_each_of_q_k_v_by_its_own_rule(method):
    """GQA (K and V narrower than Q): r rows of each of Q, K and V, chosen from that matrix's
    own gradient; the projected gradient is rho G_part[sigma] of each part."""
    mats, fused, where = _fused_qkv()
    r = 2
    tokens = 20
    x = torch.randn(tokens, fused.shape[1], dtype=torch.float64)
    dys = {k: torch.randn(tokens, v.shape[0], dtype=torch.float64) for k, v in mats.items()}
    dys["q"] = dys["q"] * torch.linspace(0.1, 4, dys["q"].shape[1], dtype=torch.float64)
    dy = torch.zeros(tokens, fused.shape[0], dtype=torch.float64)
    for k in mats:
        dy[:, where[k]] = dys[k]
    grads = {k: dys[k].t() @ x for k in mats}  # each matrix's own full gradient
    layer = _parts_layer(fused.clone(), "row", r, method, part_rows=tuple(where.values()))
    _select_from_gradient(layer, x, dy)

    assert layer.index.numel() == 3 * r
    out = grass_linear(x, layer.weight, None, layer)
    out.backward(dy)
    for p, k in enumerate(mats):
        slots = slice(p * r, (p + 1) * r)
        fused_rows = layer.index[slots].tolist()
        # each slot of part k is one of k's rows
        assert set(fused_rows) <= set(where[k].tolist()), (k, fused_rows)
        own = [where[k].tolist().index(i) for i in fused_rows]
        rho = layer.rho[slots].double()
        if method == "topr":
            assert set(own) == _paper_top_r(grads[k], r)
        if method in ("norm", "norm2"):
            ref = _paper_rho(grads[k], torch.tensor(own), r, squared=method == "norm2")
            torch.testing.assert_close(rho, ref, rtol=1e-6, atol=0)
        if method in ("topr", "norm2-nr", "uniform-nr"):
            assert len(set(own)) == r and torch.all(rho == 1)
        expected = grads[k][own] * rho[:, None]
        torch.testing.assert_close(layer.param.grad[slots], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["topr", "norm"])
def test_fused_swiglu_fc1_selects_gate_and_up_columns_separately(method):
    """gate and up (f x n, f > n: their columns are projected) each get r columns of their
    own; V is [f, 2r]; the rows written back are W0 + P V of each matrix."""
    torch.manual_seed(2)
    f, n, r, tokens = 10, 6, 2, 30
    gate, up = torch.randn(f, n, dtype=torch.float64), torch.randn(f, n, dtype=torch.float64)
    x = torch.randn(tokens, n, dtype=torch.float64)
    dy_gate = torch.randn(tokens, f, dtype=torch.float64)
    dy_up = 0.2 * torch.randn(tokens, f, dtype=torch.float64)  # up's gradient is smaller
    g_gate, g_up = dy_gate.t() @ x, dy_up.t() @ x  # each matrix's own full gradient
    # the two matrices rank their columns differently: one joint choice cannot fit both
    assert _paper_top_r(g_gate.t(), r) != _paper_top_r(g_up.t(), r)
    fused = torch.cat([gate, up])  # megatron-core's local fc1: [gate; up]
    layer = _parts_layer(fused.clone(), "col", r, method, num_col_parts=2)
    dy = torch.cat([dy_gate, dy_up], dim=1)
    _select_from_gradient(layer, x, dy)
    assert layer.index.numel() == 2 * r and tuple(layer.param.shape) == (f, 2 * r)
    out = grass_linear(x, layer.weight, None, layer)
    out.backward(dy)
    v = torch.randn(f, 2 * r, dtype=torch.float64)
    layer.write_rows(v)
    for p, (g, w0) in enumerate(((g_gate, gate), (g_up, up))):
        slots = slice(p * r, (p + 1) * r)
        cols = (layer.index[slots] - p * n).tolist()
        assert all(0 <= c < n for c in cols)
        rho = layer.rho[slots].double()
        if method == "topr":
            assert set(cols) == _paper_top_r(g.t(), r)
        else:
            ref = _paper_rho(g.t(), torch.tensor(cols), r, squared=False)
            torch.testing.assert_close(rho, ref, rtol=1e-6, atol=0)
        expected = g[:, cols] * rho[None, :]
        torch.testing.assert_close(layer.param.grad[:, slots], expected, rtol=1e-12, atol=1e-12)
        # W = W0 + P V: column c_j of this matrix moves by rho_j V[:, j] (duplicates add)
        w_ref = w0.clone()
        for j, c in enumerate(cols):
            w_ref[:, c] += rho[j] * v[:, p * r + j]
        torch.testing.assert_close(layer.weight[p * f : (p + 1) * f], w_ref, rtol=0, atol=1e-12)


def test_uniform_nr_is_uniform_without_replacement_and_agrees_across_ranks():
    """Uniform-NR: r distinct rows, each row with probability r/m, rho = 1; two replicas
    of a layer (two data-parallel ranks) choose alike from (seed, step, fqn)."""
    m, r, draws = 10, 3, 4000
    counts = torch.zeros(m, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(draws):
        index, rho = select(None, m, r, "uniform-nr", gen)
        assert index.unique().numel() == r and torch.all(rho == 1)
        counts[index] += 1
    # inclusion probability r/m = 0.3; std of the frequency sqrt(0.3 * 0.7 / 4000) = 0.007
    assert (counts / draws - r / m).abs().max() < 0.035
    assert not needs_sketch("uniform-nr", r, m)
    a, b = _layer(m, 7, r, "uniform-nr"), _layer(m, 7, r, "uniform-nr")
    for lay in (a, b):
        lay.reselect(4, lay.param.data)
    assert a.index.tolist() == b.index.tolist() and a.index.unique().numel() == r
    b.reselect(5, b.param.data)
    other = _layer(m, 7, r, "uniform-nr")
    other.load_state_dict(b.state_dict())
    assert other.index.tolist() == b.index.tolist()
    torch.testing.assert_close(other.rho, b.rho, rtol=0, atol=0)


# -- the optimizer state across a reselection --------------------------------------------------


class _PaperRowsAdam:
    """The paper's rule (Algorithms 1 and 4, section 3.3), written from the paper: Adam on
    the selected rows' projected gradient ``rho_u G_u``, its state kept per row of ``W``
    (in the units of ``G_u``, so that a row whose ``rho`` changes keeps its statistics),
    ``k`` counting the updates since the row's state was ``opt.init`` (zero). A reselection
    either re-initializes every row (reset) or keeps the rows selected before and after,
    initializes new rows and forgets dropped ones. Decoupled weight decay on the selected
    rows, the learning rate ``lr * alpha * warm``."""

    def __init__(self, weight_rows, b1, b2, eps, wd):
        self.w = weight_rows.clone()
        self.b1, self.b2, self.eps, self.wd = b1, b2, eps, wd
        self.state = {}  # row -> [M, V, k]

    def step(self, grad_rows, index, rho, lr_eff):
        index, rho = index.tolist(), rho.double().tolist()
        rows = sorted(set(index))
        self.w[rows] *= 1 - lr_eff * self.wd
        for u in rows:
            slots = [j for j, i in enumerate(index) if i == u]
            r_u = rho[slots[0]]
            g = grad_rows[u]
            st = self.state.setdefault(u, [torch.zeros_like(g), torch.zeros_like(g), 0])
            st[0] = self.b1 * st[0] + (1 - self.b1) * g
            st[1] = self.b2 * st[1] + (1 - self.b2) * g * g
            st[2] += 1
            k = st[2]
            m_hat = r_u * st[0] / (1 - self.b1**k)  # the slot's moments: rho_u * M, rho_u^2 * V
            v_hat = r_u**2 * st[1] / (1 - self.b2**k)
            update = m_hat / (v_hat.sqrt() + self.eps)
            self.w[u] -= lr_eff * len(slots) * r_u * update

    def reselect(self, index, reset):
        keep = set() if reset else set(index.tolist())
        self.state = {u: st for u, st in self.state.items() if u in keep}


@pytest.mark.parametrize(
    "method, shape, reset",
    [
        ("topr", (10, 12), False),  # rows, distinct, rho = 1
        ("topr", (12, 10), False),  # columns
        ("norm", (10, 12), False),  # with replacement: duplicates, rho changes
        ("topr", (10, 12), True),
    ],
)
def test_moments_follow_their_rows_across_a_reselection_as_the_paper_rule(method, shape, reset):
    """float64 against :class:`_PaperRowsAdam`: every step's weight (the first update after
    each selection included: a new row's first update has k = 1, so step 1's update is not
    scaled by the step-0 count); after a reselection a kept row's moments are its moments
    before (moved to its new slot, times rho_new / rho_old), a new row's are zero."""
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassSchedule

    m, n = shape
    r, steps, interval = 4, 11, 3
    layer = _layer(m, n, r, method, sketch_size=0, dtype=torch.float64)
    mode = layer.mode
    v = torch.nn.Parameter(torch.zeros(layer.param.shape, dtype=torch.float64))
    layer.param = v
    lr, wd, b1, b2, eps = 0.05, 0.1, 0.9, 0.99, 1e-14
    opt = torch.optim.AdamW([v], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    sched = GrassSchedule(update_interval=interval, rewarmup=2, scale=0.5)
    hook = GrassOptimizerHook(
        {"w": layer}, sched, lambda flat: None, reset_state=reset, param_fqn=lambda f: "v"
    )
    hook.initial_selection()
    view = _View("v", v, opt)

    def rows(t):
        return t if mode == "row" else t.t()

    ref = _PaperRowsAdam(rows(layer.weight), b1, b2, eps, wd)
    gen = torch.Generator().manual_seed(1)
    active, moved, new_rows, selections = 0, 0, 0, hook.selections
    for step in range(steps):
        view.step = step
        hook.begin_step(step)
        x = torch.randn(2, 5, n, generator=gen, dtype=torch.float64)
        # per-row scales that change every step, so that Top-r keeps some rows and drops others
        size = m if mode == "row" else n
        scale = torch.rand(size, generator=gen, dtype=torch.float64) * 2 + 0.1
        if mode == "row":
            dy = torch.randn(2, 5, m, generator=gen, dtype=torch.float64) * scale
        else:
            dy = torch.randn(2, 5, m, generator=gen, dtype=torch.float64)
            x = x * scale
        v.grad = None
        grass_linear(x, layer.weight, None, layer).backward(dy)
        if layer.index is not None:
            g_rows = rows(_full_grad(layer.weight, x, dy))
            lr_eff = lr * 0.5 * min(1.0, (step - active + 1) / 2)
            ref.step(g_rows, layer.index, layer.rho, lr_eff)
        old = None if layer.index is None else (layer.index.tolist(), layer.rho.double())
        hook.pre_step(view)
        opt.step()
        before = {key: rows(opt.state[v][key]).clone() for key in ("exp_avg", "exp_avg_sq")}
        hook.post_step(view, True)
        torch.testing.assert_close(
            rows(layer.weight), ref.w, rtol=1e-9, atol=1e-12, msg=f"step {step}"
        )
        if hook.selections == selections:
            continue
        selections, active = hook.selections, step + 1
        ref.reselect(layer.index, reset)
        if old is None:
            continue
        old_index, old_rho = old
        new_rho = layer.rho.double()
        for j, u in enumerate(layer.index.tolist()):
            for key, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
                after = rows(opt.state[v][key])[j]
                if u in old_index and not reset:
                    i = old_index.index(u)
                    expect = before[key][i] * (new_rho[j] / old_rho[i]) ** power
                    moved += int(i != j and key == "exp_avg")
                else:
                    expect = torch.zeros_like(after)
                    new_rows += int(key == "exp_avg")
                torch.testing.assert_close(after, expect, rtol=1e-12, atol=0, msg=f"{step} {j}")
    assert selections >= 3
    assert new_rows > 0
    if not reset and method == "topr":
        assert moved > 0, "no kept row changed slot: the test would not see slot-carried moments"


# -- with an outer synchronization (DiLoCo): the frozen weight as one parameter ----------------


def _inner_view(param, optimizer, other):
    """An OptimizerView over Grass's V (``"v"``, a torch AdamW parameter) and one more
    parameter (``"other"``): what the outer view wraps."""
    from megatron_ext.protocols import OptimizerView, ParamOptimState

    class View(OptimizerView):
        step = 0

        def fqns(self):
            return ["other", "v"]

        def param_state(self, fqn):
            if fqn == "other":
                return ParamOptimState("other", other, other, {})
            return ParamOptimState(
                fqn, param, param, optimizer.state.get(param, {}), None, optimizer.param_groups[0]
            )

    return View()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_outer_view_reads_and_writes_the_frozen_weight_at_full_precision(dtype):
    """GrassOuterView lists the projected weight in place of V; its main parameter is the
    weight with the selected rows at base + P V (an fp32 master copy for a bf16 weight,
    kept exact by every row write); writing it sets every row, takes the selected rows as
    base and zeroes V, keeping V's Adam moments; Grass then moves the selected rows from
    the written values only. The site state round-trips."""
    from megatron_ext.optim.grass import GrassOptimizerHook, GrassOuterView, GrassSchedule

    torch.manual_seed(0)
    m, n, r = 10, 12, 6  # uniform with replacement: duplicate rows likely
    layer = _layer(m, n, r, "uniform", dtype=torch.float64)
    layer.weight = layer.weight.to(dtype)
    master_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    v = torch.nn.Parameter(torch.zeros(r, n, dtype=master_dtype))
    layer.param = v
    opt = torch.optim.AdamW([v], lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
    hook = GrassOptimizerHook(
        {"l": layer},
        GrassSchedule(update_interval=0, rewarmup=0, scale=0.5),
        lambda flat: None,
        reset_state=True,
        param_fqn=lambda f: "v",
    )
    hook.initial_selection()
    other = torch.zeros(3, dtype=torch.float32)
    inner = _inner_view(v, opt, other)
    view = GrassOuterView(inner, {"l": layer}, param_fqn=lambda f: "v", weight_fqn=lambda f: "w")
    assert view.fqns() == ["other", "w"] and view.param_state("v") is None
    assert view.param_state("other").main_param is other
    assert view.param_numels() == {"other": 3, "w": m * n}

    def step(s):
        inner.step = s
        hook.begin_step(s)
        v.grad = torch.randn(r, n, dtype=master_dtype)
        hook.pre_step(inner)
        opt.step()
        hook.post_step(inner, True)

    for s in range(3):
        step(s)
    main = view.param_state("w").main_param
    assert main.dtype == master_dtype and tuple(main.shape) == (m, n)
    assert (layer.master is None) == (dtype == torch.float64)
    assert torch.equal(main.index_select(0, layer.unique), layer.current_rows(v.detach()))
    assert torch.equal(layer.weight, main.to(dtype))  # the weight is the master rounded
    assert v.detach().abs().sum() > 0

    # The outer step writes the whole weight.
    moments = {k: t.clone() for k, t in opt.state[v].items()}
    value = torch.randn(m, n, dtype=master_dtype)
    view.write_param("w", value)
    assert torch.equal(view.param_state("w").main_param, value)
    assert torch.equal(layer.weight, value.to(dtype))
    assert torch.equal(v.detach(), torch.zeros_like(v))
    assert torch.equal(layer.current_rows(v.detach()), value.index_select(0, layer.unique))
    for k, t in moments.items():
        assert torch.equal(opt.state[v][k], t), k  # V's Adam moments kept
    # Grass's next step moves the selected rows from the written values, nothing else.
    step(3)
    after = view.param_state("w").main_param
    others = [i for i in range(m) if i not in set(layer.unique.tolist())]
    assert torch.equal(after[others], value[others])
    torch.testing.assert_close(
        after.index_select(0, layer.unique),
        value.index_select(0, layer.unique) * (1 - 0.5 * 0.05 * 0.1)
        + (layer.current_rows(v.detach()) - layer.base),
        rtol=0,
        atol=1e-6,
    )

    # This rank's own weights (and master copies) round-trip; a misfit is refused.
    saved = view.site_state()
    assert sorted(saved) == (["weight/w"] if dtype == torch.float64 else ["master/w", "weight/w"])
    kept = (layer.weight.clone(), main.clone())
    with torch.no_grad():
        layer.weight.add_(1)
        if layer.master is not None:
            layer.master.add_(1)
    view.load_site_state(saved)
    assert torch.equal(layer.weight, kept[0]) and torch.equal(main, kept[1])
    with pytest.raises(ValueError, match="does not fit"):
        view.load_site_state({"weight/x": saved["weight/w"]})
