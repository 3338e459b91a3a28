"""How ``megatron-ext report`` draws and writes: the helpers its three modules share.

What it does:
    * markdown: :func:`fmt` (a number as a table cell), :func:`table` (a markdown table);
    * order: :func:`bandwidth_key` (unshaped first, then fastest to slowest link rate);
    * plots: :func:`pyplot` (matplotlib on the Agg backend), :func:`save_figure` (lay out,
      write and close a figure), :func:`run_colors` (a distinct colour per curve, methods
      keeping their usual colour where it is free), :func:`baseline_style` (``none`` drawn
      dashed and on top), :func:`curve_markers` (a marker shape per curve, so coinciding
      curves stay visible), :func:`smooth` and :func:`smoothing_window` (a moving mean
      short enough for the run), and :func:`loss_limits` (a y-range that shows every curve
      past its first records).

Why:
    ``report.py``, ``report_frontier.py`` and ``report_sites.py`` each drew curves; with a
    colour per *method*, runs of one method were drawn in one colour (every ``none`` black),
    the dense baseline vanished under a compressed curve lying on it, a 10-record moving
    mean over an 8-record run plotted a cumulative mean far above the losses, and a y-range
    cut at the median clipped short runs. One place decides these for every plot.

Constraints:
    Never imports torch or megatron; matplotlib only inside :func:`pyplot` (the markdown
    helpers work without it).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "METHOD_COLORS",
    "fmt",
    "table",
    "bandwidth_key",
    "pyplot",
    "save_figure",
    "run_colors",
    "baseline_style",
    "smooth",
    "smoothing_window",
    "curve_markers",
    "loss_limits",
]

METHOD_COLORS = {
    "none": "black",
    "separate": "C0",
    "radius": "C1",
    "powersgd": "C2",
    "topr": "C3",
    "quantized": "C4",
}
"""A method's usual colour (its first curve in a plot gets it)."""

_PALETTE = [f"C{k}" for k in range(10)] + [
    "tab:olive",
    "navy",
    "maroon",
    "darkgoldenrod",
    "teal",
    "indigo",
    "sienna",
    "slategray",
]


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: ``-`` for None, ``nan`` for NaN, floats with ``digits`` decimals."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; cells through :func:`fmt`."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def bandwidth_key(bw: Optional[str]) -> float:
    """Sort key of a link rate (``unshaped``, ``100mbit``, ...): fastest first."""
    if bw in (None, "unshaped"):
        return -math.inf
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if bw.endswith(unit):
            try:
                return -float(bw[: -len(unit)]) * scale
            except ValueError:
                break
    return 0.0


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> str:
    """Lay ``fig`` out tightly, write it to ``path`` (110 dpi), close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def run_colors(curves: Sequence[Tuple[str, str]]) -> Dict[str, str]:
    """A distinct colour per curve.

    Args:
        curves: ``(label, method)`` per curve, labels unique, in drawing order.

    Returns:
        ``{label: colour}``: a curve gets its method's usual colour (:data:`METHOD_COLORS`)
        when no earlier curve has it, else the first palette colour no curve has.
    """
    out: Dict[str, str] = {}
    used = set()
    for label, method in curves:
        color = METHOD_COLORS.get(method)
        if color is None or color in used:
            color = next((c for c in _PALETTE if c not in used), _PALETTE[len(out) % 18])
        used.add(color)
        out[label] = color
    return out


def baseline_style(method: str) -> Dict[str, Any]:
    """Line keywords: ``none`` dashed and above the other curves (a compressed curve lying
    on the baseline leaves it visible), every other method solid."""
    if method == "none":
        return {"linestyle": (0, (5, 2)), "zorder": 4}
    return {"linestyle": "-", "zorder": 2}


_MARKERS = "osD^vP*Xh<>"


def curve_markers(labels: Sequence[str], points: int) -> Dict[str, Dict[str, Any]]:
    """Line keywords giving each curve its own hollow marker shape, about 12 markers per
    curve of ``points`` values: curves that coincide (a resumed run over the run it
    continues, two methods with equal losses) stay distinguishable."""
    every = max(1, points // 12)
    return {
        label: {
            "marker": _MARKERS[k % len(_MARKERS)],
            "markevery": every,
            "markersize": 5,
            "markerfacecolor": "none",
        }
        for k, label in enumerate(labels)
    }


def smoothing_window(window: int, lengths: Sequence[int]) -> int:
    """The moving-mean window (in records) for runs of these record counts: at most
    ``window`` and at most a quarter of the shortest run (1: no smoothing)."""
    shortest = min((n for n in lengths if n), default=0)
    return max(1, min(window, shortest // 4))


def smooth(values: Sequence[Optional[float]], window: int) -> List[Optional[float]]:
    """Trailing mean over the last ``window`` values that are not None."""
    out: List[Optional[float]] = []
    buf: List[float] = []
    for v in values:
        if v is not None:
            buf.append(v)
            buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else None)
    return out


def loss_limits(
    curves: Sequence[Sequence[Optional[float]]], skip_fraction: float = 0.1
) -> Optional[Tuple[float, float]]:
    """A y-range for loss curves: every value of every curve past its first
    ``skip_fraction`` of values (the steep start; short curves, under 20 values, are shown
    whole), with a 5% margin; None without values."""
    shown, low = [], []
    for values in curves:
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            continue
        skip = int(math.ceil(skip_fraction * len(vals))) if len(vals) >= 20 else 0
        shown += vals[skip:]
        low += vals
    if not shown:
        return None
    lo, hi = min(low), max(shown)
    pad = 0.05 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
    return lo - pad, hi + pad
