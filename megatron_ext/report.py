"""``megatron-ext report RUN_DIR...``: plots and a markdown summary of benchmark runs.

What it does:
    Reads run directories written by the benchmarks (``benchmarks/kernels.py``,
    ``step_time.py``, ``convergence.py``: ``kernels.json``, ``step_time.json``,
    ``convergence.json``) and plain training runs (``megatron-ext train --save DIR``:
    ``DIR/log.jsonl`` and ``DIR/comm_report.json``), and writes into ``--out``:

    * ``loss_vs_step.png``: training loss against step, one line per method;
    * ``loss_vs_time.png``: the same curves on a wall-clock axis, one panel per bandwidth.
      The time is *derived*, not measured end to end: each step of the convergence run is
      placed at the median step time that ``step_time.py`` measured for that method at
      that bandwidth (DP=2); steps a method reduces densely cost ``none``'s step time when
      they are its leading warm-up (Radius's dense phase, PowerSGD before its start) and
      the method's own measured dense-step time otherwise (Radius's reselections);
    * ``bytes_per_step.png``: bytes per step (all ranks) by category, stacked, as sent
      and as they would be uncompressed, per layout and method;
    * ``kernels.png``: compression kernel ns/element against tensor size (log-log);
    * from ``benchmarks/frontier.py`` (``frontier.json``): ``frontier.png`` (final loss
      against DP bytes per step, one point per setting, the Pareto front),
      ``loss_vs_measured_time.png`` (loss against *measured* training time of the runs
      inside netbench), the measured time-to-target table and the front page (which
      setting at which bandwidth); see ``megatron_ext/report_frontier.py``;
    * from ``benchmarks/sites.py`` (``sites.json``): ``loss_vs_time_sites.png`` (loss
      against measured training time across sites), the front page's "Across sites (DiLoCo
      family)" pick per layout and link rate and the section of the same name; see
      ``megatron_ext/report_sites.py``;
    * ``report.md``: tables of final loss and gap to ``none``, step time per bandwidth and
      speed-up over ``none``, bytes per step and compression ratio, kernel costs, and the
      environment the numbers were measured in.

    A benchmark directory's JSON embeds the curves and per-step times, so the report can be
    rebuilt from the JSON files alone. When several inputs hold the same measurement (same
    layout, method and bandwidth; same method label; same kernel case; same layout, pp,
    rate, label and steps of a sites run), the one given later on the command line wins.

Constraints:
    Needs matplotlib (``pip install -e .[report]``); uses the Agg backend (no display).
    Never imports torch or megatron.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_ext import report_frontier, report_sites
from megatron_ext.report_style import (
    baseline_style,
    curve_markers,
    loss_limits,
    pyplot,
    run_colors,
    save_figure,
    smooth,
    smoothing_window,
)
from megatron_ext.traffic_categories import CATEGORIES

__all__ = [
    "build_parser",
    "main",
    "load_runs",
    "write_report",
    "read_jsonl",
    "summarize_curve",
    "final_loss",
    "mean_bytes",
    "is_compressed",
    "run_methods",
    "ReportError",
    "RunData",
]

_PROG = "megatron-ext report"
_BENCH_FILES = (
    "kernels.json",
    "step_time.json",
    "convergence.json",
    "frontier.json",
    "sites.json",
)
_FAMILY_KEYS = (
    "grad_compression",
    "p2p_compression",
    "grass_method",
    "subspace_method",
    "outer_method",
)
"""The method selectors of a run's ``ext`` settings (``comm_report.json``), in label order."""


class ReportError(Exception):
    """An input cannot be read; the message names it and says what was expected."""


@dataclass
class RunData:
    """Everything read from the inputs, merged (later inputs win on equal keys)."""

    kernels: Dict[Tuple, Dict[str, Any]] = field(default_factory=dict)
    step_time: Dict[Tuple[str, str, str], Dict[str, Any]] = field(default_factory=dict)
    convergence: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    frontier: Dict[Tuple[int, str, Optional[str]], Dict[str, Any]] = field(default_factory=dict)
    sites: Dict[Tuple[str, int, str, str, int], Dict[str, Any]] = field(default_factory=dict)
    environments: List[Tuple[str, Dict[str, Any]]] = field(default_factory=list)
    settings: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    sources: List[str] = field(default_factory=list)
    bandwidth_order: List[str] = field(default_factory=list)

    def empty(self) -> bool:
        """Whether nothing plottable was read."""
        return not (
            self.kernels or self.step_time or self.convergence or self.frontier or self.sites
        )


# -- reading -------------------------------------------------------------------------------


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot read JSON ({exc})") from exc


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """Records of a JSON-lines file (the driver's ``log.jsonl``); blank lines and a truncated
    last line are skipped."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a run killed mid-write leaves a truncated last line
    return out


def _check_bench(report: Any, path: str) -> Dict[str, Any]:
    if not isinstance(report, dict) or "benchmark" not in report:
        raise ReportError(f"{path}: not a benchmark report (no 'benchmark' field)")
    if not isinstance(report.get("results"), list):
        raise ReportError(f"{path}: benchmark report without a 'results' list")
    return report


def _bandwidth_key(bw: str) -> float:
    """Sort key: unshaped first, then fastest to slowest."""
    from megatron_ext.netbench.shaping import parse_rate  # torch-free, like this module

    if bw == "unshaped":
        return -math.inf
    try:
        return -float(parse_rate(bw))
    except ValueError:
        return 0.0


def _add_bench(data: RunData, report: Dict[str, Any], source: str) -> None:
    kind = report["benchmark"]
    data.environments.append((source, report.get("environment") or {}))
    data.settings[kind] = report.get("settings") or {}
    for r in report["results"]:
        if kind == "kernels":
            # bf16 rows (benchmarks/kernels.py --dtypes) get their own panel.
            device = r.get("device")
            if r.get("dtype") not in (None, "fp32"):
                device = f"{device}, {r['dtype']}"
            key = (device, r.get("threads"), r.get("numel"), r.get("method"))
            key += (r.get("block_size"),)
            data.kernels[key] = r
        elif kind == "step_time":
            label = _bench_label(data.settings[kind].get("family"), r)
            data.step_time[(r["layout"], label, r["bandwidth"])] = r
            if r["bandwidth"] not in data.bandwidth_order:
                data.bandwidth_order.append(r["bandwidth"])
        elif kind == "convergence":
            data.convergence[r.get("label") or r["method"]] = r
        elif kind == "frontier":
            key = (r["tokens_per_step"], r["label"], r.get("bandwidth"))
            old = data.frontier.get(key)
            # A run stopped by its time limit never replaces a complete run of the same
            # setting, whatever the order of the inputs; otherwise later inputs win.
            if not (old and r.get("truncated") and not old.get("truncated")):
                data.frontier[key] = r
        elif kind == "sites":
            data.sites[report_sites.record_key(r)] = r


def _bench_label(family: Optional[str], r: Dict[str, Any]) -> str:
    """The configured method's label of a benchmark record (``protocol-k32``), from its
    recorded options; the method name where it cannot be derived."""
    if r.get("label"):
        return r["label"]
    opts = r.get("method_options")
    try:
        from megatron_ext.methods import registry

        method = registry.get(family or "grad", r["method"])
        if method.options is None or not opts:
            return r["method"]
        return method.label(method.options(**opts))
    except (KeyError, TypeError, ValueError):
        return r["method"]


def is_compressed(sent: float, dense: float) -> bool:
    """Whether a step's DP gradients travelled compressed (from its bytes sent and dense)."""
    return bool(dense) and sent < 0.999 * dense


def mean_bytes(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Mean bytes per step (all ranks) by category over log records; empty ones dropped."""
    out: Dict[str, Dict[str, float]] = {}
    for rec in records:
        for cat, tr in (rec.get("bytes_per_step_all_ranks") or {}).items():
            acc = out.setdefault(cat, {"sent": 0.0, "dense_sent": 0.0})
            acc["sent"] += tr.get("sent", 0.0) / len(records)
            acc["dense_sent"] += tr.get("dense_sent", 0.0) / len(records)
    return {c: v for c, v in out.items() if v["sent"] or v["dense_sent"]}


def final_loss(losses: List[Optional[float]], fraction: float = 0.1) -> Optional[float]:
    """Mean of the last ``fraction`` of the logged losses (at least one value)."""
    values = [v for v in losses if v is not None]
    if not values:
        return None
    n = max(1, int(round(fraction * len(values))))
    tail = values[-n:]
    return sum(tail) / len(tail)


def summarize_curve(records: List[Dict[str, Any]], fraction: float = 0.1) -> Dict[str, Any]:
    """Curve and summary numbers of one run's ``log.jsonl`` records (the convergence
    benchmark's result fields; also how a plain ``megatron-ext train`` run is read)."""
    records = sorted(records, key=lambda r: r.get("iteration", 0))
    losses = [r.get("lm_loss") for r in records]
    times = [r.get("step_time_s") for r in records]
    grad = [((r.get("bytes_per_step_all_ranks") or {}).get("dp-grad") or {}) for r in records]
    sent = [g.get("sent", 0.0) for g in grad]
    dense = [g.get("dense_sent", 0.0) for g in grad]
    n_final = max(1, int(round(fraction * len(records)))) if records else 0
    warm = [t for t in (times[1:] if len(times) > 1 else times) if t is not None]
    dense_steps, compressed_steps = _step_kinds(records, sent, dense)
    return {
        "curve": {
            "iteration": [r.get("iteration") for r in records],
            "lm_loss": losses,
            "step_time_s": times,
            "dp_grad_sent": sent,
            "dp_grad_dense_sent": dense,
        },
        "final_loss": final_loss(losses, fraction),
        "final_loss_iterations": (
            [records[-n_final].get("iteration"), records[-1].get("iteration")] if records else None
        ),
        "last_loss": losses[-1] if losses else None,
        "mean_step_s": sum(warm) / len(warm) if warm else None,
        "bytes_per_step_all_ranks": mean_bytes(records) if records else {},
        "num_dense_steps": dense_steps,
        "num_compressed_steps": compressed_steps,
    }


def _step_kinds(
    records: List[Dict[str, Any]], sent: List[float], dense: List[float]
) -> Tuple[int, int]:
    """(dense, compressed) data-parallel steps of a run, in steps: each logged record
    covers the steps since the one before it (the first: since iteration 0), split by the
    fraction of them that reduced densely (from the record's mean bytes,
    :func:`_dense_fractions`). Records without data-parallel gradient bytes count in
    neither."""
    fractions = _dense_fractions({"dp_grad_sent": sent, "dp_grad_dense_sent": dense})
    dense_steps = compressed_steps = 0.0
    prev = 0
    for r, d, f in zip(records, dense, fractions):
        it = r.get("iteration") or prev
        steps, prev = max(0, it - prev), it
        if d:
            dense_steps += f * steps
            compressed_steps += (1.0 - f) * steps
    return int(round(dense_steps)), int(round(compressed_steps))


def run_methods(ext: Dict[str, Any]) -> str:
    """A run's methods from its ``ext`` settings: the selected ones of every family joined
    with ``+`` (``separate+diloco``; Grass as ``grass-topr``), ``none`` when none is
    selected."""
    picked = [
        f"grass-{ext[k]}" if k == "grass_method" else str(ext[k])
        for k in _FAMILY_KEYS
        if ext.get(k) not in (None, "none")
    ]
    return "+".join(picked) or "none"


def _over_segments(rep: Dict[str, Any]) -> Tuple[Optional[float], Dict[str, Dict[str, float]]]:
    """(mean s/step, bytes per step by category) over every segment of a resumed run's
    report (each weighted by its steps), not only the last one."""
    segments = [s for s in rep.get("segments") or [rep] if isinstance(s, dict)]
    time_sum = time_steps = 0.0
    sums: Dict[str, Dict[str, float]] = {}
    comm_steps = 0.0
    only = 1 if len(segments) == 1 else 0  # one segment: its means, even without counts
    for seg in segments:
        steps = seg.get("steps_this_run") or only
        if seg.get("mean_step_time_s") is not None and steps:
            time_sum += seg["mean_step_time_s"] * steps
            time_steps += steps
        comm = seg.get("comm") or {}
        n = comm.get("steps") or only
        for c, v in (comm.get("all_ranks_per_step") or {}).items():
            acc = sums.setdefault(c, {"sent": 0.0, "dense_sent": 0.0})
            acc["sent"] += (v.get("sent") or 0.0) * n
            acc["dense_sent"] += (v.get("dense_sent") or 0.0) * n
        comm_steps += n
    per_step = {
        c: {k: x / comm_steps for k, x in v.items()}
        for c, v in sums.items()
        if comm_steps and (v["sent"] or v["dense_sent"])
    }
    return (time_sum / time_steps if time_steps else None), per_step


def _train_run(path: str, name: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """A plain ``megatron-ext train`` run as a convergence-like record, or ``None``.

    Args:
        path: the run directory.
        name: how the run is named in labels (default: the directory's name).
    """
    log = os.path.join(path, "log.jsonl")
    rep_path = os.path.join(path, "comm_report.json")
    records = read_jsonl(log) if os.path.isfile(log) else []
    rep = _read_json(rep_path) if os.path.isfile(rep_path) else None
    if not records and rep is None:
        return None
    if not records and rep is not None:
        records = [h for h in rep.get("history") or [] if isinstance(h, dict)]
    method = run_methods((rep or {}).get("ext") or {})
    name = name or os.path.basename(os.path.normpath(path)) or path
    run = {"method": method, "label": f"{name} ({method})", "ok": True, "source": "train"}
    run["path"] = path
    run.update(summarize_curve(records))
    rep = rep or {}
    if run["final_loss"] is None:
        run["final_loss"] = rep.get("final_lm_loss")
    run["final_valid_loss"] = rep.get("final_valid_loss")
    # The report's means cover every step of every segment, the log only the logged ones.
    mean_step_s, per_step = _over_segments(rep)
    run["mean_step_s"] = mean_step_s or run["mean_step_s"]
    if per_step:
        run["bytes_per_step_all_ranks"] = per_step
    return run


def load_runs(paths: Sequence[str]) -> RunData:
    """Read every input (directories or benchmark JSON files), in order.

    Raises:
        ReportError: an input does not exist or holds nothing this command can read.
    """
    data = RunData()
    for path in paths:
        if os.path.isfile(path) and path.endswith(".json"):
            _add_bench(data, _check_bench(_read_json(path), path), path)
            data.sources.append(path)
            continue
        if not os.path.isdir(path):
            raise ReportError(f"{path}: no such directory")
        found = False
        for name in _BENCH_FILES:
            fpath = os.path.join(path, name)
            if os.path.isfile(fpath):
                _add_bench(data, _check_bench(_read_json(fpath), fpath), fpath)
                data.sources.append(fpath)
                found = True
        if not found:
            run = _train_run(path)
            if run is not None and run["label"] in data.convergence:
                # Two run directories of one name (a/run, b/run): named by their paths.
                if data.convergence[run["label"]].get("path") != path:
                    run = _train_run(path, name=os.path.normpath(path))
            if run is not None:
                data.convergence[run["label"]] = run
                data.sources.append(path)
                found = True
        if not found:
            raise ReportError(
                f"{path}: nothing to read (expected {', '.join(_BENCH_FILES)} from the "
                "benchmarks, or a 'megatron-ext train --save' run's log.jsonl / "
                "comm_report.json)"
            )
    data.bandwidth_order.sort(key=_bandwidth_key)
    return data


# -- derived numbers -----------------------------------------------------------------------


def convergence_layout(data: RunData) -> str:
    """The step-time layout the convergence runs trained in (``dp2``, ``pp2``, ``pp2dp2``)."""
    s = data.settings.get("convergence") or {}
    nproc = int(s.get("nproc") or 2)
    pp = int(s.get("pipeline_model_parallel_size") or 1)
    dp = max(1, nproc // pp)
    if pp == 1:
        return f"dp{dp}"
    return f"pp{pp}" if dp == 1 else f"pp{pp}dp{dp}"


def _layout_words(layout: str) -> str:
    """``pp2dp2`` -> ``PP=2 x DP=2``."""
    parts = re.findall(r"(pp|dp)(\d+)", layout)
    return " x ".join(f"{k.upper()}={v}" for k, v in parts) or layout


def _baseline(data: RunData, layout: str, bandwidth: str) -> Optional[float]:
    r = _step_record(data, "none", bandwidth, layout, None)
    return r.get("step_s") if r and r.get("ok") else None


def _step_record(
    data: RunData, method: str, bandwidth: str, layout: str, label: Optional[str]
) -> Optional[Dict[str, Any]]:
    """The step-time record of a run: its exact label, else the longest measured label it
    extends (``protocol-k32`` for ``protocol-k32-u100``), else the last record of its
    method (records are keyed by label)."""
    label = label or method
    if (layout, label, bandwidth) in data.step_time:
        return data.step_time[(layout, label, bandwidth)]
    here = {m: r for (lay, m, bw), r in data.step_time.items() if (lay, bw) == (layout, bandwidth)}
    prefixes = [m for m in here if label.startswith(m + "-")]
    if prefixes:
        return here[max(prefixes, key=len)]
    same = [r for r in here.values() if r["method"] == method]
    return same[-1] if same else None


def _step_times_for(
    data: RunData, method: str, bandwidth: str, layout: str = "dp2", label: Optional[str] = None
) -> Optional[Tuple[float, float, float]]:
    """Step times of ``method`` (configured as ``label``) at ``bandwidth``: (compressed,
    later dense, warm-up dense).

    *compressed*: the method's median step; *later dense*: its measured dense steps
    (Radius reselection: dense reduction plus the top-k selection), else ``none``'s step;
    *warm-up dense*: ``none``'s step (a dense warm-up step is a plain dense step), else the
    method's own dense steps. ``None`` when the method was not measured there.
    """
    r = _step_record(data, method, bandwidth, layout, label)
    if not r or not r.get("ok") or not r.get("step_s"):
        return None
    if not r.get("num_compressed"):
        # Every measured step was of one kind (``none``; Grass, whose reduced rows are its
        # own dense count): the method's step is its time for every step of the curve.
        return r["step_s"], r["step_s"], r["step_s"]
    base = _baseline(data, layout, bandwidth)
    own_dense = r.get("median_dense_s") if r.get("num_compressed") else None
    dense = own_dense or base or r["step_s"]
    warmup = base or own_dense or r["step_s"]
    return r["step_s"], dense, warmup


def _dense_fractions(curve: Dict[str, Any]) -> List[float]:
    """Per record, the fraction of its steps that reduced gradients densely (from bytes)."""
    sent = curve.get("dp_grad_sent") or []
    dense = curve.get("dp_grad_dense_sent") or []
    compressed = [s for s, d in zip(sent, dense) if is_compressed(s, d)]
    low = min(compressed) if compressed else None
    out = []
    for s, d in zip(sent, dense):
        if not d:
            # No data-parallel gradient traffic (a pipeline-only layout): the step costs the
            # method's own measured step (for AQ-SGD also in its full-precision first epoch,
            # which makes its derived time optimistic by that epoch's extra bytes).
            out.append(0.0)
        elif not is_compressed(s, d) or low is None:
            out.append(1.0)
        elif d - low <= 0:
            out.append(0.0)
        else:
            out.append(min(1.0, max(0.0, (s - low) / (d - low))))
    return out


def wall_clock_axis(
    curve: Dict[str, Any],
    t_compressed: float,
    t_dense: float,
    t_warmup: Optional[float] = None,
) -> List[float]:
    """Cumulative seconds at each record of ``curve``.

    Each record's steps are split into dense and compressed ones from its bytes (a record
    of several steps may hold both); compressed steps cost ``t_compressed``, dense steps
    ``t_dense``, except the leading run of all-dense records (a method's dense warm-up),
    which cost ``t_warmup`` (default ``t_dense``).
    """
    iters = curve["iteration"]
    fractions = _dense_fractions(curve) or [1.0] * len(iters)
    if len(fractions) < len(iters):
        fractions += [1.0] * (len(iters) - len(fractions))
    t_warmup = t_dense if t_warmup is None else t_warmup
    out, total, prev = [], 0.0, 0
    warming_up = True
    for it, f in zip(iters, fractions):
        steps = it - prev
        prev = it
        warming_up = warming_up and f >= 1.0
        t_d = t_warmup if warming_up else t_dense
        total += steps * (f * t_d + (1.0 - f) * t_compressed)
        out.append(total)
    return out


# -- plots ---------------------------------------------------------------------------------


def _plot_loss_vs_step(data: RunData, path: str, window: int) -> Optional[str]:
    runs = [r for r in data.convergence.values() if (r.get("curve") or {}).get("iteration")]
    if not runs:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = run_colors([(r["label"], r["method"]) for r in runs])
    window = smoothing_window(window, [len(r["curve"]["iteration"]) for r in runs])
    markers = curve_markers(
        [r["label"] for r in runs], max(len(r["curve"]["iteration"]) for r in runs)
    )
    shown = []
    for r in runs:
        c = r["curve"]
        style = {**baseline_style(r["method"]), **markers[r["label"]]}
        color = colors[r["label"]]
        ys = smooth(c["lm_loss"], window)
        if window > 1:
            ax.plot(c["iteration"], c["lm_loss"], color=color, alpha=0.2, linewidth=0.8)
        ax.plot(c["iteration"], ys, color=color, label=r["label"], **style)
        shown.append(ys)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (lm loss)")
    ax.set_title(
        f"Loss against step (thin: logged; thick: {window}-record moving mean)"
        if window > 1
        else "Loss against step (logged values)"
    )
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend()
    _clip_loss_axis(ax, shown)
    return save_figure(fig, path)


def _clip_loss_axis(ax, curves) -> None:
    limits = loss_limits(curves)
    if limits:
        ax.set_ylim(*limits)


def _plot_loss_vs_time(data: RunData, path: str, window: int) -> Optional[str]:
    layout = convergence_layout(data)
    runs = [r for r in data.convergence.values() if (r.get("curve") or {}).get("iteration")]
    bws = [
        bw
        for bw in data.bandwidth_order
        if any(_step_times_for(data, r["method"], bw, layout, r.get("label")) for r in runs)
    ]
    if not runs or not bws:
        return None
    plt = pyplot()
    colors = run_colors([(r["label"], r["method"]) for r in runs])
    window = smoothing_window(window, [len(r["curve"]["iteration"]) for r in runs])
    markers = curve_markers(
        [r["label"] for r in runs], max(len(r["curve"]["iteration"]) for r in runs)
    )
    ncols = 2 if len(bws) > 1 else 1
    nrows = math.ceil(len(bws) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for k, bw in enumerate(bws):
        ax = axes[k // ncols][k % ncols]
        shown = []
        for r in runs:
            times = _step_times_for(data, r["method"], bw, layout, r.get("label"))
            if times is None:
                continue
            x = wall_clock_axis(r["curve"], *times)
            ys = smooth(r["curve"]["lm_loss"], window)
            ax.plot(
                [t / 60.0 for t in x],
                ys,
                color=colors[r["label"]],
                label=f"{r['label']} ({times[0]:.2f} s/step)",
                **baseline_style(r["method"]),
                **markers[r["label"]],
            )
            shown.append(ys)
        ax.set_title(f"{_layout_words(layout)}, {bw}")
        ax.set_xlabel("wall-clock minutes (derived)")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xlim(left=0)
        _clip_loss_axis(ax, shown)
    for k in range(len(bws), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    fig.suptitle(
        "Loss against wall-clock time: convergence curve placed at the step times measured "
        "per bandwidth\n(time = sum over steps of the measured median step time of that "
        "method and step kind, dense or compressed; not an end-to-end run)",
        fontsize=9,
    )
    return save_figure(fig, path)


def _bytes_rows(data: RunData) -> List[Tuple[str, Dict[str, Dict[str, float]]]]:
    """(bar label, bytes per category) per layout/method; step_time first, then runs."""
    rows: List[Tuple[str, Dict[str, Dict[str, float]]]] = []
    seen = set()
    for bw in data.bandwidth_order:
        for (layout, method, b), r in data.step_time.items():
            if b != bw or (layout, method) in seen or not r.get("bytes_per_step_all_ranks"):
                continue
            seen.add((layout, method))
            rows.append((f"{layout} {method}", r["bytes_per_step_all_ranks"]))
    if not rows:
        for r in data.convergence.values():
            if r.get("bytes_per_step_all_ranks"):
                rows.append((r["label"], r["bytes_per_step_all_ranks"]))
    return rows


def _plot_bytes(data: RunData, path: str) -> Optional[str]:
    rows = _bytes_rows(data)
    if not rows:
        return None
    plt = pyplot()
    # Categories below 0.1% of the largest bar (loss reductions: 32 B) would be invisible.
    largest = max(sum(v.get("dense_sent", 0.0) for v in b.values()) for _, b in rows) or 1.0
    present = {
        c
        for _, b in rows
        for c, v in b.items()
        if max(v.get("sent", 0.0), v.get("dense_sent", 0.0)) > 1e-3 * largest
    }
    cats = [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(rows) + 2.5), 5))
    width = 0.38
    top = 0.0
    for kind, offset, hatch in (("sent", -width / 2, None), ("dense_sent", width / 2, "//")):
        bottom = [0.0] * len(rows)
        for ci, cat in enumerate(cats):
            vals = [b.get(cat, {}).get(kind, 0.0) / 1e6 for _, b in rows]
            ax.bar(
                [i + offset for i in range(len(rows))],
                vals,
                width,
                bottom=bottom,
                color=f"C{ci}",
                hatch=hatch,
                edgecolor="white" if hatch else None,
                alpha=1.0 if kind == "sent" else 0.45,
                label=f"{cat} ({'sent' if kind == 'sent' else 'uncompressed'})",
            )
            bottom = [a + v for a, v in zip(bottom, vals)]
        for i, total in enumerate(bottom):
            ax.text(i + offset, total, f"{total:.1f}", ha="center", va="bottom", fontsize=7)
        top = max([top] + bottom)
    ax.set_ylim(0, 1.25 * top if top else 1.0)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([name for name, _ in rows], rotation=20, ha="right")
    ax.set_ylabel("MB per step, all ranks")
    ax.set_title("Bytes per step: sent (solid) vs uncompressed (hatched)", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def _kernel_series(data: RunData) -> Dict[Tuple[str, int], Dict[str, List[Tuple[int, float]]]]:
    panels: Dict[Tuple[str, int], Dict[str, List[Tuple[int, float]]]] = {}
    for (device, threads, numel, method, block), r in data.kernels.items():
        name = f"SEPARATE b{block}" if method == "separate" else method
        if method == "powersgd":
            name = "PowerSGD (equal bytes)"
        elif method == "copy":
            name = "memory copy (floor)"
        panels.setdefault((str(device), threads), {}).setdefault(name, []).append(
            (numel, r["total_ns_per_element"])
        )
    return panels


def _plot_kernels(data: RunData, path: str) -> Optional[str]:
    panels = _kernel_series(data)
    if not panels:
        return None
    plt = pyplot()
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        series = panels[key]
        names = sorted(series, key=_kernel_sort)
        blocks = [n for n in names if n.startswith("SEPARATE")]
        for name in names:
            pts = sorted(series[name])
            if "copy" in name:
                style = {"linestyle": "--", "color": "gray"}
            elif "PowerSGD" in name:
                style = {"color": "C3", "linewidth": 2.2}
            elif name not in blocks:  # the codecs (quantizers, AQ-SGD, DirectQ, Protocol)
                style = {"linestyle": ":"}
            else:
                # SEPARATE block sizes: shades of one colour map, small to large.
                shade = blocks.index(name) / max(1, len(blocks) - 1)
                style = {"color": plt.cm.viridis(0.1 + 0.75 * shade)}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (elements)")
        ax.set_ylabel("compress + decompress, ns / element")
        ax.set_title(f"{key[0]}, {key[1]} thread(s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ratio = (data.settings.get("kernels") or {}).get("ratio", "?")
    fig.suptitle(f"Compression kernels at ratio {ratio} (median; lower is better)", fontsize=10)
    return save_figure(fig, path)


def _kernel_sort(name: str) -> Tuple[int, int]:
    if name.startswith("SEPARATE b"):
        return (1, int(name.split("b")[-1]))
    return (0 if "copy" in name else 2, 0)


# -- markdown ------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def _convergence_md(data: RunData) -> List[str]:
    runs = list(data.convergence.values())
    if not runs:
        return []
    settings = data.settings.get("convergence") or {}
    out = ["## Convergence", ""]
    if settings:
        out.append(
            f"{_layout_words(convergence_layout(data))} {settings.get('model', 'gpt-tiny')}"
            + (
                f" fine-tuned from {settings['finetune_from']}"
                if settings.get("finetune_from")
                else ""
            )
            + (
                f" on {settings['fixed_samples']} fixed samples"
                if settings.get("fixed_samples")
                else ""
            )
            + ", "
            f"{settings.get('iters')} iterations, global batch "
            f"{settings.get('global_batch_size')}, seed {settings.get('seed')}, lr "
            f"{settings.get('lr')} {settings.get('lr_decay_style')} (warm-up "
            f"{settings.get('lr_warmup_iters')}). Final loss: "
            f"{settings.get('final_loss_definition', 'mean of the last 10% of logged losses')}."
        )
        out.append("")
    bases = [r for r in runs if r["method"] == "none"]
    base = bases[0].get("final_loss") if bases else None
    # Several runs without a method: the gap is to the first of them, named in the header.
    gap_header = f"gap vs {bases[0]['label']}" if len(bases) > 1 else "gap vs none"
    rows = []
    for r in runs:
        gap = r.get("gap_pct")
        if gap is None and base and r.get("final_loss") is not None:
            gap = 100.0 * (r["final_loss"] - base) / base
        rows.append(
            [
                r["label"],
                _fmt(r.get("final_loss"), 4),
                f"{gap:+.2f} %" if gap is not None else "-",
                _fmt(r.get("final_valid_loss"), 4),
                r.get("num_compressed_steps", "-"),
                r.get("num_dense_steps", "-"),
                _fmt(r.get("mean_step_s"), 3),
                "ok" if r.get("ok", True) else "FAILED",
            ]
        )
    out.append(
        _table(
            [
                "method",
                "final loss",
                gap_header,
                "valid loss (end)",
                "compressed steps",
                "dense steps",
                "mean s/step (unshaped)",
                "status",
            ],
            rows,
        )
    )
    out.append("")
    return out


def _step_time_md(data: RunData) -> List[str]:
    if not data.step_time:
        return []
    out = ["## Step time against bandwidth", ""]
    s = data.settings.get("step_time") or {}
    if s:
        out.append(
            f"{s.get('model', 'gpt-tiny')}, micro-batch {s.get('micro_batch_size')}, global "
            f"batch {s.get('global_batch_size')}, {s.get('num_threads')} thread(s) per rank, "
            "every rank in its own network namespace (megatron-ext netbench). Median step "
            f"time over iterations > {s.get('skip')} of each run; methods with dense steps "
            "show the median of their compressed steps (the dense steps are listed below). "
            "Speed-up = none / method at the same layout and bandwidth."
        )
        out.append("")
    bws = data.bandwidth_order
    layouts = sorted({k[0] for k in data.step_time})
    for layout in layouts:
        methods = []
        for lay, m, _ in data.step_time:
            if lay == layout and m not in methods:
                methods.append(m)
        rows = []
        for m in methods:
            row = [m]
            for bw in bws:
                r = data.step_time.get((layout, m, bw))
                if not r:
                    row.append("-")
                    continue
                if not r.get("ok"):
                    row.append(f"failed ({r.get('exit_code')})")
                    continue
                base = _baseline(data, layout, bw)
                sp = base / r["step_s"] if base and r.get("step_s") else None
                cell = f"{_fmt(r.get('step_s'))} s"
                if m != "none" and sp:
                    cell += f" (x{sp:.2f})"
                row.append(cell)
            rows.append(row)
        out.append(f"**{layout}**")
        out.append("")
        out.append(_table(["method"] + bws, rows))
        out.append("")
    dense_rows = []
    for (layout, m, bw), r in data.step_time.items():
        if r.get("ok") and r.get("num_compressed") and r.get("num_dense"):
            dense_rows.append(
                [
                    layout,
                    m,
                    bw,
                    f"{_fmt(r.get('median_compressed_s'))} s ({r.get('num_compressed')})",
                    f"{_fmt(r.get('median_dense_s'))} s ({r.get('num_dense')})",
                    f"{_fmt(r.get('mean_all_s'))} s",
                ]
            )
    if dense_rows:
        out.append("Methods whose measured steps include dense ones (median (count)):")
        out.append("")
        out.append(
            _table(
                [
                    "layout",
                    "method",
                    "bandwidth",
                    "compressed steps",
                    "dense steps",
                    "mean of all measured steps",
                ],
                dense_rows,
            )
        )
        out.append("")
    layout = convergence_layout(data)
    runs = [r for r in data.convergence.values() if (r.get("curve") or {}).get("iteration")]
    eff_rows = []
    for r in runs:
        row = [r["label"]]
        any_cell = False
        for bw in bws:
            times = _step_times_for(data, r["method"], bw, layout, r.get("label"))
            none_times = _step_times_for(data, "none", bw, layout)
            if times is None:
                row.append("-")
                continue
            total = wall_clock_axis(r["curve"], *times)[-1]
            n = r["curve"]["iteration"][-1]
            cell = f"{total / 60:.1f} min ({total / n:.2f} s/step)"
            if none_times and r["method"] != "none":
                base_total = n * none_times[0]
                cell += f" x{base_total / total:.2f}"
            row.append(cell)
            any_cell = True
        if any_cell:
            eff_rows.append(row)
    if eff_rows:
        out.append(
            f"Derived time for the whole convergence run at each bandwidth "
            f"({_layout_words(layout)}), dense steps "
            "included (Radius's dense warm-up and reselections, PowerSGD before its start), "
            "and speed-up over none:"
        )
        out.append("")
        out.append(_table(["method"] + bws, eff_rows))
        out.append("")
    out += _time_to_loss_md(data, runs, bws)
    link_rows = []
    seen = set()
    for (layout, m, bw), r in sorted(
        data.step_time.items(), key=lambda kv: _bandwidth_key(kv[0][2])
    ):
        link = r.get("link_check") or {}
        if bw in seen or not link:
            continue
        seen.add(bw)
        link_rows.append(
            [
                bw,
                _fmt(link.get("expected_mb_per_s"), 2),
                _fmt(link.get("shaped_mb_per_s"), 2),
                _fmt(link.get("unshaped_mb_per_s"), 1),
                {True: "ok", False: "OFF"}.get(link.get("ok"), "-"),
            ]
        )
    if link_rows:
        out.append("netbench link check (TCP payload throughput measured before a run):")
        out.append("")
        out.append(
            _table(
                ["bandwidth", "rate MB/s", "shaped link MB/s", "unshaped link MB/s", "check"],
                link_rows,
            )
        )
        out.append("")
    contended = [
        (k, (r.get("contention") or {}).get("foreign_cpu_share"))
        for k, r in data.step_time.items()
        if ((r.get("contention") or {}).get("foreign_cpu_share") or 0) > 0.1
    ]
    if contended:
        out.append(
            "Runs during which other processes used more than 10% of the machine's CPUs "
            "(their step times are pessimistic): "
            + ", ".join(f"{'/'.join(k)} ({100 * v:.0f}%)" for k, v in contended)
        )
        out.append("")
    return out


def _time_to_loss_md(data: RunData, runs: List[Dict[str, Any]], bws: List[str]) -> List[str]:
    """Derived time for each method to reach the loss every method reaches."""
    window = 10
    smoothed = {r["label"]: smooth(r["curve"]["lm_loss"], window) for r in runs}
    finals = [v[-1] for v in smoothed.values() if v and v[-1] is not None]
    if len(finals) < 2:
        return []
    target = max(finals)
    layout = convergence_layout(data)
    rows = []
    for r in runs:
        curve = smoothed[r["label"]]
        hit = next((i for i, v in enumerate(curve) if v is not None and v <= target), None)
        row = [r["label"], "-" if hit is None else str(r["curve"]["iteration"][hit])]
        for bw in bws:
            times = _step_times_for(data, r["method"], bw, layout, r.get("label"))
            if times is None or hit is None:
                row.append("-")
                continue
            row.append(f"{wall_clock_axis(r['curve'], *times)[hit] / 60:.1f} min")
        rows.append(row)
    return [
        f"Derived time to reach loss {target:.3f} ({window}-record moving mean of the training "
        "loss; the highest final value among the methods, so every method reaches it):",
        "",
        _table(["method", "iteration"] + bws, rows),
        "",
    ]


def _bytes_md(data: RunData) -> List[str]:
    rows_in = _bytes_rows(data)
    if not rows_in:
        return []
    out = ["## Bytes per step", ""]
    from_step_time = any(r.get("bytes_per_step_all_ranks") for r in data.step_time.values())
    which = (
        "steps with dense reductions excluded for the methods that have them"
        if from_step_time
        else "mean over all steps of the convergence runs, dense ones (warm-up, reselections) "
        "included"
    )
    out.append(
        "All ranks, per step, as counted by megatron_ext's meters (ring convention for "
        f"collectives); {which}."
    )
    out.append("")
    rows = []
    for name, b in rows_in:
        grad = b.get("dp-grad") or {}
        pp = sum(b.get(c, {}).get("sent", 0.0) for c in ("pp-act", "pp-grad"))
        sent = sum(v.get("sent", 0.0) for v in b.values())
        dense = sum(v.get("dense_sent", 0.0) for v in b.values())
        rows.append(
            [
                name,
                _fmt(grad.get("sent", 0.0) / 1e6, 2) if grad else "-",
                _fmt(grad.get("dense_sent", 0.0) / 1e6, 2) if grad else "-",
                f"x{grad['dense_sent'] / grad['sent']:.1f}" if grad.get("sent") else "-",
                _fmt(pp / 1e6, 2) if pp else "-",
                _fmt(sent / 1e6, 2),
                f"x{dense / sent:.1f}" if sent else "-",
            ]
        )
    out.append(
        _table(
            [
                "layout / method",
                "dp-grad MB sent",
                "dp-grad MB uncompressed",
                "dp-grad ratio",
                "pp MB",
                "total MB sent",
                "total ratio",
            ],
            rows,
        )
    )
    out.append("")
    return out


def _kernels_md(data: RunData) -> List[str]:
    if not data.kernels:
        return []
    s = data.settings.get("kernels") or {}
    out = ["## Compression kernels", ""]
    out.append(
        f"Compress + decompress time per element (median of {s.get('repeats')} after "
        f"{s.get('warmup')} warm-up), ratio {s.get('ratio')}, fp32, no process group. "
        + " ".join(f"{k}: {v}." for k, v in (s.get("timed") or {}).items())
    )
    out.append("")
    panels: Dict[Tuple[str, int], Dict[int, Dict[str, Dict[str, Any]]]] = {}
    blocks = set()
    for (device, threads, numel, method, block), r in data.kernels.items():
        name = f"b{block}" if method == "separate" else method
        if method == "separate":
            blocks.add(block)
        panels.setdefault((str(device), threads), {}).setdefault(numel, {})[name] = r
    blocks_sorted = sorted(blocks)
    for (device, threads), by_size in sorted(panels.items()):
        rows = []
        for numel in sorted(by_size):
            cases = by_size[numel]
            sep = {
                b: cases[f"b{b}"]["total_ns_per_element"] for b in blocks_sorted if f"b{b}" in cases
            }
            psgd = cases.get("powersgd")
            copy = cases.get("copy")
            best = min(sep, key=sep.get) if sep else None
            rows.append(
                [
                    f"{numel:.0e}",
                    _fmt(copy["total_ns_per_element"], 3) if copy else "-",
                    _fmt(copy.get("gb_per_s"), 1) if copy else "-",
                ]
                + [_fmt(sep.get(b), 2) for b in blocks_sorted]
                + [
                    (
                        f"{_fmt(psgd['total_ns_per_element'], 2)} (r={psgd.get('approx_rank')})"
                        if psgd
                        else "-"
                    ),
                    (
                        f"b{best}: x{psgd['total_ns_per_element'] / sep[best]:.2f}"
                        if psgd and best
                        else "-"
                    ),
                    ", ".join(
                        f"b{b}"
                        for b in blocks_sorted
                        if psgd and sep.get(b, math.inf) < psgd["total_ns_per_element"]
                    )
                    or "none",
                ]
            )
        out.append(f"**{device}, {threads} thread(s)** (ns per element)")
        out.append("")
        out.append(
            _table(
                ["elements", "copy", "copy GB/s"]
                + [f"SEPARATE b{b}" for b in blocks_sorted]
                + ["PowerSGD", "PowerSGD / best SEPARATE", "SEPARATE cheaper at"],
                rows,
            )
        )
        out.append("")
    if not any("cuda" in str(k[0]) for k in panels):
        out.append("GPU: not measured (no GPU available to this run).")
        out.append("")
    return out


def _environment_md(data: RunData) -> List[str]:
    if not data.environments:
        return []
    out = ["## Environment", ""]
    rows = []
    for source, env in data.environments:
        rows.append(
            [
                os.path.basename(source),
                env.get("device", "-"),
                f"{env.get('cpu_model', '-')} ({env.get('cpu_cores', '-')} cores)",
                env.get("num_threads", "-"),
                env.get("torch", "-"),
                env.get("megatron_core", "-"),
                (env.get("git_commit") or "-")[:10] + (" (dirty)" if env.get("git_dirty") else ""),
                env.get("timestamp", "-"),
            ]
        )
    out.append(
        _table(
            ["report", "device", "CPU", "threads", "torch", "megatron-core", "commit", "time"],
            rows,
        )
    )
    out.append("")
    return out


def write_report(data: RunData, out_dir: str, *, window: int = 10) -> Dict[str, str]:
    """Write the plots and ``report.md`` into ``out_dir``; returns name -> path."""
    os.makedirs(out_dir, exist_ok=True)
    written: Dict[str, str] = {}
    plots = [
        ("loss_vs_step", _plot_loss_vs_step, (window,)),
        ("loss_vs_time", _plot_loss_vs_time, (window,)),
        ("bytes_per_step", _plot_bytes, ()),
        ("kernels", _plot_kernels, ()),
    ]
    for name, fn, extra in plots:
        path = fn(data, os.path.join(out_dir, f"{name}.png"), *extra)
        if path:
            written[name] = path
    frontier = list(data.frontier.values())
    for name, fn in (
        ("frontier", report_frontier.plot_frontier),
        ("loss_vs_measured_time", report_frontier.plot_loss_vs_wallclock),
    ):
        path = fn(frontier, os.path.join(out_dir, f"{name}.png")) if frontier else None
        if path:
            written[name] = path
    sites = list(data.sites.values())
    path = report_sites.plot_loss_vs_time(sites, os.path.join(out_dir, "loss_vs_time_sites.png"))
    if path:
        written["loss_vs_time_sites"] = path
    md = ["# megatron-ext performance report", ""]
    md.append("Sources: " + ", ".join(f"`{s}`" for s in data.sources))
    md.append("")
    front = report_frontier.front_page_md(frontier)
    sites_front = report_sites.front_page_md(sites)
    if sites_front and not front:
        front = ["## Which method at which bandwidth", ""]
    md += front + sites_front
    captions = {
        "loss_vs_step": "Loss against step",
        "loss_vs_time": "Loss against wall-clock time (derived from measured step times)",
        "bytes_per_step": "Bytes per step by category",
        "kernels": "Compression kernel cost per element",
        "frontier": "Final loss against DP bytes per step (one point per setting)",
        "loss_vs_measured_time": "Loss against measured training time (runs inside netbench)",
        "loss_vs_time_sites": "Loss against measured training time across sites (inside "
        "netbench)",
    }
    for name in written:
        md.append(f"![{captions[name]}]({name}.png)")
        md.append("")
    md += report_frontier.frontier_md(frontier)
    md += report_frontier.time_to_target_md(frontier)
    md += report_sites.sites_md(sites)
    md += _convergence_md(data)
    md += _step_time_md(data)
    md += _bytes_md(data)
    md += _kernels_md(data)
    md += _environment_md(data)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md).rstrip() + "\n")
    written["report.md"] = path
    return written


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``megatron-ext report``."""
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Plots (PNG) and a markdown summary of benchmark run directories "
        "(benchmarks/*.py) and 'megatron-ext train --save' runs.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="Run directories (or benchmark JSON files); later ones win on equal keys.",
    )
    p.add_argument(
        "--out", default=None, help="Output directory (default: <first RUN_DIR>/report)."
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=10,
        help="Moving-mean window of the loss curves, in log records (default 10).",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``megatron-ext report``; returns the exit code (2 when an input is unreadable)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        data = load_runs(args.runs)
    except ReportError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    if data.empty():
        print(f"{_PROG}: error: the inputs hold no results to report", file=sys.stderr)
        return 2
    first = args.runs[0]
    out = args.out or os.path.join(
        first if os.path.isdir(first) else os.path.dirname(first), "report"
    )
    try:
        written = write_report(data, out, window=max(1, args.smooth))
    except ImportError as exc:
        print(
            f"{_PROG}: error: {exc}; install matplotlib (pip install -e .[report])", file=sys.stderr
        )
        return 2
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
