"""Training step time against link bandwidth, per gradient-compression method and layout.

What it does:
    For every layout (``dp2``: 2 data-parallel ranks; ``pp2``: 2 pipeline stages;
    ``pp4``: 4 stages; ``pp2dp2``: both; the 4-process layouts only when asked), every
    bandwidth (``unshaped``, and tc
    rates such as ``1gbit``, ``100mbit``, ``10mbit``) and every method (``none``,
    ``separate``, ``radius``, ``powersgd``) it runs the training driver
    (``python -m megatron_ext.train --cpu --model gpt-tiny ...``, one thread per rank)
    under ``megatron-ext netbench``, so every rank sits in its own network namespace and
    the unshaped baseline uses the same networking as the shaped runs. From the driver's
    per-iteration ``log.jsonl`` it takes the median step time over the steady-state
    iterations (the first ``--skip`` excluded) of ``--rounds`` runs per cell (default 3,
    1 at 10mbit; run round-major so that a slow period of the shared machine does not
    hit every round of one cell; the steady steps of the rounds are pooled and each
    round's own median is kept), separately for compressed steps and for
    the dense steps some methods still take (Radius's dense warm-up and reselection steps,
    PowerSGD before its start step); the bytes per step by category (as sent and as they
    would be uncompressed); netbench's link measurement; wall time; and how much CPU other
    processes used meanwhile (the machine is small and shared).

    Method settings (defaults): SEPARATE ratio 16, block 256; Radius density 0.4 with 2
    dense steps and reselection every 50 steps, so iteration 3 is a (dense) reselection
    step and the rest are sparse; PowerSGD at the rank that sends about the bytes of
    SEPARATE-16 on gpt-tiny (14), starting at step 2. Pipeline layouts measure the pipeline
    families (``--family p2p``: AQ-SGD, DirectQ; ``--family subspace``: Protocol Models);
    ``pp2dp2`` also accepts the gradient methods (they compress its data-parallel
    gradients).

Usage:
    python benchmarks/step_time.py                                  # dp2 + pp2, all methods
    python benchmarks/step_time.py --quick                          # smoke run (~2 min)
    python benchmarks/step_time.py --methods none,separate --bandwidths unshaped,100mbit \\
        --layouts dp2 --iters 12 --iters-per-bandwidth 10mbit=8

Constraints:
    Needs what netbench needs (Linux, root, iproute2, network namespaces); refuses with
    the reason otherwise. At 10 Mbit/s a dense DP=2 step takes about 25 s.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from megatron_ext.report import is_compressed, mean_bytes  # noqa: E402

__all__ = [
    "LAYOUTS",
    "build_parser",
    "main",
    "method_flags",
    "train_command",
    "summarize_run",
    "aggregate_runs",
    "step_kind",
]

LAYOUTS = {
    # name: (nproc, pipeline-parallel size, method families it measures)
    "dp2": (2, 1, ("grad", "linear")),
    "pp2": (2, 2, ("p2p", "subspace")),
    "pp4": (4, 4, ("p2p", "subspace")),
    "pp2dp2": (4, 2, ("grad", "p2p", "linear", "subspace")),
}


def _layout_methods(layout: str, family: str = "grad") -> Tuple[str, ...]:
    """Methods of ``family`` a layout measures (only ``none`` where it has no such link)."""
    return common.method_choices(family) if family in LAYOUTS[layout][2] else ("none",)


DEFAULT_BANDWIDTHS = "unshaped,1gbit,100mbit,10mbit"


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/step_time.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/step_time.py",
        description="Step time of the tiny GPT against bandwidth, per compression method, "
        "through megatron-ext netbench (needs root).",
    )
    common.add_family_args(
        p,
        {
            "p2p": "runs in fixed-sample mode, see --fixed-samples",
            "subspace": "pipeline layouts",
        },
    )
    p.add_argument(
        "--fixed-samples",
        type=int,
        default=None,
        help="Fixed samples of --family p2p runs (default: two global batches, so that "
        "from the third step on every sample is a revisit).",
    )
    p.add_argument(
        "--shape",
        choices=("all", "pp", "dp"),
        default="all",
        help="Links netbench shapes: all, or only those between pipeline stages / inside "
        "a data-parallel group (default all).",
    )
    p.add_argument(
        "--bandwidths",
        default=DEFAULT_BANDWIDTHS,
        help=f"'unshaped' and/or tc rates (default {DEFAULT_BANDWIDTHS}).",
    )
    p.add_argument(
        "--layouts",
        default="dp2,pp2",
        help="dp2 (DP=2), pp2 (PP=2), pp4 (PP=4), pp2dp2 (the 4-process layouts are slow on 2 "
        "cores). Default dp2,pp2.",
    )
    p.add_argument("--iters", type=int, default=12, help="Training iterations per run (12).")
    p.add_argument(
        "--iters-per-bandwidth",
        default="10mbit=8",
        help="Overrides of --iters per bandwidth, e.g. '10mbit=8,100mbit=10' (default "
        "10mbit=8: a dense DP=2 step takes ~25 s there).",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="Runs per cell, spread over time (round-major order); their steady steps are "
        "pooled (default 3).",
    )
    p.add_argument(
        "--rounds-per-bandwidth",
        default="10mbit=1",
        help="Overrides of --rounds per bandwidth (default 10mbit=1).",
    )
    p.add_argument(
        "--skip", type=int, default=2, help="Warm-up iterations excluded from the statistics (2)."
    )
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    common.add_run_args(p, run_timeout=1800.0)
    common.add_machine_args(p, quiet_wait=120.0, what="run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="Smoke run: dp2, none and separate, unshaped and 100mbit, 5 iterations, 1 round.",
    )
    # Every method's options under the driver's names; step time wants the compressed
    # steps early: Radius's dense warm-up and PowerSGD's start after 2 steps.
    common.add_method_args(p, "grad")
    common.add_method_args(p, "p2p")
    common.add_method_args(p, "linear")
    common.add_method_args(p, "subspace")
    p.set_defaults(radius_dense_steps=2, powersgd_start_step=2)
    p.add_argument(
        "--out", default=None, help="Run directory (default runs/bench-step_time-<time>)."
    )
    return p


def _per_bandwidth(spec: str, bandwidth: str, default: int) -> int:
    overrides = {}
    for item in common.parse_list(spec):
        key, _, value = item.partition("=")
        overrides[key.strip()] = int(value)
    return overrides.get(bandwidth, default)


def _iters_for(args: argparse.Namespace, bandwidth: str) -> int:
    return _per_bandwidth(args.iters_per_bandwidth, bandwidth, args.iters)


def _rounds_for(args: argparse.Namespace, bandwidth: str) -> int:
    return max(1, _per_bandwidth(args.rounds_per_bandwidth, bandwidth, args.rounds))


def method_flags(method: str, args: argparse.Namespace) -> List[str]:
    """Driver flags selecting ``method`` (of ``--family``) with the benchmark's settings."""
    flags = common.MethodSettings(args, args.family).flags(method)
    if args.family == "p2p":
        fixed = args.fixed_samples or 2 * args.global_batch_size
        flags += ["--fixed-samples", str(fixed)]
    return flags


def train_command(
    args: argparse.Namespace, method: str, pp: int, iters: int, run_dir: str
) -> List[str]:
    """The per-rank driver command of one run."""
    # Step time does not depend on the learning rate; a short warm-up keeps the schedule
    # valid for a handful of iterations.
    schedule = ["--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0"]
    cmd = common.driver_command(
        args, run_dir, args.micro_batch_size, args.global_batch_size, iters, schedule
    )
    if pp > 1:
        cmd += ["--pipeline-model-parallel-size", str(pp)]
    cmd += method_flags(method, args)
    cmd += common.extra_train_flags(args)
    return cmd


def netbench_command(
    nproc: int,
    pp: int,
    bandwidth: str,
    report: str,
    timeout: float,
    train: Sequence[str],
    shape: str = "all",
) -> List[str]:
    """``python -m megatron_ext netbench ... -- <train>`` for one run."""
    cmd = [sys.executable, "-m", "megatron_ext", "netbench", "--nproc", str(nproc)]
    cmd += ["--pp", str(pp)]
    if bandwidth == "unshaped":
        cmd += ["--unshaped"]
    else:
        cmd += ["--bandwidth", bandwidth, "--shape", shape]
    cmd += ["--report", report, "--timeout", str(int(timeout)), "--"]
    return cmd + list(train)


# -- analysis ------------------------------------------------------------------------------


def step_kind(record: Dict[str, Any], category: str = "dp-grad") -> str:
    """``"compressed"`` when the step's traffic of ``category`` (DP gradients, or ``pp-act``
    for pipeline methods) travelled compressed, else ``"dense"``."""
    grad = (record.get("bytes_per_step_all_ranks") or {}).get(category)
    if not grad or not grad.get("dense_sent"):
        return "dense"
    return "compressed" if is_compressed(grad["sent"], grad["dense_sent"]) else "dense"


def _step_stats(times: Sequence[float], kinds: Sequence[str]) -> Dict[str, Any]:
    """Statistics of steady step times and their kinds (``compressed`` / ``dense``): the
    headline ``step_s`` is the median of the compressed steps, or of all steps for a
    method without any."""
    comp = [t for t, k in zip(times, kinds) if k == "compressed"]
    dense = [t for t, k in zip(times, kinds) if k == "dense"]
    times = list(times)
    return {
        "num_steady": len(times),
        "step_s": common.median(comp or times),
        "step_kind": "compressed" if comp else "dense",
        "median_all_s": common.median(times),
        "mean_all_s": sum(times) / len(times) if times else None,
        "median_compressed_s": common.median(comp),
        "median_dense_s": common.median(dense),
        "num_compressed": len(comp),
        "num_dense": len(dense),
        "min_s": min(times) if times else None,
        "max_s": max(times) if times else None,
    }


def summarize_run(
    records: List[Dict[str, Any]], skip: int, category: str = "dp-grad"
) -> Dict[str, Any]:
    """Statistics of one run's ``log.jsonl`` records (one per iteration).

    Returns:
        ``step_s`` (the headline: median over the steady compressed steps, or over all
        steady steps for a method that has none), ``median_all_s``/``mean_all_s`` (all
        steady steps, dense ones included), per kind medians and counts, the per-step
        times, and bytes per step (mean over the steady steps of the headline kind, and
        over all steady steps).
    """
    records = sorted(records, key=lambda r: r["iteration"])
    times = [r["step_time_s"] for r in records]
    steady_recs = [r for r in records if r["iteration"] > skip]
    kinds = [step_kind(r, category) for r in steady_recs]
    comp = [r for r, k in zip(steady_recs, kinds) if k == "compressed"]
    headline = comp or steady_recs
    return {
        "num_iterations": len(records),
        "iterations": [r["iteration"] for r in records],
        "step_times_s": times,
        "step_kinds": [step_kind(r, category) for r in records],
        **_step_stats([r["step_time_s"] for r in steady_recs], kinds),
        "bytes_per_step_all_ranks": mean_bytes(headline) if headline else {},
        "bytes_per_step_all_ranks_mean_all": mean_bytes(steady_recs) if steady_recs else {},
        "final_lm_loss": records[-1].get("lm_loss") if records else None,
    }


def aggregate_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One result from the rounds of a (layout, method, bandwidth) cell.

    The steady steps of all successful rounds are pooled: ``step_s`` is the median of the
    pooled compressed steps (all steady steps for a method without compressed ones),
    ``median_dense_s`` of the pooled dense steps; ``round_step_s`` lists each round's own
    median, so the spread between rounds (machine noise over time) stays visible.
    """
    first = runs[0]
    ok_runs = [r for r in runs if r.get("ok") and r.get("step_times_s")]
    out: Dict[str, Any] = {
        k: first[k]
        for k in ("layout", "nproc", "pp", "dp", "method", "bandwidth", "iters", "skip", "command")
        if k in first
    }
    if "method_options" in first:
        out["method_options"] = first["method_options"]
    out["num_rounds"] = len(runs)
    out["ok"] = bool(runs) and all(r.get("ok") for r in runs)
    out["exit_code"] = next((r["exit_code"] for r in runs if r["exit_code"] != 0), 0)
    out["wall_s"] = sum(r.get("wall_s", 0.0) for r in runs)
    out["run_dirs"] = [r.get("run_dir") for r in runs]
    out["round_step_s"] = [r.get("step_s") for r in runs]
    shares = [(r.get("contention") or {}).get("foreign_cpu_share") for r in runs]
    out["contention"] = {
        "foreign_cpu_share": max((x for x in shares if x is not None), default=None),
        "per_round_foreign_cpu_share": shares,
    }
    times, kinds = [], []
    for r in ok_runs:
        for it, t, kind in zip(r["iterations"], r["step_times_s"], r["step_kinds"]):
            if it > r["skip"]:
                times.append(t)
                kinds.append(kind)
    out.update(_step_stats(times, kinds))
    if ok_runs:
        last = ok_runs[-1]
        for k in ("bytes_per_step_all_ranks", "bytes_per_step_all_ranks_mean_all"):
            out[k] = last.get(k)
        out["link_check"] = last.get("link_check")
        out["link_checks_mb_per_s"] = [
            (r.get("link_check") or {}).get("shaped_mb_per_s")
            or (r.get("link_check") or {}).get("unshaped_mb_per_s")
            for r in ok_runs
        ]
    if not out["ok"]:
        out["error_tail"] = next((r.get("error_tail") for r in runs if not r.get("ok")), None)
    return out


def _link_summary(netbench: Dict[str, Any], bandwidth: str) -> Dict[str, Any]:
    links = netbench.get("link_check") or []
    shaped = [m["mb_per_s"] for m in links if m.get("shaped")]
    unshaped = [m["mb_per_s"] for m in links if not m.get("shaped")]
    out: Dict[str, Any] = {
        "links": links,
        "shaped_mb_per_s": common.median(shaped),
        "unshaped_mb_per_s": common.median(unshaped),
    }
    if bandwidth != "unshaped":
        from megatron_ext.netbench.shaping import parse_rate

        expected = parse_rate(bandwidth) / 8e6
        out["expected_mb_per_s"] = expected
        if shaped:
            out["shaped_over_expected"] = common.median(shaped) / expected
            # TCP payload over a tc-shaped link reaches ~96% of the rate (headers).
            out["ok"] = 0.85 <= common.median(shaped) / expected <= 1.05
    return out


# A full TCP segment over a 1500-byte MTU: 1448 bytes of payload in a 1514-byte frame
# (Ethernet 14, IP 20, TCP 20 + 12 of timestamps), before ACKs.
TCP_FRAME_OVERHEAD = 1514 / 1448


def wire_check(
    interface_bytes: List[Dict[str, int]], comm_report: Dict[str, Any]
) -> Dict[str, Any]:
    """The bytes each rank's interface sent against what megatron_ext's accounting counted.

    The interface counts every frame (headers, ACKs, the rendezvous, evaluation if any);
    the accounting counts payloads. Their ratio over :data:`TCP_FRAME_OVERHEAD` is the
    agreement left once frame headers are allowed for.
    """
    per_rank = comm_report.get("comm", {}).get("per_rank_total") or []
    accounted = [sum(c.get("sent", 0) for c in rank.values()) for rank in per_rank]
    sent = [c["tx_bytes"] for c in interface_bytes]
    ratios = [s / a if a else None for s, a in zip(sent, accounted)]
    return {
        "interface_tx_bytes": sent,
        "accounted_sent_bytes": accounted,
        "interface_over_accounted": ratios,
        "over_frame_overhead": [r / TCP_FRAME_OVERHEAD if r else None for r in ratios],
    }


def run_one(
    args: argparse.Namespace,
    layout: str,
    method: str,
    bandwidth: str,
    out_dir: str,
    round_index: int = 0,
) -> Dict[str, Any]:
    """One netbench run; returns its record (see :func:`summarize_run`)."""
    nproc, pp, _ = LAYOUTS[layout]
    iters = _iters_for(args, bandwidth)
    name = f"{layout}-{method}-{bandwidth}-r{round_index + 1}"
    run_dir = common.fresh_run_dir(out_dir, name)
    train = train_command(args, method, pp, iters, run_dir)
    cmd = netbench_command(
        nproc,
        pp,
        bandwidth,
        os.path.join(run_dir, "netbench.json"),
        args.run_timeout,
        train,
        shape=args.shape,
    )
    code, wall, contention = common.run_measured(args, cmd, run_dir, args.run_timeout + 120)
    result: Dict[str, Any] = {
        "layout": layout,
        "nproc": nproc,
        "pp": pp,
        "dp": nproc // pp,
        "method": method,
        "bandwidth": bandwidth,
        "round": round_index + 1,
        "iters": iters,
        "skip": args.skip,
        "exit_code": code,
        "ok": code == 0,
        "wall_s": wall,
        "command": common.shell_join(
            ["megatron-ext"] + ["python" if c == sys.executable else c for c in cmd[3:]]
        ),
        "run_dir": os.path.relpath(run_dir, out_dir),
        "contention": contention,
    }
    result["family"] = args.family
    result["method_options"] = common.MethodSettings(args, args.family).options(method)
    records = common.run_records(run_dir)
    if records is not None:
        category = "pp-act" if args.family in ("p2p", "subspace") else "dp-grad"
        result.update(summarize_run(records, args.skip, category))
    nb = common.run_json(run_dir, "netbench.json")
    if nb is not None:
        result["link_check"] = _link_summary(nb, bandwidth)
        result["netbench_wall_s"] = nb.get("wall_time_s")
        report = common.run_json(run_dir, "comm_report.json") if nb.get("interface_bytes") else None
        if report is not None:
            result["wire_check"] = wire_check(nb["interface_bytes"], report)
    if code != 0:
        result["error_tail"] = common.stdout_tail(run_dir)
    return result


def print_table(results: List[Dict[str, Any]]) -> None:
    """Step time per (layout, method) and bandwidth, with the speed-up over ``none``."""
    base = {
        (r["layout"], r["bandwidth"]): r.get("step_s")
        for r in results
        if r["method"] == "none" and r.get("ok")
    }
    rows = []
    for r in results:
        b = base.get((r["layout"], r["bandwidth"]))
        s = r.get("step_s")
        dp = (r.get("bytes_per_step_all_ranks") or {}).get("dp-grad", {})
        pp_bytes = sum(
            (r.get("bytes_per_step_all_ranks") or {}).get(c, {}).get("sent", 0.0)
            for c in ("pp-act", "pp-grad")
        )
        link = r.get("link_check") or {}
        rows.append(
            [
                r["layout"],
                r["method"],
                r["bandwidth"],
                "ok" if r.get("ok") else f"FAILED ({r['exit_code']})",
                s,
                r.get("median_dense_s") if r.get("num_compressed") else None,
                r.get("mean_all_s"),
                b / s if b and s else None,
                dp.get("sent", 0.0) / 1e6 if dp else None,
                pp_bytes / 1e6 if pp_bytes else None,
                " / ".join(f"{x:.2f}" for x in r.get("round_step_s") or [] if x is not None),
                link.get("shaped_mb_per_s") or link.get("unshaped_mb_per_s"),
                (r.get("contention") or {}).get("foreign_cpu_share"),
            ]
        )
    headers = [
        "layout",
        "method",
        "bandwidth",
        "status",
        "step s (median)",
        "dense-step s",
        "mean s (all)",
        "speed-up vs none",
        "dp-grad MB/step",
        "pp MB/step",
        "per round s",
        "link MB/s",
        "other CPU",
    ]
    print(common.format_table(headers, rows))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.quick:
        defaults = build_parser().parse_args([])
        for name, value in (
            ("methods", "none,separate"),
            ("bandwidths", "unshaped,100mbit"),
            ("layouts", "dp2"),
            ("iters", 5),
            ("rounds", 1),
        ):
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
        if args.quiet_wait == defaults.quiet_wait:
            args.quiet_wait = 0.0
    methods = common.family_methods(args, "step_time.py")
    if methods is None:
        return 2
    layouts = common.parse_list(args.layouts)
    bandwidths = common.parse_list(args.bandwidths)
    for lay in layouts:
        if lay not in LAYOUTS:
            print(f"step_time.py: error: unknown layout {lay!r} (choose from {list(LAYOUTS)})")
            return 2
    from megatron_ext.netbench.shaping import parse_rate

    for bw in bandwidths:
        if bw != "unshaped":
            try:
                parse_rate(bw)
            except ValueError as exc:
                print(f"step_time.py: error: --bandwidths: {exc}")
                return 2
    if args.iters <= args.skip:
        print(f"step_time.py: error: --iters {args.iters} must exceed --skip {args.skip}")
        return 2
    from megatron_ext.netbench.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(
            "step_time.py: error: megatron-ext netbench cannot run here, so step time against "
            f"bandwidth cannot be measured: {reason}",
            file=sys.stderr,
        )
        return 2
    report = common.SweepReport("step_time", args)
    out, settings = report.out, report.settings
    cells = [
        (lay, m, bw)
        for lay in layouts
        for bw in bandwidths
        for m in methods
        if m in _layout_methods(lay, args.family)
    ]
    # Round-major: the rounds of a cell are spread over the whole benchmark, so slow
    # periods of a shared machine do not hit one cell's every round.
    num_rounds = max(_rounds_for(args, bw) for bw in bandwidths)
    plan = [
        (k, lay, m, bw)
        for k in range(num_rounds)
        for (lay, m, bw) in cells
        if k < _rounds_for(args, bw)
    ]
    skipped = [
        {"layout": lay, "method": m, "reason": f"the layout has no {args.family} links"}
        for lay in layouts
        for m in methods
        if m not in _layout_methods(lay, args.family)
    ]
    chosen = common.MethodSettings(args, args.family)
    settings["method_options"] = {m: chosen.options(m) for m in methods}
    settings["plan"] = [[k + 1, lay, m, bw] for k, lay, m, bw in plan]
    settings["statistic"] = (
        f"median step time over the pooled iterations > {args.skip} of every round; for "
        "methods with dense steps (radius reselection, powersgd before its start) the "
        "headline is the median of the compressed steps, the dense steps are reported "
        "separately"
    )
    runs: List[Dict[str, Any]] = []
    results: List[Dict[str, Any]] = []
    for i, (k, lay, m, bw) in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] round {k + 1}: {lay} {m} {bw} ...", flush=True)
        res = run_one(args, lay, m, bw, out, round_index=k)
        runs.append(res)
        print(
            f"    -> {'ok' if res['ok'] else 'FAILED'}: step "
            f"{res.get('step_s') or float('nan'):.3f} s (dense steps "
            f"{res.get('median_dense_s') or float('nan'):.3f} s), wall {res['wall_s']:.0f} s, "
            "other processes "
            f"{100 * ((res.get('contention') or {}).get('foreign_cpu_share') or 0):.0f}% CPU",
            flush=True,
        )
        results = [
            aggregate_runs([r for r in runs if (r["layout"], r["method"], r["bandwidth"]) == c])
            for c in cells
            if any((r["layout"], r["method"], r["bandwidth"]) == c for r in runs)
        ]
        report.write(results, skipped=skipped, runs=runs)
    print()
    print_table(results)
    print(f"\nreport: {report.path}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
