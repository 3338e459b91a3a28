"""Strict-device mode: each method's steady-state step on stand-in device tensors.

Every test runs a method's public classes the way ``megatron_ext/megatron`` drives them, on
``meta`` tensors under :class:`tests.helpers.strict_device.StrictDeviceMode`, with "ranks"
run one after another on torch's fake process group. A steady-state step must show no
finding (a CPU tensor meeting a device tensor, a CPU generator for device tensors, a host
sync, a data-dependent shape, a host-to-device copy, a collective on a CPU tensor or in a
dtype/reduction NCCL refuses), issue the same collectives on every rank, and stay within
its launch budget (a DP bucket's device ops do not grow with its parameters, with matrices of
one shape or with the data-parallel size). Selection/update steps every K steps are declared
``sync_ok``. The steps themselves are ``tests/helpers/method_steps.py``'s, which the cost
model (``benchmarks/gpu_cost.py``) runs at model shapes.

Tests that fail on the current code are marked ``xfail(strict=True)`` with the finding as
the reason: each turns into an XPASS failure the moment its fix lands (then drop the mark).
What this mode cannot prove (values, streams, speed) is in the helper's docstring.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.method_steps import (
    CodecBoundary,
    DiLoCoView,
    diloco_hook,
    diloco_steps,
    dp_body,
    grass_steps,
    protocol_stage,
    protocol_steps,
    states_view,
    to_cpu as _to_cpu,
)
from tests.helpers.strict_device import (
    DEVICE,
    StrictDeviceMode,
    compare_ranks,
    format_findings,
    run_ranks,
)


def _assert_clean(records, what="steady-state step"):
    """No undeclared finding in ``records`` (StepRecords)."""
    bad = [f for r in records for f in r.violations]
    assert not bad, f"{what} findings:\n{format_findings(bad)}"


# -- positive control ----------------------------------------------------------------------


def test_mode_catches_each_class_on_a_deliberately_bad_step():
    def body(rank, mode):
        x = torch.zeros(8, device=DEVICE)
        with mode.step("bad") as bad:
            x[torch.tensor([1, 2])]  # CPU index on a device tensor
            x[[1, 2]]  # a Python list as index: copied to the device below the dispatcher
            torch.tensor([1.0, 2.0], device=DEVICE)  # host data built on the device
            x.tolist()  # device-to-host copy
            x.sum().item()  # host sync
            x.copy_(torch.ones(8))  # host-to-device copy
            x[x > 0]  # data-dependent shape
            torch.rand(3, generator=torch.Generator(), device=DEVICE)  # CPU generator
            dist.all_reduce(torch.ones(3))  # collective on a CPU tensor
            dist.all_reduce(torch.ones(3, dtype=torch.int32, device=DEVICE), op=dist.ReduceOp.AVG)
            if rank == 1:
                dist.all_reduce(x)  # only one rank: sequences differ
        with mode.step("selection", sync_ok=True) as declared:
            x.sum().item()
            x.copy_(torch.ones(8))
            x + torch.ones(8)  # declared steps may sync, never mix devices
        with mode.step("good") as good:
            y = x * 2 + torch.tensor(2.0)  # a 0-dim CPU operand is fine (CUDA allows it)
            dist.all_reduce(y)
        return bad, declared, good

    runs = run_ranks(2, body)
    bad, declared, good = runs[0].result
    kinds = {f.kind for f in bad.violations}
    assert kinds == {
        "cpu-tensor",
        "host-sync",
        "h2d-copy",
        "data-dependent-shape",
        "cpu-generator",
        "collective-cpu",
        "collective-unsupported",
    }, format_findings(bad.findings)
    ops = {f.op for f in bad.findings}
    assert {"Tensor.__getitem__", "torch.tensor", "aten._to_copy.default"} <= ops
    assert all(f.where.startswith("tests/unit/test_strict_device.py") for f in bad.findings)
    assert {f.kind for f in declared.findings if f.declared} == {"host-sync", "h2d-copy"}
    assert [f.kind for f in declared.violations] == ["cpu-tensor"]
    assert not good.findings
    assert good.device_ops == ["aten.mul.Tensor", "aten.add.Tensor"]
    assert len(good.collectives) == 1 and good.collectives[0].reduce_op == "SUM"
    problems = compare_ranks(runs)
    assert len(problems) == 1 and "step 1 (bad)" in problems[0]


@pytest.mark.parametrize(
    "dtype, reduce_op, refused",
    [
        (torch.float64, "SUM", False),
        (torch.bfloat16, "AVG", False),
        (torch.uint8, None, False),  # all-gather / all-to-all of packed codes
        (torch.bool, "SUM", False),  # travels as uint8, reduced with max
        (torch.bool, "AVG", True),
        (torch.int32, "AVG", True),
        (torch.int16, "SUM", True),
        (torch.int16, None, True),
        (torch.float32, "BAND", True),
        (torch.int64, "PREMUL_SUM", True),
        (torch.float16, "PREMUL_SUM", False),
    ],
)
def test_nccl_support_rules(dtype, reduce_op, refused):
    from tests.helpers.strict_device import nccl_unsupported

    assert bool(nccl_unsupported(dtype, reduce_op)) == refused


# -- data-parallel reducers: GradReducer.bind(BucketGroupSpec), launch(step), wait ----------

# (fqn, shape) in bucket order, as in tests/distributed/test_grad_reducers.py.
PARAMS = [("w1", (8, 64)), ("b1", (64,)), ("w2", (16, 32)), ("ln", (32,))]

# method -> (options, steps, names of the steps: "steady" must be clean, others declared)
DP_METHODS = {
    "separate": ({"ratio": 4, "block_size": 32, "reset_interval": 3}, 4, None),
    "powersgd": ({"approx_rank": 2, "start_step": 1}, 4, None),
    "quantized": ({"bits": 4, "block_size": 32}, 3, None),
    "radius": ({"density": 0.25, "interval": 3, "dense_steps": 1}, 6, None),
}


def _dp_body(method, kw, steps, *, params=PARAMS, **kwargs):
    """A rank's run (tests.helpers.method_steps.dp_body): one bucket of ``params`` (dtype,
    reduction, reduce-scatter, resume as ``kwargs``), then ``steps`` launch/wait steps; dense
    steps before a method's start are checked like the others, selection steps are
    declared."""
    return dp_body(method, kw, steps, params=params, **kwargs)


def _dp_runs(method, world=2, **kwargs):
    kw, steps, _ = DP_METHODS[method]
    return run_ranks(world, _dp_body(method, kw, steps, **kwargs))


_DP_STEADY_FINDINGS = {
    # Fixed: SEPARATE drew each step's projection on the CPU (float64 randn + QR in
    # compressors/separate.py projection_block) and copied it to the device (h2d-copy); it
    # now draws and orthonormalizes it on the device with a device generator.
    "separate": None,
    "powersgd": None,
    "quantized": None,
    # Fixed: Radius built its send index lazily in the first sparse step after a selection
    # (torch.nonzero, boolean masks per owner shard): now built in the selection step.
    "radius": None,
}


def _xfail_if(reason):
    return pytest.mark.xfail(strict=True, reason=reason) if reason else ()


@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=_xfail_if(r)) for m, r in _DP_STEADY_FINDINGS.items()],
)
def test_dp_reducer_steady_step_stays_on_device(method, reduce_scatter):
    runs = _dp_runs(method, reduce_scatter=reduce_scatter)
    for run in runs:
        _assert_clean(run.mode.steps, f"{method} rank {run.rank}")


_LAYOUTS = {
    "all_reduce": dict(world=2),
    "reduce_scatter": dict(world=2, reduce_scatter=True),
    # megatron's average_in_collective with bf16 gradient buffers, 4 shards of unequal
    # selected counts (Radius pads them)
    "reduce_scatter-avg-bf16-4ranks": dict(
        world=4, reduce_scatter=True, op=dist.ReduceOp.AVG, dtype=torch.bfloat16
    ),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("method", list(DP_METHODS))
def test_dp_reducer_collectives_agree_across_ranks_and_suit_nccl(method, layout):
    runs = _dp_runs(method, **_LAYOUTS[layout])
    assert not compare_ranks(runs)
    world = _LAYOUTS[layout]["world"]
    for run in runs:
        bad = [f for f in run.mode.findings if f.kind.startswith("collective")]
        assert not bad, format_findings(bad)
        assert all(c.group_size == world for s in run.mode.steps for c in s.collectives)
        assert all(s.collectives for s in run.mode.steps if s.name != "setup")


_DP_RESUME_FINDINGS = {
    "separate": _DP_STEADY_FINDINGS["separate"],
    # Fixed: PowerSGD's load_state_dict moves the warm start q to the gradient's device (it
    # stayed on the CPU after a CPU-mapped checkpoint and met the device gradient in aten.mm).
    "powersgd": None,
    "quantized": None,
    # Fixed: Radius kept CPU-loaded masks on the CPU and copied them into device buffers
    # in the first sparse step; load_state_dict moves them and builds the index.
    "radius": None,
}


@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=_xfail_if(r)) for m, r in _DP_RESUME_FINDINGS.items()],
)
def test_dp_reducer_resumed_from_cpu_loaded_state_steps_on_device(method):
    kw, steps, _ = DP_METHODS[method]
    first = run_ranks(2, _dp_body(method, kw, steps))
    resumed = run_ranks(2, _dp_body(method, kw, 3, resume_from=(first[0].result, steps)))
    for run in resumed:
        _assert_clean(run.mode.steps, f"{method} resumed, rank {run.rank}")
    assert not compare_ranks(resumed)


# -- launch budgets: device ops per bucket ---------------------------------------------------
#
# A bucket's steady step must launch a number of device ops that does not depend on how many
# parameters the bucket holds, on how many matrices share a shape, or on the data-parallel
# size (benchmarks/gpu_cost.py reports the counts at model shapes). Rank 0 is enough: the
# ranks' collectives are compared above.

_BUDGET_METHODS = {"none": ({}, 2, None), **DP_METHODS}


def _steady_ops(method, world=2, **kwargs):
    """Device ops of rank 0's last steady step of ``method``."""
    kw, steps, _ = _BUDGET_METHODS[method]
    runs = run_ranks(world, _dp_body(method, kw, steps, **kwargs), ranks=[0])
    return len([s for s in runs[0].mode.steps if s.name == "steady"][-1].device_ops)


# Fixed: the quantized exchange looped over peers in Python (101 device ops at DP 2, 155 at
# DP 4, 263 at DP 8); it now packs, unpacks and dequantizes every peer's partition as one batch.
_DP_SIZE_FINDINGS: dict = {}


@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=_xfail_if(_DP_SIZE_FINDINGS.get(m))) for m in _BUDGET_METHODS],
)
def test_dp_reducer_device_ops_per_bucket_do_not_grow_with_dp_size(method):
    ops = {w: _steady_ops(method, world=w) for w in (2, 4, 8)}
    assert ops[2] == ops[4] == ops[8], ops


def _same_shape_params(count):
    """``count`` weight matrices of one shape and a bias."""
    return [(f"w{i}", (16, 32)) for i in range(count)] + [("b", (32,))]


def _mixed_params(count):
    """``count`` times a weight matrix, its bias and a norm, as a layer holds them."""
    return [
        p for i in range(count) for p in ((f"w{i}", (16, 32)), (f"b{i}", (32,)), (f"ln{i}", (16,)))
    ]


_GROWTH = {"same-shape-matrices": _same_shape_params, "parameters": _mixed_params}

# Fixed: PowerSGD looped per matrix (11 device ops and two QRs each: 25 ops at 2 matrices of
# one shape, 69 at 6); it now batches the matrices of one shape (bmm, batched QR). Fixed:
# SEPARATE packed and unpacked each weight with its own copy_ (12 ops at 2 matrices, 20 at
# 6); one fused _foreach_copy_ each way now. Fixed: SEPARATE and PowerSGD checked each 1-D
# parameter (biases, norms) for non-finite values on its own (isfinite as eq, abs, ne, mul,
# then logical_not, any) and copied it back on its own (55 device ops at 2 x (matrix, bias,
# norm), 111 at 6); now one gather packs the leftovers, one scatter writes them back, and
# the flag reads each packed buffer once (aminmax).
_PARAM_COUNT_FINDINGS: dict = {}


@pytest.mark.parametrize(
    "method, growth",
    [
        pytest.param(m, g, marks=_xfail_if(_PARAM_COUNT_FINDINGS.get((m, g))), id=f"{m}-{g}")
        for m in _BUDGET_METHODS
        for g in _GROWTH
    ],
)
def test_dp_reducer_device_ops_per_bucket_do_not_grow_with_parameters(method, growth):
    ops = {k: _steady_ops(method, params=_GROWTH[growth](k)) for k in (2, 6)}
    assert ops[2] == ops[6], ops


# -- AQ-SGD and DirectQ codecs (pipeline activations), both directions ---------------------

SEQ, HIDDEN, MBS, NMB, NUM = 8, 16, 2, 2, 8


def _boundary(method, **options):
    """Sender (stage 0) and receiver (stage 1) of one boundary, device buffers
    (tests.helpers.method_steps.CodecBoundary)."""
    return CodecBoundary(
        method,
        seq=SEQ,
        micro_batch=MBS,
        hidden=HIDDEN,
        num_microbatches=NMB,
        num_samples=NUM,
        **options,
    )


@pytest.mark.parametrize(
    "method, rounding",
    [
        # Fixed: AQ-SGD copied small host index tensors to the device per microbatch and
        # read the finite mask on the host at the commit; begin_step now prepares every
        # microbatch's indices in one copy and the commit stays on the device.
        pytest.param("aqsgd", "nearest"),
        pytest.param("aqsgd", "stochastic"),
        pytest.param("directq", "nearest"),
        pytest.param("directq", "stochastic"),  # fixed: the generator is on the device
    ],
)
def test_pipeline_codec_steps_stay_on_device(method, rounding):
    with StrictDeviceMode() as mode:
        boundary = _boundary(method, rounding=rounding)
        # Two epochs: first visits (full precision), then revisits (quantized deltas).
        boundary.steps(mode, 2 * boundary.steps_per_epoch)
    _assert_clean(mode.steps)
    assert mode.named("microbatch") and all(s.device_ops for s in mode.named("microbatch"))
    for record in mode.named("begin_step"):  # two codecs: at most one copy each way each
        kinds = [f.kind for f in record.findings]
        assert kinds.count("h2d-copy") <= 2 and kinds.count("host-sync") <= 2, kinds


def test_aqsgd_resumed_from_cpu_loaded_buffers_steps_on_device():
    with StrictDeviceMode() as mode:
        boundary = _boundary("aqsgd", checkpoint_buffers=True)
        boundary.steps(mode, 2)
        states = [_to_cpu(c.state_dict()) for c in (boundary.sender, boundary.receiver)]
        boundary = _boundary("aqsgd", checkpoint_buffers=True)
        with mode.step("load", sync_ok=True):
            boundary.sender.load_state_dict(states[0])
            boundary.receiver.load_state_dict(states[1])
        boundary.steps(mode, 2, first=2)
    _assert_clean(mode.steps)


def test_aqsgd_middle_stage_prepares_both_sides_in_one_copy():
    """A middle stage holds a receive and a send buffer: its begin_step copies both sides'
    indices to the device at once, and its microbatches and commit stay clean."""
    from megatron_ext.collectives.aqsgd import AQSGDCodec
    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.methods.aqsgd import AQSGDConfig
    from tests.helpers.aqsgd_samples import fixed_samples

    samples = fixed_samples(NUM, MBS, NMB, SEQ)
    with StrictDeviceMode() as mode:
        first, middle, last = (AQSGDCodec(AQSGDConfig(), None) for _ in range(3))
        for stage, codec in enumerate((first, middle, last)):
            codec.allocate(samples, SEQ, HIDDEN, stage=stage, num_stages=3, device=DEVICE)
        for step in range(2 * NUM // (NMB * MBS)):
            base = (step * NMB * MBS) % NUM

            def ids_of(mb, base=base):
                return torch.arange(base + mb * MBS, base + (mb + 1) * MBS)

            with mode.step("begin_step", sync_ok=True) as begin:
                middle.begin_step(ids_of)
            first.begin_step(ids_of), last.begin_step(ids_of)  # outside the record
            for mb in range(NMB):
                fwd = P2PContext("forward", mb, ids_of(mb), step, False)
                x = torch.randn(SEQ, MBS, HIDDEN, device=DEVICE)
                with mode.step("microbatch"):
                    shape = tuple(x.shape)
                    middle.payload_spec(shape, x.dtype, fwd)
                    y = middle.decode(first.encode(x, fwd), fwd, shape, x.dtype)
                    last.payload_spec(shape, x.dtype, fwd)
                    last.decode(middle.encode(y, fwd), fwd, shape, x.dtype)
            with mode.step("end_step"):
                first.end_step(), middle.end_step(), last.end_step()
            assert [f.kind for f in begin.findings].count("h2d-copy") == 1
    _assert_clean(mode.steps)


# -- Grass: forward/backward, selection, optimizer write -----------------------------------

from tests.helpers.grass import GRASS_K, GrassView as _GrassView, grass_setup  # noqa: E402


def _grass_setup(method, reset=True):
    """Two projected layers (a row- and a column-projected one) with their virtual
    parameters on the device and the optimizer hook (``tests.helpers.grass``)."""
    return grass_setup(method, reset, DEVICE, lambda i, shape: torch.randn(shape, device=DEVICE))


def _grass_steps(mode, layers, hook, view, steps, first=0):
    """Training steps (tests.helpers.method_steps.grass_steps): begin_step, two microbatches
    of forward/backward through grass_linear, pre_step, an Adam-like device update of V,
    post_step (selection every GRASS_K steps, declared ``sync_ok``)."""
    grass_steps(mode, layers, hook, view, steps, first, microbatches=2, tokens=4)


# Fixed: Grass kept its selection on the CPU and copied it per layer per microbatch.
@pytest.mark.parametrize(
    "method, reset",
    [("topr", True), ("norm", True), ("uniform-nr", True), ("topr", False), ("norm", False)],
    ids=["topr", "norm", "uniform-nr", "topr-keep-moments", "norm-keep-moments"],
)
def test_grass_steady_steps_stay_on_device(method, reset):
    # keep-moments: --no-grass-reset-state moves the moments with their rows at a selection
    # and corrects each slot's bias from its own count in the steady steps.
    def body(rank, mode):
        layers, hook = _grass_setup(method, reset)
        view = _GrassView(layers)
        _grass_steps(mode, layers, hook, view, steps=2 * GRASS_K + 1)
        return None

    runs = run_ranks(2, body)
    for run in runs:
        assert run.mode.named("select") and run.mode.named("steady")
        _assert_clean(run.mode.steps, f"grass rank {run.rank}")


@pytest.mark.parametrize("method", ["topr", "norm"])
def test_grass_collectives_agree_across_ranks_and_suit_nccl(method):
    def body(rank, mode):
        layers, hook = _grass_setup(method)
        _grass_steps(mode, layers, hook, _GrassView(layers), steps=GRASS_K + 1)

    runs = run_ranks(2, body)
    assert not compare_ranks(runs)
    selects = runs[0].mode.named("select")
    assert selects and all(s.collectives for s in selects)  # the sketch all-reduce
    for run in runs:
        bad = [f for f in run.mode.findings if f.kind.startswith("collective")]
        assert not bad, format_findings(bad)


def test_grass_resumed_from_cpu_loaded_state_steps_on_device():
    def body(rank, mode):
        layers, hook = _grass_setup("topr")
        _grass_steps(mode, layers, hook, _GrassView(layers), steps=2)
        state = _to_cpu(hook.state_dict())
        # The selection lives on the device now, so its saved values are made up by the
        # mode (meta holds none): give the loaded selection distinct rows, as a real one has.
        for key, value in state.items():
            if key.startswith("index/"):
                state[key] = torch.arange(value.numel(), dtype=value.dtype).view(value.shape)
        layers, hook = _grass_setup("topr")
        with mode.step("load", sync_ok=True):
            hook.load_state_dict(state)
        _grass_steps(mode, layers, hook, _GrassView(layers), steps=1, first=2)

    runs = run_ranks(2, body)
    for run in runs:
        _assert_clean(run.mode.steps, f"grass resumed, rank {run.rank}")


def _grass_steady_launches(layers_count, dtype, mode_name):
    """Launches of one steady step's parts: ``layers_count`` identical projected layers
    (bf16 or fp32 weights, fp32 ``main_grad``), top-r, two microbatches."""
    from tests.helpers.grass import GrassSpec

    shape = (8, 16) if mode_name == "row" else (16, 8)
    specs = [GrassSpec(f"l{i}.weight", shape, mode_name, 2) for i in range(layers_count)]

    def body(rank, mode):
        layers, hook = grass_setup(
            "topr",
            True,
            DEVICE,
            lambda i, shape: torch.zeros(shape, device=DEVICE, dtype=dtype),
            specs=specs,
            main_grad=True,
        )
        grass_steps(mode, layers, hook, _GrassView(layers), 2, microbatches=2, tokens=4)
        (steady,) = mode.named("steady")
        return {p: steady.launches([p]) for p in ("forward", "backward", "hook")}

    (run,) = run_ranks(1, body)
    return run.result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode_name", ["row", "col"])
def test_grass_launch_budget(dtype, mode_name):
    # Per layer and microbatch: the forward matmul; the input-gradient matmul, the gather of
    # the selected rows, the projected matmul and the add into main_grad (dense: 4). The
    # optimizer hook: 7 foreach ops for all layers (copy of V; sub, mul, add of the rescale;
    # the decay; the base decay; base + P V) and per layer only the scatter into its weight
    # (a bf16 weight: its cast too; column mode: base + P V too, whose operands differ in
    # layout).
    small, large = (_grass_steady_launches(n, dtype, mode_name) for n in (2, 4))
    for n, launches in ((2, small), (4, large)):
        assert launches["forward"] == n * 2, launches
        assert launches["backward"] == 4 * n * 2, launches
    per_layer = 1 + (dtype == torch.bfloat16) + (mode_name == "col")
    assert large["hook"] - small["hook"] == 2 * per_layer, (small, large)
    assert small["hook"] - 2 * per_layer == 7 - (mode_name == "col"), small


# -- Protocol Models: codec, optimizer correction, Grassmann step --------------------------

D, K, VOCAB, PM_UPDATE = 32, 4, 16, 3


def _protocol_stage(accumulate):
    """One stage (tests.helpers.method_steps.protocol_stage) over one constrained writer
    ``d x n`` and an embedding ``vocab x d``."""
    return protocol_stage(
        accumulate,
        d=D,
        k=K,
        vocab=VOCAB,
        params=[("writer.weight", (D, 12), 0), ("embedding.weight", (VOCAB, D), 1)],
        update_interval=PM_UPDATE,
        reproject_interval=2,
    )


def _protocol_steps(mode, first, last, steps, start=0):
    """Steps of both stages (tests.helpers.method_steps.protocol_steps); the Grassmann
    update every PM_UPDATE steps is declared ``sync_ok``."""
    protocol_steps(
        mode, first, last, steps, start, shape=(8, 2, D), vocab=VOCAB, update_interval=PM_UPDATE
    )


def test_protocol_steady_steps_stay_on_device_and_ranks_agree():
    def body(rank, mode):
        first, last = _protocol_stage(False), _protocol_stage(True)
        _protocol_steps(mode, first, last, steps=2 * PM_UPDATE)

    runs = run_ranks(2, body)
    assert not compare_ranks(runs)
    for run in runs:
        assert run.mode.named("update") and run.mode.named("steady")
        assert all(s.collectives for s in run.mode.named("update"))
        _assert_clean(run.mode.steps, f"protocol rank {run.rank}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_protocol_launch_budget(dtype):
    # The codec: one fused op per side and direction. The optimizer correction: 9 launches a
    # constrained parameter (its projections, coordinates, second-moment mean and write back,
    # coordinate update), 4 foreach ops for all of them.
    def launches(params):
        def body(rank, mode):
            kw = dict(d=D, k=K, vocab=VOCAB, update_interval=0, reproject_interval=0)
            first = protocol_stage(False, params=params, dtype=dtype, **kw)
            last = protocol_stage(True, params=[], accumulate=False, dtype=dtype, **kw)
            protocol_steps(
                mode, first, last, 1, shape=(8, 2, D), vocab=VOCAB, update_interval=0, dtype=dtype
            )
            (steady,) = mode.named("steady")
            return {p: steady.launches([p]) for p in ("forward", "backward", "hook")}

        (run,) = run_ranks(1, body)
        return run.result

    one = [("w0.weight", (D, 12), 0), ("w0.bias", (D,), 0), ("embedding.weight", (VOCAB, D), 1)]
    two = one + [("w1.weight", (D, 12), 0), ("w1.bias", (D,), 0), ("w2.weight", (D, 5), 0)]
    for params in (one, two):
        counts = launches(params)
        assert counts["forward"] == counts["backward"] == 2 * 2, counts  # 2 microbatches
        assert counts["hook"] == 9 * len(params) + 4, (len(params), counts)


def test_protocol_resumed_from_cpu_loaded_state_steps_on_device():
    def body(rank, mode):
        first, last = _protocol_stage(False), _protocol_stage(True)
        _protocol_steps(mode, first, last, steps=2)
        state = _to_cpu(last[1].subspace.state_dict())
        first, last = _protocol_stage(False), _protocol_stage(True)
        with mode.step("load", sync_ok=True):
            last[1].subspace.load_state_dict(state)
            first[1].subspace.load_state_dict(state)
        _protocol_steps(mode, first, last, steps=PM_UPDATE, start=2)

    runs = run_ranks(2, body)
    for run in runs:
        _assert_clean(run.mode.steps, f"protocol resumed, rank {run.rank}")


# -- DiLoCo: the outer step and its exchanges ----------------------------------------------

from megatron_ext.protocols import ParamOptimState  # noqa: E402

DILOCO_SHAPES = {"a.bias": (16,), "a.weight": (16, 8), "b.weight": (8, 16), "c.weight": (32, 8)}
DILOCO_H = 4


def _DiLoCoView(sharded):
    """bf16 model parameters with fp32 main copies on the device (whole, or this rank's half
    of each parameter); counts the parameter gathers."""
    return DiLoCoView(DILOCO_SHAPES, sharded)


def _diloco_steps(mode, hook, view, steps, first=0):
    diloco_steps(mode, hook, view, steps, first)


def _outer_checks(findings):
    """The reads of the outer update's non-finite flag (DiLoCoHook.finish_fragment: one per
    fragment applied) among ``findings``."""
    return [
        f
        for f in findings
        if f.kind == "host-sync"
        and f.detail.startswith("item()")
        and "optim/diloco/hook.py" in f.where
        and "(finish_fragment)" in f.where
    ]


def _diloco_hook(view, **options):
    return diloco_hook(view, interval=DILOCO_H, fragments=2, **options)


DILOCO_CASES = {
    "dense": dict(),
    "dense-overlapped": dict(delay=1),
    "dense-sharded": dict(),
    "dense-host-state": dict(state_device="cpu"),
    "quantized": dict(compression="quantized"),
    "radius": dict(compression="radius"),
    "separate": dict(compression="separate"),
    "powersgd": dict(compression="powersgd"),
}


@pytest.mark.parametrize("case", list(DILOCO_CASES))
def test_diloco_steps_between_outer_syncs_stay_on_device(case):
    """DiLoCo adds nothing to a step between outer syncs; the dense outer step reads one flag
    per fragment applied (declared: whether its update is finite, before anything is
    written); a compressed exchange syncs once more per exchange (declared: its non-finite
    check). The same collectives on every site."""
    options = DILOCO_CASES[case]

    def body(rank, mode):
        view = _DiLoCoView(sharded=case.endswith("sharded"))
        with mode.step("setup", sync_ok=True):
            hook = _diloco_hook(view, **options)
        _diloco_steps(mode, hook, view, steps=3 * DILOCO_H)
        hook.finish()
        return view.gathers, hook.syncs

    runs = run_ranks(2, body)
    assert not compare_ranks(runs)
    for run in runs:
        assert run.mode.named("steady") and run.mode.named("outer")
        gathers, applied = run.result
        # a parameter gather after each fragment sync applied (12 steps: 6, 5 overlapped)
        assert gathers == applied == (5 if options.get("delay") else 6)
        for s in run.mode.named("steady"):
            assert not s.findings and not s.collectives, format_findings(s.findings)
        _assert_clean(run.mode.steps, f"diloco {case}, rank {run.rank}")
        outer = [f for s in run.mode.named("outer") for f in s.findings]
        assert len(_outer_checks(outer)) == applied, format_findings(outer)
        if options.get("compression", "none") != "none":
            for s in run.mode.named("outer"):
                checks = _outer_checks(s.findings)
                syncs = [f for f in s.findings if f.kind == "host-sync" and f not in checks]
                assert len(syncs) == 1 and {f.kind for f in s.findings} == {"host-sync"}
        elif options.get("state_device") != "cpu":
            assert len(outer) == applied, format_findings(outer)  # nothing but the checks


def test_diloco_with_grass_steps_stay_on_device():
    """DiLoCo through Grass's outer view, bf16 weights (so the fp32 master copies): a step
    between outer syncs adds only the master copy's row write, the dense outer step (every
    projected weight written, rebased, V zeroed) stays on the device; Grass's selection
    steps are declared. The same collectives on every site."""
    from megatron_ext.autograd.grass import grass_linear
    from megatron_ext.optim.diloco import DiLoCoHook, fragment_due
    from megatron_ext.optim.grass import GrassOuterView
    from megatron_ext.options.outer import OuterConfig

    bf16 = torch.bfloat16

    def body(rank, mode):
        layers, grass = grass_setup(
            "topr", True, DEVICE, lambda i, shape: torch.randn(shape, device=DEVICE).to(bf16)
        )
        states = {}
        for fqn, layer in layers.items():
            layer.param = torch.nn.Parameter(torch.zeros_like(layer.param, dtype=bf16))
            states[f"{fqn}.grass_weight"] = ParamOptimState(
                fqn=f"{fqn}.grass_weight",
                model_param=layer.param,
                main_param=torch.zeros(layer.param.shape, device=DEVICE),
                state={"step": torch.tensor(0.0)},
                group={"lr": 1e-2, "weight_decay": 0.1},
            )

        view = states_view(states)
        wrap = lambda v: GrassOuterView(  # noqa: E731
            v, layers, param_fqn=lambda f: f"{f}.grass_weight", weight_fqn=lambda f: f
        )
        o = OuterConfig(interval=DILOCO_H)
        with mode.step("setup", sync_ok=True):
            outer = DiLoCoHook(o, dist.group.WORLD, view_wrappers=[wrap])
            outer.setup(view)
        for step in range(2 * DILOCO_H):
            view.step = step
            selecting = grass.schedule.is_selection_step(step)
            due = bool(fragment_due(step + 1, o.interval, o.fragments))
            name = "select" if selecting else "outer" if due else "steady"
            with mode.step(name, sync_ok=selecting or due):
                grass.begin_step(step)
                x = torch.randn(4, 16, device=DEVICE, dtype=bf16, requires_grad=True)
                h = grass_linear(x, layers["l0.weight"].weight, None, layers["l0.weight"])
                y = grass_linear(h, layers["l1.weight"].weight, None, layers["l1.weight"])
                y.float().sum().backward()
                outer.pre_step(view)  # the runtime's order: outer hooks first,
                grass.pre_step(view)
                for s in states.values():
                    s.main_param.add_(s.model_param.grad.float(), alpha=-1e-2)
                    s.model_param.grad = None
                    s.state["step"] += 1
                grass.post_step(view, True)  # ... their post_step last
                outer.post_step(view, True)
        return [layer.master is not None for layer in layers.values()]

    runs = run_ranks(2, body)
    assert not compare_ranks(runs)
    for run in runs:
        assert run.result == [True, True]
        assert run.mode.named("steady") and run.mode.named("outer") and run.mode.named("select")
        for s in run.mode.named("steady"):
            assert not s.findings, format_findings(s.findings)
        for s in run.mode.named("outer"):  # the outer update's non-finite check only
            assert len(_outer_checks(s.findings)) == len(s.findings) == 1, format_findings(
                s.findings
            )
        _assert_clean(run.mode.steps, f"diloco with grass, rank {run.rank}")


def test_diloco_resumed_from_cpu_loaded_state_steps_on_device():
    """A resume (state loaded from a CPU checkpoint, an overlapped exchange in flight)
    continues on the device."""

    def body(rank, mode):
        view = _DiLoCoView(sharded=False)
        with mode.step("setup", sync_ok=True):
            hook = _diloco_hook(view, delay=1)
        _diloco_steps(mode, hook, view, steps=DILOCO_H)  # fragment 0's exchange in flight
        assert hook.pending
        with mode.step("save", sync_ok=True):
            state = _to_cpu(hook.state_dict())
        view = _DiLoCoView(sharded=False)
        with mode.step("load", sync_ok=True):
            hook = _diloco_hook(view, delay=1)
            hook.load_state_dict(state)
        _diloco_steps(mode, hook, view, steps=DILOCO_H + 1, first=DILOCO_H)

    runs = run_ranks(2, body)
    assert not compare_ranks(runs)
    for run in runs:
        _assert_clean(run.mode.steps, f"diloco resumed, rank {run.rank}")
        found = [f for s in run.mode.steps if s.name in ("steady", "outer") for f in s.findings]
        found = [f for f in found if f not in _outer_checks(found)]
        assert not found, format_findings(found)
