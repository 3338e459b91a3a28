"""Training across sites: loss against measured time per method, layout and inter-site rate.

What it does:
    For every layout, every rate and every method configuration it trains gpt-tiny with the
    driver (``python -m megatron_ext.train --cpu``, one thread per rank, the same seed, data
    order, batch and number of iterations for every run) under ``megatron-ext netbench``,
    with only the links between sites shaped (``--shape sites --sites S``):

    * layouts: ``dpN`` (N data-parallel ranks, one per site: pure DiLoCo's layout) and
      ``SxR`` (S sites of R data-parallel ranks each, e.g. ``2x2``); ``--pp`` makes every
      site's ranks pipelines of that many stages;
    * rates: ``unshaped`` (the same namespaces without tc) and tc rates (``100mbit``);
    * configurations: ``LABEL=FLAGS``, extra driver flags per run (``none=``,
      ``powersgd-r14=--grad-compression powersgd --powersgd-approx-rank 14
      --powersgd-start-step 30``,
      ``diloco-h50=--outer-method diloco --outer-interval 50``). A configuration that
      names ``--outer-method`` but not ``--outer-groups`` gets ``--outer-groups S`` (one
      group per site).

    Before it starts anything, each configuration is parsed and validated as the driver
    does before training (flags, layout, method combinations); a configuration the driver
    refuses (e.g. the DiLoCo ones while the method is not on this branch) is recorded as
    ``refused`` with the driver's message, and the sweep goes on.

    From each run's ``log.jsonl`` (one record per iteration) it records the loss curve
    against measured training time (the running sum of the logged per-step times, which
    exclude start-up and evaluation), the final loss (mean of the last 10% of the logged
    losses) and its gap to the target, the mean bytes per step of every accounting
    category (``dp-grad``, ``outer`` when the method logs it, ...), and the time to reach
    the target. The target is the final loss of the complete ``none`` run of the layout (at
    the same rate when there is one, else at another rate: the loss per iteration does not
    depend on the link). The time to it is the first time the run's trailing-mean loss
    (window: 10% of the iterations, the final loss's window) is at or below it, linearly
    interpolated in time between the two logged iterations that bracket it: a measured
    time on the logged curve, never one derived from bytes and a rate. A run that never
    reaches it reports ``None``. The speed-up is the ``none`` run's time to the target at
    the same rate divided by the configuration's; when that ``none`` run was stopped by
    ``--time-limit`` first, its whole measured time is used and the speed-up is flagged as
    a lower bound. The JSON (``sites.json``, the layout of
    :func:`benchmarks.common.make_report`) is rewritten after every run; a table is printed
    at the end.

Usage:
    python benchmarks/sites.py --layouts dp2,2x2 --rates unshaped,100mbit,10mbit --iters 1000 \\
        --config none= \\
        --config "powersgd-r14=--grad-compression powersgd --powersgd-approx-rank 14 \\
            --powersgd-start-step 30" \\
        --config "diloco-h50=--outer-method diloco --outer-interval 50" \\
        --config "diloco-h50-q4=--outer-method diloco --outer-interval 50 \\
            --outer-compression quantized --quantized-bits 4" \\
        --time-limit 10mbit=1800
    python benchmarks/sites.py --quick     # smoke run: dp2, 100mbit, 4 steps, none + powersgd

Constraints:
    Needs what netbench needs (Linux, root, iproute2, network namespaces); refuses with the
    reason otherwise. gpt-tiny's dense DP exchange is ~29.5 MB per step, so a dense step at
    10 Mbit/s takes ~25 s: use ``--time-limit`` there (a stopped run gives lower bounds).
    Runs one configuration at a time; every rank uses ``--num-threads`` threads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

__all__ = [
    "DEFAULT_CONFIGS",
    "Layout",
    "parse_layout",
    "parse_config",
    "config_flags",
    "check_config",
    "time_to_loss",
    "summarize_run",
    "add_comparisons",
    "build_parser",
    "main",
]

DEFAULT_CONFIGS = (
    "none=",
    "powersgd-r14=--grad-compression powersgd --powersgd-approx-rank 14 --powersgd-start-step 30",
    "diloco-h50=--outer-method diloco --outer-interval 50",
    "diloco-h50-q4=--outer-method diloco --outer-interval 50 --outer-compression quantized "
    "--quantized-bits 4",
)
"""``LABEL=FLAGS`` of the default sweep (DiLoCo's configurations included).
PowerSGD starts at step 30, its setting in ``benchmarks/frontier.py`` (``bench_defaults``)."""

QUICK_CONFIGS = (
    "none=",
    "powersgd-r14=--grad-compression powersgd --powersgd-approx-rank 14 --powersgd-start-step 1",
    "diloco-h2=--outer-method diloco --outer-interval 2",
)
"""``--quick``'s configurations (PowerSGD compresses from step 2 of the 4)."""

QUICK_DEFAULTS = {"layouts": "dp2", "rates": "100mbit", "iters": 4}
"""``--quick``'s defaults; flags given explicitly still win."""

FINAL_FRACTION = 0.1
"""Share of the iterations whose mean loss is the final loss (and the smoothing window)."""


class Layout:
    """Ranks of one layout: ``sites`` sites of ``per_site`` DP ranks, ``pp`` stages each.

    Args:
        name: ``dpN`` (N sites of one DP rank) or ``SxR`` (S sites of R DP ranks).
        sites: Number of sites.
        per_site: Data-parallel ranks per site.
        pp: Pipeline stages of every data-parallel replica.
    """

    def __init__(self, name: str, sites: int, per_site: int, pp: int = 1):
        self.name, self.sites, self.per_site, self.pp = name, sites, per_site, pp

    @property
    def dp(self) -> int:
        """Data-parallel size."""
        return self.sites * self.per_site

    @property
    def nproc(self) -> int:
        """Number of ranks."""
        return self.dp * self.pp

    def __repr__(self) -> str:
        return f"Layout({self.name!r}, sites={self.sites}, per_site={self.per_site}, pp={self.pp})"


def parse_layout(text: str, pp: int = 1) -> Layout:
    """``dp2`` -> 2 sites x 1 rank; ``2x2`` -> 2 sites x 2 ranks (``ValueError`` otherwise)."""
    m = re.fullmatch(r"dp(\d+)", text) or re.fullmatch(r"(\d+)x(\d+)", text)
    if not m:
        raise ValueError(f"--layouts: {text!r} is neither dpN nor SxR (e.g. dp2, 2x2)")
    sites = int(m.group(1))
    per_site = int(m.group(2)) if m.lastindex == 2 else 1
    if sites < 2 or per_site < 1:
        raise ValueError(f"--layouts: {text!r} needs at least 2 sites of at least 1 rank")
    return Layout(text, sites, per_site, pp)


def parse_config(text: str) -> Tuple[str, List[str]]:
    """``"LABEL=FLAGS"`` -> ``(label, flags)``; an empty FLAGS is the dense run."""
    label, sep, flags = text.partition("=")
    label = label.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", label):
        raise ValueError(f"--config: expected LABEL=FLAGS with a plain label, got {text!r}")
    return label, shlex.split(flags)


def config_flags(flags: Sequence[str], layout: Layout) -> List[str]:
    """The configuration's driver flags for ``layout``: ``--outer-groups`` set to the
    number of sites when ``--outer-method`` is given without it."""
    flags = list(flags)
    if "--outer-method" in flags and "--outer-groups" not in flags:
        flags += ["--outer-groups", str(layout.sites)]
    return flags


def config_iters(flags: Sequence[str], default: int) -> Tuple[int, List[str]]:
    """A configuration's own number of iterations: ``--train-iters N`` among its flags (a
    method whose steps are cheap over a slow link may train longer than the dense run to
    reach its loss), else ``default``; returns it and the flags without it."""
    flags, iters = list(flags), default
    while "--train-iters" in flags:
        i = flags.index("--train-iters")
        try:
            iters = int(flags[i + 1])
        except (IndexError, ValueError):
            raise ValueError(f"--config: --train-iters needs an integer, got {flags[i + 1:i + 2]}")
        if iters < 1:
            raise ValueError(f"--config: --train-iters must be positive, got {iters}")
        del flags[i : i + 2]
    return iters, flags


def train_command(
    args: argparse.Namespace,
    layout: Layout,
    flags: Sequence[str],
    run_dir: str,
    iters: Optional[int] = None,
) -> List[str]:
    """The per-rank driver command of one run of ``iters`` iterations (``args.iters``): a
    linear warm-up over 10% of them, then cosine decay to ``--min-lr`` at the last."""
    iters = iters or args.iters
    mbs = args.micro_batch_size or max(1, min(8, args.global_batch_size // layout.dp))
    schedule = common.lr_schedule_flags(args, max(1, iters // 10))
    schedule += ["--eval-iters", "0", "--log-interval", "1"]
    cmd = common.driver_command(args, run_dir, mbs, args.global_batch_size, iters, schedule)
    if layout.pp > 1:
        cmd += ["--pipeline-model-parallel-size", str(layout.pp)]
    return cmd + list(flags) + common.extra_train_flags(args)


def netbench_command(
    layout: Layout,
    rate: str,
    report: str,
    timeout: float,
    train: Sequence[str],
    check_seconds: float = 1.0,
) -> List[str]:
    """``python -m megatron_ext netbench ... -- <train>``: only inter-site links shaped."""
    cmd = [sys.executable, "-m", "megatron_ext", "netbench", "--nproc", str(layout.nproc)]
    cmd += ["--pp", str(layout.pp)]
    if rate == "unshaped":
        cmd += ["--unshaped"]
    else:
        cmd += ["--bandwidth", rate, "--shape", "sites", "--sites", str(layout.sites)]
    cmd += [
        "--check-seconds",
        str(check_seconds),
        "--report",
        report,
        "--timeout",
        str(int(timeout)),
    ]
    return cmd + ["--"] + list(train)


def check_config(train: Sequence[str], layout: Layout) -> Optional[str]:
    """Validate a run's driver command as the driver does before training.

    Returns:
        ``None`` when the driver accepts it, else the driver's error message.
    """
    from megatron_ext.config import validate_ext_config
    from megatron_ext.train import parse_args
    from megatron_ext.train_config import driver_layout, layout_sizes

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse_args(list(train[3:]))
            validate_ext_config(cfg.ext, driver_layout(cfg, layout_sizes(cfg, layout.nproc)))
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if "error" in line]
        return (lines[-1] if lines else err.getvalue().strip()[-500:]) or "refused"
    except Exception as exc:  # ConfigError / ValueError: the driver's own refusal
        return f"{type(exc).__name__}: {exc}"
    return None


# -- analysis ------------------------------------------------------------------------------


def _trailing_mean(values: Sequence[Optional[float]], window: int) -> List[Optional[float]]:
    from megatron_ext.report_frontier import trailing_mean

    return trailing_mean(values, window)


def time_to_loss(
    elapsed: Sequence[float], smooth: Sequence[Optional[float]], target: float
) -> Optional[float]:
    """First time the smoothed loss is at or below ``target``, interpolated linearly in
    time between the two logged points that bracket it; ``None`` when never reached.

    Args:
        elapsed: Measured training time at the end of each logged iteration.
        smooth: The (trailing-mean) loss at each logged iteration.
        target: The loss to reach.
    """
    prev_t, prev_l = 0.0, None
    for t, loss in zip(elapsed, smooth):
        if loss is None:
            continue
        if loss <= target:
            if prev_l is None or prev_l <= loss:
                return t
            return prev_t + (t - prev_t) * (prev_l - target) / (prev_l - loss)
        prev_t, prev_l = t, loss
    return None


def summarize_run(
    records: List[Dict[str, Any]], iters: int, smooth_iters: Optional[int] = None
) -> Dict[str, Any]:
    """Curve, final loss, measured time and mean bytes per step by category of one run.

    Args:
        records: The run's per-iteration log records.
        iters: The run's iterations: the final loss is the mean of the last 10% of them.
        smooth_iters: The sweep's iterations (``iters``): the trailing mean of the curve
            spans 10% of them, the same window for every run of the sweep.
    """
    from megatron_ext.report import final_loss, mean_bytes

    records = sorted(records, key=lambda r: r.get("iteration", 0))
    losses = [r.get("lm_loss") for r in records]
    elapsed, total = [], 0.0
    for r in records:
        total += r.get("step_time_s") or 0.0
        elapsed.append(total)
    window = max(1, int(round(FINAL_FRACTION * (smooth_iters or iters))))
    by_cat = mean_bytes(records) if records else {}
    return {
        "curve": {
            "iteration": [r.get("iteration") for r in records],
            "lm_loss": losses,
            "elapsed_s": elapsed,
            "smoothed_loss": _trailing_mean(losses, window),
        },
        "iterations_done": len(records),
        "final_loss": final_loss(losses, FINAL_FRACTION),
        "train_time_s": total,
        "mean_step_s": total / len(records) if records else None,
        "bytes_per_step_all_ranks": by_cat,
        "bytes_per_step_sent_total": sum(v["sent"] for v in by_cat.values()),
    }


def _dense_reference(results: List[Dict[str, Any]], r: Dict[str, Any]) -> Optional[Dict]:
    """The complete ``none`` run of ``r``'s layout: at ``r``'s rate when there is one, else
    at any rate (the loss per iteration does not depend on the link; only time does)."""
    complete = [
        x
        for x in results
        if x["label"] == "none" and x["layout"] == r["layout"] and x["status"] == "ok"
    ]
    same = [x for x in complete if x["rate"] == r["rate"]]
    return (same or complete or [None])[0]


def _compare_times(
    results: List[Dict[str, Any]], r: Dict[str, Any], target: float, kind: str = ""
) -> Optional[float]:
    """Time to ``target``: ``r``'s measured time to reach it (``time_to_<kind>target_s``), the
    ``none`` run's at the same layout and rate (``none_time_to_<kind>target_s``) and the
    speed-up over it (``speedup_<kind>vs_none``); when that ``none`` run was stopped before
    reaching the target, its whole training time, and the speed-up a lower bound
    (``speedup_<kind>is_lower_bound``). ``kind``: ``""`` or ``"half_"``. Returns ``r``'s time
    (``None`` when not reached)."""
    t = time_to_loss(r["curve"]["elapsed_s"], r["curve"]["smoothed_loss"], target)
    r[f"time_to_{kind}target_s"] = t
    base = next(
        (
            x
            for x in results
            if x["label"] == "none"
            and x["layout"] == r["layout"]
            and x["rate"] == r["rate"]
            and x["status"] in ("ok", "stopped")
            and x.get("curve")
        ),
        None,
    )
    if base is None:
        return t
    t_base = time_to_loss(base["curve"]["elapsed_s"], base["curve"]["smoothed_loss"], target)
    lower = t_base is None  # the dense run was stopped first: its whole time, a bound
    t_base = base["train_time_s"] if lower else t_base
    r[f"none_time_to_{kind}target_s"] = t_base
    if t is not None and t_base:
        r[f"speedup_{kind}vs_none"] = t_base / t
        r[f"speedup_{kind}is_lower_bound"] = lower
    return t


def add_comparisons(results: List[Dict[str, Any]]) -> None:
    """Per result: the target (the final loss of the complete ``none`` run of its layout,
    :func:`_dense_reference`), the gap to it, the measured time to reach it, and the speed-up
    over the ``none`` run at the same rate. When that ``none`` run was stopped by its time
    limit before reaching the target, its measured time is a lower bound and so is the
    speed-up (``speedup_is_lower_bound``)."""
    for r in results:
        for key in (
            "target_loss",
            "target_from_rate",
            "gap_pct",
            "time_to_target_s",
            "none_time_to_target_s",
            "speedup_vs_none",
        ):
            r[key] = None
        r["reached_target"] = False
        r["speedup_is_lower_bound"] = False
        ref = _dense_reference(results, r)
        if ref is None or r["status"] not in ("ok", "stopped") or r.get("final_loss") is None:
            continue
        target = ref["final_loss"]
        r["target_loss"], r["target_from_rate"] = target, ref["rate"]
        if r["status"] == "ok":
            r["gap_pct"] = 100.0 * (r["final_loss"] - target) / target
        r["reached_target"] = _compare_times(results, r, target) is not None
    add_half_milestone(results)


def add_half_milestone(results: List[Dict[str, Any]]) -> None:
    """The same comparison at a second, nearer target: the complete ``none`` run's
    trailing-mean loss at half its iterations (as the frontier's 50% milestone). Fields
    ``half_target_loss``, ``time_to_half_target_s``, ``none_time_to_half_target_s``,
    ``speedup_half_vs_none``, ``speedup_half_is_lower_bound``: measured times on the runs'
    logged curves, as the final-loss ones."""
    for r in results:
        r["half_target_loss"] = r["time_to_half_target_s"] = None
        r["none_time_to_half_target_s"] = r["speedup_half_vs_none"] = None
        r["speedup_half_is_lower_bound"] = False
        ref = _dense_reference(results, r)
        if ref is None or r["status"] not in ("ok", "stopped") or not r.get("curve"):
            continue
        curve = ref["curve"]["smoothed_loss"]
        target = curve[len(curve) // 2 - 1] if len(curve) >= 2 else None
        if target is None:
            continue
        r["half_target_loss"] = target
        _compare_times(results, r, target, "half_")


# -- running -------------------------------------------------------------------------------


def run_one(
    args: argparse.Namespace,
    layout: Layout,
    rate: str,
    label: str,
    flags: Sequence[str],
    out_dir: str,
) -> Dict[str, Any]:
    """Check, then (if the driver accepts it) train one configuration; returns its record."""
    run_dir = common.fresh_run_dir(out_dir, f"{layout.name}-{rate}-{label}")
    iters, flags = config_iters(config_flags(flags, layout), args.iters)
    train = train_command(args, layout, flags, run_dir, iters)
    time_limit = common.time_limit(args, rate)
    limit = args.run_timeout if time_limit is None else time_limit
    cmd = netbench_command(
        layout, rate, os.path.join(run_dir, "netbench.json"), limit, train, args.check_seconds
    )
    result: Dict[str, Any] = {
        "label": label,
        "layout": layout.name,
        "sites": layout.sites,
        "ranks_per_site": layout.per_site,
        "pp": layout.pp,
        "nproc": layout.nproc,
        "rate": rate,
        "iters": iters,
        "sweep_iters": args.iters,
        "flags": list(flags),
        "command": common.shell_join(["python" if c == sys.executable else c for c in cmd]),
        "run_dir": os.path.relpath(run_dir, out_dir),
        "time_limit_s": time_limit,
    }
    refusal = check_config(train, layout)
    if refusal is not None:
        result.update(status="refused", refusal=refusal, exit_code=None, wall_s=0.0)
        return result
    code, wall, contention = common.run_measured(args, cmd, run_dir, limit + 120)
    result.update(exit_code=code, wall_s=wall, contention=contention)
    records = common.run_records(run_dir) or []
    if records:
        result.update(summarize_run(records, iters, args.iters))
    done = len(records) >= iters
    if code == 0 and done:
        result["status"] = "ok"
    elif records and result["time_limit_s"] is not None and code != 0:
        result["status"] = "ok" if done else "stopped"  # a lower bound when stopped
    else:
        result["status"] = "failed"
        result["error_tail"] = common.stdout_tail(run_dir)
    nb = common.run_json(run_dir, "netbench.json")
    if nb is not None:
        result["link_check"] = nb.get("link_check")
        result["netbench_wall_s"] = nb.get("wall_time_s")
    return result


def print_table(results: List[Dict[str, Any]]) -> None:
    """One row per run: status, final loss, bytes by category, time to the dense loss."""
    cats = sorted({c for r in results for c in (r.get("bytes_per_step_all_ranks") or {})})
    rows = []
    for r in results:
        by_cat = r.get("bytes_per_step_all_ranks") or {}
        rows.append(
            [r["layout"], r["rate"], r["label"], r["status"], r.get("final_loss"), r.get("gap_pct")]
            + [by_cat[c]["sent"] / 1e6 if c in by_cat else None for c in cats]
            + [
                r.get("mean_step_s"),
                r.get("train_time_s"),
                r.get("time_to_target_s"),
                (
                    f">={r['speedup_vs_none']:.2f}"
                    if r.get("speedup_is_lower_bound") and r.get("speedup_vs_none")
                    else r.get("speedup_vs_none")
                ),
                r.get("time_to_half_target_s"),
                (
                    f">={r['speedup_half_vs_none']:.2f}"
                    if r.get("speedup_half_is_lower_bound") and r.get("speedup_half_vs_none")
                    else r.get("speedup_half_vs_none")
                ),
            ]
        )
    header = ["layout", "link", "config", "status", "final loss", "gap %"]
    header += [f"{c} MB/step" for c in cats]
    header += ["step s", "train s", "s to dense loss", "speed-up"]
    header += ["s to dense loss at 50%", "speed-up at 50%"]
    print(common.format_table(header, rows))
    for r in results:
        if r["status"] == "refused":
            print(f"refused: {r['layout']} {r['rate']} {r['label']}: {r['refusal']}")


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/sites.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/sites.py",
        description="Loss against measured time, bytes per step and time to the dense run's "
        "final loss per method configuration, with only the links between sites shaped "
        "(inside megatron-ext netbench; needs root).",
    )
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="LABEL=FLAGS",
        help="A method configuration: a label and its extra driver flags (repeat; default: "
        + "; ".join(DEFAULT_CONFIGS)
        + "). Put the 'none=' configuration first: the others are compared with it.",
    )
    p.add_argument("--layouts", default="dp2,2x2", help="dpN and/or SxR (default dp2,2x2).")
    p.add_argument("--pp", type=int, default=1, help="Pipeline stages per replica (1).")
    p.add_argument(
        "--rates",
        default="unshaped,100mbit,10mbit",
        help="Inter-site link rates: unshaped and/or tc rates (default unshaped,100mbit,10mbit).",
    )
    p.add_argument("--iters", type=int, default=300, help="Training iterations per run (300).")
    p.add_argument("--global-batch-size", type=int, default=8, help="Sequences per step (8).")
    p.add_argument("--micro-batch-size", type=int, default=None, help="Default: min(8, GBS / DP).")
    common.add_lr_schedule_args(p)
    common.add_run_args(p, run_timeout=7200.0, time_limits=True, link_checks=True)
    common.add_machine_args(p, quiet_wait=0.0, what="run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="Smoke run: dp2 at 100mbit, 4 steps, none + powersgd-r14 + diloco-h2 (flags "
        "given explicitly still apply).",
    )
    p.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="SITES_JSON",
        help="An earlier sweep's sites.json (repeatable): its complete or time-stopped runs "
        "of a planned (layout, rate, config) are taken as they are instead of run again; "
        "those of the sweep's configurations at other rates are kept as references (e.g. "
        "the unshaped none run as the 100mbit sweep's target). Refused unless its "
        "training settings (--iters, batch sizes, --model, --seed, --lr, --min-lr, --pp, "
        "--extra-train-args) and the configuration's flags are this sweep's.",
    )
    p.add_argument(
        "--skip",
        default="",
        metavar="LABELS",
        help="Configurations planned but not run in this sweep, comma-separated (e.g. 'none' "
        "while the dense reference at the same rate runs in another sweep): they are left out "
        "of its results; a later sweep that --reuse's both compares them.",
    )
    p.add_argument("--out", default=None, help="Run directory (runs/bench-sites-<time>).")
    return p


REUSE_SETTINGS = (
    "iters",
    "global_batch_size",
    "micro_batch_size",
    "model",
    "seed",
    "lr",
    "min_lr",
    "pp",
    "extra_train_args",
)
"""Settings an earlier sweep must share for its runs to be reused."""


def load_reused(
    paths: Sequence[str], args: argparse.Namespace, configs: Sequence[Tuple[str, str]]
) -> Dict[Tuple[str, str, str], Dict[str, Any]]:
    """``(layout, rate, label) -> result`` of the earlier sweeps' reusable runs; raises
    ``ValueError`` naming the setting or configuration that differs."""
    flags = dict(configs)
    out: Dict[Tuple[str, str, str], Dict[str, Any]] = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        if report.get("benchmark") != "sites":
            raise ValueError(f"--reuse {path}: not a sites.json")
        settings = report.get("settings", {})
        for key in REUSE_SETTINGS:
            if settings.get(key) != getattr(args, key):
                raise ValueError(
                    f"--reuse {path}: its {key} is {settings.get(key)!r}, this sweep's "
                    f"{getattr(args, key)!r}"
                )
        theirs = settings.get("configs", {})
        for r in report.get("results", []):
            label = r.get("label")
            if label not in flags or r.get("status") not in ("ok", "stopped"):
                continue
            if list(theirs.get(label) or []) != list(flags[label]):
                raise ValueError(
                    f"--reuse {path}: configuration {label!r} has other flags there "
                    f"({theirs.get(label)!r})"
                )
            out[(r["layout"], r["rate"], label)] = dict(r, reused_from=path)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns 0 when every run that was not refused succeeded (or was
    stopped by its time limit), 1 otherwise, 2 on bad arguments or without netbench."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK_DEFAULTS)
        args = parser.parse_args(argv)
        args.config = args.config or list(QUICK_CONFIGS)
    try:
        configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
        iters_of = {label: config_iters(flags, args.iters)[0] for label, flags in configs}
        if iters_of.get("none", args.iters) != args.iters:
            raise ValueError("--config: the 'none' reference trains --iters iterations")
        layouts = [parse_layout(t, args.pp) for t in common.parse_list(args.layouts)]
        rates = common.parse_list(args.rates)
        common.parse_per(args.time_limit, "--time-limit")
        if args.pp < 1 or args.iters < 1:
            raise ValueError("--pp and --iters must be positive")
        if len({label for label, _ in configs}) != len(configs):
            raise ValueError("--config: two configurations share a label")
        if "none" not in {label for label, _ in configs}:
            raise ValueError("--config: a 'none=' configuration is needed as the reference")
        from megatron_ext.netbench.shaping import parse_rate

        for rate in rates:
            if rate != "unshaped":
                parse_rate(rate)
        skip = set(common.parse_list(args.skip))
        unknown = skip - {label for label, _ in configs}
        if unknown:
            raise ValueError(f"--skip: no configuration labelled {sorted(unknown)}")
        reused = load_reused(args.reuse, args, configs)
        # The dense reference first, so every later run is compared as soon as it ends.
        configs.sort(key=lambda c: c[0] != "none")
        plan = [(lay, rate, c) for lay in layouts for rate in rates for c in configs]
        skipped = [
            (lay, rate, c)
            for lay, rate, c in plan
            if c[0] in skip and (lay.name, rate, c[0]) not in reused
        ]
        plan = [p for p in plan if p not in skipped]
        if not plan:
            raise ValueError("--skip: nothing left to run or reuse (no report to write)")
    except (ValueError, OSError) as exc:
        print(f"sites.py: error: {exc}")
        return 2
    from megatron_ext.netbench.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(f"sites.py: error: this benchmark runs inside megatron-ext netbench: {reason}")
        return 2
    report = common.SweepReport("sites", args)
    out, settings = report.out, report.settings
    settings["configs"] = {label: flags for label, flags in configs}
    settings["final_loss_definition"] = "mean of the logged training losses of the last 10%"
    settings["time_definition"] = (
        "running sum of the logged per-step times (start-up and evaluation excluded); time to "
        "the target: first time the trailing-mean loss (window 10% of the iterations) is at or "
        "below the none run's final loss, interpolated between the bracketing iterations"
    )
    # Reused runs outside the plan (e.g. the unshaped none run of a shaped sweep) are kept as
    # references: the target is the final loss of a complete none run at any rate.
    planned = {(lay.name, rate, c[0]) for lay, rate, c in plan}
    results: List[Dict[str, Any]] = [r for k, r in reused.items() if k not in planned]
    for lay, rate, (label, _) in skipped:
        print(f"skipped: {lay.name}, {rate}, {label} (--skip)", flush=True)
    for i, (lay, rate, (label, flags)) in enumerate(plan):
        print(
            f"[{i + 1}/{len(plan)}] {lay.name}, {rate}, {label}: {iters_of[label]} steps",
            flush=True,
        )
        res = reused.get((lay.name, rate, label))
        if res is not None:
            print(f"    (reused from {res['reused_from']})", flush=True)
        else:
            res = run_one(args, lay, rate, label, flags, out)
        results.append(res)
        add_comparisons(results)
        if res["status"] == "refused":
            print(f"    -> refused by the driver: {res['refusal']}", flush=True)
        else:
            print(
                f"    -> {res['status']}: final loss {res.get('final_loss') or float('nan'):.4f}"
                f", train {res.get('train_time_s') or 0.0:.1f} s, wall {res['wall_s']:.0f} s",
                flush=True,
            )
        report.write(results)
    print()
    print_table(results)
    print(f"\nreport: {report.path}")
    return 0 if all(r["status"] in ("ok", "stopped", "refused") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
