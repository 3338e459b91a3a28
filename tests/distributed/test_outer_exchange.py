"""The compressed exchange of DiLoCo's pseudo-gradient (``collectives/outer_exchange.py``).

One launch of 4 gloo ranks covers G = 4 sites (the whole world) and G = 2 (the pairs {0, 1}
and {2, 3}). Every method exchanges a fresh pseudo-gradient per rank for ``CALLS`` outer
syncs, on a flat buffer and on a parameter layout (two matrices and a bias), and the test
checks, in float64 bookkeeping of the float32 values:

* **Exact error feedback** (every method but SEPARATE): after ``T`` calls
  ``sum_t average_t + mean_r residual_r == sum_t mean_r delta_r,t`` (what
  test_error_feedback.py states for the DP reducers, here exactly rather than as a bound),
  with a residual that is not zero (the exchange did compress). SEPARATE keeps a moving
  average of its error by design (``e <- (1 - beta) e + beta d``, reset at the first sync),
  so the test checks that recursion per call instead:
  ``average_t + mean_r (e_t - (1 - beta) e_{t-1}) / beta == mean_r (delta_r,t + e_{t-1})``.
* Every rank gets bit-identical averages. (The dense exchange, ``none``, is DiLoCo's
  ``DenseOuterExchange``: the overlap cases below run it.)
* **Resume**: the state after ``CALLS // 2`` calls, saved with ``torch.save`` and loaded into
  a new exchange, continues bit-exactly.
* **Bytes**: ``wire_bytes`` against the dense fp32 all-reduce, by the factor each method's
  payload implies.
* A NaN on one rank makes every rank raise, leaving the residual as it was; bad arguments
  are refused naming what is wrong.
"""

import pytest

from tests.helpers.dist import run_ranks

SHAPES = [("w1", (48, 64)), ("b1", (64,)), ("w2", (32, 48))]
NUMEL = 48 * 64 + 64 + 32 * 48  # 4672: two top-k chunks, the second padded
CALLS = 10
METHODS = ("quantized", "radius", "separate", "powersgd")


def _delta(member, call, numel):
    import torch

    gen = torch.Generator().manual_seed(10_000 * call + member)
    # Varying scales, so that quantization and top-k leave residuals of several sizes.
    return torch.randn(numel, generator=gen) * (1.0 + 0.5 * (call % 3))


def _gather(x, size, group):
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def _one(method, layout, members, group):
    import io

    import torch
    import torch.distributed as dist

    from megatron_ext.collectives.outer_exchange import OuterExchange, outer_defaults

    size = len(members)
    me = members.index(dist.get_rank())
    kwargs = {"name": "outer/0"}
    if layout == "params":
        kwargs["shapes"] = SHAPES
    ex = OuterExchange(method, None, NUMEL, group, "cpu", **kwargs)
    opts = outer_defaults(method)
    res = {"wire": [], "dense": ex.dense_wire_bytes(), "rank_equal": True}
    outs, saved, prev_e = [], None, torch.zeros(NUMEL, dtype=torch.float64)
    total_out = torch.zeros(NUMEL, dtype=torch.float64)
    total_mean = torch.zeros(NUMEL, dtype=torch.float64)
    separate_err = 0.0
    for t in range(CALLS):
        if t == CALLS // 2:
            buf = io.BytesIO()
            torch.save(ex.state_dict(), buf)
            saved = buf.getvalue()
        deltas = [_delta(m, t, NUMEL) for m in members]
        mean = sum(d.double() for d in deltas) / size
        out = ex.average(deltas[me])
        outs.append(out.clone())
        res["wire"].append(ex.wire_bytes())
        res["rank_equal"] &= all(torch.equal(out, o) for o in _gather(out, size, group))
        total_out += out.double()
        total_mean += mean
        e = sum(r.double() for r in _gather(ex.residual(), size, group)) / size
        if method == "separate":
            beta = opts.beta_scale / opts.ratio
            if t == 0:  # the reset at the first sync drops the error
                separate_err = max(separate_err, e.abs().max().item())
            else:
                lhs = out.double() + (e - (1 - beta) * prev_e) / beta
                separate_err = max(separate_err, (lhs - (mean + prev_e)).abs().max().item())
        prev_e = e
    res["ef_err"] = (total_out + prev_e - total_mean).abs().max().item()
    res["separate_err"] = separate_err
    res["residual"] = prev_e.abs().max().item()
    res["scale"] = total_mean.abs().max().item()

    # Resume from the saved state in a new exchange: the same averages, bit for bit.
    again = OuterExchange(method, None, NUMEL, group, "cpu", **kwargs)
    again.load_state_dict(torch.load(io.BytesIO(saved)))
    res["resume_exact"] = all(
        torch.equal(again.average(_delta(members[me], t, NUMEL)), outs[t])
        for t in range(CALLS // 2, CALLS)
    )
    res["resume_syncs"] = again.syncs

    # A NaN on one rank: every rank raises and keeps its residual.
    before = ex.residual()
    bad = _delta(members[me], CALLS, NUMEL)
    if me == size - 1:
        bad[7] = float("nan")
    try:
        ex.average(bad)
        res["nan_raised"] = False
    except RuntimeError as exc:
        res["nan_raised"] = "NaN or Inf" in str(exc)
    res["nan_kept"] = torch.equal(ex.residual(), before) and ex.syncs == CALLS
    return res


def _refusals(group):
    import torch

    from megatron_ext.collectives.outer_exchange import OuterExchange
    from megatron_ext.methods.quantized import QuantizedConfig

    out = []
    for args, kwargs in [
        (("topk", None), {}),
        (("none", None), {}),
        (("powersgd", QuantizedConfig()), {}),
        (("quantized", None), {"shapes": [("w", (3, 3))]}),
    ]:
        try:
            OuterExchange(*args, NUMEL, group, "cpu", **kwargs)
            out.append(None)
        except (ValueError, TypeError) as exc:
            out.append(str(exc))
    ex = OuterExchange("quantized", None, NUMEL, group, "cpu")
    try:
        ex.average(torch.zeros(NUMEL, dtype=torch.float64))
        out.append(None)
    except ValueError as exc:
        out.append(str(exc))
    return out


def _warmups(group):
    """Options given explicitly are used as given: a dense start of 2 outer syncs."""
    import torch

    from megatron_ext.collectives.outer_exchange import OuterExchange
    from megatron_ext.methods.powersgd import PowerSGDConfig
    from megatron_ext.methods.radius import RadiusConfig

    members = [0, 1, 2, 3]
    me = torch.distributed.get_rank()
    out = {}
    for method, options in [
        ("radius", RadiusConfig(density=1 / 64, dense_steps=2)),
        ("powersgd", PowerSGDConfig(start_step=2)),
    ]:
        ex = OuterExchange(method, options, NUMEL, group, "cpu", shapes=SHAPES)
        rows = []
        for t in range(3):
            deltas = [_delta(m, t, NUMEL) for m in members]
            mean = sum(d.double() for d in deltas) / 4
            avg = ex.average(deltas[me])
            err = (avg.double() - mean).abs().max().item()
            rows.append((err, ex.wire_bytes() == ex.dense_wire_bytes()))
        out[method] = rows
    return out


def _inner_step(member, step, numel):
    import torch

    gen = torch.Generator().manual_seed(7_000 * step + member)
    return 0.01 * torch.randn(numel, generator=gen)


def _overlap(
    members, group, *, delay, alpha, steps=14, save_at=None, state=None, compression="none"
):
    """Streaming DiLoCo with the exchange overlapped (``--outer-delay``) through
    :class:`DiLoCoHook` on a plain view: H = 4, F = 2 fragments, the paper's outer SGD; each
    site's inner step adds a fixed random vector. Returns the weights after every step, the
    steps at which each fragment's exchange was in flight, and the state at ``save_at``."""
    import torch

    from megatron_ext.optim.diloco import DiLoCoHook
    from tests.helpers.outer_options import outer_options
    from tests.helpers.views import ParamsView

    me = members.index(torch.distributed.get_rank())
    params = {n: torch.zeros(shape) for n, shape in SHAPES}
    for i, (n, _) in enumerate(SHAPES):
        params[n].add_(0.1 * (i + 1))  # the same start on every site
    clock = {"step": 0}

    opts = outer_options(
        interval=4, lr=0.7, fragments=2, compression=compression, delay=delay, merge_alpha=alpha
    )
    hook = DiLoCoHook(opts, group)
    view = ParamsView(params, clock)
    hook.setup(view)
    start = 0
    if state is not None:
        weights, hook_state, start = state
        for n, t in weights.items():
            params[n].copy_(t)
        hook.load_state_dict(hook_state)
    out = {"weights": [], "in_flight": [], "fragments": hook.fragments, "hook": hook}
    for step in range(start, steps):
        clock["step"] = step
        hook.pre_step(view)  # as megatron's step: before the inner update
        flat = _inner_step(members[me], step, NUMEL)
        offset = 0
        for n, shape in SHAPES:
            k = params[n].numel()
            params[n].sub_(flat[offset : offset + k].view(shape))
            offset += k
        hook.post_step(view, True)
        out["weights"].append({n: t.clone() for n, t in params.items()})
        # in flight and not waited for: the handle still holds its collective
        out["in_flight"].append(sorted(i for i, (_, p) in hook.pending.items() if p.in_flight()))
        if save_at is not None and step + 1 == save_at:
            import io

            buf = io.BytesIO()
            torch.save(({n: t.clone() for n, t in params.items()}, hook.state_dict()), buf)
            buf.seek(0)
            weights, hook_state = torch.load(buf)
            out["saved"] = (weights, hook_state, step + 1)
    # end of training: what is in flight lands and the exchange thread stops, before the
    # group is used again by the next case
    out["threaded"] = hook.worker is not None
    hook.finish()
    assert hook.worker is None
    return out


def _overlap_reference(members, fragments, *, delay, alpha, steps=14):
    """An independent float64 statement of Streaming DiLoCo with overlap (Douillard et al.,
    2025, Alg. 2 with tau and alpha): every site simulated here."""
    import torch

    sites = len(members)
    start = torch.cat(
        [
            torch.full((int(torch.tensor(shape).prod()),), 0.1 * (i + 1))
            for i, (_, shape) in enumerate(SHAPES)
        ]
    ).double()
    sizes = [int(torch.tensor(shape).prod()) for _, shape in SHAPES]
    names = [n for n, _ in SHAPES]
    spans, offset = {}, 0
    for n, k in zip(names, sizes):
        spans[n] = (offset, offset + k)
        offset += k
    idx = [torch.cat([torch.arange(*spans[n]) for n in frag]) for frag in fragments]
    local = [start.clone() for _ in range(sites)]
    glob = start.clone()
    mom = [None] * len(fragments)
    sent = {}  # fragment -> (apply at, mean pseudo-gradient)
    history = []
    for step in range(steps):
        t = step + 1
        for m in range(sites):
            local[m] -= _inner_step(members[m], step, NUMEL).double()
        for f in range(len(fragments)):
            if t % 4 == (f * 4) // len(fragments):
                delta = sum(glob[idx[f]] - local[m][idx[f]] for m in range(sites)) / sites
                sent[f] = (t + delay, delta)
        for f in sorted(sent):  # tau = 0: applied at once
            due, delta = sent[f]
            if due != t:
                continue
            del sent[f]
            mom[f] = delta.clone() if mom[f] is None else 0.9 * mom[f] + delta
            glob[idx[f]] -= 0.7 * (delta + 0.9 * mom[f])
            for m in range(sites):
                local[m][idx[f]] = alpha * local[m][idx[f]] + (1 - alpha) * glob[idx[f]]
        history.append([x.clone() for x in local])
    return history


def _overlap_blocking(members, group, fragments, *, delay, alpha, compression, steps=14):
    """The overlapped compressed exchange's reference on this rank: the same schedule with
    each exchange called (blocking) at its slot on fresh exchanges built as the hook builds
    them, its mean held back and applied tau steps later, with the hook's own arithmetic
    (``outer_sgd_step``, ``torch.lerp``: the outer step itself is checked against float64
    above and against torchft in test_diloco_torchft.py), so the two agree bit for bit."""
    import torch

    from megatron_ext.optim.diloco import make_outer_exchange, outer_sgd_step

    me = members.index(torch.distributed.get_rank())
    shapes = dict(SHAPES)
    local = {n: torch.full(shape, 0.1 * (i + 1)) for i, (n, shape) in enumerate(SHAPES)}
    glob = {n: t.clone() for n, t in local.items()}
    exchanges = [
        make_outer_exchange(
            compression,
            None,
            sum(local[n].numel() for n in frag),
            group,
            "cpu",
            name=f"outer/{i}",
            shapes=[(n, shapes[n]) for n in frag],
        )
        for i, frag in enumerate(fragments)
    ]
    mom, sent, history = [None] * len(fragments), {}, []
    for step in range(steps):
        t = step + 1
        flat, offset = _inner_step(members[me], step, NUMEL), 0
        for n, shape in SHAPES:
            k = local[n].numel()
            local[n] -= flat[offset : offset + k].view(shape)
            offset += k
        for f in sorted(sent):  # applies before sends, as the hook
            due, avg = sent[f]
            if due != t:
                continue
            del sent[f]
            g = torch.cat([glob[n].reshape(-1) for n in fragments[f]])
            cur = torch.cat([local[n].reshape(-1) for n in fragments[f]])
            mom[f] = outer_sgd_step(g, mom[f], avg, lr=0.7, momentum=0.9, nesterov=True)
            new = g if alpha == 0 else torch.lerp(g, cur, alpha)
            offset = 0
            for n in fragments[f]:
                k = glob[n].numel()
                glob[n] = g[offset : offset + k].view(shapes[n]).clone()
                local[n] = new[offset : offset + k].view(shapes[n]).clone()
                offset += k
        for f in range(len(fragments)):
            if t % 4 == (f * 4) // len(fragments):
                delta = torch.cat([(glob[n] - local[n]).reshape(-1) for n in fragments[f]])
                sent[f] = (t + delay, exchanges[f].average(delta))
        history.append({n: x.clone() for n, x in local.items()})
    return history


COMPRESSED_OVERLAPS = (("quantized", 2, 0.0), ("powersgd", 3, 0.5), ("radius", 2, 0.0))


def _overlaps(members, group):
    out = {}
    cases = [("none", d, a) for d, a in ((2, 0.0), (3, 0.5), (0, 0.5))]
    for compression, delay, alpha in cases + list(COMPRESSED_OVERLAPS):
        kw = dict(delay=delay, alpha=alpha, compression=compression)
        full = _overlap(members, group, save_at=5, **kw)
        resumed = _overlap(members, group, state=full["saved"], **kw)
        entry = {
            "weights": full["weights"],
            "in_flight": full["in_flight"],
            "fragments": full["fragments"],
            "resumed_equal": all(
                all(torch_equal(a[n], b[n]) for n in a)
                for a, b in zip(full["weights"][5:], resumed["weights"])
            ),
            "pending_saved": sorted(full["saved"][1]["pending"]),
            "threaded": full["threaded"],
        }
        if compression != "none":
            entry["blocking"] = _overlap_blocking(members, group, full["fragments"], **kw)
        out[(delay, alpha) if compression == "none" else (compression, delay, alpha)] = entry
    return out


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def _all(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {"refusals": _refusals(dist.group.WORLD), "warmups": _warmups(dist.group.WORLD)}
    out["overlap", 4] = _overlaps([0, 1, 2, 3], dist.group.WORLD)
    out["overlap", 2] = _overlaps([0, 1] if rank < 2 else [2, 3], pairs[rank // 2])
    for method in METHODS:
        for layout in ("flat", "params"):
            out[(4, method, layout)] = _one(method, layout, [0, 1, 2, 3], dist.group.WORLD)
            pair = [0, 1] if rank < 2 else [2, 3]
            out[(2, method, layout)] = _one(method, layout, pair, pairs[rank // 2])
    return out


def _expected_ratio(method, layout, size):
    """Dense fp32 all-reduce bytes over the method's bytes, from its payload."""
    import math

    dense = 2 * (size - 1) / size * 4 * NUMEL
    if method == "quantized":
        # All-to-all of the rank's 4-bit codes + fp16 scales per 256 (+ a 4-byte flag per
        # partition), then all-gather of the owner's re-quantized partition.
        part = math.ceil(NUMEL / size)
        rows = math.ceil(part / 256)
        nbytes = rows * 256 // 2 + 2 * rows
        return dense / ((size - 1) * (nbytes + 4) + (size - 1) * nbytes)
    if method == "radius":
        chunks, k = 2, math.ceil(4096 / 64)  # NUMEL < 2 chunks of 4096; density 1/64
        return dense / ((size - 1) * (6 * chunks * k + 4))
    if method == "separate":
        # Rows of 256 projected to 16 values; the bias (params layout) dense; the flag.
        matrix = NUMEL if layout == "flat" else NUMEL - 64
        floats = math.ceil(matrix / 256) * 16 + (0 if layout == "flat" else 64) + 1
        return dense / (2 * (size - 1) / size * 4 * floats)
    # PowerSGD rank 4: P then Q of each matrix (1-D dense with P; one flag).
    if layout == "flat":
        cols = math.isqrt(NUMEL - 1) + 1
        rows = math.ceil(NUMEL / cols)
        floats = (rows + cols) * 4 + 1
    else:
        floats = (48 + 64) * 4 + (32 + 48) * 4 + 64 + 1
    return dense / (2 * (size - 1) / size * 4 * floats)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 4)


def test_outer_exchange_refuses_bad_arguments(results):
    unknown, dense, wrong_options, wrong_shapes, wrong_dtype = results[0]["refusals"]
    assert unknown and "unknown method 'topk'" in unknown
    assert dense and "'none' is the dense all-reduce" in dense and "DenseOuterExchange" in dense
    assert wrong_options and "PowerSGDConfig" in wrong_options
    assert wrong_shapes and "cover 9 elements" in wrong_shapes
    assert wrong_dtype and "float32" in wrong_dtype


def test_outer_exchange_dense_start_when_asked(results):
    for out in results:
        for method, rows in out["warmups"].items():
            # Syncs 0 and 1 dense (the exact mean, dense bytes), sync 2 compressed.
            for err, dense in rows[:2]:
                assert err < 1e-5 and dense, (method, rows)
            err, dense = rows[2]
            assert err > 1e-2 and not dense, (method, rows)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_outer_exchange_error_feedback_resume_and_bytes(results, method, size):
    for rank, out in enumerate(results):
        for layout in ("flat", "params"):
            r = out[(size, method, layout)]
            where = f"{method} G={size} {layout} rank {rank}"
            assert r["rank_equal"], where
            # fp32 rounding of a few additions per call on values of order 1-10 (observed
            # at most 2e-6 for the exchanges, 6e-6 for SEPARATE's recursion).
            tol = 1e-5 * max(1.0, r["scale"])
            if method == "separate":
                assert r["separate_err"] < tol, (where, r["separate_err"])
                assert r["residual"] > 1e-2, where
            else:
                assert r["ef_err"] < tol, (where, r["ef_err"], r["residual"])
                assert r["residual"] > 1e-2, (where, r["residual"])
            assert r["resume_exact"] and r["resume_syncs"] == CALLS, where
            assert r["nan_raised"] and r["nan_kept"], where
            want = _expected_ratio(method, layout, size)
            for wire in r["wire"]:
                got = r["dense"] / wire
                assert abs(got - want) <= 0.02 * want, (where, got, want)


def _expected_in_flight(delay):
    """The fragments in flight after each of the 14 steps: fragment 0 is sent after steps 4,
    8, 12, fragment 1 after 2, 6, 10, 14 (H = 4, F = 2), each for ``delay`` steps; the save
    after step 5 waits for what is in flight then."""
    sends = ((0, 4), (0, 8), (0, 12), (1, 2), (1, 6), (1, 10), (1, 14))
    return [
        sorted(f for f, t in sends if t <= s < t + delay and not t <= 5 < s) for s in range(1, 15)
    ]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("compression, delay, alpha", COMPRESSED_OVERLAPS)
def test_overlapped_compressed_exchange_runs_on_a_thread_and_equals_the_blocking_one(
    results, size, compression, delay, alpha
):
    """``--outer-delay`` with ``--outer-compression``: the exchange runs on the worker thread
    (not waited for during its tau steps), every step's weights equal bit for bit the same
    schedule run with the blocking exchange (error feedback included), and a state saved with
    an exchange in flight resumes bit-exactly."""
    import torch

    for rank, out in enumerate(results):
        r = out["overlap", size][compression, delay, alpha]
        assert r["threaded"]
        for step, (got, want) in enumerate(zip(r["weights"], r["blocking"])):
            for n in got:
                assert torch.equal(got[n], want[n]), (size, compression, rank, step, n)
        assert r["resumed_equal"], (size, compression, rank)
        assert r["in_flight"] == _expected_in_flight(delay), r["in_flight"]
        assert r["pending_saved"] == ["0"], r["pending_saved"]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("delay, alpha", [(2, 0.0), (3, 0.5), (0, 0.5)])
def test_overlapped_exchange_is_streaming_diloco_and_resumes_in_flight(results, size, delay, alpha):
    """``--outer-delay tau`` / ``--outer-merge-alpha alpha``: each fragment's all-reduce
    started after step t is not waited for until step t + tau, the result matches the float64
    statement of the algorithm at every step, and a state saved with an exchange in flight
    resumes bit-exactly."""
    import torch

    for rank, out in enumerate(results):
        r = out["overlap", size][delay, alpha]
        members = list(range(4)) if size == 4 else ([0, 1] if rank < 2 else [2, 3])
        ref = _overlap_reference(members, r["fragments"], delay=delay, alpha=alpha)
        me = members.index(rank)
        names = [n for n, _ in SHAPES]
        worst = 0.0
        for got, want in zip(r["weights"], ref):
            flat = torch.cat([got[n].reshape(-1) for n in names]).double()
            worst = max(worst, (flat - want[me]).abs().max().item())
        assert worst < 1e-5, (size, delay, alpha, rank, worst)
        assert r["resumed_equal"], (size, delay, alpha, rank)
        if delay:
            assert r["in_flight"] == _expected_in_flight(delay), r["in_flight"]
            assert r["pending_saved"] == ["0"], r["pending_saved"]  # sent at 4, saved at 5
        else:
            assert r["in_flight"] == [[]] * 14 and r["pending_saved"] == []
    if alpha == 0:  # the sites agree once a fragment's exchange has landed
        a, b = results[0]["overlap", size][delay, alpha], results[1]["overlap", size][delay, alpha]
        frag = a["fragments"][0]
        for n in frag:
            assert torch.equal(a["weights"][5][n], b["weights"][5][n])  # fragment 0 landed at 6
