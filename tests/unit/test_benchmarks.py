"""The benchmarks' pure helpers, their JSON layout, and a smoke run of the kernel benchmark.

The step-time and convergence benchmarks train for minutes and step time needs root
(netbench); here only their pure parts run: statistics of a run's log records, the final
loss, the equal-bytes PowerSGD rank, the flags they pass to the driver, and the refusal
when netbench cannot run.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import (
    common,
    convergence,
    grass_throughput,
    kernels,
    state_memory,
    step_time,
    subspace_overhead,
)
from tests.helpers.paths import REPO

# -- equal-bytes PowerSGD rank -------------------------------------------------------------


def test_equal_bytes_rank_matches_the_formula():
    # r = n m / (ratio (n + m)), rounded: 1000 x 1000 at ratio 16 -> 31.25 -> 31.
    assert common.equal_bytes_rank(1000, 1000, 16) == 31
    # 8192 x 256: 2097152 / (16 * 8448) = 15.5 -> 16 (round half to even gives 16 too).
    assert common.equal_bytes_rank(8192, 256, 16) == 16
    assert common.equal_bytes_rank(4, 4, 16) == 1  # at least 1
    with pytest.raises(ValueError):
        common.equal_bytes_rank(0, 4, 16)


def test_gpt_tiny_shapes_and_equal_bytes_rank():
    preset = common.load_model_preset("gpt-tiny")
    shapes = common.gpt_matrix_shapes(preset)
    matrices = sum(n * m for n, m in shapes)
    # The driver logs 7.39M parameters; 1-D parameters (biases, norms) are the rest.
    assert matrices + common.gpt_vector_numel(preset) == 7_386_624
    # sum(nm) / (16 sum(n + m)) = 7372800 / (16 * 33664) = 13.7 -> 14.
    assert common.equal_bytes_rank_for_shapes(shapes, 16) == 14


def test_squareish_shape():
    assert common.squareish_shape(100_000) == (250, 400)
    assert common.squareish_shape(10**8) == (10_000, 10_000)
    assert common.squareish_shape(13) == (1, 13)


# -- tables and JSON -----------------------------------------------------------------------


def test_format_table_aligns_and_marks_missing_values():
    text = common.format_table(["name", "value"], [["a", 1.23456], ["bb", None]], digits=2)
    lines = text.splitlines()
    assert lines[0] == "| name | value |"
    assert lines[1] == "|------|------:|"
    assert lines[2] == "| a    |  1.23 |"
    assert lines[3] == "| bb   |     - |"
    with pytest.raises(ValueError):
        common.format_table(["a", "b"], [[1]])


def _env():
    return {"device": "cpu (no GPU lent)"}


def test_report_schema_round_trip(tmp_path):
    report = common.make_report("kernels", {"ratio": 16}, [{"method": "copy"}], _env(), extra=1)
    path = common.write_report(report, str(tmp_path))
    assert os.path.basename(path) == "kernels.json"
    loaded = json.loads(Path(path).read_text())
    assert common.validate_report(loaded)["extra"] == 1
    assert loaded["schema_version"] == common.SCHEMA_VERSION


@pytest.mark.parametrize(
    "broken, message",
    [
        ({"schema_version": 1, "environment": {}, "settings": {}, "results": []}, "benchmark"),
        (
            {
                "benchmark": "nope",
                "schema_version": 1,
                "environment": {},
                "settings": {},
                "results": [],
            },
            "unknown benchmark",
        ),
        (
            {
                "benchmark": "kernels",
                "schema_version": 1,
                "environment": {},
                "settings": {},
                "results": {},
            },
            "results",
        ),
        (
            {
                "benchmark": "kernels",
                "schema_version": 99,
                "environment": {},
                "settings": {},
                "results": [],
            },
            "newer",
        ),
    ],
)
def test_validate_report_rejects_bad_layouts(broken, message):
    with pytest.raises(ValueError, match=message):
        common.validate_report(broken)


# -- step time and convergence statistics --------------------------------------------------


def _record(iteration, seconds, sent, dense, loss=5.0):
    return {
        "iteration": iteration,
        "step_time_s": seconds,
        "lm_loss": loss,
        "bytes_per_step_all_ranks": {
            "dp-grad": {"sent": sent, "dense_sent": dense},
            "other": {"sent": 32.0, "dense_sent": 32.0},
        },
    }


def test_summarize_run_separates_dense_and_compressed_steps():
    # Radius-like: 2 dense warm-up steps, a dense reselection step, then sparse steps.
    records = [_record(1, 9.0, 100, 100), _record(2, 3.0, 100, 100), _record(3, 3.2, 100, 100)]
    records += [_record(i, t, 40, 100) for i, t in zip(range(4, 9), (1.0, 1.2, 1.1, 0.9, 1.3))]
    s = step_time.summarize_run(records, skip=2)
    assert s["num_steady"] == 6
    assert (s["num_compressed"], s["num_dense"]) == (5, 1)
    assert s["step_s"] == pytest.approx(1.1)  # median of the compressed steps only
    assert s["median_dense_s"] == pytest.approx(3.2)
    assert s["mean_all_s"] == pytest.approx((3.2 + 1.0 + 1.2 + 1.1 + 0.9 + 1.3) / 6)
    assert s["bytes_per_step_all_ranks"]["dp-grad"] == {"sent": 40.0, "dense_sent": 100.0}


def test_summarize_run_dense_method_uses_all_steady_steps():
    records = [_record(i, t, 100, 100) for i, t in zip(range(1, 6), (5.0, 2.0, 3.0, 1.0, 2.0))]
    s = step_time.summarize_run(records, skip=2)
    assert s["step_kind"] == "dense"
    assert s["step_s"] == pytest.approx(2.0)  # median of 3.0, 1.0, 2.0


def test_aggregate_runs_pools_the_rounds():
    rounds = []
    for k, times in enumerate(((9.0, 9.0, 1.0, 1.2, 1.4), (9.0, 9.0, 2.0, 2.2, 2.4))):
        recs = [_record(i + 1, t, 40, 100) for i, t in enumerate(times)]
        run = {"layout": "dp2", "method": "separate", "bandwidth": "100mbit", "skip": 2}
        run.update(ok=True, exit_code=0, wall_s=10.0, run_dir=f"r{k + 1}")
        run["contention"] = {"foreign_cpu_share": 0.05 * (k + 1)}
        run.update(step_time.summarize_run(recs, skip=2))
        rounds.append(run)
    agg = step_time.aggregate_runs(rounds)
    assert agg["num_rounds"] == 2 and agg["ok"] and agg["num_steady"] == 6
    assert agg["round_step_s"] == pytest.approx([1.2, 2.2])
    assert agg["step_s"] == pytest.approx((1.4 + 2.0) / 2)  # median of the pooled 6 steps
    assert agg["contention"]["foreign_cpu_share"] == pytest.approx(0.1)
    assert agg["wall_s"] == 20.0
    rounds[1]["ok"], rounds[1]["exit_code"], rounds[1]["error_tail"] = False, 1, "boom"
    failed = step_time.aggregate_runs(rounds)
    assert not failed["ok"] and failed["exit_code"] == 1 and failed["error_tail"] == "boom"
    assert failed["step_s"] == pytest.approx(1.2)  # only the successful round is pooled


def test_final_loss_is_the_mean_of_the_last_fraction():
    assert convergence.final_loss([float(i) for i in range(1, 11)], 0.2) == pytest.approx(9.5)
    assert convergence.final_loss([4.0], 0.1) == 4.0
    assert convergence.final_loss([], 0.1) is None


def test_driver_flags_of_the_methods():
    args = step_time.build_parser().parse_args([])
    cmd = step_time.train_command(args, "powersgd", pp=1, iters=12, run_dir="/tmp/x")
    joined = " ".join(cmd)
    assert "--powersgd-approx-rank 14 --powersgd-start-step 2" in joined
    assert "--global-batch-size 8" in joined and "--num-threads 1" in joined
    assert "--pipeline-model-parallel-size" not in joined
    cmd = step_time.train_command(args, "none", pp=2, iters=12, run_dir="/tmp/x")
    assert "--pipeline-model-parallel-size 2" in " ".join(cmd)
    cargs = convergence.build_parser().parse_args([])
    flags = " ".join(convergence.method_flags("radius", cargs))
    # Radius's benchmark defaults: dense for 20% of 300 steps, reselection every 50.
    assert "--radius-dense-steps 60" in flags and "--radius-interval 50" in flags
    assert "--radius-density 0.4" in flags
    # A given option wins over the benchmark default.
    cargs = convergence.build_parser().parse_args(["--radius-interval", "7"])
    assert "--radius-interval 7" in " ".join(convergence.method_flags("radius", cargs))
    cargs = convergence.build_parser().parse_args([])
    assert convergence.label("separate", cargs) == "separate-16"
    gargs = convergence.build_parser().parse_args(["--extra-train-args=--separate-adaptive"])
    assert convergence.label("separate", gargs) == "g-separate-16"
    assert "--separate-adaptive" in convergence.train_command(gargs, "separate", "/tmp/x")


def test_training_benchmarks_share_their_run_options():
    from benchmarks import frontier, sites, sites_ft

    for module in (convergence, frontier, sites, sites_ft, step_time):
        args = module.build_parser().parse_args([])
        assert (args.model, args.num_threads) == ("gpt-tiny", 1), module.__name__
    # --extra-train-args is split as a shell would: a quoted value stays one flag value.
    args = sites.build_parser().parse_args(["--extra-train-args=--log-json 'a b.jsonl' --x"])
    assert common.extra_train_flags(args) == ["--log-json", "a b.jsonl", "--x"]
    assert "a b.jsonl" in convergence.train_command(
        convergence.build_parser().parse_args([f"--extra-train-args={args.extra_train_args}"]),
        "none",
        "/tmp/x",
    )
    # --time-limit: per link rate, None where none is given (--run-timeout applies).
    args = frontier.build_parser().parse_args(["--time-limit", "10mbit=600, 1gbit=1e2"])
    assert common.time_limit(args, "10mbit") == 600.0
    assert common.time_limit(args, "1gbit") == 100.0
    assert common.time_limit(args, "100mbit") is None
    assert common.parse_per("4=1e3,8=20", "--iters", int) == {"4": 1000, "8": 20}
    for bad in ("10mbit", "10mbit=fast"):
        args = sites.build_parser().parse_args(["--time-limit", bad])
        with pytest.raises(ValueError, match="--time-limit: expected KEY=NUMBER"):
            common.time_limit(args, "10mbit")


def test_training_benchmarks_read_back_what_a_run_left(tmp_path):
    """A run's folder as the benchmarks read it: the driver's records and JSON outputs (none
    when it wrote none, also after fresh_run_dir cleared an earlier run's), and the end of
    its output for a failed run's error_tail."""
    run_dir = common.fresh_run_dir(str(tmp_path), "r")
    assert common.run_records(run_dir) is None and common.run_json(run_dir, "netbench.json") is None
    with open(os.path.join(run_dir, "log.jsonl"), "w") as f:
        f.write(json.dumps({"iteration": 1, "lm_loss": 9.5}) + "\n")
    with open(os.path.join(run_dir, "comm_report.json"), "w") as f:
        json.dump({"final_valid_loss": 7.25}, f)
    with open(os.path.join(run_dir, "stdout.txt"), "w") as f:
        f.write("x" * 3000 + "Traceback: the end")
    assert common.run_records(run_dir) == [{"iteration": 1, "lm_loss": 9.5}]
    assert common.run_json(run_dir, "comm_report.json") == {"final_valid_loss": 7.25}
    tail = common.stdout_tail(run_dir)
    assert len(tail) == 2000 and tail.endswith("Traceback: the end")
    run_dir = common.fresh_run_dir(str(tmp_path), "r")  # the same run again
    assert common.run_records(run_dir) is None
    assert common.run_json(run_dir, "comm_report.json") is None


def test_grass_runs_through_the_linear_family():
    cargs = convergence.build_parser().parse_args(
        ["--family", "linear", "--iters", "1000", "--grass-rank", "64", "--grass-scale", "1"]
    )
    flags = " ".join(convergence.method_flags("topr", cargs))
    # Grass's benchmark defaults: four selections per run, a quarter of K re-warming up.
    assert "--grass-method topr --grass-rank 64 --grass-update-interval 250" in flags
    assert "--grass-scale 1.0 --grass-rewarmup-steps 62" in flags
    assert convergence.label("topr", cargs) == "grass-topr-r64-a1"
    assert convergence.method_flags("none", cargs) == ["--grass-method", "none"]
    sargs = step_time.build_parser().parse_args(["--family", "linear"])
    assert "topr" in step_time._layout_methods("dp2", sargs.family)
    assert step_time._layout_methods("pp2", sargs.family) == ("none",)


def test_protocol_runs_through_the_subspace_family():
    cargs = convergence.build_parser().parse_args(
        ["--family", "subspace", "--pipeline-model-parallel-size", "2",
         "--subspace-update-interval", "100", "--subspace-lr", "0.1"]
    )  # fmt: skip
    flags = " ".join(convergence.method_flags("protocol", cargs))
    assert "--subspace-method protocol" in flags and "--subspace-update-interval 100" in flags
    assert convergence.label("protocol", cargs) == "protocol-x100-u100"
    kargs = convergence.build_parser().parse_args(["--family", "subspace", "--subspace-rank", "32"])
    assert convergence.label("protocol", kargs) == "protocol-k32"
    assert convergence.method_flags("none", cargs) == ["--subspace-method", "none"]
    sargs = step_time.build_parser().parse_args(["--family", "subspace"])
    assert step_time._layout_methods("pp2", sargs.family) == ("none", "protocol")
    assert step_time._layout_methods("dp2", sargs.family) == ("none",)


def test_convergence_pairs_pipeline_methods_with_gradient_methods():
    cargs = convergence.build_parser().parse_args(
        ["--family", "p2p", "--iters", "200", "--quantized-adam-warmup-steps", "32"]
    )
    runs = convergence.run_names(["none", "aqsgd"], ["none", "quantized", "quantized-adam"])
    assert runs == ["none", "aqsgd", "aqsgd+quantized", "aqsgd+quantized-adam"]
    assert convergence.label("aqsgd+quantized-adam", cargs) == "aqsgd-fw4bw8+quantized-adam-4bit"
    flags = " ".join(convergence.method_flags("aqsgd+quantized-adam", cargs))
    assert "--p2p-compression aqsgd" in flags
    assert "--grad-compression quantized-adam" in flags
    assert "--quantized-adam-warmup-steps 32" in flags
    assert convergence.method_flags("none", cargs) == ["--p2p-compression", "none"]
    # The benchmark default warm-up: the authors' 10% of training.
    dargs = convergence.build_parser().parse_args(["--family", "p2p", "--iters", "200"])
    assert "--quantized-adam-warmup-steps 20" in " ".join(
        convergence.method_flags("aqsgd+quantized-adam", dargs)
    )


def test_subspace_overhead_times_every_operation(tmp_path):
    argv = ["--hidden-size", "32", "--rank", "4", "--ffn-hidden-size", "64", "--tokens", "16",
            "--vocab-size", "50", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    assert subspace_overhead.main(argv) == 0
    report = json.loads((tmp_path / "subspace_overhead.json").read_text())
    common.validate_report(report)
    names = [r["operation"] for r in report["results"]]
    assert len(names) == 8 and "Grassmann update (d x d)" in names
    assert all(r["s"] > 0 for r in report["results"])


def test_state_memory_counts_created_storages_once():
    import torch

    before = torch.zeros(100, device="meta")  # exists before: never counted
    mode = state_memory.live_bytes_mode()
    with mode:
        a = torch.zeros(1000, device="meta")
        assert mode.live == 4000
        view = a.view(10, 100)
        a.add_(1.0)
        before.mul_(2.0)
        part = before[:50]
        assert mode.live == 4000  # views and in-place results allocate nothing
        b = a.to(torch.float16)
        assert (mode.live, mode.peak) == (6000, 6000)
        del a, b
        assert mode.live == 4000  # the view keeps a's storage alive
        del view, part
        assert (mode.live, mode.peak) == (0, 6000)


def test_state_memory_tiny_measures_every_method(tmp_path):
    argv = ["--models", "tiny", "--dp-size", "2", "--aqsgd-samples", "16", "--out", str(tmp_path)]
    assert state_memory.main(argv) == 0
    report = json.loads((tmp_path / "state_memory.json").read_text())
    common.validate_report(report)
    rows = {r["method"]: r for r in report["results"]}
    assert sorted(rows) == sorted(state_memory.METHODS)
    matrices = sum(
        state_memory._numel(s) for _, s in state_memory.model_params("tiny") if len(s) == 2
    )
    for method in ("separate", "radius", "powersgd", "quantized"):
        # Each keeps an fp32 error-feedback residual of every compressed matrix (PowerSGD:
        # all but the ones too small to compress, here none) and works on fp32 payloads.
        assert rows[method]["persistent"] >= 4 * matrices, method
        assert rows[method]["transient"] > 0, method
    # AQ-SGD, middle stage: a send and a receive buffer of 16 x 32 x 64 fp16, and their
    # visit flags.
    assert rows["aqsgd"]["sides"] == ["send", "recv"]
    assert rows["aqsgd"]["persistent"] == 2 * (16 * 32 * 64 * 2 + 16)
    # Protocol Models: U (64 x 1), A (64 x 64) and T_fixed (512 x 64, bf16) at least.
    assert rows["protocol"]["persistent"] >= 4 * 64 + 4 * 64 * 64 + 2 * 512 * 64
    assert rows["protocol"]["transient"] > 0 and rows["grass"]["persistent"] > 0


def test_grass_throughput_shapes_and_one_layer():
    # llama-1b with SwiGLU: fc1 holds both halves (2 x 5461); no GQA, so QKV is 3 x 2048.
    shapes = grass_throughput.layer_shapes(common.load_model_preset("llama-1b"))
    assert shapes == [("linear_qkv", 6144, 2048), ("linear_proj", 2048, 2048),
                      ("linear_fc1", 10922, 2048), ("linear_fc2", 2048, 5461)]  # fmt: skip
    # llama-tiny: 2 query groups of 32 -> QKV 256 + 2 x 64.
    tiny = grass_throughput.layer_shapes(common.load_model_preset("llama-tiny"))
    assert tiny[0] == ("linear_qkv", 384, 256)
    for rank in (0, 4):
        t = grass_throughput.measure_layer(24, 16, tokens=32, rank=rank, repeats=1, device="cpu")
        assert set(t) == {"forward_s", "backward_s", "step_s"} and min(t.values()) > 0


def test_step_time_refuses_without_netbench(monkeypatch, capsys, tmp_path):
    from megatron_ext.netbench import netns

    monkeypatch.setattr(netns, "netns_unavailable_reason", lambda: "netbench must run as root")
    code = step_time.main(["--quick", "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "netbench cannot run here" in err and "must run as root" in err


# -- kernel benchmark smoke run ------------------------------------------------------------


def test_kernel_helpers_time_our_functions():
    import torch

    cpu = torch.device("cpu")
    res = kernels.time_separate(4096, 64, 16, cpu, warmup=1, repeats=2)
    assert res["payload_elements"] == 4096 // 16 and res["total_s"] > 0
    res = kernels.time_powersgd(4096, 16, cpu, warmup=1, repeats=2)
    assert res["shape"] == [64, 64] and res["approx_rank"] == 2
    # bf16 gradients: the reducers' fp32 math, the result cast back.
    res = kernels.time_separate(4096, 64, 16, cpu, 1, 2, dtype="bfloat16")
    assert res["total_s"] > 0
    res = kernels.time_quantized(4096, 4, cpu, 1, 2, dtype="bfloat16")
    # 4-bit codes of 4096 values, 16 fp16 scales (rows of 256), the 4-byte input flag.
    assert res["payload_bytes"] == 4096 // 2 + 2 * 16 + 4
    # A time budget cuts the repetitions (judged from the warm-up), never below one.
    calls = []
    walls, _ = kernels._timed_phases([calls.append], cpu, 0, 50, budget_s=1e-9)
    assert len(walls[0]) == 1 and len(calls) == 2
    assert kernels.activation_shape(10**9, 2048) == (1024, 477, 2048)
    assert kernels.activation_shape(1000, 1024) == (1, 1, 1024)
    res = kernels.time_aqsgd(4 * 1024 * 16, 16, cpu, 1, 2)
    # Revisits only: 4-bit deltas of 4 samples and their per-channel fp16 scales.
    assert res["shape"] == [1024, 4, 16]
    assert res["payload_bytes"] == 4 * 1024 * 16 // 2 + 2 * 4 * 16
    res = kernels.time_protocol(64 * 256, 256, cpu, 1, 2, dtype="bfloat16")
    assert res["rank"] == 32 and res["payload_elements"] == 64 * (32 + 2)  # k coords + ids


def test_kernel_targets_compare_with_the_copy_floor_and_powersgd():
    def row(method, ns, numel=100, **extra):
        return {"device": "cpu", "threads": 1, "numel": numel, "dtype": "fp32",
                "method": method, "total_ns_per_element": ns, **extra}  # fmt: skip

    results = [row("copy", 1.0), row("powersgd", 2.5), row("separate", 2.0, block_size=64),
               row("separate", 2.8, block_size=256), row("separate", 3.5, block_size=512),
               row("quantized-4bit", 2.0), row("aqsgd", 2.1), row("copy", 4.0, numel=7),
               row("protocol", 7.0, numel=7)]  # fmt: skip
    kernels._add_targets(results)
    meets = [r["meets"] for r in results]
    # SEPARATE: <= 3x the floor and below PowerSGD (2.8 is within 3x but not below 2.5).
    assert meets == [None, None, True, False, False, True, False, None, True]
    assert results[4]["copy_ratio"] == pytest.approx(3.5)
    assert results[-1]["copy_ratio"] == pytest.approx(1.75)  # the floor of its own size


def test_kernels_quick_writes_its_json(tmp_path):
    out = tmp_path / "k"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "kernels.py"),
            "--quick",
            "--sizes",
            "4096",
            "--block-sizes",
            "64",
            "--dtypes",
            "fp32,bf16",
            "--methods",
            "all",
            "--hidden",
            "64",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compress + decompress" in proc.stdout and "no GPU lent" in proc.stdout
    report = common.validate_report(json.loads((out / "kernels.json").read_text()))
    rows = report["results"]
    methods = {(r["method"], r["numel"], r["dtype"]) for r in rows}
    names = ["copy", "separate", "powersgd", "quantized-4bit", "quantized-8bit",
             "quantized-2bit", "aqsgd", "directq", "protocol"]  # fmt: skip
    assert methods == {(m, 4096, d) for m in names for d in ("fp32", "bf16")}
    assert all(r["total_ns_per_element"] > 0 and r["copy_ratio"] > 0 for r in rows)
    for r in rows:
        kind = r["method"].split("-")[0]
        if kind in ("copy", "powersgd"):
            assert r["meets"] is None
        else:
            assert r["target"] == ("<=3x, <PowerSGD" if kind == "separate" else "<=2x")
            assert isinstance(r["meets"], bool)
    assert report["environment"]["device"].startswith("cpu")
    assert report["settings"]["dtypes"] == {"cpu": ["fp32", "bf16"]}
    # --fused-kernels off (the default): the methods' kernels ran eager, as recorded
    assert report["settings"]["fused_kernels"] == "off" and "fused kernels: off" in proc.stdout
    assert {r["fused_kernels"] for r in rows} == {"off"}
    assert report["complete"] is True  # rewritten after every row, complete at the end


def test_kernels_fused_flag_sets_the_mode_or_refuses_naming_it(monkeypatch):
    from megatron_ext import kernels as fused

    assert kernels.build_parser().parse_args([]).fused_kernels == "off"
    with pytest.raises(SystemExit) as exit_info:
        kernels.build_parser().parse_args(["--fused-kernels", "auto"])  # argparse: choices
    assert exit_info.value.code == 2
    monkeypatch.delenv(fused.ENV_VAR, raising=False)
    try:
        kernels._set_fused_kernels("on")
        assert fused.mode() == "on"
        monkeypatch.setattr(fused, "fused_unavailable", lambda device="cpu": "no C++ compiler")
        with pytest.raises(SystemExit, match="--fused-kernels on: no C\\+\\+ compiler"):
            kernels._set_fused_kernels("on")
    finally:
        fused.set_mode(None)


# -- sites ---------------------------------------------------------------------------------


def test_sites_time_to_loss_is_interpolated_on_the_measured_curve():
    from benchmarks import sites

    elapsed = [1.0, 2.0, 3.0, 4.0]
    assert sites.time_to_loss(elapsed, [5.0, 4.0, 3.0, 2.0], 3.5) == pytest.approx(2.5)
    assert sites.time_to_loss(elapsed, [5.0, 4.0, 3.0, 2.0], 3.0) == pytest.approx(3.0)
    assert sites.time_to_loss(elapsed, [2.0, 4.0, 3.0, 1.0], 2.5) == pytest.approx(1.0)
    assert sites.time_to_loss(elapsed, [None, 4.0, 3.0, 2.0], 1.0) is None
    # From the start (time 0) when the first logged point already is below the target.
    assert sites.time_to_loss(elapsed, [None, 1.0, 3.0, 2.0], 1.5) == pytest.approx(2.0)


def _sites_records(losses, step_s, outer=0.0):
    return [
        {
            "iteration": i + 1,
            "lm_loss": loss,
            "step_time_s": step_s,
            "bytes_per_step_all_ranks": {
                "dp-grad": {"sent": 100.0, "dense_sent": 100.0},
                **({"outer": {"sent": outer, "dense_sent": 4 * outer}} if outer else {}),
            },
        }
        for i, loss in enumerate(losses)
    ]


def test_sites_summary_and_comparison_with_the_dense_run():
    from benchmarks import sites

    dense_losses = [10.0 - i for i in range(10)]  # 10 ... 1, final (last 10%) = 1.0
    base = dict(label="none", layout="dp2", rate="100mbit", status="ok")
    base.update(sites.summarize_run(_sites_records(dense_losses, 2.0), 10))
    assert base["curve"]["elapsed_s"] == pytest.approx([2.0 * (i + 1) for i in range(10)])
    assert base["final_loss"] == 1.0 and base["train_time_s"] == pytest.approx(20.0)
    fast = dict(label="diloco-h5", layout="dp2", rate="100mbit", status="ok")
    fast.update(sites.summarize_run(_sites_records([9.0, 5.0, 0.5] + [0.5] * 7, 0.5, 8.0), 10))
    assert fast["bytes_per_step_all_ranks"]["outer"] == pytest.approx(
        {"sent": 8.0, "dense_sent": 32.0}
    )
    assert fast["bytes_per_step_sent_total"] == pytest.approx(108.0)
    other_rate = dict(base, rate="10mbit", label="powersgd-r14", status="failed")
    refused = dict(label="x", layout="dp2", rate="100mbit", status="refused")
    results = [base, fast, other_rate, refused]
    sites.add_comparisons(results)
    assert base["time_to_target_s"] == pytest.approx(20.0) and base["speedup_vs_none"] == 1.0
    # Loss 5.0 at 1.0 s, 0.5 at 1.5 s: 1.0 is crossed at 1.0 + 0.5 * 4 / 4.5 s.
    t = 1.0 + 0.5 * 4.0 / 4.5
    assert fast["time_to_target_s"] == pytest.approx(t)
    assert fast["speedup_vs_none"] == pytest.approx(20.0 / t)
    assert fast["gap_pct"] == pytest.approx(-50.0) and fast["reached_target"]
    assert other_rate["time_to_target_s"] is None  # a failed run is not compared
    assert refused["time_to_target_s"] is None and not refused["reached_target"]
    # The 50% milestone: the dense run's trailing mean at iteration 5 (window 1): 6.0, reached
    # by it at 10 s, by the fast run between 9.0 at 0.5 s and 5.0 at 1.0 s.
    assert base["half_target_loss"] == 6.0 and base["time_to_half_target_s"] == pytest.approx(10)
    assert fast["time_to_half_target_s"] == pytest.approx(0.5 + 0.5 * 3.0 / 4.0)
    assert fast["speedup_half_vs_none"] == pytest.approx(10.0 / 0.875)
    assert not fast["speedup_half_is_lower_bound"] and refused["half_target_loss"] is None


def test_sites_layouts_configs_and_commands():
    from benchmarks import sites

    dp2, two_by_two = sites.parse_layout("dp2"), sites.parse_layout("2x2", pp=2)
    assert (dp2.sites, dp2.per_site, dp2.nproc) == (2, 1, 2)
    assert (two_by_two.sites, two_by_two.dp, two_by_two.nproc) == (2, 4, 8)
    for bad in ("dp1", "1x4", "2by2", "x2"):
        with pytest.raises(ValueError, match="--layouts"):
            sites.parse_layout(bad)
    label, flags = sites.parse_config("diloco-h50=--outer-method diloco --outer-interval 50")
    assert label == "diloco-h50" and flags == ["--outer-method", "diloco", "--outer-interval", "50"]
    assert sites.parse_config("none=") == ("none", [])
    with pytest.raises(ValueError, match="--config"):
        sites.parse_config("no label")
    assert sites.config_flags(flags, sites.parse_layout("2x2"))[-2:] == ["--outer-groups", "2"]
    assert sites.config_flags(flags + ["--outer-groups", "4"], dp2).count("--outer-groups") == 1
    assert sites.config_flags(["--grad-compression", "powersgd"], dp2) == [
        "--grad-compression",
        "powersgd",
    ]
    cmd = sites.netbench_command(two_by_two, "10mbit", "nb.json", 60, ["python", "x"])
    text = " ".join(cmd)
    assert "--nproc 8 --pp 2 --bandwidth 10mbit --shape sites --sites 2" in text
    assert cmd[-3:] == ["--", "python", "x"]
    assert "--unshaped" in sites.netbench_command(dp2, "unshaped", "nb.json", 60, ["x"])
    # A configuration may train longer than the sweep (its own --train-iters): its schedule
    # (10% warm-up, cosine to the end) follows its own length; the smoothing window stays the
    # sweep's.
    assert sites.config_iters(["--outer-method", "diloco"], 1000) == (
        1000,
        ["--outer-method", "diloco"],
    )
    iters, rest = sites.config_iters(["--train-iters", "2000", "--outer-interval", "50"], 1000)
    assert (iters, rest) == (2000, ["--outer-interval", "50"])
    with pytest.raises(ValueError, match="--train-iters"):
        sites.config_iters(["--train-iters", "x"], 1000)
    assert sites.main(["--iters", "4", "--config", "none=--train-iters 8"]) == 2  # the reference
    assert sites.main(["--iters", "4", "--config", "none=", "--skip", "nonee"]) == 2  # a typo
    assert sites.main(["--iters", "4", "--config", "none=", "--skip", "none"]) == 2  # nothing
    args = sites.build_parser().parse_args(["--iters", "1000"])
    cmd = sites.train_command(args, dp2, rest, "run", iters)
    assert cmd[cmd.index("--train-iters") + 1] == "2000" and cmd.count("--train-iters") == 1
    assert cmd[cmd.index("--lr-warmup-iters") + 1] == "200"
    losses = [float(10 - i) for i in range(20)]
    long = sites.summarize_run(_sites_records(losses, 1.0), 20, 10)
    assert long["final_loss"] == pytest.approx((-8.0 + -9.0) / 2)
    assert long["curve"]["smoothed_loss"][-1] == pytest.approx(-9.0)  # window: 1 of the sweep's 10


def test_sites_check_config_reports_the_drivers_refusal(tmp_path):
    from benchmarks import sites

    args = sites.build_parser().parse_args(["--iters", "4"])
    dp2 = sites.parse_layout("dp2")
    ok = sites.train_command(args, dp2, ["--grad-compression", "powersgd"], str(tmp_path))
    assert sites.check_config(ok, dp2) is None
    bad = sites.train_command(args, dp2, ["--no-such-flag", "3"], str(tmp_path))
    assert "unrecognized arguments: --no-such-flag" in sites.check_config(bad, dp2)
    # 3 DP ranks cannot split a global batch of 8: refused naming the flags.
    three = sites.train_command(args, sites.parse_layout("dp3"), [], str(tmp_path))
    assert "--global-batch-size" in sites.check_config(three, sites.parse_layout("dp3"))


def _netbench_reason():
    from megatron_ext.netbench.netns import netns_unavailable_reason

    try:
        return netns_unavailable_reason()
    except Exception as exc:
        return f"network namespace probe failed: {exc}"


_PSGD_FROM_STEP_2 = "--grad-compression powersgd --powersgd-approx-rank 14 --powersgd-start-step 1"


def _quick_sites_run(name, tmp_path, args):
    """``benchmarks/<name>.py --quick`` with ``args`` into ``tmp_path`` (one thread a process,
    5 minutes at most): the finished process and its validated ``<name>.json`` report."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--quick", "--out", str(tmp_path)] + args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, common.validate_report(json.loads((tmp_path / f"{name}.json").read_text()))


def test_sites_quick_runs_inside_netbench(tmp_path):
    """none and PowerSGD trained for 3 steps at 1gbit between 2 sites; a config the driver
    refuses is reported as such and the sweep goes on (about 25 s, needs root)."""
    reason = _netbench_reason()
    if reason:
        pytest.skip(f"netbench cannot run here: {reason}")
    proc, report = _quick_sites_run(
        "sites",
        tmp_path,
        ["--rates", "1gbit", "--iters", "3", "--check-seconds", "0.3", "--config", "none="]
        + ["--config", "refused=--no-such-flag"]
        + ["--config", f"powersgd-r14={_PSGD_FROM_STEP_2}"],
    )
    assert report["benchmark"] == "sites"
    runs = {r["label"]: r for r in report["results"]}
    assert [r["label"] for r in report["results"]] == ["none", "refused", "powersgd-r14"]
    assert runs["refused"]["status"] == "refused" and "--no-such-flag" in runs["refused"]["refusal"]
    for label in ("none", "powersgd-r14"):
        r = runs[label]
        assert r["status"] == "ok" and r["iterations_done"] == 3, r
        assert len(r["curve"]["elapsed_s"]) == 3 and r["train_time_s"] > 0
        assert all(m["src_site"] != m["dst_site"] for m in r["link_check"] if m["shaped"])
    dense = runs["none"]
    assert dense["time_to_target_s"] == pytest.approx(dense["train_time_s"])
    assert dense["speedup_vs_none"] == 1.0 and dense["gap_pct"] == 0.0
    grad = runs["powersgd-r14"]["bytes_per_step_all_ranks"]["dp-grad"]
    assert grad["sent"] < 0.5 * dense["bytes_per_step_all_ranks"]["dp-grad"]["sent"]
    assert "refused: dp2 1gbit refused" in proc.stdout


def test_sites_ft_reads_the_jobs_output_and_the_time_lost():
    from benchmarks import sites_ft

    text = (
        "noise\n [2026-11-28 12:00:01.500000] iteration        1/      60 | lm loss: 9\n"
        "megatron-ext: torchft site 1: commit step=3 sites=2 attempts=1 iteration=10 "
        "weight=1024 total_weight=2048 at 1764331202.250\n"
        " [2026-11-28 12:00:03.000000] iteration        2/      60 |\n"
    )
    its = sites_ft.parse_iterations(text)
    assert [i["iteration"] for i in its] == [1, 2]
    assert its[1]["time"] - its[0]["time"] == pytest.approx(1.5)
    (commit,) = sites_ft.parse_commits(text)
    assert commit["sites"] == "2" and commit["total_weight"] == "2048"
    assert commit["time"] == pytest.approx(1764331202.25)
    # survivors, H = 2: inner steps of 1 s, outer steps of 2 s, one of 6 s after the kill
    a = {"iteration": [1, 2, 3, 4, 5, 6], "wall_s": [1.0, 3.0, 4.0, 6.0, 7.0, 13.0]}
    b = {"iteration": [1, 2, 3, 4, 5], "wall_s": [1.5, 3.5, 4.5, 6.5, 7.5]}
    a["commit_s"], b["commit_s"] = [3.0, 6.0, 13.0], [3.5, 6.5]
    lost = sites_ft.time_lost([a, b], 6.8, 2)
    assert lost["kill_to_next_iteration_s"] == pytest.approx(0.7)
    assert lost["kill_to_next_outer_commit_s"] == pytest.approx(6.2)
    assert lost["next_outer_step_s"] == pytest.approx(6.0)
    assert lost["median_outer_step_before_kill_s"] == pytest.approx(2.0)
    assert lost["median_inner_step_before_kill_s"] == pytest.approx(1.0)
    assert sites_ft.main(["--scenarios", "a,x"]) == 2
    assert sites_ft.main(["--iters", "9", "--save-interval", "3"]) == 2  # no checkpoint < 1/3


def test_sites_ft_quick_runs_site_jobs_inside_netbench(tmp_path):
    """Two site jobs (gpt-tiny, one rank each) and a lighthouse, each in its namespace, 3
    steps over torchft at 100mbit between the sites; the links between sites are shaped,
    the lighthouse's and a site's own are not, each site's manager advertises its own
    address (about 30 s, needs root and torchft)."""
    reason = _netbench_reason()
    if reason:
        pytest.skip(f"netbench cannot run here: {reason}")
    pytest.importorskip("torchft")
    _, report = _quick_sites_run("sites_ft", tmp_path, ["--iters", "3", "--check-seconds", "0.3"])
    (a,) = report["results"]
    assert a["scenario"] == "a" and a["status"] == "ok" and a["final_loss"] > 0
    for site in a["sites"]:
        assert site["curve"]["iteration"] == [1, 2, 3] and site["last_iteration"] == 3
        assert all(w > 0 for w in site["curve"]["wall_s"])
        assert float(site["commits"][-1]["total_weight"]) > 0
    links = {(m["src"], m["dst"]): m for m in a["link_check"]}
    assert links[(0, 1)]["shaped"] and links[(0, 1)]["mb_per_s"] < 13.0  # 100mbit: 12.5 MB/s
    assert not links[(0, 0)]["shaped"] and links[(0, 0)]["mb_per_s"] > 50.0
    assert any(2 in pair and not m["shaped"] for pair, m in links.items())  # the lighthouse
    log0 = (tmp_path / "runs" / "a" / "site0.txt").read_text()
    subnet = re.search(r"--outer-lighthouse http://(\d+\.\d+\.\d+)\.3:", a["commands"]["site0"])
    assert f"Manager listening on http://{subnet.group(1)}.1:" in log0, log0[-2000:]


def test_sites_stopped_dense_run_gives_a_lower_bound():
    from benchmarks import sites

    def run(label, rate, status, losses, step_s):
        r = dict(label=label, layout="dp2", rate=rate, status=status)
        r.update(sites.summarize_run(_sites_records(losses, step_s), 10))
        return r

    losses = [10.0 - i for i in range(10)]
    unshaped = run("none", "unshaped", "ok", losses, 0.1)
    slow_dense = run("none", "10mbit", "stopped", losses[:3], 25.0)  # stopped at loss 8
    slow_fast = run("diloco", "10mbit", "ok", [9.0, 0.5] + [0.5] * 8, 1.0)
    sites.add_comparisons([unshaped, slow_dense, slow_fast])
    assert slow_fast["target_loss"] == 1.0 and slow_fast["target_from_rate"] == "unshaped"
    t = 1.0 + 8.0 / 8.5
    assert slow_fast["time_to_target_s"] == pytest.approx(t)
    assert slow_fast["none_time_to_target_s"] == pytest.approx(75.0)
    assert slow_fast["speedup_vs_none"] == pytest.approx(75.0 / t)
    assert slow_fast["speedup_is_lower_bound"]
    assert slow_dense["time_to_target_s"] is None and slow_dense["gap_pct"] is None
    assert unshaped["speedup_vs_none"] == 1.0 and not unshaped["speedup_is_lower_bound"]


def test_sites_reuse_takes_matching_runs_and_refuses_other_settings(tmp_path):
    import json

    from benchmarks import sites

    args = sites.build_parser().parse_args(["--iters", "1000"])
    settings = {k: getattr(args, k) for k in sites.REUSE_SETTINGS}
    settings["configs"] = {"none": [], "diloco-h50": ["--outer-method", "diloco"]}
    results = [
        {"label": "none", "layout": "dp2", "rate": "unshaped", "status": "ok"},
        {"label": "diloco-h50", "layout": "dp2", "rate": "unshaped", "status": "failed"},
    ]
    path = tmp_path / "sites.json"
    path.write_text(json.dumps({"benchmark": "sites", "settings": settings, "results": results}))
    configs = [sites.parse_config("none="), sites.parse_config("diloco-h50=--outer-method diloco")]
    reused = sites.load_reused([str(path)], args, configs)
    assert list(reused) == [("dp2", "unshaped", "none")]  # a failed run is run again
    with pytest.raises(ValueError, match="its iters is 1000, this sweep's 200"):
        sites.load_reused([str(path)], sites.build_parser().parse_args(["--iters", "200"]), configs)
    other = [sites.parse_config("none=--seed 2")]
    with pytest.raises(ValueError, match="configuration 'none' has other flags"):
        sites.load_reused([str(path)], args, other)
