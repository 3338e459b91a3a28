"""``megatron-ext report`` on synthetic run directories: plots, report.md rows, errors."""

import json
from pathlib import Path

import pytest

from benchmarks import common
from megatron_ext import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {"device": "cpu (no GPU lent)", "cpu_model": "test", "torch": "x", "git_commit": "abc"}


def _curve(n, loss0, sent, dense, dense_steps=0):
    return {
        "iteration": list(range(1, n + 1)),
        "lm_loss": [loss0 - 0.01 * i for i in range(n)],
        "step_time_s": [0.5] * n,
        "dp_grad_sent": [dense if i < dense_steps else sent for i in range(n)],
        "dp_grad_dense_sent": [dense] * n,
    }


def _write(directory: Path, rep: dict) -> None:
    common.write_report(rep, str(directory))


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "bench"
    dense = 59_092_992.0
    conv = [
        {
            "method": "none",
            "label": "none",
            "ok": True,
            "final_loss": 6.0,
            "gap_pct": 0.0,
            "curve": _curve(40, 8.0, dense, dense),
            "mean_step_s": 0.4,
            "num_dense_steps": 40,
            "num_compressed_steps": 0,
            "bytes_per_step_all_ranks": {"dp-grad": {"sent": dense, "dense_sent": dense}},
        },
        {
            "method": "separate",
            "label": "separate-16",
            "ok": True,
            "final_loss": 6.3,
            "gap_pct": 5.0,
            "curve": _curve(40, 8.2, 3_796_992.0, dense),
            "mean_step_s": 0.45,
            "num_dense_steps": 0,
            "num_compressed_steps": 40,
            "bytes_per_step_all_ranks": {"dp-grad": {"sent": 3_796_992.0, "dense_sent": dense}},
        },
        {
            "method": "radius",
            "label": "radius-0.4",
            "ok": True,
            "final_loss": 6.1,
            "gap_pct": 1.7,
            "curve": _curve(40, 8.1, 23_700_000.0, dense, dense_steps=8),
            "mean_step_s": 0.5,
            "num_dense_steps": 8,
            "num_compressed_steps": 32,
        },
    ]
    _write(d, common.make_report("convergence", {"iters": 40, "nproc": 2}, conv, ENV))
    st = []
    for bw, none_s, sep_s, rad_s in (("unshaped", 0.4, 0.45, 0.5), ("100mbit", 3.2, 0.8, 1.5)):
        st.append(_step("none", bw, none_s, dense, dense))
        st.append(_step("separate", bw, sep_s, 3_796_992.0, dense))
        st.append(_step("radius", bw, rad_s, 23_700_000.0, dense, dense_s=none_s * 1.05))
    pp = _step("none", "100mbit", 1.0, 0, 0)
    pp.update(layout="pp2", bytes_per_step_all_ranks={"pp-act": {"sent": 2e6, "dense_sent": 2e6}})
    st.append(pp)
    _write(d, common.make_report("step_time", {"skip": 2, "model": "gpt-tiny"}, st, ENV))
    kern = []
    for numel in (10**5, 10**6):
        kern.append(
            {
                "device": "cpu",
                "threads": 1,
                "numel": numel,
                "method": "copy",
                "total_ns_per_element": 0.3,
                "gb_per_s": 13.0,
            }
        )
        for b, ns in ((64, 3.0), (256, 4.0)):
            kern.append(
                {
                    "device": "cpu",
                    "threads": 1,
                    "numel": numel,
                    "method": "separate",
                    "block_size": b,
                    "total_ns_per_element": ns,
                }
            )
        kern.append(
            {
                "device": "cpu",
                "threads": 1,
                "numel": numel,
                "method": "powersgd",
                "approx_rank": 31,
                "total_ns_per_element": 3.5,
            }
        )
    _write(d, common.make_report("kernels", {"ratio": 16, "repeats": 7}, kern, ENV))
    return d


def _step(method, bw, step_s, sent, dense, dense_s=None):
    rec = {
        "layout": "dp2",
        "method": method,
        "bandwidth": bw,
        "ok": True,
        "exit_code": 0,
        "step_s": step_s,
        "median_compressed_s": step_s if sent < dense else None,
        "median_dense_s": dense_s if dense_s else (step_s if sent >= dense else None),
        "num_compressed": 5 if sent < dense else 0,
        "num_dense": 1 if dense_s else (0 if sent < dense else 5),
        "mean_all_s": step_s,
        "bytes_per_step_all_ranks": {"dp-grad": {"sent": sent, "dense_sent": dense}},
        "link_check": (
            {"expected_mb_per_s": 12.5, "shaped_mb_per_s": 11.98, "ok": True}
            if bw != "unshaped"
            else {"unshaped_mb_per_s": 2000.0}
        ),
        "contention": {"foreign_cpu_share": 0.0},
    }
    return rec


def test_report_writes_plots_and_tables(bench_dir, tmp_path):
    out = tmp_path / "out"
    assert report.main([str(bench_dir), "--out", str(out)]) == 0
    for name in ("loss_vs_step", "loss_vs_time", "bytes_per_step", "kernels"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert png.stat().st_size > 5000
    md = (out / "report.md").read_text()
    for name in ("loss_vs_step", "loss_vs_time", "bytes_per_step", "kernels"):
        assert f"({name}.png)" in md
    # Convergence rows with the gap to none.
    assert "| separate-16 | 6.3000 | +5.00 % |" in md
    assert "| none | 6.0000 | +0.00 % |" in md
    # Step time per bandwidth and speed-up vs none (3.2 / 0.8 = 4).
    assert "| method | unshaped | 100mbit |" in md
    assert "| separate | 0.450 s (x0.89) | 0.800 s (x4.00) |" in md
    assert "**pp2**" in md
    # Radius: the dense steps listed separately.
    assert "| dp2 | radius | 100mbit | 1.500 s (5) | 3.360 s (1) |" in md
    # Bytes per step and compression ratio.
    assert "| dp2 separate | 3.80 | 59.09 | x15.6 |" in md
    assert "| pp2 none | - | - | - | 2.00 |" in md
    assert "steps with dense reductions excluded" in md
    # Kernels: PowerSGD vs the best SEPARATE block, and where SEPARATE is cheaper.
    assert "| 1e+05 | 0.300 | 13.0 | 3.00 | 4.00 | 3.50 (r=31) | b64: x1.17 | b64 |" in md
    assert "GPU: not measured" in md


def test_wall_clock_axis_uses_dense_and_compressed_step_times():
    curve = _curve(6, 8.0, 40.0, 100.0, dense_steps=2)
    times = report.wall_clock_axis(curve, t_compressed=1.0, t_dense=3.0)
    assert times == pytest.approx([3.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    # Warm-up dense steps cost none's time, later dense steps (reselection) the method's.
    curve = _curve(6, 8.0, 40.0, 100.0, dense_steps=2)
    curve["dp_grad_sent"][4] = 100.0
    times = report.wall_clock_axis(curve, t_compressed=1.0, t_dense=4.0, t_warmup=3.0)
    assert times == pytest.approx([3.0, 6.0, 7.0, 8.0, 12.0, 13.0])
    # Log records every 2 iterations, one dense and one compressed step in the first one.
    curve = {"iteration": [2, 4], "dp_grad_sent": [70.0, 40.0], "dp_grad_dense_sent": [100.0] * 2}
    assert report.wall_clock_axis(curve, 1.0, 3.0) == pytest.approx([4.0, 6.0])


def test_a_method_without_compressed_steps_costs_its_own_step():
    # Grass reduces fewer rows but counts them as its own dense bytes: every step of its
    # curve is "dense" and must cost Grass's measured step, not none's.
    data = report.RunData()
    data.step_time[("dp2", "none", "100mbit")] = {"ok": True, "step_s": 2.9, "num_compressed": 0}
    data.step_time[("dp2", "topr", "100mbit")] = {"ok": True, "step_s": 2.2, "num_compressed": 0}
    data.step_time[("dp2", "radius", "100mbit")] = {
        "ok": True, "step_s": 1.0, "num_compressed": 8, "median_dense_s": 3.5
    }  # fmt: skip
    assert report._step_times_for(data, "topr", "100mbit") == (2.2, 2.2, 2.2)
    assert report._step_times_for(data, "none", "100mbit") == (2.9, 2.9, 2.9)
    assert report._step_times_for(data, "radius", "100mbit") == (1.0, 3.5, 2.9)


def test_report_reads_a_plain_train_run(tmp_path):
    run = tmp_path / "gpt-tiny-dp2"
    run.mkdir()
    with open(run / "log.jsonl", "w") as f:
        for i in range(1, 21):
            rec = {
                "iteration": i,
                "step_time_s": 0.3,
                "lm_loss": 9.0 - 0.1 * i,
                "bytes_per_step_all_ranks": {"dp-grad": {"sent": 1e6, "dense_sent": 1e6}},
            }
            f.write(json.dumps(rec) + "\n")
    (run / "comm_report.json").write_text(
        json.dumps({"ext": {"grad_compression": "none"}, "final_valid_loss": 7.5})
    )
    out = tmp_path / "out"
    assert report.main([str(run), "--out", str(out)]) == 0
    assert (out / "loss_vs_step.png").read_bytes()[:8] == PNG_MAGIC
    md = (out / "report.md").read_text()
    # Final loss = mean of the last 10% (2 of 20 records): (7.1 + 7.0) / 2.
    assert "| gpt-tiny-dp2 (none) | 7.0500 |" in md


def _train_dir(path: Path, ext: dict, segments, every=5, dense_until=0) -> Path:
    """A driver run directory: log.jsonl every ``every`` steps (dense gradients up to
    ``dense_until``, a quarter of the bytes after), comm_report.json with ``segments``
    ((start, steps, mean s/step, dp-grad bytes per step))."""
    path.mkdir(parents=True)
    end = max(start + steps for start, steps, _, _ in segments)
    with open(path / "log.jsonl", "w") as f:
        for i in range(every, end + 1, every):
            sent = 4e6 if i <= dense_until else 1e6
            rec = {
                "iteration": i,
                "step_time_s": 0.3,
                "lm_loss": 9.0 - 0.05 * i,
                "bytes_per_step_all_ranks": {"dp-grad": {"sent": sent, "dense_sent": 4e6}},
            }
            f.write(json.dumps(rec) + "\n")
    segs = [
        {
            "start_iteration": start,
            "steps_this_run": steps,
            "mean_step_time_s": step_s,
            "comm": {
                "steps": steps,
                "all_ranks_per_step": {"dp-grad": {"sent": b, "dense_sent": 4e6}},
            },
        }
        for start, steps, step_s, b in segments
    ]
    (path / "comm_report.json").write_text(json.dumps({**segs[-1], "ext": ext, "segments": segs}))
    return path


def test_plain_runs_get_their_methods_distinct_colours_and_counts_in_steps(tmp_path):
    """Runs of one method are told apart (labels and colours), a run is labelled with the
    methods of every family, dense steps are counted in steps (not log records), s/step and
    bytes cover every resumed segment, and a short run is drawn whole."""
    from megatron_ext.report_style import loss_limits, run_colors, smoothing_window

    a = _train_dir(tmp_path / "a" / "run", {"grad_compression": "none"}, [(0, 40, 0.4, 4e6)])
    b = _train_dir(tmp_path / "b" / "run", {"grad_compression": "none"}, [(0, 40, 0.4, 4e6)])
    psgd = _train_dir(
        tmp_path / "psgd", {"grad_compression": "powersgd"}, [(0, 40, 0.5, 1.75e6)], dense_until=10
    )
    # Resumed: 40 steps at 0.2 s, then 20 at 0.8 s (the last segment alone says 0.8).
    sites = _train_dir(
        tmp_path / "sites",
        {"grad_compression": "none", "outer_method": "diloco"},
        [(0, 40, 0.2, 4e6), (40, 20, 0.8, 1e6)],
    )
    data = report.load_runs([str(a), str(b), str(psgd), str(sites)])
    runs = {r["label"]: r for r in data.convergence.values()}
    # The second directory named "run" is named by its path.
    assert set(runs) == {"run (none)", f"{b} (none)", "psgd (powersgd)", "sites (diloco)"}
    p = runs["psgd (powersgd)"]
    assert (p["num_dense_steps"], p["num_compressed_steps"]) == (10, 30)
    s = runs["sites (diloco)"]
    assert s["mean_step_s"] == pytest.approx((40 * 0.2 + 20 * 0.8) / 60)
    assert s["bytes_per_step_all_ranks"]["dp-grad"]["sent"] == pytest.approx(
        (40 * 4e6 + 20 * 1e6) / 60
    )
    colors = run_colors([(r["label"], r["method"]) for r in data.convergence.values()])
    assert len(set(colors.values())) == 4, colors
    # 8 records: no 10-record mean (it would plot a cumulative mean), every value in range.
    assert smoothing_window(10, [8, 40]) == 2
    losses = [9.0 - 0.05 * i for i in range(5, 45, 5)]
    lo, hi = loss_limits([losses])
    assert lo < min(losses) and hi > max(losses)
    out = tmp_path / "out"
    assert report.main([str(a), str(b), str(psgd), str(sites), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| psgd (powersgd) |" in md and "| 30 | 10 | 0.500 |" in md
    assert "| gap vs run (none) |" in md  # several runs without a method: the first


def test_report_refuses_an_empty_directory(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main([str(empty), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nothing to read" in err and str(empty) in err
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_later_inputs_win(bench_dir, tmp_path):
    again = tmp_path / "again"
    st = [_step("separate", "100mbit", 0.7, 3_796_992.0, 59_092_992.0)]
    _write(again, common.make_report("step_time", {"skip": 2}, st, ENV))
    data = report.load_runs([str(bench_dir), str(again)])
    assert data.step_time[("dp2", "separate", "100mbit")]["step_s"] == 0.7
    assert data.bandwidth_order == ["unshaped", "100mbit"]


def test_bytes_of_convergence_runs_are_means_with_dense_steps(tmp_path):
    dense = 59_092_992.0
    conv = [
        {
            "method": m,
            "label": m,
            "ok": True,
            "final_loss": 6.0,
            "gap_pct": 0.0,
            "curve": _curve(10, 8.0, sent, dense),
            "bytes_per_step_all_ranks": {"dp-grad": {"sent": sent, "dense_sent": dense}},
        }
        for m, sent in (("none", dense), ("radius-0.4", 27_560_000.0))
    ]
    _write(tmp_path / "c", common.make_report("convergence", {"iters": 10}, conv, ENV))
    assert report.main([str(tmp_path / "c"), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| radius-0.4 | 27.56 | 59.09 | x2.1 |" in md
    assert "dense ones (warm-up, reselections) included" in md
    assert "dense reductions excluded" not in md


def test_step_times_follow_the_configured_method_label():
    """Two configurations of one method measured apart: each convergence run takes its own
    (a Grassmann variant the fixed-subspace run it extends), not the last one loaded."""
    data = report.RunData()
    opts = {"compression_rate": 100.0, "seed": 0, "update_interval": 0, "lr": 0.1,
            "uncompressed_last_layers": 1, "reproject_interval": 100}  # fmt: skip
    for rank, step in ((0, 0.5), (32, 0.6)):
        rec = {"layout": "pp2", "method": "protocol", "bandwidth": "10mbit", "ok": True,
               "step_s": step, "num_compressed": 0, "method_options": {**opts, "rank": rank}}  # fmt: skip
        report._add_bench(data, {"benchmark": "step_time", "settings": {"family": "subspace"},
                                 "results": [rec]}, "x")  # fmt: skip
    times = lambda label: report._step_times_for(data, "protocol", "10mbit", "pp2", label)[0]
    assert times("protocol-x100") == 0.5 and times("protocol-k32") == 0.6
    assert times("protocol-x100-u100") == 0.5 and times("protocol-k32-u100") == 0.6
    assert "| protocol |" not in "\n".join(report._step_time_md(data))


# -- sites (benchmarks/sites.py) -------------------------------------------------------------


def _site(label, rate="100mbit", *, t=None, speed=None, lower=False, gap=0.0, target=6.0, **kw):
    """A ``sites.json`` record with the comparison fields ``benchmarks/sites.py`` records."""
    outer = label.startswith("diloco")
    rec = {
        "label": label,
        "layout": "dp2",
        "sites": 2,
        "ranks_per_site": 1,
        "pp": 1,
        "rate": rate,
        "iters": 20,
        "status": "ok",
        "iterations_done": 20,
        "final_loss": None if gap is None else target * (1 + gap / 100),
        "gap_pct": gap,
        "target_loss": target,
        "target_from_rate": "unshaped",
        "time_to_target_s": t,
        "reached_target": t is not None,
        "speedup_vs_none": speed,
        "speedup_is_lower_bound": lower,
        "mean_step_s": 0.5,
        "train_time_s": 10.0,
        "bytes_per_step_all_ranks": {
            ("outer" if outer else "dp-grad"): {"sent": 1.5e6 if outer else 5.9e7},
            "other": {"sent": 32.0},
        },
        "curve": {
            "iteration": list(range(1, 21)),
            "lm_loss": [8.0 - 0.1 * i for i in range(20)],
            "elapsed_s": [0.5 * i for i in range(1, 21)],
            "smoothed_loss": [8.0 - 0.09 * i for i in range(20)],
        },
    }
    rec.update(kw)
    return rec


def _front_rows(records):
    from megatron_ext import report_sites

    lines = "\n".join(report_sites.front_page_md(records)).splitlines()
    return [line for line in lines if line.startswith("| dp2")]


def test_sites_front_page_picks_the_soonest_configuration_other_than_none():
    records = [
        _site("none", t=50.0, speed=1.0),
        _site("diloco-h50", t=30.0, speed=50 / 30, gap=-0.5),  # lowest loss, not the soonest
        _site("diloco-h10", t=20.0, speed=2.5, gap=0.4),  # the soonest
        _site("diloco-h100", t=40.0, speed=1.25, gap=-0.1),
        _site("powersgd-r14", gap=0.1),  # not reached
    ]
    (row,) = _front_rows(records)
    assert row == (
        "| dp2 | 100mbit | 20 | diloco-h10 | 20 s | 2.5x | +0.40 % | 1.50 | 0.50 (0.50) | - |"
    )


def test_sites_speedup_over_a_stopped_none_is_marked_as_a_lower_bound():
    from megatron_ext import report_sites

    records = [
        _site("none", status="stopped", iterations_done=7, gap=None, speed=None),
        _site("diloco-h50-q4", t=12.0, speed=2.04, lower=True),
        _site("diloco-h50", t=15.0, speed=1.63, lower=True),
    ]
    (row,) = _front_rows(records)
    assert "| diloco-h50-q4 | 12 s | >= 2.0x |" in row
    section = "\n".join(report_sites.sites_md(records))
    assert "| diloco-h50-q4 | ok |" in section and "| 12.0 | >= 2.04x |" in section
    assert "| none | stopped (7 of 20 steps) | - | - |" in section
    # Not flagged: a plain number, never a bound.
    (row,) = _front_rows([_site("none", t=30.0, speed=1.0), _site("diloco-h50", t=15.0, speed=2.0)])
    assert "| 15 s | 2.0x |" in row and ">=" not in row


def test_sites_front_page_says_none_reached_with_the_closest_gap_and_its_outer_bytes():
    records = [
        _site("none", rate="unshaped", t=46.0, speed=1.0),  # none reaches its own loss
        _site("diloco-h10", rate="unshaped", gap=15.1),
        _site("diloco-h50-q4", rate="unshaped", gap=6.85),
        _site("diloco-h50", rate="unshaped", gap=6.86),
    ]
    records[2]["bytes_per_step_all_ranks"] = {"outer": {"sent": 150_040.96}}
    records[0]["mean_step_s"] = 2.85  # the step time column: the pick's, then none's
    records[2]["mean_step_s"] = 0.249
    (row,) = _front_rows(records)
    assert row == (
        "| dp2 | unshaped | 20 | none reached (closest: diloco-h50-q4) | - | - | +6.85 % | 0.15 "
        "| 0.25 (2.85) | - |"
    )
    # Without a recorded target (the sweep's none run never completed) there is no pick.
    records = [_site(lab, gap=None, target=None) for lab in ("none", "diloco-h50")]
    records[0]["status"] = "stopped"
    (row,) = _front_rows(records)
    assert "no target (no complete none run)" in row


def test_sites_later_inputs_win_on_layout_pp_rate_label_and_steps(tmp_path):
    def write(name, records):
        common.write_report(common.make_report("sites", {}, records, ENV), str(tmp_path / name))
        return str(tmp_path / name)

    first = write("a", [_site("none", t=9.0), _site("diloco-h50", t=5.0)])
    second = write(
        "b",
        [
            _site("diloco-h50", t=4.0),  # same key: replaces a's
            _site("diloco-h50", t=3.0, iters=40),  # other steps: kept beside it
            _site("diloco-h50", t=2.0, pp=2),  # other pipeline depth: kept beside it
        ],
    )
    data = report.load_runs([first, second])
    assert data.sources == [str(tmp_path / "a" / "sites.json"), str(tmp_path / "b" / "sites.json")]
    assert data.sites[("dp2", 1, "100mbit", "diloco-h50", 20)]["time_to_target_s"] == 4.0
    assert data.sites[("dp2", 1, "100mbit", "diloco-h50", 40)]["time_to_target_s"] == 3.0
    assert data.sites[("dp2", 2, "100mbit", "diloco-h50", 20)]["time_to_target_s"] == 2.0
    assert len(data.sites) == 4
    data = report.load_runs([second, first])
    assert data.sites[("dp2", 1, "100mbit", "diloco-h50", 20)]["time_to_target_s"] == 5.0


def test_sites_section_lists_every_configuration_with_bytes_by_category():
    from megatron_ext import report_sites

    pp = _site("none", t=10.0, speed=1.0, pp=2)
    pp["bytes_per_step_all_ranks"]["pp-act"] = {"sent": 2e6}
    refused = {"label": "diloco-bad", "layout": "dp2", "pp": 1, "rate": "100mbit", "iters": 20}
    refused.update(status="refused", refusal="no such flag")
    records = [
        _site("none", t=10.0, speed=1.0),
        _site("diloco-h50", t=8.0, speed=1.25, gap=1.0),
        refused,
        pp,
    ]
    md = report_sites.sites_md(records)
    assert md[0] == "## Across sites (DiLoCo family)"
    text = "\n".join(md)
    lines = text.splitlines()
    header = (
        "| config | status | final loss | gap % | dp-grad MB/step | outer MB/step | "
        "other MB/step | step s | train s | s to dense loss | speed-up |"
    )
    assert header in lines
    assert (
        "| none | ok | 6.0000 | +0.00 | 59.00 | - | 0.00 | 0.500 | 10.0 | 10.0 | 1.00x |" in lines
    )
    assert (
        "| diloco-h50 | ok | 6.0600 | +1.00 | - | 1.50 | 0.00 | 0.500 | 10.0 | 8.0 | 1.25x |"
        in lines
    )
    assert "| diloco-bad | refused | - | - | - | - | - | - | - | - | - |" in lines
    assert "Refused by the driver: diloco-bad: no such flag" in text
    assert "**dp2 (2 sites x 1 DP rank), 100mbit, 20 steps**" in text
    # The pipelined layout gets its own table, with its pipeline bytes as an extra column.
    assert "**dp2 (2 sites x 1 DP rank, PP=2), 100mbit, 20 steps**" in text
    assert "other MB/step | pp-act MB/step | step s" in text
    assert (
        "Target: the complete `none` run's final loss, 6.0000 (the `none` run at unshaped)."
        in lines
    )


def test_report_renders_sites_json(tmp_path):
    records = [_site("none", rate=r, t=10.0, speed=1.0) for r in ("unshaped", "100mbit")]
    records.append(_site("diloco-h50", t=5.0, speed=2.0))
    common.write_report(common.make_report("sites", {}, records, ENV), str(tmp_path / "run"))
    assert report.main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "loss_vs_time_sites.png").read_bytes()[:8] == PNG_MAGIC
    assert "(loss_vs_time_sites.png)" in md
    # The front page's table sits under the front page's heading even without frontier runs.
    front = md.index("## Which method at which bandwidth")
    assert front < md.index("### Across sites (DiLoCo family)") < md.index("![")
    assert md.index("![") < md.index("\n## Across sites (DiLoCo family)")
    assert "| dp2 | unshaped | 20 | none reached | - | - | - | - |" in md
    assert "| dp2 | 100mbit | 20 | diloco-h50 | 5 s | 2.0x |" in md


def test_report_without_sites_json_has_no_sites_parts(bench_dir, tmp_path):
    assert report.main([str(bench_dir), "--out", str(tmp_path / "out")]) == 0
    assert "Across sites" not in (tmp_path / "out" / "report.md").read_text()
    assert not (tmp_path / "out" / "loss_vs_time_sites.png").exists()


def test_sites_half_way_milestone_picks_the_soonest_and_marks_bounds():
    from megatron_ext import report_sites

    records = [
        _site("none", status="stopped", gap=None, speed=None),
        _site("diloco-h50", gap=5.0),
        _site("diloco-h10", gap=4.0),
        _site("powersgd-r14", gap=0.5),
    ]
    for r, (t, speed) in zip(records, [(None, None), (30.0, 4.0), (20.0, 6.0), (None, None)]):
        r.update(half_target_loss=7.0, time_to_half_target_s=t, speedup_half_vs_none=speed)
        r["speedup_half_is_lower_bound"] = speed is not None
    (row,) = _front_rows(records)
    assert row.endswith("| diloco-h10: 20 s (>= 6.0x) |"), row
    section = "\n".join(report_sites.sites_md(records))
    assert "s to dense loss at 50% | speed-up at 50% |" in section
    assert "| 30.0 | >= 4.00x |" in section and "| diloco-h10 |" in section
    for r in records:
        r["time_to_half_target_s"] = None
    (row,) = _front_rows(records)
    assert row.endswith("| none reached |"), row


def test_sites_rows_name_the_global_batch_from_the_runs_commands():
    records = [_site("none", t=30.0, speed=1.0), _site("diloco-h50", t=15.0, speed=2.0)]
    for r in records:
        r["command"] = "python -m megatron_ext.train --global-batch-size 32 --train-iters 20"
    (row,) = _front_rows(records)
    assert row.startswith("| dp2 | 100mbit | 20 (batch 32) | diloco-h50 |")


def test_sites_a_longer_run_is_compared_in_its_sweeps_group_and_names_its_steps():
    """A configuration that trained longer than the sweep's ``none`` run (its own
    ``--train-iters``) sits in the sweep's group, its label naming its steps."""
    from megatron_ext import report_sites

    records = [
        _site("none", t=50.0, speed=1.0, sweep_iters=20),
        _site("diloco-h50", t=8.0, speed=6.25, gap=-1.5, iters=40, sweep_iters=20),
    ]
    (row,) = _front_rows(records)
    assert row.startswith("| dp2 | 100mbit | 20 | diloco-h50 (40 steps) | 8 s | 6.2x | -1.50 % |")
    section = "\n".join(report_sites.sites_md(records))
    assert "| diloco-h50 (40 steps) | ok |" in section and "| none | ok |" in section
    # Records written before ``sweep_iters`` existed group by their own steps.
    a, b = _front_rows([_site("none", t=5.0, speed=1.0), _site("none", t=5.0, iters=40)])
    assert "| 20 |" in a and "| 40 |" in b
