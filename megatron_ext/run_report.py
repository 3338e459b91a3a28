"""Where a run's JSON report goes, and how a resumed run adds to it instead of replacing it.

What it does:
    * :func:`report_file`: ``--comm-report``, else ``<--save>/comm_report.json``, else
      ``<run directory>/comm_report.json``, where the run directory is a fresh
      ``runs/<date>-<time>`` made by :func:`fresh_run_dir` for a run without ``--save``.
    * :func:`write_report`: writes the report; when the run resumed from a checkpoint
      (``start_iteration`` > 0) and the file holds the report of the earlier segments, they
      are kept: ``segments`` lists every segment's summary in order (this one last), and a
      ``history`` of logged iterations continues the earlier one. The top-level fields stay
      this segment's (what readers of a one-segment report read).
    * :func:`discard_if_empty`: a run refused after its fresh run directory was made
      removes it again, so refusals leave no empty ``runs/<stamp>`` behind.
    * :func:`check_not_finished`: a ``--load`` whose checkpoint is at or past
      ``--train-iters`` is refused before anything is built, naming the flags that extend it.

Why:
    Without ``--save`` the report used to land in the working directory, where the next run
    overwrote it; a resume replaced the run's report with its own segment; and ``--load`` of
    a finished run loaded the model (tens of seconds), trained nothing and overwrote the
    report with an empty one.

Constraints:
    Pure Python (both hosts call it: the driver and Megatron-LM's session). Only rank 0
    writes. A report that cannot be read as a JSON mapping is replaced (named on stdout).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

from megatron_ext.config import ConfigError

__all__ = [
    "REPORT_NAME",
    "RUNS_DIR",
    "report_file",
    "fresh_run_dir",
    "discard_if_empty",
    "write_report",
    "check_not_finished",
]

REPORT_NAME = "comm_report.json"
"""The report's file name in ``--save`` or the run directory."""

RUNS_DIR = "runs"
"""Where runs without ``--save`` get their directory (relative to the working directory)."""


def report_file(explicit: Optional[str], save_dir: Optional[str], run_dir: Optional[str]) -> str:
    """``--comm-report``, else ``<save>/comm_report.json``, else ``<run_dir>/comm_report.json``
    (``./comm_report.json`` only when there is neither, e.g. a caller that made no run
    directory)."""
    if explicit:
        return explicit
    for directory in (save_dir, run_dir):
        if directory:
            return os.path.join(directory, REPORT_NAME)
    return REPORT_NAME


def fresh_run_dir(base: str = RUNS_DIR) -> str:
    """Create and return a new directory ``base/<YYYYmmdd-HHMMSS>[-N]`` (never an existing
    one: two runs started in the same second get different ones).

    Raises:
        ConfigError: naming ``--save`` when ``base`` cannot be written.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        os.makedirs(base, exist_ok=True)
        for n in range(10000):
            path = os.path.join(base, stamp if n == 0 else f"{stamp}-{n}")
            try:
                os.mkdir(path)
                return path
            except FileExistsError:
                continue
    except OSError as exc:
        raise ConfigError(
            "--save",
            f"without --save the run's reports go to a new directory under {base}/, which "
            f"cannot be created: {exc.strerror or exc}; pass --save DIR (or --comm-report FILE)",
        ) from None
    raise ConfigError("--save", f"no free run directory name under {base}/; pass --save DIR")


def discard_if_empty(path: Optional[str]) -> None:
    """Remove ``path`` if it is an empty directory (a fresh run directory of a run that
    stopped before writing anything into it); anything else is left as it is."""
    if not path:
        return
    try:
        os.rmdir(path)  # fails, and keeps the directory, unless it is empty
    except OSError:
        pass


def _summary_of(report: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("segments", "history")}


def write_report(path: str, report: Dict[str, Any], start_iteration: Optional[int]) -> List[str]:
    """Write ``report`` to ``path`` (see module docstring); returns lines to print.

    Args:
        path: the report file.
        report: this segment's report (a JSON-able mapping).
        start_iteration: the iteration this segment started from (0 or None: not resumed;
            a report already at ``path`` is then replaced).
    """
    notes: List[str] = []
    segments: List[Dict[str, Any]] = []
    history: List[Any] = []
    if start_iteration and os.path.isfile(path):
        try:
            with open(path) as f:
                previous = json.load(f)
        except (OSError, ValueError) as exc:
            previous = None
            notes.append(f"{path}: the earlier report is unreadable ({exc}); replaced")
        if isinstance(previous, dict):
            earlier = previous.get("segments") or [_summary_of(previous)]
            # Segments this one supersedes (a resume from an earlier checkpoint) are dropped.
            segments = [
                s
                for s in earlier
                if isinstance(s, dict) and (s.get("start_iteration") or 0) < start_iteration
            ]
            history = [
                h
                for h in previous.get("history") or []
                if isinstance(h, dict) and h.get("iteration", 0) <= start_iteration
            ]
            notes.append(f"{path}: added to the report of the earlier segments")
    out = dict(report)
    out["segments"] = segments + [_summary_of(report)]
    if "history" in report:
        out["history"] = history + list(report["history"] or [])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, path)
    return notes


def check_not_finished(
    load: str, iteration: Optional[int], train_iters: Optional[int], *, finetune: bool = False
) -> None:
    """Refuse a ``--load`` whose checkpoint already reached ``--train-iters``.

    Args:
        load: the ``--load`` value (named in the message).
        iteration: the checkpoint's iteration (None: no checkpoint, nothing to check).
        train_iters: this run's ``--train-iters`` (None: counted in samples, not checked).
        finetune: ``--finetune`` (starts at iteration 0: never finished).

    Raises:
        ConfigError: naming ``--load`` and ``--train-iters`` and the flags that extend a run.
    """
    if finetune or iteration is None or not train_iters or iteration < train_iters:
        return
    raise ConfigError(
        ["--load", "--train-iters"],
        f"{load} holds a finished run (iteration {iteration}, --train-iters {train_iters}): "
        "nothing left to train. To extend it pass --train-iters above "
        f"{iteration} with --override-opt-param-scheduler (this run's learning-rate "
        "schedule, continued from the checkpoint's step) or "
        "--use-checkpoint-opt-param-scheduler (the checkpoint's); to start a new run from its "
        "weights, --finetune",
    )
