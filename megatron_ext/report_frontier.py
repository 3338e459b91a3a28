"""The quality-versus-bytes frontier and measured time-to-target (``benchmarks/frontier.py``).

What it does:
    Reads the records of ``frontier.json`` (one training run per method setting, batch size
    and link bandwidth) and derives what a user picks a method by:

    * the frontier: per batch size, final training and held-out loss against DP gradient
      bytes per step, one point per setting, and the Pareto front (no other setting of the
      batch size is both cheaper in bytes and lower in loss);
    * time to target, measured: per batch size and bandwidth, the *measured* training time
      (the sum of the driver's per-step wall times, process start and evaluation excluded)
      until a run's trailing-mean loss first reaches each milestone of the dense run, i.e.
      ``none``'s own trailing-mean loss at 25/50/75/100% of its iterations, within a
      tolerance (1%: a run reaches a milestone ``m`` at the first iteration where its
      trailing mean is <= ``m * 1.01``); a run stopped by its time limit before reaching a
      milestone gives a lower bound (``> t``);
    * the front page: which setting to pick at which bandwidth (the shortest measured time to
      dense final quality) and the cheapest setting within 2% of dense per batch size.

    The trailing mean uses the window of the final-loss definition (the last 10% of the
    iterations), so ``none``'s 100% milestone is its final loss.

Constraints:
    Never imports torch or megatron; the plots need matplotlib.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_ext.report_style import (
    METHOD_COLORS,
    bandwidth_key,
    baseline_style,
    pyplot,
    run_colors,
    save_figure,
    table,
)

__all__ = [
    "trailing_mean",
    "milestones",
    "time_to",
    "pareto_front",
    "dp_bytes",
    "frontier_md",
    "time_to_target_md",
    "front_page_md",
    "plot_frontier",
    "plot_loss_vs_wallclock",
    "MILESTONE_FRACTIONS",
]

MILESTONE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def trailing_mean(values: Sequence[Optional[float]], window: int) -> List[Optional[float]]:
    """Mean of the last ``window`` values at each position (fewer at the start); ``None``
    entries are skipped, a position without any value gives ``None``."""
    out: List[Optional[float]] = []
    window = max(1, int(window))
    for i in range(len(values)):
        tail = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(tail) / len(tail) if tail else None)
    return out


def _window(record: Dict[str, Any], fraction: float) -> int:
    return max(1, int(round(fraction * int(record.get("iters") or 1))))


def milestones(
    dense: Dict[str, Any], fractions: Sequence[float] = MILESTONE_FRACTIONS, final: float = 0.1
) -> List[Dict[str, Any]]:
    """``[{fraction, iteration, loss}]``: the dense run's trailing-mean loss at ``fractions``
    of its iterations (needs a complete dense run)."""
    curve = dense["curve"]
    smooth = trailing_mean(curve["lm_loss"], _window(dense, final))
    iters = curve["iteration"]
    out = []
    for f in fractions:
        target_iter = max(1, int(round(f * int(dense["iters"]))))
        idx = max((i for i, it in enumerate(iters) if it <= target_iter), default=None)
        if idx is None or smooth[idx] is None:
            continue
        out.append({"fraction": f, "iteration": iters[idx], "loss": smooth[idx]})
    return out


def time_to(
    record: Dict[str, Any], target: float, tolerance: float = 0.01, final: float = 0.1
) -> Dict[str, Any]:
    """When ``record``'s trailing-mean loss first reaches ``target * (1 + tolerance)``.

    Returns ``{"reached": bool, "iteration", "seconds"}``: seconds is the measured training
    time up to and including that iteration; when never reached, the time of all logged
    iterations (a lower bound when the run was stopped early).
    """
    curve = record["curve"]
    smooth = trailing_mean(curve["lm_loss"], _window(record, final))
    elapsed = 0.0
    for it, loss, dt in zip(curve["iteration"], smooth, curve["step_time_s"]):
        elapsed += dt or 0.0
        if loss is not None and loss <= target * (1.0 + tolerance):
            return {"reached": True, "iteration": it, "seconds": elapsed}
    return {"reached": False, "iteration": None, "seconds": elapsed}


def pareto_front(points: Sequence[Tuple[float, float]]) -> List[int]:
    """Indices of the points (bytes, loss) not dominated by a cheaper-or-equal, lower-loss
    point, sorted by bytes."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def dp_bytes(record: Dict[str, Any]) -> Optional[float]:
    """Mean DP-gradient bytes sent per step, all ranks (as measured)."""
    grad = (record.get("bytes_per_step_all_ranks") or {}).get("dp-grad") or {}
    return grad.get("sent")


def _batches(records: Sequence[Dict[str, Any]]) -> List[int]:
    return sorted({r["tokens_per_step"] for r in records})


def _dense(records: Sequence[Dict[str, Any]], tokens: int) -> Optional[Dict[str, Any]]:
    """The complete ``none`` run at this batch (unshaped preferred: its loss is the same)."""
    runs = [
        r
        for r in records
        if r["tokens_per_step"] == tokens
        and r["method"] == "none"
        and not r.get("batch_div")
        and r.get("ok")
    ]
    runs.sort(key=lambda r: r.get("bandwidth") not in (None, "unshaped"))
    return runs[0] if runs else None


def _loss_points(records: Sequence[Dict[str, Any]], tokens: int) -> Dict[str, Dict[str, Any]]:
    """One record per label at this batch (first complete one: losses do not depend on the
    link)."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in records:
        if r["tokens_per_step"] == tokens and r.get("ok") and r["label"] not in out:
            out[r["label"]] = r
    return out


def frontier_md(records: Sequence[Dict[str, Any]]) -> List[str]:
    """Per batch size: final loss, held-out loss, gaps and bytes per setting, front marked."""
    if not records:
        return []
    out = ["## Quality against bytes (frontier)", ""]
    out.append(
        "One training run per setting (same seed, data order and initialisation), final loss = "
        "mean training loss of the last 10% of the iterations, held-out = validation loss at "
        "the end; DP bytes = mean DP-gradient bytes sent per step, all ranks, as measured. "
        "`front`: on the Pareto front of training loss against bytes at that batch size. "
        "`@B/n`: a control trained at 1/n of the batch for the same number of steps."
    )
    out.append("")
    for tokens in _batches(records):
        points = _loss_points(records, tokens)
        dense = _dense(records, tokens)
        if not points:
            continue
        sample = next(iter(points.values()))
        out.append(
            f"**{tokens} tokens per step, {sample['iters']} steps "
            f"({tokens * sample['iters'] / 1e6:.2f}M tokens)**"
        )
        out.append("")
        labels = [lab for lab in points if not points[lab].get("batch_div")]
        pts = [
            (dp_bytes(points[lab]) or 0.0, points[lab].get("final_loss") or math.inf)
            for lab in labels
        ]
        front = {labels[i] for i in pareto_front(pts)}
        rows = []
        base = dense.get("final_loss") if dense else None
        vbase = dense.get("final_valid_loss") if dense else None
        dbytes = dp_bytes(dense) if dense else None
        for lab, r in sorted(points.items(), key=lambda kv: -(dp_bytes(kv[1]) or 0.0)):
            f, v, b = r.get("final_loss"), r.get("final_valid_loss"), dp_bytes(r)
            rows.append(
                [
                    lab,
                    f,
                    100.0 * (f - base) / base if f is not None and base else None,
                    v,
                    100.0 * (v - vbase) / vbase if v is not None and vbase else None,
                    b / 1e6 if b is not None else None,
                    dbytes / b if b and dbytes else None,
                    "yes" if lab in front else "",
                ]
            )
        out.append(
            table(
                [
                    "setting",
                    "final loss",
                    "gap %",
                    "held-out",
                    "held-out gap %",
                    "DP MB/step",
                    "x fewer bytes",
                    "front",
                ],
                rows,
            )
        )
        out.append("")
    return out


def _ttt_rows(
    records: Sequence[Dict[str, Any]], tokens: int, bandwidth: str, tolerance: float
) -> Tuple[List[Dict[str, Any]], List[List[Any]], Dict[str, Dict[str, Any]]]:
    dense = _dense(records, tokens)
    if dense is None:
        return [], [], {}
    marks = milestones(dense)
    runs = [
        r
        for r in records
        if r["tokens_per_step"] == tokens and r.get("bandwidth") == bandwidth and r.get("curve")
    ]
    rows, final = [], {}
    for r in runs:
        cells: List[Any] = [r["label"]]
        for m in marks:
            t = time_to(r, m["loss"], tolerance)
            if t["reached"]:
                cells.append(f"{t['seconds']:.0f} s (it {t['iteration']})")
            else:
                cells.append(f"> {t['seconds']:.0f} s" if r.get("truncated") else "not reached")
            if m["fraction"] == 1.0:
                final[r["label"]] = t
        cells.append(r.get("mean_step_s"))
        rows.append(cells)
    return marks, rows, final


def time_to_target_md(records: Sequence[Dict[str, Any]], tolerance: float = 0.01) -> List[str]:
    """Measured time to each of the dense run's milestones, per batch and bandwidth."""
    shaped = [r for r in records if r.get("bandwidth") not in (None, "unshaped")]
    if not shaped:
        return []
    out = ["## Time to target, measured end to end", ""]
    out.append(
        "Each run trained inside `megatron-ext netbench` at the given link rate; time = sum of "
        "the driver's measured per-step wall times until the run's trailing-mean loss (window "
        f"= 10% of the iterations) first reaches the milestone within {tolerance:.0%}; "
        "milestones = the dense run's own trailing-mean loss at 25/50/75/100% of its "
        "iterations. `> t`: the run was stopped by its time limit after t seconds of training "
        "without reaching it (a lower bound). Not derived: every number is from the run at "
        "that rate."
    )
    out.append("")
    for tokens in _batches(shaped):
        bws = sorted(
            {r["bandwidth"] for r in shaped if r["tokens_per_step"] == tokens}, key=bandwidth_key
        )
        for bw in bws:
            marks, rows, final = _ttt_rows(records, tokens, bw, tolerance)
            if not marks:
                continue
            out.append(f"**{bw}, {tokens} tokens per step**")
            out.append("")
            headers = (
                ["setting"]
                + [f"{int(100 * m['fraction'])}%: {m['loss']:.3f}" for m in marks]
                + ["mean step s"]
            )
            out.append(table(headers, rows))
            out.append("")
    return out


def front_page_md(
    records: Sequence[Dict[str, Any]], tolerance: float = 0.01, quality: float = 2.0
) -> List[str]:
    """Which setting to pick: per bandwidth the shortest measured time to dense final
    quality; per batch the cheapest setting within ``quality`` percent of dense."""
    if not records:
        return []
    out = ["## Which method at which bandwidth", ""]
    rows = []
    shaped = [r for r in records if r.get("bandwidth") not in (None, "unshaped")]
    for tokens in _batches(shaped):
        bws = sorted(
            {r["bandwidth"] for r in shaped if r["tokens_per_step"] == tokens}, key=bandwidth_key
        )
        for bw in bws:
            _, _, final = _ttt_rows(records, tokens, bw, tolerance)
            reached = {k: v for k, v in final.items() if v["reached"]}
            if not reached:
                continue
            best = min(reached, key=lambda k: reached[k]["seconds"])
            dense = final.get("none")
            if dense and dense["reached"]:
                speed = f"{dense['seconds'] / reached[best]['seconds']:.1f}x"
            elif dense and dense["seconds"] >= reached[best]["seconds"]:
                speed = f"> {dense['seconds'] / reached[best]['seconds']:.1f}x"
            elif dense:
                # Stopped before the pick got there: no bound on the speed-up.
                speed = f"none stopped at {dense['seconds']:.0f} s, unreached"
            else:
                speed = "-"
            rows.append([bw, tokens, best, f"{reached[best]['seconds']:.0f} s", speed])
    if rows:
        out.append(
            f"Measured time to the dense run's final loss (within {tolerance:.0%}), "
            "shortest per link rate:"
        )
        out.append("")
        out.append(
            table(["link", "tokens/step", "pick", "time to dense final loss", "vs none"], rows)
        )
        out.append("")
    rows = []
    for tokens in _batches(records):
        dense = _dense(records, tokens)
        if dense is None or not dense.get("final_loss"):
            continue
        base, dbytes = dense["final_loss"], dp_bytes(dense) or 0.0
        ok = [
            r
            for r in _loss_points(records, tokens).values()
            if not r.get("batch_div")
            and r["method"] != "none"
            and r.get("final_loss") is not None
            and 100.0 * (r["final_loss"] - base) / base <= quality
            and dp_bytes(r)
        ]
        if not ok:
            rows.append([tokens, f"no setting within {quality:g}%", "-", "-"])
            continue
        cheapest = min(ok, key=dp_bytes)
        gap = 100.0 * (cheapest["final_loss"] - base) / base
        rows.append(
            [tokens, cheapest["label"], f"{gap:+.2f}%", f"{dbytes / dp_bytes(cheapest):.1f}x"]
        )
    if rows:
        out.append(f"Fewest DP bytes within {quality:g}% of the dense final loss, per batch size:")
        out.append("")
        out.append(table(["tokens/step", "setting", "gap", "fewer bytes"], rows))
        out.append("")
    return out


def _annotate(ax, notes: Sequence[Tuple[float, float, str]]) -> None:
    """Label points; points whose labels would overlap (within a factor 1.6 in bytes, about
    a label's width on these axes, and 4% of the loss range) get one label naming the first
    and how many more, instead of labels printed over each other."""
    if not notes:
        return
    ys = [y for _, y, _ in notes]
    span = (max(ys) - min(ys)) or 1.0
    groups: List[List[Tuple[float, float, str]]] = []
    for x, y, label in notes:
        for group in groups if not label.startswith("none") else []:  # the baseline: own label
            if group[0][2].startswith("none"):
                continue
            gx, gy, _ = group[0]
            if abs(math.log(x / gx)) < 0.47 and abs(y - gy) < 0.04 * span:
                group.append((x, y, label))
                break
        else:
            groups.append([(x, y, label)])
    for group in groups:
        x, y, label = group[0]
        text = label if len(group) == 1 else f"{label} (+{len(group) - 1} more)"
        ax.annotate(text, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")


def plot_frontier(records: Sequence[Dict[str, Any]], path: str) -> Optional[str]:
    """Final loss (training, held-out) against DP bytes per step, one panel pair per batch."""
    batches = _batches(records)
    if not batches:
        return None
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(len(batches), 2, figsize=(12, 4.2 * len(batches)), squeeze=False)
    for row, tokens in enumerate(batches):
        points = _loss_points(records, tokens)
        if not points:
            continue
        for col, key in enumerate(("final_loss", "final_valid_loss")):
            ax = axes[row][col]
            seen = set()
            notes: List[Tuple[float, float, str]] = []
            plain = [r for r in points.values() if not r.get("batch_div") and r.get(key)]
            for r in points.values():
                b, y = dp_bytes(r), r.get(key)
                if not b or y is None:
                    continue
                color = METHOD_COLORS.get(r["method"], "C5")
                marker = "x" if r.get("batch_div") else "o"
                ax.scatter(
                    [b / 1e6],
                    [y],
                    color=color,
                    marker=marker,
                    label=(
                        None
                        if (r["method"], marker) in seen
                        else (r["method"] + (" (smaller batch)" if r.get("batch_div") else ""))
                    ),
                )
                seen.add((r["method"], marker))
                notes.append((b / 1e6, y, r["label"]))
            _annotate(ax, notes)
            pts = [(dp_bytes(r) or 0.0, r[key]) for r in plain]
            front = [plain[i] for i in pareto_front(pts)]
            if len(front) > 1:
                ax.plot(
                    [dp_bytes(r) / 1e6 for r in front],
                    [r[key] for r in front],
                    "k--",
                    lw=0.8,
                    label="Pareto front",
                )
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # label the decades only
            ax.set_xlabel("DP gradient MB per step (all ranks)")
            ax.set_ylabel("final training loss" if col == 0 else "held-out loss")
            ax.set_title(f"{tokens} tokens/step, {next(iter(points.values()))['iters']} steps")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_loss_vs_wallclock(records: Sequence[Dict[str, Any]], path: str) -> Optional[str]:
    """Measured loss against training wall-clock time, one panel per (batch, bandwidth)."""
    shaped = [r for r in records if r.get("bandwidth") not in (None, "unshaped") and r.get("curve")]
    panels = sorted(
        {(r["tokens_per_step"], r["bandwidth"]) for r in shaped},
        key=lambda p: (p[0], bandwidth_key(p[1])),
    )
    if not panels:
        return None
    plt = pyplot()
    colors = run_colors(list(dict.fromkeys((r["label"], r["method"]) for r in shaped)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (tokens, bw) in zip(axes[0], panels):
        for r in shaped:
            if (r["tokens_per_step"], r["bandwidth"]) != (tokens, bw):
                continue
            curve = r["curve"]
            t, xs = 0.0, []
            for dt in curve["step_time_s"]:
                t += dt or 0.0
                xs.append(t)
            ys = trailing_mean(curve["lm_loss"], _window(r, 0.1))
            ax.plot(
                xs,
                ys,
                color=colors[r["label"]],
                label=r["label"] + (" (stopped)" if r.get("truncated") else ""),
                **baseline_style(r["method"]),
            )
        ax.set_xlabel("measured training time (s)")
        ax.set_ylabel("training loss (trailing mean)")
        ax.set_title(f"{bw}, {tokens} tokens/step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return save_figure(fig, path)
