"""The GPU cost model on the CPU: the traffic rules, fused kernels as custom ops, the report.

``tests/helpers/strict_device.py`` counts each device op's memory traffic (its docstring has
the rules) and ``benchmarks/gpu_cost.py`` reports launches, traffic as a ratio to a copy and
host time per method step. Here: the rules on known ops, a fused kernel registered as a
``torch.library`` custom op counted as one op with exactly its own traffic, one quick run of
the benchmark (schema and known values: a copy costs 1.0, the dense reducer launches nothing
beside its collective, DiLoCo adds nothing between outer syncs), and the traffic targets of
the fused kernels, expected to fail (strict) until the kernels land. Host times are reported,
never asserted.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from tests.helpers.strict_device import DEVICE, StrictDeviceMode, run_ranks

N = 1000
F32, BF16 = 4, 2


def _costs(fn):
    """``[(op, read, written), ...]`` of the device ops ``fn`` issues in one step."""
    with StrictDeviceMode() as mode:
        with mode.step("s") as record:
            fn()
    return [(c.op.split(".")[1], c.read, c.written) for c in record.op_costs]


def test_traffic_rules_on_known_ops():
    x, y = (torch.empty(N, device=DEVICE) for _ in range(2))
    m, v = torch.empty(10, 20, device=DEVICE), torch.empty(20, device=DEVICE)
    i = torch.empty(10, dtype=torch.long, device=DEVICE)
    src = torch.empty(10, device=DEVICE)
    w, o = torch.empty(20, 10, device=DEVICE), torch.empty(10, 10, device=DEVICE)
    cases = {
        # elementwise: every distinct input read, the output written; x + x reads x once
        "add": (lambda: x + y, [("add", 2 * N * F32, N * F32)]),
        "same-input": (lambda: x + x, [("add", N * F32, N * F32)]),
        # in place reads and writes self; a broadcast (stride-0) operand counts once
        "inplace": (lambda: x.add_(y), [("add_", 2 * N * F32, N * F32)]),
        "broadcast": (lambda: m.add_(v.expand(10, 20)), [("add_", 220 * F32, 200 * F32)]),
        # write-only ops and copies do not read their destination; a cast writes its dtype
        "zero": (lambda: x.zero_(), [("zero_", 0, N * F32)]),
        "normal": (lambda: x.normal_(), [("normal_", 0, N * F32)]),
        "copy": (lambda: y.copy_(x), [("copy_", N * F32, N * F32)]),
        "cast": (lambda: x.to(torch.bfloat16), [("_to_copy", N * F32, N * BF16)]),
        # out= is written, not read
        "out": (lambda: torch.mm(m, w, out=o), [("mm", 400 * F32, 100 * F32)]),
        # gather reads only what it outputs (+ the index); scatter writes only the values
        "gather": (lambda: x.index_select(0, i), [("index_select", 10 * F32 + 80, 10 * F32)]),
        "scatter": (lambda: x.index_copy_(0, i, src), [("index_copy_", 10 * F32 + 80, 10 * F32)]),
        "accumulate": (lambda: x.index_add_(0, i, src), [("index_add_", 20 * F32 + 80, 10 * F32)]),
        # views cost nothing (no device op)
        "views": (lambda: (x.view(10, 100).t(), x[3:7], x.unsqueeze(0)), []),
    }
    for name, (fn, expected) in cases.items():
        assert _costs(fn) == expected, name
    # a reduction reads its input and writes its small output
    assert _costs(lambda: x.sum()) == [("sum", N * F32, F32)]


def test_parts_and_collectives_are_kept_apart():
    def body(rank, mode):
        x = torch.empty(N, device=DEVICE)
        with mode.step("s") as record:
            x.mul_(2)  # scaffolding: no part
            with mode.part("method"):
                x.add_(1)
                dist.all_reduce(x)
        return record

    (run,) = run_ranks(2, body, ranks=[0])
    record = run.result
    assert record.launches() == 2 and record.launches(["method"]) == 1
    assert record.traffic(["method"]) == 2 * N * F32
    assert record.traffic() == 4 * N * F32  # collectives are not memory traffic
    assert record.collective_bytes(["method"]) == N * F32 and record.collective_bytes([None]) == 0


# -- a fused kernel is one op with its own traffic ---------------------------------------------


@torch.library.custom_op("megatron_ext_test::fused_axpby_", mutates_args=("y",))
def _fused_axpby_(x: torch.Tensor, y: torch.Tensor, a: float, b: float) -> None:
    """``y <- a x + b y`` in one kernel (the test's stand-in for a Triton kernel)."""
    y.mul_(b).add_(x, alpha=a)


@_fused_axpby_.register_fake
def _(x, y, a, b):
    return None


@torch.library.custom_op("megatron_ext_test::fused_scale_cast", mutates_args=())
def _fused_scale_cast(x: torch.Tensor, s: float) -> torch.Tensor:
    """``bf16(s x)`` in one kernel."""
    return (x * s).to(torch.bfloat16)


@_fused_scale_cast.register_fake
def _(x, s):
    return torch.empty_like(x, dtype=torch.bfloat16)


def test_fused_custom_op_counts_as_one_op_with_its_own_traffic():
    x, y = (torch.empty(N, device=DEVICE) for _ in range(2))
    # Eager: two launches, y read twice and written twice.
    eager = _costs(lambda: y.mul_(0.5).add_(x, alpha=2.0))
    assert [c[0] for c in eager] == ["mul_", "add_"]
    assert sum(r + w for _, r, w in eager) == 5 * N * F32
    # Fused (mutates y): one launch reading x and y, writing y.
    assert _costs(lambda: _fused_axpby_(x, y, 2.0, 0.5)) == [("fused_axpby_", 2 * N * F32, N * F32)]
    # Fused with an output of its own: reads x, writes the bf16 result.
    eager = _costs(lambda: (x * 3.0).to(torch.bfloat16))
    assert sum(r + w for _, r, w in eager) == 2 * N * F32 + N * F32 + N * BF16
    assert _costs(lambda: _fused_scale_cast(x, 3.0)) == [("fused_scale_cast", N * F32, N * BF16)]


@torch.library.custom_op("megatron_ext_test::fused_gather_add", mutates_args=())
def _fused_gather_add(x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x + table[ids]`` in one kernel (reads only the addressed rows of ``table``)."""
    return x + table[ids]


@_fused_gather_add.register_fake
def _(x, ids, table):
    return torch.empty_like(x)


def test_fused_custom_op_gathering_rows_reads_only_those_rows():
    from megatron_ext.kernels import ROW_GATHERS

    x, table = torch.empty(10, 20, device=DEVICE), torch.empty(N, 20, device=DEVICE)
    ids = torch.empty(10, dtype=torch.long, device=DEVICE)
    whole = (10 * 20 * F32 + 80 + N * 20 * F32, 10 * 20 * F32)
    assert _costs(lambda: _fused_gather_add(x, ids, table)) == [("fused_gather_add", *whole)]
    ROW_GATHERS["megatron_ext_test::fused_gather_add"] = ("table", "ids")
    try:
        rows = (2 * 10 * 20 * F32 + 80, 10 * 20 * F32)
        assert _costs(lambda: _fused_gather_add(x, ids, table)) == [("fused_gather_add", *rows)]
    finally:
        del ROW_GATHERS["megatron_ext_test::fused_gather_add"]


# -- the benchmark -----------------------------------------------------------------------------

EXPECTED = [
    "copy",
    "none",
    "separate",
    "powersgd",
    "quantized",
    "radius",
    "aqsgd-forward",
    "aqsgd-backward",
    "directq-forward",
    "directq-backward",
    "grass",
    "grass-dense",
    "protocol-forward",
    "protocol-backward",
    "protocol-optimizer",
    "diloco-inner",
    "diloco-outer",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One quick run (gpt-tiny, one host-time step), read back from its JSON."""
    from benchmarks.gpu_cost import main

    path = tmp_path_factory.mktemp("gpu_cost") / "cost.json"
    argv = ["--quick", "--models", "gpt-tiny", "--repeats", "1", "--offenders", "0"]
    main(argv + ["--json", str(path)])
    with open(path) as f:
        return json.load(f)


def test_report_schema_and_known_values(report):
    methods = report["methods"]
    assert list(methods) == EXPECTED
    for name, m in methods.items():
        assert isinstance(m["launches_per_step"], int) and m["launches_per_step"] >= 0, name
        assert isinstance(m["traffic_vs_copy"], float) and m["traffic_vs_copy"] >= 0, name
        assert isinstance(m["host_ms"], float) and m["host_ms"] >= 0, name  # not a timing check
        assert m["model"] == "gpt-tiny" and m["unit"] and m["denominator"], name
        for dtype, r in m["detail"]["gpt-tiny"].items():
            # the parts add up; a steady step shows no finding
            assert sum(r["launches_by_part"].values()) == r["launches_per_step"], (name, dtype)
            assert math.isclose(sum(r["traffic_vs_copy_by_part"].values()), r["traffic_vs_copy"])
            assert r["findings"] == [], (name, dtype, r["findings"])
    # DP reducers: a --bf16 run reduces fp32 buckets; codecs and Grass work in bf16
    assert methods["separate"]["dtype"] == "fp32" and methods["aqsgd-forward"]["dtype"] == "bf16"
    for dtype in ("fp32", "bf16"):
        copy = methods["copy"]["detail"]["gpt-tiny"][dtype]
        assert copy["launches_per_step"] == 1 and copy["traffic_vs_copy"] == 1.0
        # the dense reducer: megatron-core's collective only, no device op of its own
        none = methods["none"]["detail"]["gpt-tiny"][dtype]
        assert none["launches_per_step"] == 0 and none["traffic_bytes"] == 0
        assert none["collective_bytes"] == none["denominator_bytes"] // 2
        assert methods["grass-dense"]["detail"]["gpt-tiny"][dtype]["traffic_vs_copy"] == 1.0
    # DiLoCo adds nothing to a step between outer syncs; its outer step works
    assert methods["diloco-inner"]["launches_per_step"] == 0
    assert methods["diloco-outer"]["launches_per_step"] > 0
    # every compressing method costs more than nothing, and names its top ops
    for name in ("separate", "powersgd", "quantized", "aqsgd-forward", "grass"):
        assert methods[name]["traffic_vs_copy"] > 0
        assert methods[name]["detail"]["gpt-tiny"]["fp32"]["top_by_traffic"], name


# Measured on the current code (gpt-tiny here; gpt2-345m in docs/performance/cost): the rows
# still over their target after the fused kernels, and why. A fix turns a row into an XPASS
# failure: then drop the mark.
_OVER_TARGET = {
    # Fused (fp32 buckets 2.6x). bf16 buckets cannot reach 3: the fp32 error read and written
    # every step is already 2 copies of a bf16 bucket, the gradient read and written 1 more,
    # P 0.125; the decompress kernel's in-place write counts as a read too (as every mutated
    # custom-op argument does).
    ("separate", "bf16"): "3.78x a copy (gpt2-345m 3.76x): the fp32 error alone is 2 copies",
    # Fused (megatron_ext/kernels/quant.py), and at its floor: the exchange is error
    # compensated, so per fp32 element the gradient is read (4 B), the worker error read and
    # written (8 B), the output written (4 B), plus the codes and the server's share: 18.6 B
    # against a copy's 8 B, 2.32 at gpt2-345m. A target of 2 holds only without error feedback.
    ("quantized", "fp32"): "2.32x a copy (gpt-tiny, fused): the error feedback's floor",
    ("quantized", "bf16"): "3.65x a copy (gpt-tiny, fused)",
    # Fused on the whole buffer (rows read inside the kernels, updated in place at the
    # commit): at the floor of a step-level commit. Per microbatch of A activation bytes and
    # P payload bytes: the sender reads x and its rows (2A), the receiver the payload and its
    # rows and writes its activations (2A + P), and the commit on each side reads the payload
    # and the rows and writes the rows (2 x (2A + P)): 8A + 4P against a copy's 2A, 4 + 2P/A
    # (P/A = 1/8 fp32, 1/4 bf16 at 4 bits). No design reaches 2: the algorithm itself reads
    # x and both sides' rows and writes both rows and the activations (6A = 3 copies).
    ("aqsgd-forward", "fp32"): "4.26x a copy (gpt-tiny, fused; gpt2-345m 4.25x): floor 4 + 2P/A",
    ("aqsgd-forward", "bf16"): "4.52x a copy (gpt-tiny, fused; gpt2-345m 4.50x): floor 4 + 2P/A",
    # Fused (megatron_ext/kernels/subspace.py): both sides read T_fixed[ids] and the payload
    # travels too, 2 + (4k + 24) / (4d) copies at the least (gpt-tiny's k / d is large).
    ("protocol-forward", "fp32"): "2.26x a copy (gpt2-345m 2.04x): T_fixed's rows read twice",
    ("protocol-forward", "bf16"): "2.40x a copy (gpt2-345m 2.04x): T_fixed's rows read twice",
}


def _target_params():
    from benchmarks.gpu_cost import TARGETS

    out = []
    for name in TARGETS:
        for dtype in ("fp32", "bf16"):
            reason = _OVER_TARGET.get((name, dtype))
            marks = pytest.mark.xfail(strict=True, reason=reason) if reason else ()
            out.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return out


@pytest.mark.parametrize("name, dtype", _target_params())
def test_traffic_within_target(report, name, dtype):
    """SEPARATE's compress + decompress + error feedback within 3 copies of traffic; the
    quantizer and each codec direction (AQ-SGD, DirectQ, Protocol) within 2."""
    from benchmarks.gpu_cost import TARGETS

    measured = report["methods"][name]["detail"]["gpt-tiny"][dtype]["traffic_vs_copy"]
    assert measured <= TARGETS[name], f"{name} {dtype}: {measured:.2f}x a copy"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--models", "gpt-huge"], "--models"),
        (["--methods", "separate,fused"], "--methods"),
        (["--dp-size", "0"], "--dp-size"),
        (["--bucket-size", "-1"], "--bucket-size"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, flag, capsys):
    from benchmarks.gpu_cost import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
