"""Grass's algorithm without Megatron: selection rules, the row-sparse backward, the rows.

The projected gradient equals the rho-scaled selected rows (or columns) of the full weight
gradient for every rule; the backward passes gradcheck in float64 against the explicit
parametrization ``W = W0 + P V``; the with-replacement rules are unbiased
(``E[P P^T G] = G``); the sketch ranks rows like the exact norms; folding ``V`` into the
weight keeps the fp32 values of rows that stay selected.
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


def _layer(m, n, rank, method, sketch_size=0, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    weight = torch.randn(m, n, dtype=dtype)
    mode, _ = projected_dim((m, n))
    shape = (rank, n) if mode == "row" else (m, rank)
    param = torch.zeros(shape, dtype=dtype, requires_grad=True)
    return GrassLayer(
        fqn="decoder.layers.0.mlp.linear_fc1",
        weight=weight,
        param=param,
        mode=mode,
        rank=rank,
        method=method,
        sketch_size=sketch_size,
        seed=seed,
    )


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
        from megatron_ext.optim.hooks import ParamOptimState

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
