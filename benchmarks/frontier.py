"""Quality against bytes (the frontier) and measured time to target, per method setting.

What it does:
    Trains gpt-tiny with 2 data-parallel ranks (CPU/gloo, one thread per rank) once per
    *point* (a method with one setting of its options), per batch size (``--batch-sizes``,
    global batch in sequences of 128 tokens) and, with ``--bandwidths``, per link rate
    inside ``megatron-ext netbench`` (needs root); without ``--bandwidths`` the runs use
    ``torchrun`` on loopback (losses do not depend on the link). Every run uses the same
    seed, hence the same initialisation and data order; the number of steps per batch size
    (``--iters GBS=N,...``) fixes the token budget of that batch size, the same for every
    setting. Learning rate 1e-3, cosine to 1e-4, warm-up 10% of the steps.

    Per run it records the loss curve, the final loss (mean of the last 10% of the
    iterations), the held-out loss at the end (``--eval-iters`` batches), the measured DP
    bytes per step, the measured per-step wall times and the gap to ``none`` at the same
    batch. ``megatron-ext report`` turns ``frontier.json`` into the frontier plot (loss
    against bytes, Pareto front), the measured time-to-target table (time until a run's
    trailing-mean loss reaches the dense run's milestones) and the front page
    (``megatron_ext/report_frontier.py``).

    Points: ``[family/]method[:option=v1,v2,...]...``; options are the method's option
    fields (``separate:ratio=2,4,8,16,32``, ``radius:density=0.1,0.4``,
    ``powersgd:approx_rank=7,14``, ``linear/topr:rank=64``, ``separate:ratio=16:blocks=layer``),
    several values give one point each (their product across options). The pseudo-option
    ``batch_div=n`` trains the point at 1/n of the batch for the same number of steps (a
    control: e.g. ``none:batch_div=16`` beside ``separate:ratio=16``).

    ``--time-limit BW=SECONDS`` stops runs at that rate after so many seconds (a dense run
    at 10 Mbit/s takes ~25 s a step); the milestones it did not reach then give a lower
    bound on its time.

Usage:
    python benchmarks/frontier.py --batch-sizes 8 --iters 8=300 \\
        --points none separate:ratio=2,4,8,16,32 powersgd:approx_rank=7,14,55 radius:density=0.1,0.4
    python benchmarks/frontier.py --batch-sizes 8 --iters 8=300 --bandwidths 1gbit,100mbit \\
        --points none powersgd:approx_rank=14 --time-limit 10mbit=600
    python benchmarks/frontier.py --quick       # smoke run: 6 steps, none and separate-16

Constraints:
    ``--bandwidths`` needs what netbench needs (Linux, root, iproute2, network namespaces).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from megatron_ext.report import summarize_curve  # noqa: E402

__all__ = ["Point", "parse_points", "point_label", "point_flags", "build_parser", "main"]

_FAMILIES = ("grad", "p2p", "linear", "subspace")


@dataclasses.dataclass(frozen=True)
class Point:
    """One method setting of the sweep."""

    family: str
    method: str
    options: Tuple[Tuple[str, Any], ...] = ()
    batch_div: int = 1


def _convert(cls: Any, name: str, text: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ValueError(f"unknown option {name!r} (options: {', '.join(sorted(fields))})")
    default = getattr(cls(), name)
    kinds = [type(default)] if default is not None else [int, float, str]
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected true/false, got {text!r}")
    for kind in kinds:
        try:
            return kind(text)
        except ValueError:
            continue
    raise ValueError(f"{name}: cannot read {text!r}")


def parse_points(specs: List[str]) -> List[Point]:
    """``["none", "separate:ratio=4,16"]`` -> points (see the module docstring).

    Raises:
        ValueError: an unknown family, method or option, or an unreadable value.
    """
    from megatron_ext.methods import registry

    points: List[Point] = []
    for spec in specs:
        head, *parts = spec.split(":")
        family, _, method = head.rpartition("/")
        family = family or "grad"
        if family not in _FAMILIES:
            raise ValueError(f"{spec}: unknown family {family!r} (choose from {_FAMILIES})")
        if method not in registry.choices(family):
            raise ValueError(
                f"{spec}: unknown {family} method {method!r} (choose from "
                f"{registry.choices(family)})"
            )
        cls = registry.get(family, method).options
        axes: List[List[Tuple[str, Any]]] = []
        divs = [1]
        for part in parts:
            name, sep, values = part.partition("=")
            if not sep or not values:
                raise ValueError(f"{spec}: expected option=value[,value...], got {part!r}")
            if name == "batch_div":
                divs = [int(v) for v in values.split(",")]
                if any(d < 1 for d in divs):
                    raise ValueError(f"{spec}: batch_div must be >= 1")
                continue
            if cls is None:
                raise ValueError(f"{spec}: {method} has no options")
            axes.append([(name, _convert(cls, name, v)) for v in values.split(",")])
        for combo in itertools.product(*axes) if axes else [()]:
            for div in divs:
                points.append(Point(family, method, tuple(combo), div))
    return points


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/frontier.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/frontier.py",
        description="Final loss against DP bytes per method setting and batch size; with "
        "--bandwidths, measured time to the dense run's loss milestones.",
    )
    p.add_argument(
        "--points",
        nargs="+",
        default=["none", "separate:ratio=4,16", "powersgd:approx_rank=14", "radius:density=0.4"],
        help="Method settings, [family/]method[:option=v1,v2...]... (see the docstring).",
    )
    p.add_argument("--batch-sizes", default="8", help="Global batch sizes in sequences (8).")
    p.add_argument(
        "--iters", default="8=300", help="Steps per batch size, GBS=N,... (fixes the tokens)."
    )
    p.add_argument(
        "--bandwidths",
        default=None,
        help="Link rates to train at inside netbench (e.g. 1gbit,100mbit,10mbit); default: "
        "loopback via torchrun.",
    )
    p.add_argument("--nproc", type=int, default=2, help="Data-parallel ranks (2).")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="Micro-batch size (default: min(8, GBS / nproc)).",
    )
    common.add_lr_schedule_args(p)
    p.add_argument("--eval-iters", type=int, default=4, help="Held-out batches at the end (4).")
    common.add_run_args(p, run_timeout=7200.0, time_limits=True)
    common.add_machine_args(p, quiet_wait=0.0, what="run")
    p.add_argument("--quick", action="store_true", help="Smoke run: 6 steps, 2 points.")
    p.add_argument("--out", default=None, help="Run directory (runs/bench-frontier-<time>).")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings_args(args: argparse.Namespace, point: Point) -> argparse.Namespace:
    """``args`` with the point's options under the driver's names (``separate_ratio``)."""
    from megatron_ext.config import flag_of
    from megatron_ext.methods import registry

    ns = copy.copy(args)
    cls = registry.get(point.family, point.method).options
    for name, value in point.options:
        setattr(ns, flag_of(cls, name)[2:].replace("-", "_"), value)
    return ns


def point_flags(args: argparse.Namespace, point: Point, iters: int) -> List[str]:
    """Driver flags selecting the point's method and options."""
    ns = _settings_args(args, point)
    ns.iters = iters
    return common.MethodSettings(ns, point.family).flags(point.method)


def _method_label(args: argparse.Namespace, point: Point, iters: int) -> str:
    ns = _settings_args(args, point)
    ns.iters = iters
    base = common.MethodSettings(ns, point.family).label(point.method)
    if point.family == "linear" and point.method != "none" and not base.startswith("grass"):
        base = f"grass-{base}"
    return base


def point_label(args: argparse.Namespace, point: Point, iters: int) -> str:
    """The method's label (``separate-16``); options it does not show are appended
    (``separate-16+seed=7``), and a batch control as ``@B/16``."""
    from megatron_ext.methods import registry

    base = _method_label(args, point, iters)
    defaults = (registry.get(point.family, point.method).options or object)()
    for i, (name, value) in enumerate(point.options):
        without = dataclasses.replace(point, options=point.options[:i] + point.options[i + 1 :])
        text = f"{value:g}" if isinstance(value, float) else str(value)
        if getattr(defaults, name, None) == value or text in re.split(r"-r?|\+", base):
            continue  # the method's default, or shown already
        if _method_label(args, without, iters) == base:  # the label does not show it
            base += f"+{name}={value:g}" if isinstance(value, float) else f"+{name}={value}"
    return base + (f"@B/{point.batch_div}" if point.batch_div > 1 else "")


def train_command(
    args: argparse.Namespace, point: Point, gbs: int, iters: int, run_dir: str
) -> List[str]:
    """The per-rank driver command of one run."""
    mbs = args.micro_batch_size or max(1, min(8, gbs // args.nproc))
    schedule = common.lr_schedule_flags(args, max(1, iters // 10))
    schedule += ["--eval-iters", str(args.eval_iters), "--log-interval", "1"]
    train = common.driver_command(args, run_dir, mbs, gbs, iters, schedule)
    return train + point_flags(args, point, iters) + common.extra_train_flags(args)


def run_one(
    args: argparse.Namespace,
    point: Point,
    gbs: int,
    iters: int,
    bandwidth: Optional[str],
    out_dir: str,
    seq_length: int,
) -> Dict[str, Any]:
    """Train one point at one batch size (and link rate); returns its record."""
    from benchmarks.step_time import netbench_command

    label = point_label(args, point, iters)
    run_gbs = gbs // point.batch_div
    name = f"b{gbs}-{label}" + (f"-{bandwidth}" if bandwidth else "")
    run_dir = common.fresh_run_dir(out_dir, name.replace("/", "_"))
    train = train_command(args, point, run_gbs, iters, run_dir)
    time_limit = common.time_limit(args, bandwidth or "")
    limit = args.run_timeout if time_limit is None else time_limit
    if bandwidth:
        cmd = netbench_command(
            args.nproc, 1, bandwidth, os.path.join(run_dir, "netbench.json"), limit, train
        )
        env = None
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
        cmd += [str(args.nproc), "--master-port", str(_free_port())] + train[1:]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.num_threads))
    timeout = limit + 120 if bandwidth else limit
    code, wall, contention = common.run_measured(args, cmd, run_dir, timeout, env)
    result: Dict[str, Any] = {
        "label": label,
        "family": point.family,
        "method": point.method,
        "options": dict(point.options),
        "batch_div": point.batch_div if point.batch_div > 1 else None,
        "global_batch_size": run_gbs,
        "batch_of": gbs,
        "tokens_per_step": gbs * seq_length,
        "run_tokens_per_step": run_gbs * seq_length,
        "iters": iters,
        "bandwidth": bandwidth,
        "time_limit_s": time_limit,
        "exit_code": code,
        "ok": code == 0,
        "wall_s": wall,
        "flags": point_flags(args, point, iters),
        "command": common.shell_join(["python" if c == sys.executable else c for c in cmd]),
        "run_dir": os.path.relpath(run_dir, out_dir),
        "contention": contention,
    }
    records = common.run_records(run_dir) or []
    if records:
        result.update(summarize_curve(records))
        complete = len(records) >= iters
        # A time-limited run that was stopped: a lower bound if unfinished, complete if
        # the limit hit only its final evaluation or shutdown.
        stopped = result["time_limit_s"] is not None and code != 0
        result["truncated"] = stopped and not complete
        result["ok"] = code == 0 or (stopped and complete)
        result["iterations_done"] = len(records)
    rep = common.run_json(run_dir, "comm_report.json")
    if rep is not None:
        result["final_valid_loss"] = rep.get("final_valid_loss")
    if code != 0 and not result.get("truncated"):
        result["error_tail"] = common.stdout_tail(run_dir)
    return result


def add_gaps(results: List[Dict[str, Any]]) -> None:
    """``gap_pct`` / ``valid_gap_pct`` against the complete ``none`` run of the same batch."""
    for r in results:
        base = next(
            (
                x
                for x in results
                if x["method"] == "none"
                and not x.get("batch_div")
                and x["tokens_per_step"] == r["tokens_per_step"]
                and x["ok"]
            ),
            None,
        )
        for key, gap in (("final_loss", "gap_pct"), ("final_valid_loss", "valid_gap_pct")):
            b, v = (base or {}).get(key), r.get(key)
            r[gap] = 100.0 * (v - b) / b if b and v is not None and r["ok"] else None


def print_table(results: List[Dict[str, Any]]) -> None:
    """One row per run."""
    rows = []
    for r in results:
        grad = (r.get("bytes_per_step_all_ranks") or {}).get("dp-grad") or {}
        status = "ok" if r["ok"] else ("stopped" if r.get("truncated") else "FAILED")
        rows.append(
            [
                r["tokens_per_step"],
                r.get("bandwidth") or "loopback",
                r["label"],
                status,
                r.get("final_loss"),
                r.get("gap_pct"),
                r.get("final_valid_loss"),
                r.get("valid_gap_pct"),
                grad.get("sent", 0.0) / 1e6 if grad else None,
                r.get("mean_step_s"),
                r["wall_s"],
            ]
        )
    print(
        common.format_table(
            [
                "tokens/step",
                "link",
                "setting",
                "status",
                "final loss",
                "gap %",
                "held-out",
                "held-out gap %",
                "DP MB/step",
                "step s",
                "wall s",
            ],
            rows,
        )
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.points = ["none", "separate:ratio=16"]
        args.batch_sizes, args.iters, args.eval_iters = "4", "4=6", 1
    try:
        points = parse_points(args.points)
        batches = common.parse_list(args.batch_sizes, int)
        iters = {int(k): v for k, v in common.parse_per(args.iters, "--iters", int).items()}
        common.parse_per(args.time_limit, "--time-limit")
    except ValueError as exc:
        print(f"frontier.py: error: {exc}")
        return 2
    missing = [b for b in batches if b not in iters]
    if missing:
        print(f"frontier.py: error: --iters gives no step count for batch size(s) {missing}")
        return 2
    bandwidths = common.parse_list(args.bandwidths) if args.bandwidths else [None]
    if args.bandwidths:
        from megatron_ext.netbench.netns import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason:
            print(f"frontier.py: error: --bandwidths needs megatron-ext netbench: {reason}")
            return 2
    seq = int(common.load_model_preset(args.model)["seq_length"])
    report = common.SweepReport("frontier", args)
    out, settings = report.out, report.settings
    settings["seq_length"] = seq
    settings["final_loss_definition"] = "mean of the logged training losses of the last 10%"
    plan = [
        (gbs, bw, p)
        for gbs in batches
        for bw in bandwidths
        for p in points
        if gbs % p.batch_div == 0 and (gbs // p.batch_div) % args.nproc == 0
    ]
    skipped = [
        (gbs, p) for gbs in batches for p in points if (gbs // p.batch_div) % args.nproc != 0
    ]
    for gbs, p in skipped:
        print(
            f"note: {p.method} at batch {gbs}/{p.batch_div} does not split over {args.nproc} ranks"
        )
    results: List[Dict[str, Any]] = []
    for i, (gbs, bw, p) in enumerate(plan):
        lab = point_label(args, p, iters[gbs])
        print(
            f"[{i + 1}/{len(plan)}] batch {gbs}, {bw or 'loopback'}, {lab}: {iters[gbs]} steps",
            flush=True,
        )
        res = run_one(args, p, gbs, iters[gbs], bw, out, seq)
        results.append(res)
        add_gaps(results)
        print(
            f"    -> {'ok' if res['ok'] else ('stopped' if res.get('truncated') else 'FAILED')}"
            f": final loss {res.get('final_loss') or float('nan'):.4f}, held-out "
            f"{res.get('final_valid_loss') or float('nan'):.4f}, wall {res['wall_s']:.0f} s",
            flush=True,
        )
        report.write(results)
    print()
    print_table(results)
    print(f"\nreport: {report.path}")
    return 0 if all(r["ok"] or r.get("truncated") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
