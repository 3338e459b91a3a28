"""Pure math of the gradient compressors: SEPARATE's projection, Radius's selection,
PowerSGD's orthogonalization. No process group."""

import math

import pytest
import torch

from megatron_ext.compressors.seeding import stable_seed
from megatron_ext.compressors.separate import (
    projection_block,
    random_projection_cosine,
    reconstruct,
    update_error,
)
from megatron_ext.compressors.topk import adamw_corrected_gradient, num_selected, topk_mask


def test_projection_is_a_pure_function_of_seed_step_key():
    a = projection_block(1, 5, "b0", 64, 8)
    assert torch.equal(a, projection_block(1, 5, "b0", 64, 8))
    assert not torch.equal(a, projection_block(1, 6, "b0", 64, 8))
    assert not torch.equal(a, projection_block(1, 5, "b1", 64, 8))
    assert not torch.equal(a, projection_block(2, 5, "b0", 64, 8))
    assert stable_seed("x", 1) == stable_seed("x", 1) != stable_seed("x", 2)


@pytest.mark.parametrize("orthonormal", [True, False])
def test_projection_estimator_is_unbiased(orthonormal):
    """Mean of Omega Omega^T h / k over many steps -> h.

    With N draws the mean's error has standard deviation sqrt(var / N), var ~= (ratio +- 1)
    |h|^2 per draw; we allow 4 standard deviations (a false alarm probability far below
    1e-4 for this fixed seed set, which is deterministic anyway).
    """
    c, k, n = 64, 8, 1000
    h = torch.randn(3, c, generator=torch.Generator().manual_seed(0))
    total = torch.zeros_like(h)
    sq = 0.0
    for step in range(n):
        omega = projection_block(7, step, "key", c, k, orthonormal=orthonormal)
        est = reconstruct(h @ omega, omega)
        total += est
        sq += ((est - h) ** 2).sum().item()
    mean = total / n
    var = sq / n / (h**2).sum().item()
    ratio = c / k
    expected_var = (ratio - 1) if orthonormal else (c + 1) / k
    assert abs(var - expected_var) / expected_var < 0.1
    err = ((mean - h) ** 2).sum().sqrt().item() / (h**2).sum().sqrt().item()
    assert err < 4 * math.sqrt(expected_var / n)


def test_orthonormal_projection_at_ratio_1_is_exact():
    h = torch.randn(5, 32, dtype=torch.float64)
    omega = projection_block(0, 0, "k", 32, 32, dtype=torch.float64)
    # Q Q^T = I for a square orthogonal Q; float64 rounding only.
    assert torch.allclose(reconstruct(h @ omega, omega), h, atol=1e-12)
    omega32 = projection_block(0, 0, "k", 32, 32)
    h32 = h.float()
    # float32 matmuls: relative error of a few ulps per entry.
    assert torch.allclose(reconstruct(h32 @ omega32, omega32), h32, atol=1e-5)


def test_error_feedback_recursion():
    e = torch.tensor([1.0, 2.0])
    h = torch.tensor([3.0, -1.0])
    est = torch.tensor([2.0, 0.0])
    update_error(e, h, est, beta=0.25, reset=False)
    # e <- 0.75 * [1, 2] + 0.25 * ([3, -1] - [2, 0])
    assert torch.allclose(e, torch.tensor([1.0, 1.25]))
    update_error(e, h, est, beta=0.25, reset=True)
    assert torch.equal(e, torch.zeros(2))


def test_random_projection_cosine_reference():
    c, k = 256, 16
    h = torch.randn(1, c, generator=torch.Generator().manual_seed(1))
    cos = []
    for step in range(500):
        omega = projection_block(3, step, "k", c, k, orthonormal=True)
        est = reconstruct(h @ omega, omega)
        cos.append(torch.nn.functional.cosine_similarity(est, h).item())
    assert abs(sum(cos) / len(cos) - random_projection_cosine(c / k)) < 0.03


def test_topk_mask_keeps_ceil_density_entries():
    scores = torch.tensor([0.1, -5.0, 3.0, 0.2, -0.3, 4.0])
    mask = topk_mask(scores, 0.5)
    assert mask.tolist() == [False, True, True, False, False, True]
    assert num_selected(10, 0.41) == 5 and num_selected(10, 1.0) == 10
    assert num_selected(3, 0.01) == 1
    assert topk_mask(scores, 1.0).all()


def test_adamw_corrected_gradient_matches_torch_adamw():
    """Run one real torch AdamW step, then recover Radius's G_c from its state."""
    torch.manual_seed(0)
    w0 = torch.randn(20)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        p.grad = torch.randn(20)
        w_before = p.detach().clone()
        opt.step()
    st = opt.state[p]
    g = adamw_corrected_gradient(
        st["exp_avg"],
        st["exp_avg_sq"],
        p.detach(),
        step=int(st["step"]),
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
    )
    bc1, bc2 = 1 - 0.9**3, 1 - 0.95**3
    direction = (st["exp_avg"] / bc1) / ((st["exp_avg_sq"] / bc2).sqrt() + 1e-8)
    expected = direction + 0.1 * w_before
    assert torch.allclose(g, expected, atol=1e-5, rtol=1e-4)


def test_powersgd_recovers_low_rank_matrices_exactly():
    from megatron_ext.compressors.lowrank import orthogonalize

    torch.manual_seed(0)
    m = torch.randn(30, 3, dtype=torch.float64) @ torch.randn(3, 20, dtype=torch.float64)
    q = orthogonalize(torch.randn(20, 3, dtype=torch.float64))
    p = orthogonalize(m @ q)
    q = m.t() @ p
    assert torch.allclose(p @ q.t(), m, atol=1e-10)
