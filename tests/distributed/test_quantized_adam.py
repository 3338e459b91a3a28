"""QuantizedAdam's promises on plain gloo process groups (DP=2 and DP=4), float64 bookkeeping.

One launch of 4 ranks (DP=4, and DP=2 on two pairs) drives the method's reducer and optimizer hook (built through the
registry) on three parameters of an ordinary ``torch.optim.AdamW``, every rank with its own
gradient each step, and checks:

* **The reducer.** During the warm-up each rank's bucket holds the dense reduction (the mean
  gradient); afterwards it holds the rank's own gradient in the units of the reduced one
  (megatron's 1/W pre-scaling undone under SUM, untouched under AVG). A non-finite gradient
  on one rank makes every rank's bucket non-finite (so megatron's loss scaler skips the step
  everywhere), and such a skipped step does not count toward the warm-up.
* **Exact error compensation.** With ``m'_t`` the momentum every rank applies at compressed
  step ``t``, ``u_i,t = beta1 * m'_{t-1} + (1 - beta1) * g_i,t`` the momentum rank ``i``
  computed, ``e_i,t`` its worker residual and ``s_t`` the server residuals (each owner's
  partition), all zero when the warm-up ends, after ``T`` compressed steps:
  ``sum_t m'_t = sum_t mean_i u_i,t - (mean_i e_i,T + s_T)`` (float64 sums of the float32
  values; tolerance 1e-4 against residuals of order 0.1-1 at 2 bits).
* **The update.** Adam's variance and the replicas: ``exp_avg_sq`` stays what the warm-up
  left, ``step`` counts on, every parameter follows
  ``p <- (p - lr * sqrt(1 - b2^t) / (1 - b1^t) * m' / (sqrt(v) + eps)) * (1 - lr * wd)``,
  and all ranks hold bit-identical parameters and momenta.
"""

from tests.helpers.dist import run_ranks

# 1320 elements: 21 rows of 64, so one partition's payload (codes, fp16 scales) is 378 bytes,
# not a multiple of 4: DP=1 reads its flag and scales at unaligned offsets.
SHAPES = [("w1", (24, 40)), ("b1", (40,)), ("w2", (16, 20))]
WARMUP = 3
STEPS = 23
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


class _View:
    """A plain-torch OptimizerView over an AdamW's parameters."""

    def __init__(self, params, opt, clock):
        self.params, self.opt, self.clock = params, opt, clock

    def fqns(self):
        return sorted(self.params)

    def param_state(self, fqn):
        from megatron_ext.protocols import ParamOptimState

        p = self.params[fqn]
        return ParamOptimState(
            fqn=fqn,
            model_param=p,
            main_param=p,
            state=self.opt.state[p],
            group=self.opt.param_groups[0],
        )

    @property
    def step(self):
        return self.clock.step


def _gather(x, world, group):
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def _run(rank, world, op_name, group):
    import math

    import torch
    import torch.distributed as dist

    from megatron_ext.collectives.quantized_adam import QuantizedAdamHook
    from megatron_ext.state import StepClock
    from tests.helpers.reducers import bind, make_reducer, param_slices, reduce

    op = getattr(dist.ReduceOp, op_name)
    slices, n = param_slices(SHAPES)
    torch.manual_seed(0)  # the same initial parameters on every rank
    params = {fqn: torch.nn.Parameter(torch.randn(shape)) for fqn, shape in SHAPES}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    reducer = make_reducer("quantized-adam", bits=2, block_size=64, warmup_steps=WARMUP)
    buffer = torch.zeros(n)
    bound = bind(reducer, buffer, slices, op=op, group=group)
    hook = QuantizedAdamHook(reducer.cfg, reducer)
    clock = StepClock()
    view = _View(params, opt, clock)
    fqns = view.fqns()

    def grad(r, t):
        return torch.randn(n, generator=torch.Generator().manual_seed(1000 * t + r))

    def flat(key):
        return torch.cat([opt.state[params[f]][key].reshape(-1) for f, _ in SHAPES])

    out = {"reducer": [], "formula": [], "skipped_poisons": None}
    sum_applied = torch.zeros(n, dtype=torch.float64)
    sum_true = torch.zeros(n, dtype=torch.float64)
    v_frozen = None
    t = 0
    while reducer.applied_steps < STEPS:
        clock.step = t  # megatron's iteration (a skipped one included)
        g = grad(rank, t)
        mean = sum(grad(r, t).double() for r in range(world)) / world
        buffer.copy_(g / world if op_name == "SUM" else g)
        if t == WARMUP + 4:
            # One rank's overflow: every rank's bucket turns non-finite and the step is skipped.
            if rank == world - 1:
                buffer[5] = float("inf")
            before = hook.state_dict()
            reduce(bound, clock.step, applied=False)
            out["skipped_poisons"] = (
                not bool(torch.isfinite(buffer).all()),
                float(reducer.nonfinite()) > 0,
            )
            hook.post_step(view, False)  # megatron skipped it: no update, no count
            after = hook.state_dict()
            out["skip_left_state"] = all(
                (
                    torch.equal(before[k], after[k])
                    if isinstance(before[k], torch.Tensor)
                    else before[k] == after[k]
                )
                for k in before
            )
            reducer.end_step(False)
            t += 1
            continue
        compressing = reducer.compressing()
        reduce(bound, clock.step)
        expected = g if compressing else mean.float()
        out["reducer"].append(
            (compressing, float((buffer.double() - expected.double()).abs().max()))
        )
        for s in slices:
            params[s.fqn].grad = buffer[s.start : s.end].view(s.shape).clone()
        override = hook.update_override(view)
        assert (override is None) == (not compressing)
        if not compressing:
            opt.step()
        else:
            if v_frozen is None:
                v_frozen = flat("exp_avg_sq").clone()
            m_prev = flat("exp_avg").double()
            p_prev = {f: params[f].detach().double().clone() for f in fqns}
            step_prev = float(opt.state[params[fqns[0]]]["step"])
            override(fqns)
            sum_applied += flat("exp_avg").double()
            sum_true += BETAS[0] * m_prev + (1 - BETAS[0]) * mean
            # The update as the authors write it, in float64 from the applied momentum.
            tt = step_prev + 1
            size = LR * math.sqrt(1 - BETAS[1] ** tt) / (1 - BETAS[0] ** tt)
            worst = 0.0
            for f in fqns:
                st = opt.state[params[f]]
                ref = (
                    p_prev[f]
                    - size * st["exp_avg"].double() / (st["exp_avg_sq"].double().sqrt() + EPS)
                ) * (1 - LR * WD)
                worst = max(worst, float((params[f].detach().double() - ref).abs().max()))
            out["formula"].append(
                (
                    worst,
                    float(opt.state[params[fqns[0]]]["step"]) == tt,
                    torch.equal(flat("exp_avg_sq"), v_frozen),
                )
            )
        hook.post_step(view, True)
        reducer.end_step(True)
        t += 1
    # Residuals: mean of the ranks' worker errors plus the owners' server errors.
    state = hook.state_dict()
    worker = torch.cat([state[f"worker_error/{f}"].reshape(-1) for f, _ in SHAPES]).double()
    server = torch.cat([state[f"server_error/{f}"].reshape(-1) for f, _ in SHAPES]).double()
    residual = sum(_gather(worker, world, group)) / world + sum(_gather(server, world, group))
    out["invariant"] = float((sum_applied - sum_true + residual).abs().max())
    out["without_residual"] = float((sum_applied - sum_true).abs().max())
    out["residual"] = float(residual.abs().max())
    out["applied_steps"] = reducer.applied_steps
    flat_p = torch.cat([params[f].detach().reshape(-1) for f, _ in SHAPES] + [flat("exp_avg")])
    out["replicas_equal"] = all(torch.equal(x, flat_p) for x in _gather(flat_p, world, group))
    out["keys"] = sorted(state)
    return out


def _all(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # DP=4 on the whole world, DP=2 on {0, 1} and {2, 3} (every rank creates every group).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    # DP=1 (one GPU; one partition: the payload's byte offsets are not float-aligned).
    singles = [dist.new_group([r]) for r in range(world)]
    out = {}
    for op_name in ("SUM", "AVG"):
        out[(4, op_name)] = _run(rank, 4, op_name, dist.group.WORLD)
        out[(2, op_name)] = _run(rank % 2, 2, op_name, pairs[rank // 2])
    out[(1, "AVG")] = _run(0, 1, "AVG", singles[rank])
    return out


def test_quantized_adam_exact_error_compensation_and_update():
    """DP=2 and DP=4, SUM and AVG, and DP=1, in one launch of 4 ranks."""
    for rank, results in enumerate(run_ranks(_all, 4)):
        for (world, op_name), out in results.items():
            where = f"DP={world} {op_name} rank {rank}"
            phases = [c for c, _ in out["reducer"]]
            assert phases == [False] * WARMUP + [True] * (STEPS - WARMUP), (where, phases)
            # Warm-up: the dense mean (float32 all-reduce); after: the rank's own gradient.
            for compressing, err in out["reducer"]:
                assert err < (0.0 if compressing else 1e-5) + 1e-12, (where, compressing, err)
            assert out["skipped_poisons"] == (True, True), where
            assert out["skip_left_state"], where
            assert out["applied_steps"] == STEPS, where
            for worst, step_ok, frozen in out["formula"]:
                assert worst < 1e-6 and step_ok and frozen, (where, worst, step_ok, frozen)
            # Exact error compensation, and a test that can fail: the residuals are large.
            assert out["invariant"] < 1e-4, (where, out["invariant"])
            assert out["residual"] > 1e-2 and out["without_residual"] > 1e-2, (where, out)
            assert out["replicas_equal"], where
            assert "applied_steps" in out["keys"] and "worker_error/w1" in out["keys"]
