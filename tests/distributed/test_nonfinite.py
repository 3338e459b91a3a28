"""A step that overflows is skipped, and leaves every compressor's state as it was.

Under fp16 megatron's loss scaler starts at 2^32, so the first steps overflow by design and
are skipped; later ones overflow whenever the scale has grown too far. Before this contract
(collectives/grad_reducer.py: a step is a transaction) an overflowing gradient entered the
residual of every error-feedback compressor, every later step overflowed too, and no DP
compressor trained under ``--fp16``.

What is checked here, per compressed method, on gloo with 2 and 4 ranks:

* an Inf injected into one rank's gradient (at the first step, and at a later step; for
  Radius in an entry that is *not* sent, so only its residual would see it) makes the
  applied gradient non-finite on *every* rank, so megatron's loss scaler skips the step
  everywhere;
* after that skipped step, training proceeds exactly (bit for bit) as a run whose same step
  was skipped without any Inf: same applied gradients, same state;
* loss-scaled state follows the loss scale: doubling the scale (``end_step``'s ``rescale``)
  and the gradients from then on doubles every later applied gradient, exactly.
"""

import pytest

from tests.distributed.test_error_feedback import SETTINGS, _select_radius, _slices
from tests.helpers.dist import run_ranks

STEPS = 10
INJECT_AT = (0, 3)  # the first step (selection / warm-up) and a steady-state step


def _grad(rank, step, n):
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank))


def _unsent_entry(reducer, method, slices):
    """A position in w2 whose value this step would not send (Radius's unselected entry)."""
    import torch

    w2 = next(s for s in slices if s.fqn == "w2")
    if method == "radius" and "w2" in reducer.masks and reducer.phase(3) == "sparse":
        return w2.start + int(torch.nonzero(~reducer.masks["w2"])[0])
    return w2.start + 5


def _run(rank, world, method, reduce_scatter, inject, skip, double_from=None):
    """Per-rank applied gradients (this rank's region) and final state of one run."""
    import torch

    from tests.helpers.reducers import bind, make_reducer

    slices, n = _slices()
    reducer = make_reducer(method, **SETTINGS[method])
    buffer = torch.zeros(n)
    bound = bind(
        reducer, buffer, slices, key="w1..w2", distributed_optimizer=reduce_scatter, op=None
    )
    lo, hi = bound.spec.buckets[0].region(reduce_scatter)
    outs, poisoned = [], None
    for step in range(STEPS):
        scale = 2.0 if double_from is not None and step >= double_from else 1.0
        buffer.copy_(_grad(rank, step, n) * (scale / world))
        if step == inject and rank == world - 1:
            buffer[_unsent_entry(reducer, method, slices)] = float("inf")
        handle = bound.launch(step)
        if handle is not None:
            handle.wait()
        if step == inject:
            poisoned = not bool(torch.isfinite(buffer[lo:hi]).all())
        applied = step != skip
        rescale = None
        if double_from is not None and step == double_from - 1:
            rescale = torch.tensor(2.0)
        bound.end_step(applied, rescale)
        if method == "radius" and applied and reducer.phase(step) == "select":
            _select_radius(reducer, slices, step)
        outs.append(buffer[lo:hi].clone())
    return outs, reducer.state_dict(), poisoned


def _skipped_step(rank, world, methods, reduce_scatter):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {}
    for method in methods:
        for at in INJECT_AT:
            injected = _run(rank, world, method, reduce_scatter, inject=at, skip=at)
            clean = _run(rank, world, method, reduce_scatter, inject=None, skip=at)
            out[(method, at)] = (injected, clean)
    return out


def _equal_after(a, b, step):
    import torch

    outs_a, state_a, _ = a
    outs_b, state_b, _ = b
    for t in range(step + 1, STEPS):
        if not torch.equal(outs_a[t], outs_b[t]):
            return f"applied gradient differs at step {t}"
    if set(state_a) != set(state_b):
        return "state keys differ"
    for key in state_a:
        x, y = state_a[key], state_b[key]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if not same:
            return f"state {key} differs"
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(x.isfinite().all()):
            return f"state {key} is not finite"
    return None


@pytest.mark.parametrize(
    "world,reduce_scatter", [(2, False), (4, False), (2, True)], ids=["dp2", "dp4", "dp2-distopt"]
)
def test_an_inf_skips_the_step_everywhere_and_leaves_no_trace(world, reduce_scatter):
    from tests.helpers.reducers import compressed_grad_methods

    methods = tuple(compressed_grad_methods())
    assert set(methods) == set(SETTINGS)
    results = run_ranks(_skipped_step, world, methods, reduce_scatter)
    for key in results[0]:
        poisoned = [result[key][0][2] for result in results]
        # megatron's found-inf check is all-reduced over the model-parallel group only
        # without the distributed optimizer (replicas hold the same gradient), over the
        # whole world with it: so every rank's applied gradient must be non-finite, or
        # with the distributed optimizer some rank's shard.
        if reduce_scatter:
            assert any(poisoned), f"{key}: every shard stayed finite"
        else:
            assert all(poisoned), f"{key}: an applied gradient stayed finite: {poisoned}"
    for rank, result in enumerate(results):
        for (method, at), (injected, clean) in result.items():
            where = f"{method}, Inf at step {at}, rank {rank} of {world}"
            assert not clean[2], f"{where}: the clean run's gradient is not finite"
            problem = _equal_after(injected, clean, at)
            assert problem is None, f"{where}: {problem}"


def _doubled(rank, world, methods):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for method in methods:
        plain = _run(rank, world, method, False, inject=None, skip=None)
        doubled = _run(rank, world, method, False, inject=None, skip=None, double_from=5)
        out[method] = (plain[0], doubled[0])
    return out


def test_state_follows_the_loss_scale():
    import torch

    methods = tuple(SETTINGS)
    for result in run_ranks(_doubled, 2, methods):
        for method, (plain, doubled) in result.items():
            for t in range(STEPS):
                factor = 2.0 if t >= 5 else 1.0
                # Powers of two scale every operation exactly (matmuls, QR, max-abs
                # quantization scales), so the doubled run is exactly twice the plain one.
                assert torch.equal(doubled[t], plain[t] * factor), (method, t)
