"""The JSON report every benchmark writes, and the markdown tables it prints.

:func:`make_report` / :func:`write_report` / :func:`validate_report` give every benchmark the
same JSON layout (``benchmark``, ``schema_version``, ``environment``, ``settings``,
``results``), which :mod:`megatron_ext.report` reads; :func:`write_results` writes it once at
the end of a benchmark, :class:`SweepReport` after every run of a sweep; :func:`format_table`
prints GitHub-markdown tables (readable in a terminal, pasteable into docs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

from benchmarks.common.environment import default_out_dir, environment

__all__ = [
    "SCHEMA_VERSION",
    "BENCHMARKS",
    "make_report",
    "validate_report",
    "write_report",
    "write_results",
    "SweepReport",
    "format_table",
]


SCHEMA_VERSION = 1
"""Version of the JSON layout written by :func:`make_report`."""

BENCHMARKS = (
    "kernels",
    "step_time",
    "convergence",
    "grass_memory",
    "grass_throughput",
    "subspace_overhead",
    "frontier",
    "state_memory",
    "one_gpu",
    "sites",
    "sites_ft",
)
"""Names a report's ``benchmark`` field may take; also the JSON file names (``<name>.json``)."""

_REQUIRED = {"benchmark": str, "schema_version": int, "environment": dict, "settings": dict}


def make_report(
    benchmark: str,
    settings: Dict[str, Any],
    results: List[Dict[str, Any]],
    env: Dict[str, Any],
    **extra: Any,
) -> Dict[str, Any]:
    """The common JSON layout of a benchmark report (see :func:`validate_report`)."""
    report = {
        "benchmark": benchmark,
        "schema_version": SCHEMA_VERSION,
        "environment": env,
        "settings": settings,
        "results": results,
    }
    report.update(extra)
    validate_report(report)
    return report


def validate_report(report: Any) -> Dict[str, Any]:
    """Check the layout of a benchmark report; returns it, raises ``ValueError`` if wrong.

    Required: ``benchmark`` (one of :data:`BENCHMARKS`), ``schema_version`` (an int not
    newer than :data:`SCHEMA_VERSION`), ``environment`` and ``settings`` (dicts), and
    ``results``, a list of dicts.
    """
    if not isinstance(report, dict):
        raise ValueError(f"a report is a JSON object, got {type(report).__name__}")
    for key, kind in _REQUIRED.items():
        if key not in report:
            raise ValueError(f"report has no {key!r}")
        if not isinstance(report[key], kind):
            raise ValueError(f"report {key!r} must be {kind.__name__}")
    if report["benchmark"] not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {report['benchmark']!r} (known: {BENCHMARKS})")
    if report["schema_version"] > SCHEMA_VERSION:
        raise ValueError(f"report schema {report['schema_version']} is newer than {SCHEMA_VERSION}")
    results = report.get("results")
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise ValueError("report 'results' must be a list of objects")
    return report


def write_report(report: Dict[str, Any], out_dir: str) -> str:
    """Write ``<out_dir>/<benchmark>.json``; returns the path."""
    validate_report(report)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{report['benchmark']}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def write_results(
    benchmark: str,
    args: argparse.Namespace,
    results: List[Dict[str, Any]],
    out_dir: str,
    **extra: Any,
) -> str:
    """Write the report of a benchmark that writes it once, at its end: :func:`make_report`
    with every option as its settings and this machine's :func:`environment`, to
    ``<out_dir>/<benchmark>.json`` (:func:`write_report`); returns the path."""
    report = make_report(benchmark, vars(args), results, environment(), **extra)
    return write_report(report, out_dir)


class SweepReport:
    """The report of a benchmark that trains one configuration after another, rewritten after
    every run so that a sweep stopped half-way keeps what it measured.

    Args:
        benchmark: The report's name (one of :data:`BENCHMARKS`).
        args: The parsed options: ``out`` (the folder, default :func:`default_out_dir`, made
            here) and ``num_threads`` (the environment's); every option but ``out`` starts
            :attr:`settings`, to which the benchmark adds its own entries.

    Attributes:
        out: The folder of the report and the runs.
        settings: The report's ``settings``.
        path: ``<out>/<benchmark>.json``.
    """

    def __init__(self, benchmark: str, args: argparse.Namespace) -> None:
        self.benchmark = benchmark
        self.out: str = args.out or default_out_dir(benchmark)
        os.makedirs(self.out, exist_ok=True)
        self.path = os.path.join(self.out, f"{benchmark}.json")
        self.settings: Dict[str, Any] = {k: v for k, v in vars(args).items() if k != "out"}
        self._num_threads = args.num_threads
        self._t0 = time.time()

    def write(self, results: List[Dict[str, Any]], **extra: Any) -> str:
        """Write the report of ``results`` so far (and ``extra`` top-level fields) with the
        current environment and ``wall_s``, the seconds since the report was made; returns
        :attr:`path`."""
        env = environment(num_threads=self._num_threads)
        extra["wall_s"] = time.time() - self._t0
        return write_report(
            make_report(self.benchmark, self.settings, results, env, **extra), self.out
        )


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        if value != 0 and (abs(value) >= 10 ** (digits + 3) or abs(value) < 10**-digits):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    digits: int = 3,
    align: Optional[Sequence[str]] = None,
) -> str:
    """A GitHub-markdown table with padded columns.

    Args:
        headers: column titles.
        rows: one sequence of cells per row; floats get ``digits`` decimals, ``None`` is
            shown as ``-``.
        digits: decimals of float cells.
        align: per column ``"l"`` or ``"r"``; default: right for numbers, left otherwise.

    Returns:
        The table, lines joined by ``\\n`` (no trailing newline).
    """
    rows = [list(r) for r in rows]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row has {len(r)} cells, expected {len(headers)}: {r}")
    if align is None:
        align = []
        for j in range(len(headers)):
            numeric = [isinstance(r[j], (int, float)) for r in rows if r[j] is not None]
            align.append("r" if numeric and all(numeric) else "l")
    text = [[_cell(v, digits) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[j]) for r in text]) for j, h in enumerate(headers)]

    def line(cells):
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)
        )
        + "|"
    )
    return "\n".join([line(headers), rule] + [line(r) for r in text])
