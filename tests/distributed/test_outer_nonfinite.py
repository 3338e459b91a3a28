"""DiLoCo's outer step obeys the non-finite rule (``optim/diloco/hook.py``, "Non-finite values").

One launch of 2 gloo ranks, each rank a site, runs :class:`DiLoCoHook` on a plain view (as
tests/distributed/test_outer_exchange.py does): H = 2, F = 1, the paper's outer SGD. After
the first (finite) sync, site 1's pseudo-gradient is made non-finite at the second sync (a
NaN in its weights), for each exchange: dense blocking, dense overlapped (``--outer-delay``),
4-bit blocking and 4-bit overlapped (on the exchange thread), with and without loss scaling.
Every case checks that nothing of the outer step is written (weights, snapshot, momentum,
the 4-bit exchange's error feedback are as before it), that without loss scaling both ranks
stop with a message naming site 1, and that with loss scaling both skip with one line and a
later sync (site 1 repaired) applies normally. A NaN outer learning rate stops even under
loss scaling. A save with a non-finite exchange in flight leaves it out (loss scaling) or
stops. Last, SEPARATE's projection memory estimate refuses a block that cannot be drawn.
"""

import math

import pytest

from tests.helpers.dist import run_ranks

SHAPES = [("w1", (16, 8)), ("b1", (8,))]


H = 4


def _hook(*, compression, delay, scaled, lr=0.7, interval=H):
    import torch

    from megatron_ext.optim.diloco import DiLoCoHook
    from tests.helpers.outer_options import outer_options
    from tests.helpers.views import ParamsView

    params = {n: torch.full(shape, 0.1 * (i + 1)) for i, (n, shape) in enumerate(SHAPES)}
    clock = {"step": 0}

    class View(ParamsView):
        def loss_scale(self):
            return torch.tensor(1024.0) if scaled else None

    opts = outer_options(interval=interval, lr=lr, compression=compression, delay=delay)
    hook = DiLoCoHook(opts, torch.distributed.group.WORLD)
    view = View(params, clock)
    hook.setup(view)
    return hook, view, params, clock


def _step(hook, view, params, clock, step, rank):
    """Inner step ``step`` (0-based) of site ``rank``: a random update, then the hook."""
    import torch

    clock["step"] = step
    hook.pre_step(view)
    gen = torch.Generator().manual_seed(100 * step + rank)
    for p in params.values():
        p.sub_(0.01 * torch.randn(p.shape, generator=gen))
    hook.post_step(view, True)


def _copies(hook, params):
    def clone(d):
        return {k: v.clone() for k, v in d.items()}

    exchange = hook.exchanges[0]
    residual = exchange.residual().clone() if hasattr(exchange, "residual") else None
    return clone(params), clone(hook.snapshot), clone(hook.momentum), residual


def _equal(x, y):
    """Bitwise equal, NaN equal to NaN (site 1's weights hold one)."""

    return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())


def _same(a, b):
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if isinstance(x, dict):
            if set(x) != set(y) or not all(_equal(x[k], y[k]) for k in x):
                return False
        elif x is not None and not _equal(x, y):
            return False
    return True


def _case(rank, compression, delay, scaled):
    """H = 4: sync 1 sent after step 4 (finite); site 1 broken before step 8, whose sync is
    applied after step 8 + delay: nothing written, stop or skip; then (skip) site 1 takes
    site 0's weights and sync 3 (sent after 12) applies."""
    import contextlib
    import io

    import torch

    from megatron_ext.protocols import NonFiniteError

    hook, view, params, clock = _hook(compression=compression, delay=delay, scaled=scaled)
    res = {}
    t = [0]  # steps taken

    def run_to(steps):
        while t[0] < steps:
            _step(hook, view, params, clock, t[0], rank)
            t[0] += 1

    run_to(H + delay)
    res["first_sync"] = hook.syncs == 1
    run_to(2 * H - 1)
    if rank == 1:
        params["w1"].view(-1)[5] = float("nan")  # a broken site
    if delay:
        run_to(2 * H + 1)  # sent after step 8, in flight for one more step
        try:
            res["save_in_flight"] = sorted(hook.state_dict()["pending"])
        except NonFiniteError as exc:
            res["save_in_flight"] = str(exc)
    run_to(2 * H + delay - 1)
    # The step after which the update is applied: the weights as that step's inner update
    # left them (recorded when the hook finishes the fragment), the outer state as before
    # the step (a compressed exchange sent with it must keep its error feedback too).
    before = {"outer": _copies(hook, params)}
    original = hook.finish_fragment

    def finish(v, index):
        before["weights"] = _copies(hook, params)[0]
        return original(v, index)

    hook.finish_fragment = finish
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            run_to(2 * H + delay)
            res["error"] = None
        except NonFiniteError as exc:
            res["error"] = str(exc)
            t[0] += 1
    hook.finish_fragment = original
    after = _copies(hook, params)
    res["printed"] = printed.getvalue()
    res["unchanged"] = _same([before["weights"]] + list(before["outer"][1:]), after)
    res["syncs"], res["skipped"] = hook.syncs, hook.skipped
    if res["error"] is None:
        for k, p in params.items():  # site 1 repaired: site 0's weights
            got = [torch.empty_like(p) for _ in range(2)]
            torch.distributed.all_gather(got, p.contiguous())
            p.copy_(got[0])
        run_to(3 * H + delay)
        finite = all(bool(torch.isfinite(p).all()) for p in params.values())
        res["after_repair"] = (hook.syncs, finite)
    hook.finish()
    res["worker_closed"] = hook.worker is None
    return res


def _nan_lr(rank):
    """--outer-lr NaN (as a run file could once pass it): stops even under loss scaling."""
    from megatron_ext.protocols import NonFiniteError

    hook, view, params, clock = _hook(
        compression="none", delay=0, scaled=True, lr=math.nan, interval=2
    )
    _step(hook, view, params, clock, 0, rank)
    before = _copies(hook, params)
    try:
        clock["step"] = 1
        hook.pre_step(view)
        hook.post_step(view, True)  # the sync after step 2 (no inner update here)
        return None, False
    except NonFiniteError as exc:
        return str(exc), _same(before, _copies(hook, params))


def _separate_memory(rank):
    """A SEPARATE block whose projection cannot be drawn is refused at bind, naming the
    flags, before anything is allocated for it."""
    import torch

    from megatron_ext.config import ConfigError
    from tests.helpers.reducers import bind, make_reducer, param_slices

    slices, numel = param_slices([("w", (4, 2**16))])
    reducer = make_reducer("separate", block_size=2**18, ratio=1)  # 24 * 2^36 bytes
    try:
        bind(reducer, torch.zeros(numel), slices)
        return None
    except ConfigError as exc:
        return str(exc)


CASES = [(c, d, s) for c in ("none", "quantized") for d in (0, 2) for s in (False, True)]


def _all(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {}
    for case in CASES:
        out[case] = _case(rank, *case)
    out["nan_lr"] = _nan_lr(rank)
    out["separate"] = _separate_memory(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2)


@pytest.mark.parametrize("compression, delay, scaled", CASES)
def test_a_non_finite_pseudo_gradient_is_never_applied(results, compression, delay, scaled):
    for rank, out in enumerate(results):
        r = out[compression, delay, scaled]
        assert r["first_sync"], (rank, r)
        assert r["unchanged"], (rank, "the outer step wrote something")
        assert r["worker_closed"]
        if scaled:
            assert r["error"] is None, r["error"]
            assert (r["syncs"], r["skipped"]) == (1, 1)
            lines = [l for l in r["printed"].splitlines() if "skipped under loss scaling" in l]
            assert len(lines) == (1 if rank == 0 else 0), r["printed"]  # the group's first rank
            if rank == 0:
                assert "the pseudo-gradient of site 1 (of 2) is not finite" in lines[0]
            assert r["after_repair"] == (2, True), r["after_repair"]
        else:
            assert r["error"] is not None, (rank, "the run went on")
            assert "the pseudo-gradient of site 1 (of 2) is not finite" in r["error"], r["error"]
            assert "training stops before it is applied" in r["error"]
            assert r["syncs"] == 1
        if delay:
            if scaled:  # left out of the saved state: skipped when it lands
                assert r["save_in_flight"] == [], r["save_in_flight"]
            else:
                assert "is not finite" in r["save_in_flight"], r["save_in_flight"]
                assert "this state is not saved" in r["save_in_flight"]


def test_a_nan_outer_lr_stops_even_under_loss_scaling(results):
    for out in results:
        message, unchanged = out["nan_lr"]
        assert message is not None and unchanged
        assert "although the averaged pseudo-gradient is (--outer-lr nan" in message, message


def test_separate_block_beyond_memory_is_refused_at_bind(results):
    for out in results:
        message = out["separate"]
        assert message is not None
        assert message.startswith("--separate-block-size, --separate-ratio: drawing SEPARATE's")
        assert "more than the" in message
