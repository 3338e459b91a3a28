"""The frontier benchmark's pure parts: its point grammar and labels, and the analysis the
report draws from it (trailing mean, the dense run's milestones, measured time to a target,
the Pareto front, the front page's picks). The sweep itself trains for minutes per point;
its smoke run is ``python benchmarks/frontier.py --quick``."""

import math

import pytest

from benchmarks import frontier
from megatron_ext import report_frontier as rf


def test_points_expand_their_values_and_know_their_family():
    points = frontier.parse_points(
        ["none", "separate:ratio=4,16:blocks=layer", "linear/topr:rank=64", "none:batch_div=16"]
    )
    assert [(p.family, p.method, p.options, p.batch_div) for p in points] == [
        ("grad", "none", (), 1),
        ("grad", "separate", (("ratio", 4), ("blocks", "layer")), 1),
        ("grad", "separate", (("ratio", 16), ("blocks", "layer")), 1),
        ("linear", "topr", (("rank", 64),), 1),
        ("grad", "none", (), 16),
    ]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nosuch", "unknown grad method 'nosuch'"),
        ("separate:nosuch=1", "unknown option 'nosuch'"),
        ("separate:ratio", "expected option=value"),
        ("separate:ratio=abc", "ratio: cannot read 'abc'"),
        ("wire/none", "unknown family 'wire'"),
        ("none:batch_div=0", "batch_div must be >= 1"),
    ],
)
def test_bad_points_are_refused_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        frontier.parse_points([spec])


def test_labels_show_every_option_the_method_label_hides():
    args = frontier.build_parser().parse_args([])
    label = lambda spec: frontier.point_label(args, frontier.parse_points([spec])[0], 300)  # noqa
    assert label("separate:ratio=16") == "separate-16"
    assert label("separate:ratio=16:blocks=layer") == "separate-16-layer"
    assert label("separate:ratio=16:refresh_interval=0") == "separate-16-refreshreset"
    assert label("powersgd:approx_rank=14") == "powersgd-r14"
    assert label("radius:density=0.4") == "radius-0.4"
    assert label("separate:ratio=16:seed=7") == "separate-16+seed=7"
    assert label("none:batch_div=16") == "none@B/16"
    flags = frontier.point_flags(args, frontier.parse_points(["separate:ratio=8"])[0], 300)
    assert flags[:4] == ["--grad-compression", "separate", "--separate-ratio", "8"]


def test_the_quick_run_refuses_missing_step_counts(capsys, tmp_path):
    code = frontier.main(["--batch-sizes", "8,32", "--iters", "8=10", "--out", str(tmp_path)])
    assert code == 2 and "no step count for batch size(s) [32]" in capsys.readouterr().out


def _run(label, losses, step_s, *, method=None, tokens=1024, sent=1e6, bw=None, **extra):
    iters = len(losses)
    rec = {
        "label": label,
        "method": method or label.split("-")[0],
        "tokens_per_step": tokens,
        "iters": iters,
        "bandwidth": bw,
        "ok": True,
        "curve": {
            "iteration": list(range(1, iters + 1)),
            "lm_loss": losses,
            "step_time_s": [step_s] * iters,
        },
        "final_loss": rf.trailing_mean(losses, max(1, round(0.1 * iters)))[-1],
        "final_valid_loss": None,
        "bytes_per_step_all_ranks": {"dp-grad": {"sent": sent}},
    }
    rec.update(extra)
    return rec


def test_trailing_mean_and_milestones_of_the_dense_run():
    assert rf.trailing_mean([4.0, None, 2.0, 0.0], 2) == [4.0, 4.0, 2.0, 1.0]
    dense = _run("none", [10.0 - 0.1 * i for i in range(20)], 1.0)
    marks = rf.milestones(dense)
    assert [m["iteration"] for m in marks] == [5, 10, 15, 20]
    # Window 2 (10% of 20): the 100% milestone is the final loss.
    assert marks[-1]["loss"] == pytest.approx(dense["final_loss"])
    assert marks[0]["loss"] == pytest.approx((9.7 + 9.6) / 2)


def test_time_to_a_target_is_measured_time_and_a_lower_bound_when_unreached():
    fast = _run("powersgd-r14", [10.0 - 0.2 * i for i in range(20)], 0.5)
    t = rf.time_to(fast, 8.0, tolerance=0.0)
    # Trailing mean of two: (8.2 + 8.0) / 2 > 8 at iteration 11, (8.0 + 7.8) / 2 at 12.
    assert t == {"reached": True, "iteration": 12, "seconds": 6.0}
    within = rf.time_to(fast, 8.0, tolerance=0.02)  # 8.16 allowed: (8.2+8.0)/2 = 8.1
    assert within["iteration"] == 11
    slow = _run("none", [10.0] * 4, 3.0, truncated=True)
    assert rf.time_to(slow, 8.0) == {"reached": False, "iteration": None, "seconds": 12.0}


def test_pareto_front_keeps_the_undominated_points():
    pts = [(10.0, 5.0), (1.0, 6.0), (2.0, 5.5), (3.0, 5.9), (1.0, 7.0), (20.0, 5.0)]
    assert rf.pareto_front(pts) == [1, 2, 0]


def _records():
    dense = _run("none", [10.0 - 0.1 * i for i in range(40)], 0.3, sent=6e7)
    loss = [10.0 - 0.1 * i for i in range(40)]
    return [
        dense,
        _run("none", loss[:10], 3.0, sent=6e7, bw="100mbit", truncated=True, ok=False),
        _run("powersgd-r14", [v + 0.01 for v in loss], 0.5, sent=4e6, bw="100mbit"),
        _run("separate-16", [v + 0.5 for v in loss], 0.5, sent=4e6, method="separate"),
        _run("none@B/16", [v + 0.6 for v in loss], 0.1, sent=6e7, batch_div=16),
    ]


def test_front_page_picks_by_measured_time_and_by_bytes_within_two_percent():
    md = "\n".join(rf.front_page_md(_records()))
    # PowerSGD reaches the dense final loss (within 1%) at 100 Mbit/s; none, stopped after
    # 30 s, did not: a lower bound on the speed-up.
    assert "| 100mbit | 1024 | powersgd-r14 |" in md
    assert "> " in md.split("powersgd-r14")[1].split("\n")[0]
    # A dense run stopped before the pick got there bounds nothing: said, not a ratio < 1.
    records = _records()
    records[1]["curve"]["step_time_s"] = [0.1] * 10
    md_short = "\n".join(rf.front_page_md(records))
    assert "none stopped at 1 s, unreached" in md_short
    # Fewest bytes within 2%: PowerSGD (gap ~0.2%), not SEPARATE (gap ~7%) nor the control.
    assert "| 1024 | powersgd-r14 |" in md and "15.0x" in md


def test_frontier_and_time_tables_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    records = _records()
    table = "\n".join(rf.frontier_md(records))
    assert "| separate-16 |" in table and "| none@B/16 |" in table
    ttt = "\n".join(rf.time_to_target_md(records))
    assert "**100mbit, 1024 tokens per step**" in ttt and "> 30 s" in ttt
    assert rf.plot_frontier(records, str(tmp_path / "f.png"))
    assert rf.plot_loss_vs_wallclock(records, str(tmp_path / "t.png"))
    assert not math.isnan(rf.dp_bytes(records[2]))


def test_the_report_reads_frontier_json(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import common
    from megatron_ext import report

    rep = common.make_report("frontier", {}, _records(), {"device": "cpu"})
    common.write_report(rep, str(tmp_path / "run"))
    assert report.main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.index("## Which method at which bandwidth") < md.index("## Quality against bytes")
    assert (tmp_path / "out" / "frontier.png").exists()
    assert (tmp_path / "out" / "loss_vs_measured_time.png").exists()


def test_a_stopped_run_never_replaces_a_complete_one_of_the_same_setting(tmp_path):
    from benchmarks import common
    from megatron_ext import report

    loss = [10.0 - 0.1 * i for i in range(40)]
    complete = _run("none", loss, 3.0, sent=6e7, bw="100mbit")
    stopped = _run("none", loss[:10], 3.0, sent=6e7, bw="100mbit", truncated=True, ok=False)
    paths = []
    for name, rec in (("a", complete), ("b", stopped), ("c", complete)):
        common.write_report(common.make_report("frontier", {}, [rec], {}), str(tmp_path / name))
        paths.append(str(tmp_path / name / "frontier.json"))
    for order in (paths[:2], paths[1:]):
        data = report.load_runs(order)
        (kept,) = data.frontier.values()
        assert not kept.get("truncated") and kept["iters"] == 40, order
