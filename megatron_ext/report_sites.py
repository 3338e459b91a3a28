"""Training across sites (``benchmarks/sites.py``): the front-page pick, the tables and a plot.

What it does:
    Reads the records of ``sites.json`` (one training run per layout, pipeline depth, link
    rate between sites, number of steps and method configuration: ``none``, PowerSGD, the
    DiLoCo family) and renders, from the fields the benchmark recorded:

    * the front page: per (layout, pp, rate, steps), the configuration other than ``none``
      that reached the dense run's final loss soonest in measured training time, that time
      and its recorded speed-up over ``none`` (``>=`` when the benchmark flagged it as a
      lower bound: the ``none`` run at that rate was stopped by its time limit first); when
      no configuration reached it, the closest one's gap and its outer-exchange bytes;
    * a section with the full table of every configuration (status, final loss, gap, bytes
      per step by category, step and training time, time to the dense loss, speed-up);
    * ``loss_vs_time_sites.png``: training loss (the smoothed curve when recorded) against
      measured cumulative training time, one line per configuration, one panel per
      (layout, pp, rate).

    Records are keyed by :func:`record_key` (layout, pp, rate, label, iters); the caller
    keeps the last one given per key.

Why:
    The question these runs answer is which configuration to train with across sites at a
    given link, so the front page gives the pick and the section the evidence.

Constraints:
    Every number is a field of the JSON as ``benchmarks/sites.py`` recorded it: nothing is
    recomputed, no time is derived from bytes and a rate. Comparisons (target, gap, time to
    it, speed-up) are therefore relative to the ``none`` run of the sweep that measured each
    record; a record without them (its sweep had no complete ``none`` run) shows ``-``.
    Never imports torch or megatron; the plot needs matplotlib.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Shared table, rate-order and pyplot helpers of the frontier report (same package).
from megatron_ext.report_style import (
    bandwidth_key,
    baseline_style,
    pyplot,
    run_colors,
    save_figure,
    table,
)

__all__ = [
    "SECTION_TITLE",
    "record_key",
    "group_records",
    "pick",
    "front_page_md",
    "sites_md",
    "plot_loss_vs_time",
]

SECTION_TITLE = "Across sites (DiLoCo family)"
"""Title of the front-page table and of the section."""

_FIXED_CATEGORIES = ("dp-grad", "outer", "other")
"""Byte categories that always get a column ('-' when a run has none of them)."""

_EXTRA_CATEGORY_ORDER = ("dp-param", "pp-act", "pp-grad", "subspace", "tp")
"""Further categories, shown after the fixed ones only when some run of a table has them."""

GroupKey = Tuple[str, int, str, int]
"""(layout, pp, rate, iters): the runs compared with one another."""


def record_key(record: Dict[str, Any]) -> Tuple[str, int, str, str, int]:
    """(layout, pp, rate, label, iters) of a ``sites.json`` record: equal keys are one
    measurement, and the one given later wins."""
    return (
        record["layout"],
        int(record.get("pp") or 1),
        record["rate"],
        record["label"],
        int(record.get("iters") or 0),
    )


def group_records(records: Sequence[Dict[str, Any]]) -> List[Tuple[GroupKey, List[Dict]]]:
    """Records grouped by (layout, pp, rate, iters): layouts in order of first appearance,
    then pipeline depth, fastest link first, fewest steps first; records in input order.
    ``iters`` is the sweep's (``sweep_iters``): a configuration that trained longer than its
    sweep's ``none`` run is compared with it, in its group."""
    groups: Dict[GroupKey, List[Dict[str, Any]]] = {}
    layouts: List[str] = []
    for r in records:
        layout, pp, rate, _, iters = record_key(r)
        iters = int(r.get("sweep_iters") or iters)
        if layout not in layouts:
            layouts.append(layout)
        groups.setdefault((layout, pp, rate, iters), []).append(r)
    order = sorted(groups, key=lambda k: (layouts.index(k[0]), k[1], bandwidth_key(k[2]), k[3]))
    return [(k, groups[k]) for k in order]


def pick(records: Sequence[Dict[str, Any]]) -> Tuple[str, Optional[Dict[str, Any]]]:
    """The front page's choice among one group's records (configurations other than
    ``none``), from their recorded fields.

    Returns:
        ``("reached", r)``: ``r`` reached the target soonest (smallest recorded
        ``time_to_target_s``; the first given on a tie); ``("none reached", r)``: no
        configuration reached it, ``r`` has the smallest recorded gap (``None`` when no
        gap was recorded); ``("no target", None)``: no record of the group carries a
        target (its sweep had no complete ``none`` run).
    """
    others = [r for r in records if r["label"] != "none"]
    if not any(r.get("target_loss") is not None for r in records):
        return "no target", None
    reached = [
        r for r in others if r.get("reached_target") and r.get("time_to_target_s") is not None
    ]
    if reached:
        return "reached", min(reached, key=lambda r: r["time_to_target_s"])
    gaps = [r for r in others if r.get("gap_pct") is not None]
    return "none reached", (min(gaps, key=lambda r: r["gap_pct"]) if gaps else None)


def _speedup(record: Dict[str, Any], digits: int, milestone: str = "") -> str:
    """Recorded speed-up over ``none``: ``1.5x``, ``>= 1.5x`` when flagged a lower bound
    (``milestone="half"``: at the dense run's loss at half its steps)."""
    infix = f"_{milestone}" if milestone else ""
    s = record.get(f"speedup{infix}_vs_none")
    if s is None:
        return "-"
    return (">= " if record.get(f"speedup{infix}_is_lower_bound") else "") + f"{s:.{digits}f}x"


def _half_pick(group: Sequence[Dict[str, Any]], iters: int) -> str:
    """The configuration other than ``none`` that reached the dense run's loss at half its
    steps soonest (recorded ``time_to_half_target_s``), with its time and speed-up."""
    reached = [
        r for r in group if r["label"] != "none" and r.get("time_to_half_target_s") is not None
    ]
    if not reached:
        has_target = any(r.get("half_target_loss") is not None for r in group)
        return "none reached" if has_target else "-"
    r = min(reached, key=lambda r: r["time_to_half_target_s"])
    return f"{_label(r, iters)}: {r['time_to_half_target_s']:.0f} s ({_speedup(r, 1, 'half')})"


def _mb(record: Dict[str, Any], category: str) -> str:
    """Mean MB sent per step (all ranks) of ``category``; ``-`` when the run has none."""
    b = (record.get("bytes_per_step_all_ranks") or {}).get(category)
    return "-" if b is None else f"{b.get('sent', 0.0) / 1e6:.2f}"


def _num(value: Optional[float], fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def _layout_cell(layout: str, pp: int) -> str:
    return layout if pp == 1 else f"{layout}, PP={pp}"


def _steps_cell(iters: int, group: Sequence[Dict[str, Any]]) -> str:
    """``iters``, with the global batch when the runs' commands state it (``1000 (batch
    8)``)."""
    batches = set()
    for r in group:
        m = re.search(r"--global-batch-size (\d+)", r.get("command") or "")
        if m:
            batches.add(int(m.group(1)))
    return f"{iters} (batch {batches.pop()})" if len(batches) == 1 else str(iters)


def _label(record: Dict[str, Any], iters: int) -> str:
    """The configuration's label, with its own number of steps when it trained longer (or
    shorter) than its group's ``iters``."""
    own = int(record.get("iters") or iters)
    return record["label"] if own == iters else f"{record['label']} ({own} steps)"


def _step_cell(record: Optional[Dict[str, Any]], group: Sequence[Dict[str, Any]]) -> str:
    """The record's measured mean step time and, in parentheses, the ``none`` run's at the
    same rate (stopped or not: a step time is measured either way)."""
    if record is None or record.get("mean_step_s") is None:
        return "-"
    none = [x for x in group if x["label"] == "none" and x.get("mean_step_s") is not None]
    ref = f" ({none[0]['mean_step_s']:.2f})" if none else ""
    return f"{record['mean_step_s']:.2f}{ref}"


def front_page_md(records: Sequence[Dict[str, Any]]) -> List[str]:
    """The front page's table (a ``###`` subsection of "Which method at which bandwidth"):
    one row per (layout, pp, rate, steps)."""
    if not records:
        return []
    rows = []
    for (layout, pp, rate, iters), group in group_records(records):
        outcome, r = pick(group)
        if outcome == "reached":
            cells = [_label(r, iters), f"{r['time_to_target_s']:.0f} s", _speedup(r, 1)]
        elif outcome == "none reached" and r is not None:
            cells = [f"none reached (closest: {_label(r, iters)})", "-", "-"]
        elif outcome == "none reached":
            cells = ["none reached", "-", "-"]
        else:
            cells = ["no target (no complete none run)", "-", "-"]
        gap = "-" if r is None or r.get("gap_pct") is None else f"{r['gap_pct']:+.2f} %"
        rows.append(
            [_layout_cell(layout, pp), rate, _steps_cell(iters, group)]
            + cells
            + [gap, _mb(r, "outer") if r else "-", _step_cell(r, group), _half_pick(group, iters)]
        )
    return [
        f"### {SECTION_TITLE}",
        "",
        "Measured training time (inside netbench, only the links between sites shaped) until "
        "the trailing-mean loss first reaches the dense (`none`) run's final loss: the "
        "configuration other than `none` that got there soonest, per layout and link rate, "
        "and its speed-up over `none` at that rate (`>=`: `none` was stopped by its time "
        "limit first, a lower bound). When none reached it: the closest configuration's gap "
        "and its outer-exchange bytes. Step s: its measured mean step time (the `none` "
        "run's at that rate). Last column: the same at a nearer target, the `none` "
        "run's trailing-mean loss at half its steps.",
        "",
        table(
            [
                "layout",
                "link",
                "steps",
                "pick",
                "time to dense final loss",
                "vs none",
                "gap",
                "outer MB/step",
                "step s (none)",
                "soonest to the dense loss at 50% (vs none)",
            ],
            rows,
        ),
        "",
    ]


def _categories(group: Sequence[Dict[str, Any]]) -> List[str]:
    present = {c for r in group for c in (r.get("bytes_per_step_all_ranks") or {})}
    extra = [c for c in _EXTRA_CATEGORY_ORDER if c in present]
    extra += sorted(present - set(_FIXED_CATEGORIES) - set(extra))
    return list(_FIXED_CATEGORIES) + extra


def _status(r: Dict[str, Any]) -> str:
    status = r.get("status") or "-"
    if status == "stopped" and r.get("iterations_done") is not None:
        return f"stopped ({r['iterations_done']} of {r.get('iters')} steps)"
    return status


def _target_line(group: Sequence[Dict[str, Any]]) -> str:
    targets = []
    for r in group:
        t = (r.get("target_loss"), r.get("target_from_rate"))
        if t[0] is not None and t not in targets:
            targets.append(t)
    if not targets:
        return (
            "No target recorded: the sweep that measured these runs had no complete `none` "
            "run of this layout, so gap, time to the dense loss and speed-up are absent."
        )
    words = ", ".join(f"{loss:.4f} (the `none` run at {rate})" for loss, rate in targets)
    if len(targets) > 1:
        return f"Targets (the records come from different sweeps): {words}."
    return f"Target: the complete `none` run's final loss, {words}."


def sites_md(records: Sequence[Dict[str, Any]]) -> List[str]:
    """The section: per (layout, pp, rate, steps), every configuration's recorded numbers."""
    if not records:
        return []
    out = [f"## {SECTION_TITLE}", ""]
    out.append(
        "`benchmarks/sites.py`: each configuration trained inside `megatron-ext netbench` with "
        "only the links between sites shaped (same seed, data order and batch). Final loss = "
        "mean of the logged training losses of the last 10%; gap = to the target, the final "
        "loss of the sweep's complete `none` run of the layout; MB/step = mean bytes sent per "
        "step, all ranks, by accounting category (`outer`: DiLoCo's outer exchange); step s "
        "and train s = mean and sum of the logged per-step times (start-up and evaluation "
        "excluded); s to dense loss = first measured time the trailing-mean loss (window 10% "
        "of the steps) is at or below the target, interpolated between the two logged steps "
        "that bracket it; speed-up = the `none` run's time to it at the same rate over the "
        "configuration's (`>=`: `none` was stopped by its time limit first and its whole "
        "time was used, a lower bound). Every number is from the run at that rate."
    )
    out.append("")
    for (layout, pp, rate, iters), group in group_records(records):
        sample = group[0]
        where = f"{sample.get('sites', '?')} sites x {sample.get('ranks_per_site', '?')} DP rank"
        where += "s" if sample.get("ranks_per_site") != 1 else ""
        if pp > 1:
            where += f", PP={pp}"
        out.append(f"**{layout} ({where}), {rate}, {_steps_cell(iters, group)} steps**")
        out.append("")
        out.append(_target_line(group))
        out.append("")
        cats = _categories(group)
        half = any(r.get("half_target_loss") is not None for r in group)
        rows = []
        for r in group:
            gap = r.get("gap_pct")
            rows.append(
                [_label(r, iters), _status(r), _num(r.get("final_loss"), ".4f")]
                + ["-" if gap is None else f"{gap:+.2f}"]
                + [_mb(r, c) for c in cats]
                + [
                    _num(r.get("mean_step_s"), ".3f"),
                    _num(r.get("train_time_s"), ".1f"),
                    _num(r.get("time_to_target_s"), ".1f"),
                    _speedup(r, 2),
                ]
                + (
                    [_num(r.get("time_to_half_target_s"), ".1f"), _speedup(r, 2, "half")]
                    if half
                    else []
                )
            )
        headers = ["config", "status", "final loss", "gap %"]
        headers += [f"{c} MB/step" for c in cats]
        headers += ["step s", "train s", "s to dense loss", "speed-up"]
        if half:
            headers += ["s to dense loss at 50%", "speed-up at 50%"]
        out.append(table(headers, rows))
        out.append("")
        for r in group:
            if r.get("status") == "refused" and r.get("refusal"):
                out.append(f"Refused by the driver: {r['label']}: {r['refusal']}")
                out.append("")
    return out


def _nan(values: Sequence[Optional[float]]) -> List[float]:
    return [math.nan if v is None else v for v in values]


def plot_loss_vs_time(records: Sequence[Dict[str, Any]], path: str) -> Optional[str]:
    """Training loss (smoothed when recorded) against measured training time, one line per
    configuration, one panel per (layout, pp, rate); ``None`` when no record has a curve."""
    panels: Dict[Tuple[str, int, str], List[Dict[str, Any]]] = {}
    for (layout, pp, rate, _), group in group_records(records):
        for r in group:
            if (r.get("curve") or {}).get("elapsed_s"):
                panels.setdefault((layout, pp, rate), []).append(r)
    if not panels:
        return None
    # One colour per configuration across panels (``none`` black, dashed, on top).
    labels = list(dict.fromkeys(r["label"] for runs in panels.values() for r in runs))
    colors = run_colors([(x, "none" if x == "none" else x) for x in labels])
    plt = pyplot()
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for k, ((layout, pp, rate), runs) in enumerate(panels.items()):
        ax = axes[k // ncols][k % ncols]
        several = len({r.get("iters") for r in runs}) > 1
        smoothed = all(r["curve"].get("smoothed_loss") for r in runs)
        for r in runs:
            curve = r["curve"]
            ys = curve.get("smoothed_loss") or curve.get("lm_loss") or []
            label = r["label"] + (f" ({r.get('iters')} steps)" if several else "")
            label += " (stopped)" if r.get("status") == "stopped" else ""
            ax.plot(
                _nan(curve["elapsed_s"]),
                _nan(ys),
                color=colors[r["label"]],
                label=label,
                **baseline_style("none" if r["label"] == "none" else r["label"]),
            )
        targets = {r.get("target_loss") for r in runs if r.get("target_loss") is not None}
        if len(targets) == 1:
            ax.axhline(next(iter(targets)), color="gray", ls=":", lw=0.8, label="target")
        ax.set_xlabel("measured training time (s)")
        ax.set_ylabel("training loss" + (" (trailing mean)" if smoothed else ""))
        ax.set_title(f"{_layout_cell(layout, pp)}, {rate}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for k in range(len(panels), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    return save_figure(fig, path)
