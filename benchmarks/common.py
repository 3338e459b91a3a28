"""Shared helpers of the benchmarks: environment capture, JSON reports, tables, statistics.

What it does:
    * :func:`environment` records what a number depends on: torch and megatron-core
      versions, CPU model and core count, torch threads, git commit (and whether the work
      tree had uncommitted changes), the device ("cpu (no GPU lent)" or the CUDA device),
      load average and time.
    * :func:`make_report` / :func:`write_report` / :func:`validate_report` give every
      benchmark the same JSON layout (``benchmark``, ``schema_version``, ``environment``,
      ``settings``, ``results``), which :mod:`megatron_ext.report` reads.
    * :func:`format_table` prints GitHub-markdown tables (readable in a terminal, pasteable
      into docs).
    * :func:`equal_bytes_rank` picks PowerSGD's rank so that it sends about as many bytes as
      a projection at a given ratio; :func:`gpt_matrix_shapes` lists the weight matrices of
      a GPT preset for the model-wide version.
    * :func:`run_logged` runs a command with its output in a log file, :func:`read_jsonl`
      reads the driver's ``log.jsonl``, :func:`median` is the statistic.

Constraints:
    Imports torch lazily (only :func:`environment` needs it), so the step-time and
    convergence drivers stay light; never imports megatron.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_ext.report import read_jsonl  # noqa: F401 (re-exported for the benchmarks)

__all__ = [
    "REPO_ROOT",
    "SCHEMA_VERSION",
    "BENCHMARKS",
    "environment",
    "default_out_dir",
    "make_report",
    "add_method_args",
    "method_choices",
    "MethodSettings",
    "add_machine_args",
    "write_report",
    "validate_report",
    "format_table",
    "equal_bytes_rank",
    "equal_bytes_rank_for_shapes",
    "squareish_shape",
    "gpt_matrix_shapes",
    "gpt_vector_numel",
    "load_model_preset",
    "median",
    "read_jsonl",
    "run_logged",
    "parse_list",
    "shell_join",
    "CpuMonitor",
    "wait_for_quiet",
    "set_priority",
    "PriorityBooster",
]

REPO_ROOT = Path(__file__).resolve().parents[1]

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
)
"""Names a report's ``benchmark`` field may take; also the JSON file names (``<name>.json``)."""

_REQUIRED = {"benchmark": str, "schema_version": int, "environment": dict, "settings": dict}


# -- environment ---------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _memory_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _package_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def source_fingerprint() -> str:
    """sha256 (first 16 hex digits) of every ``megatron_ext/**/*.py`` file, path and content.

    The work tree may hold uncommitted changes; this names the exact code measured.
    """
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "megatron_ext").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_description() -> str:
    """``"cpu (no GPU lent)"`` or the CUDA device name."""
    try:
        import torch
    except ImportError:
        return "cpu (no GPU lent)"
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return "cpu (no GPU lent)"


def environment(num_threads: Optional[Any] = None) -> Dict[str, Any]:
    """What the measured numbers depend on.

    Args:
        num_threads: torch intra-op threads used by the measurement (an int, a list of ints
            or a description); default ``torch.get_num_threads()``.

    Returns:
        A JSON-serialisable dict.
    """
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": _package_version("megatron-core"),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "num_threads": torch.get_num_threads() if num_threads is None else num_threads,
        "device": device_description(),
        "cuda_available": torch.cuda.is_available(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "source_fingerprint": source_fingerprint(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(sys.argv),
    }


def default_out_dir(name: str) -> str:
    """``runs/bench-<name>-<YYYYmmdd-HHMMSS>`` (relative to the working directory)."""
    return os.path.join("runs", f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}")


# -- CPU contention ------------------------------------------------------------------------


def _cpu_busy_s() -> Optional[float]:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...
    values = [int(v) for v in fields[1:]]
    busy = values[0] + values[1] + values[2] + values[5] + values[6]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuMonitor:
    """CPU time used by *other* processes while a measurement runs.

    The benchmarks share a small machine; another process's work slows ours down. On exit
    ``result()`` gives the wall time, our CPU seconds (this process and its waited-for
    children), the machine's busy CPU seconds, the difference ("foreign") and the foreign
    share of the machine's capacity (``foreign / (wall * cores)``). Linux only; elsewhere
    the foreign fields are ``None``.
    """

    def __enter__(self) -> "CpuMonitor":
        self._t0 = time.time()
        self._busy0 = _cpu_busy_s()
        self._own0 = _own_cpu_s()
        self.wall_s = self.own_cpu_s = self.foreign_cpu_s = self.foreign_share = None
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.time() - self._t0
        self.own_cpu_s = _own_cpu_s() - self._own0
        busy1 = _cpu_busy_s()
        if self._busy0 is not None and busy1 is not None:
            self.foreign_cpu_s = max(0.0, (busy1 - self._busy0) - self.own_cpu_s)
            capacity = max(1e-9, self.wall_s * (os.cpu_count() or 1))
            self.foreign_share = self.foreign_cpu_s / capacity

    def result(self) -> Dict[str, Any]:
        """JSON-ready numbers (after the ``with`` block)."""
        return {
            "wall_s": self.wall_s,
            "own_cpu_s": self.own_cpu_s,
            "foreign_cpu_s": self.foreign_cpu_s,
            "foreign_cpu_share": self.foreign_share,
            "load_average_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }


def wait_for_quiet(
    max_wait_s: float, threshold: float = 0.1, window_s: float = 3.0, log=print
) -> Dict[str, Any]:
    """Wait (up to ``max_wait_s``) until other processes use less than ``threshold`` of the CPUs.

    Call it between measurements, when this process is idle. Returns what was seen:
    ``{"waited_s", "busy_share"}`` (the last window's machine-wide busy share).
    """
    t0 = time.time()
    share = None
    while True:
        b0, w0 = _cpu_busy_s(), time.time()
        time.sleep(window_s)
        b1, w1 = _cpu_busy_s(), time.time()
        if b0 is None or b1 is None:
            return {"waited_s": 0.0, "busy_share": None}
        share = (b1 - b0) / ((w1 - w0) * (os.cpu_count() or 1))
        waited = time.time() - t0
        if share < threshold or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "busy_share": round(share, 3)}
        if log:
            log(
                f"  (other processes use {100 * share:.0f}% of the CPUs; waiting for a quiet "
                f"machine, {waited:.0f}/{max_wait_s:.0f} s)"
            )
        time.sleep(7.0)


# -- priority ------------------------------------------------------------------------------


def set_priority(pid: int, nice: int) -> bool:
    """Give process ``pid`` the scheduling weight of ``nice``, across sessions too.

    With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, the default
    on desktop kernels) the CPU is shared fairly between *sessions* and a process's nice
    value only counts inside its session; netbench and torchrun start every rank in a new
    session. So both the process nice value and its autogroup's nice value are set.
    Negative values need root (CAP_SYS_NICE). Returns whether anything was set.
    """
    done = False
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        done = True
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        done = True
    except OSError:
        pass
    return done


def _children_map() -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses.
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


class PriorityBooster:
    """Keep a process tree at a given priority while it runs (see :func:`set_priority`).

    A background thread walks the descendants of ``root_pid`` every ``interval_s`` seconds
    and sets each new one's priority, so ranks started later (after a link check, by
    torchrun) are covered. Only processes of that tree are touched.
    """

    def __init__(self, root_pid: int, nice: int, interval_s: float = 0.3):
        import threading

        self.root_pid, self.nice, self.interval_s = root_pid, nice, interval_s
        self.boosted: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PriorityBooster":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                children = _children_map()
                todo = [self.root_pid]
                while todo:
                    pid = todo.pop()
                    if pid not in self.boosted and set_priority(pid, self.nice):
                        self.boosted.add(pid)
                    todo.extend(children.get(pid, []))
            except Exception:  # noqa: BLE001 - best effort; never break the measurement
                pass
            self._stop.wait(self.interval_s)


# -- reports -------------------------------------------------------------------------------


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


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


# -- tables --------------------------------------------------------------------------------


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


# -- PowerSGD at equal bytes ---------------------------------------------------------------


def equal_bytes_rank(rows: int, cols: int, ratio: float) -> int:
    """PowerSGD rank sending about as many numbers as a ratio-``ratio`` projection.

    An ``n x m`` matrix at rank ``r`` sends ``P`` (``n x r``) and ``Q`` (``m x r``), so
    ``r = n m / (ratio (n + m))``, rounded to the nearest integer and at least 1.
    """
    if rows <= 0 or cols <= 0 or ratio <= 0:
        raise ValueError(f"need positive sizes and ratio, got {rows}, {cols}, {ratio}")
    return max(1, int(round(rows * cols / (ratio * (rows + cols)))))


def equal_bytes_rank_for_shapes(shapes: Iterable[Tuple[int, int]], ratio: float) -> int:
    """One PowerSGD rank for several matrices: ``sum(n m) / (ratio sum(n + m))``, rounded."""
    from megatron_ext.compressors.lowrank import equal_bytes_rank

    return equal_bytes_rank(shapes, ratio)


def squareish_shape(numel: int) -> Tuple[int, int]:
    """``(n, m)`` with ``n * m == numel`` and ``n <= m`` as close as possible to square."""
    if numel <= 0:
        raise ValueError(f"numel must be positive, got {numel}")
    n = int(math.isqrt(numel))
    while numel % n:
        n -= 1
    return n, numel // n


def load_model_preset(name: str = "gpt-tiny") -> Dict[str, Any]:
    """The YAML mapping of ``configs/models/<name>.yaml``."""
    import yaml

    path = REPO_ROOT / "configs" / "models" / f"{name}.yaml"
    with open(path) as f:
        return yaml.safe_load(f) or {}


def gpt_matrix_shapes(preset: Dict[str, Any]) -> List[Tuple[int, int]]:
    """Weight matrices (2-D parameters) of a GPT-2-style megatron-core model, as (rows, cols).

    Word and position embeddings, per layer QKV ``(3h, h)``, attention output ``(h, h)``,
    MLP ``(f, h)`` and ``(h, f)``, and the output layer when untied. GPT-2 style only
    (no GQA / SwiGLU); enough for the equal-bytes rank of the benchmarks' gpt-tiny.
    """
    h = int(preset["hidden_size"])
    f = int(preset.get("ffn_hidden_size") or 4 * h)
    v = int(preset["vocab_size"])
    s = int(preset.get("max_position_embeddings") or preset["seq_length"])
    shapes = [(v, h), (s, h)]
    for _ in range(int(preset["num_layers"])):
        shapes += [(3 * h, h), (h, h), (f, h), (h, f)]
    if preset.get("untie_embeddings_and_output_weights"):
        shapes.append((v, h))
    return shapes


def gpt_vector_numel(preset: Dict[str, Any]) -> int:
    """Entries of the 1-D parameters (biases, LayerNorms) of the same model."""
    h = int(preset["hidden_size"])
    f = int(preset.get("ffn_hidden_size") or 4 * h)
    # Per layer: 2 LayerNorms (2h each), QKV bias 3h, proj bias h, fc1 bias f, fc2 bias h.
    return int(preset["num_layers"]) * (2 * 2 * h + 3 * h + h + f + h) + 2 * h


# -- methods -------------------------------------------------------------------------------


def add_method_args(p: Any, family: str = "grad") -> None:
    """The driver's options of every registered ``family`` method (``--separate-ratio``,
    ``--radius-density``, ...), left unset unless given: an unset option takes the method's
    benchmark default (``Method.bench_defaults``), else the method's own default."""
    import argparse

    from megatron_ext.config import add_config_args
    from megatron_ext.methods import registry

    added = set()
    for method in registry.methods(family).values():
        if method.options is not None and method.options not in added:
            added.add(method.options)  # methods may share one options class
            add_config_args(p, method.options, flag_default=argparse.SUPPRESS)


def method_choices(family: str = "grad") -> Tuple[str, ...]:
    """The registered methods of ``family`` (what ``--methods`` accepts)."""
    from megatron_ext.methods import registry

    return registry.choices(family)


class MethodSettings:
    """The options each method runs with in a benchmark: given flags, then the method's
    benchmark defaults, then its own defaults (see :func:`add_method_args`).

    Args:
        args: the benchmark's parsed arguments (``model``, ``iters`` and the method options).
        family: the method family benchmarked.
    """

    def __init__(self, args: Any, family: str = "grad"):
        from megatron_ext.methods import registry

        self.args = args
        self.family = registry.family(family)
        self._methods = registry.methods(family)
        self._resolving: set = set()
        self._cache: Dict[str, Dict[str, Any]] = {}

    def _given(self, method: str) -> Dict[str, Any]:
        import dataclasses

        from megatron_ext.config import flag_of

        cls = self._methods[method].options
        out = {}
        for f in dataclasses.fields(cls):
            dest = flag_of(cls, f.name)[2:].replace("-", "_")
            if hasattr(self.args, dest):
                out[f.name] = getattr(self.args, dest)
        return out

    def options(self, method: str) -> Dict[str, Any]:
        """``{field: value}`` of the options ``method`` runs with (empty without options)."""
        from megatron_ext.methods.registry import BenchContext

        if method in self._cache:
            return self._cache[method]
        spec = self._methods[method]
        if spec.options is None:
            return {}
        values: Dict[str, Any] = {}
        if spec.bench_defaults is not None and method not in self._resolving:
            self._resolving.add(method)
            try:
                shapes = gpt_matrix_shapes(load_model_preset(self.args.model))
                bench = BenchContext(
                    iters=self.args.iters,
                    matrix_shapes=shapes,
                    resolve=lambda other, option: self.options(other).get(option),
                )
                values.update(spec.bench_defaults(bench))
            finally:
                self._resolving.discard(method)
        values.update(self._given(method))
        # Fill in the method's own defaults (and validate) through its dataclass.
        import dataclasses

        instance = spec.options(**values)
        self._cache[method] = {
            f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)
        }
        return self._cache[method]

    def flags(self, method: str) -> List[str]:
        """Driver flags selecting ``method`` with its options."""
        from megatron_ext.config import flag_of

        spec = self._methods[method]
        out = [self.family.flag, method]
        if spec.options is None:
            return out
        defaults = spec.options()
        for name, value in self.options(method).items():
            flag = flag_of(spec.options, name)
            default = getattr(defaults, name)
            if isinstance(value, bool):
                if value != default:
                    out.append(flag if value else "--no-" + flag[2:])
            elif value is None:
                continue
            elif isinstance(value, (list, tuple)):
                out += [flag] + [str(v) for v in value]
            else:
                out += [flag, str(value)]
        return out

    def label(self, method: str, extra_flags: Sequence[str] = ()) -> str:
        """Short name of the configured method, e.g. ``separate-16``, ``g-separate-16``
        (``--separate-adaptive`` among ``extra_flags``), ``powersgd-r14``."""
        import argparse

        from megatron_ext.config import add_args, config_from_args

        spec = self._methods[method]
        if spec.options is None:
            return spec.label(None)
        parser = add_args(argparse.ArgumentParser(allow_abbrev=False))
        ns, _ = parser.parse_known_args(self.flags(method) + list(extra_flags))
        return spec.label(config_from_args(spec.options, ns))


def add_machine_args(p: Any, *, quiet_wait: float, what: str) -> None:
    """``--quiet-wait`` and ``--priority``, shared by the benchmarks."""
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=quiet_wait,
        help=f"Before each {what} wait up to this many seconds for other processes to leave "
        f"the CPUs idle (0: do not wait; default {quiet_wait:g}).",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="Nice value for the benchmark's processes, applied to their autogroups too "
        "(e.g. -10 on a machine shared with other work; needs root). Default: unchanged.",
    )


# -- statistics and runs -------------------------------------------------------------------


def median(values: Sequence[float]) -> Optional[float]:
    """Median, ``None`` for an empty sequence."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def shell_join(argv: Sequence[str]) -> str:
    """A copy-pasteable command line."""
    import shlex

    return " ".join(shlex.quote(str(a)) for a in argv)


def run_logged(
    argv: Sequence[str],
    log_path: str,
    *,
    timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
    echo: bool = False,
    priority: Optional[int] = None,
) -> Tuple[int, float]:
    """Run ``argv`` with stdout and stderr in ``log_path``; returns (exit code, wall seconds).

    A timeout kills the process group and returns exit code 124. ``priority``: a nice
    value for the whole process tree (:class:`PriorityBooster`), e.g. -10 on a machine
    shared with other work; ``None`` leaves priorities alone.
    """
    import contextlib

    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(f"$ {shell_join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE if echo else log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            text=True,
        )
        booster = (
            PriorityBooster(proc.pid, priority)
            if priority is not None
            else contextlib.nullcontext()
        )
        with booster:
            try:
                if echo:
                    for line in proc.stdout:
                        log.write(line)
                        sys.stdout.write(line)
                        sys.stdout.flush()
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                import signal

                # SIGINT first: netbench then stops its ranks and removes its namespaces.
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                code = 124
    return code, time.time() - t0


def parse_list(text: str, kind=str) -> List[Any]:
    """``"a,b, c"`` -> ``["a", "b", "c"]`` converted with ``kind`` (floats like 1e6 to int)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if kind is int:
            out.append(int(float(part)))
        else:
            out.append(kind(part))
    return out
