"""Loss curves of each gradient-compression method against dense training, same seed and data.

What it does:
    Trains gpt-tiny with 2 data-parallel ranks (``torchrun``, CPU/gloo, one thread per rank,
    global batch 8) for ``--iters`` steps (default 300) on the driver's default data (the
    embedded corpus), once per method, sequentially, with the same seed, hence the same
    initialisation, data order and dropout masks; only the gradient reduction differs.
    Learning rate: 1e-3, cosine decay to 1e-4, 30 warm-up steps (``--lr*`` flags). Each
    iteration is logged (``--log-interval 1``), so the curves hold every step's loss, step
    time and bytes.

    Per run it reports the final loss, defined as the mean of the logged training losses
    of the last 10% of the iterations (``--final-fraction``; iterations 271-300 of 300),
    the gap to ``none`` in percent, the validation loss at the end (2 batches), the mean
    step time (unshaped loopback, not the bandwidth benchmark) and the bytes per step.

    Default methods: ``none``; ``separate`` (ratio 16, block 256); ``radius`` (density
    0.4, dense for the first 20% of the steps, reselection every 50); ``powersgd`` (the
    rank that sends about the bytes of SEPARATE-16 on gpt-tiny, 14, from step 30).

    With ``--family p2p`` (or ``subspace``, ``linear``) ``--grad-methods`` adds the data-parallel
    half: each method of ``--methods`` other than ``none`` runs once per gradient method
    listed (label ``<method>+<grad method>``), ``none`` runs with dense gradients only (the
    baseline), e.g. AQ-SGD with each data-parallel option at PP=2 x DP=2 (``--nproc 4``).

Usage:
    python benchmarks/convergence.py                       # 4 methods x 300 steps (~12 min)
    python benchmarks/convergence.py --quick               # smoke run: 20 steps, 2 methods
    python benchmarks/convergence.py --methods none,separate --iters 1000
    python benchmarks/convergence.py --family p2p --methods none,aqsgd --nproc 4 \
        --pipeline-model-parallel-size 2 --fixed-samples 256 \
        --grad-methods none,quantized,quantized-adam
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from megatron_ext.report import final_loss, summarize_curve  # noqa: E402,F401

__all__ = ["build_parser", "main", "final_loss", "summarize_curve", "method_flags", "label"]


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/convergence.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/convergence.py",
        description="Loss curves per gradient-compression method vs dense, DP=2 gpt-tiny.",
    )
    common.add_family_args(p, {"subspace": "needs pipeline stages"})
    p.add_argument(
        "--grad-methods",
        default=None,
        help="With a family other than grad: run each method of --methods other than none "
        "once per gradient method of this comma-separated list (none runs with dense "
        f"gradients only). Choices: {common.method_choices('grad')}.",
    )
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages (the p2p and subspace families need 2 or more; default 1).",
    )
    p.add_argument(
        "--fixed-samples",
        type=int,
        default=None,
        help="Fixed-sample mode: train in epochs over this many samples (aqsgd needs it).",
    )
    p.add_argument(
        "--finetune-from",
        default=None,
        help="Fine-tune: start every run from the model weights of this checkpoint "
        "directory (the driver's --load DIR --finetune).",
    )
    p.add_argument("--iters", type=int, default=300, help="Training iterations (300).")
    p.add_argument("--nproc", type=int, default=2, help="Data-parallel ranks (2).")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    common.add_lr_schedule_args(p)
    p.add_argument("--lr-decay-style", default="cosine")
    p.add_argument("--lr-warmup-iters", type=int, default=30)
    p.add_argument(
        "--final-fraction",
        type=float,
        default=0.1,
        help="Final loss = mean logged loss of the last this fraction of iterations (0.1).",
    )
    common.add_run_args(p, run_timeout=3600.0)
    common.add_machine_args(p, quiet_wait=120.0, what="run")
    p.add_argument(
        "--quick", action="store_true", help="Smoke run: 20 iterations, none and separate."
    )
    # Every method's options under the driver's names (--separate-ratio, --radius-density,
    # --aqsgd-fw-bits, ...); unset ones take the method's benchmark defaults (Radius: dense
    # for 20%% of the iterations, reselection every 50; PowerSGD: the rank sending
    # SEPARATE's bytes, start step 30), then its own defaults.
    common.add_method_args(p, "grad")
    common.add_method_args(p, "p2p")
    common.add_method_args(p, "linear")
    common.add_method_args(p, "subspace")
    p.add_argument(
        "--out", default=None, help="Run directory (default runs/bench-convergence-<time>)."
    )
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split(method: str) -> tuple:
    """``(method, grad method or None)`` of a run name ``method[+grad]``."""
    name, _, grad = method.partition("+")
    return name, (grad or None)


def method_flags(method: str, args: argparse.Namespace) -> List[str]:
    """Driver flags of ``method`` (``method+grad`` with a gradient method, see
    ``--grad-methods``) with this benchmark's options."""
    name, grad = _split(method)
    out = common.MethodSettings(args, args.family).flags(name)
    if grad is not None:
        out += common.MethodSettings(args, "grad").flags(grad)
    return out


def label(method: str, args: argparse.Namespace) -> str:
    """Short name of a configured method, e.g. ``separate-16``, ``g-separate-16`` (with
    ``--separate-adaptive`` among the extra driver flags), ``powersgd-r14``,
    ``aqsgd-fw4bw8+quantized-adam-4bit``."""
    name, grad = _split(method)
    extra = common.extra_train_flags(args)
    out = common.MethodSettings(args, args.family).label(name, extra)
    if grad is not None:
        out += "+" + common.MethodSettings(args, "grad").label(grad, extra)
    return out


def run_names(methods: List[str], grad_methods: Optional[List[str]]) -> List[str]:
    """The runs: ``methods``, or with ``grad_methods`` each non-none method paired with each
    gradient method (``method+grad``; ``+none`` left out) and ``none`` alone."""
    if not grad_methods:
        return list(methods)
    out = []
    for m in methods:
        if m == "none":
            out.append(m)
            continue
        out += [m if g == "none" else f"{m}+{g}" for g in grad_methods]
    return out


def train_command(args: argparse.Namespace, method: str, run_dir: str) -> List[str]:
    """``torchrun ... -m megatron_ext.train ...`` of one run."""
    schedule = common.lr_schedule_flags(args, args.lr_warmup_iters, args.lr_decay_style)
    train = common.driver_command(
        args,
        run_dir,
        args.micro_batch_size,
        args.global_batch_size,
        args.iters,
        schedule + ["--log-interval", "1"],
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    cmd += ["--master-port", str(_free_port())] + train[1:]
    if args.pipeline_model_parallel_size > 1:
        cmd += ["--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size)]
    if args.fixed_samples:
        cmd += ["--fixed-samples", str(args.fixed_samples)]
    if args.finetune_from:
        cmd += ["--load", args.finetune_from, "--finetune"]
    cmd += method_flags(method, args)
    cmd += common.extra_train_flags(args)
    return cmd


def run_one(args: argparse.Namespace, method: str, out_dir: str) -> Dict[str, Any]:
    """Train one method; returns its result record."""
    name = label(method, args)
    run_dir = common.fresh_run_dir(out_dir, name)
    cmd = train_command(args, method, run_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.num_threads))
    code, wall, contention = common.run_measured(args, cmd, run_dir, args.run_timeout, env)
    shown = ["torchrun"] + [
        "python" if c == sys.executable else c for c in cmd[3:] if c != "torch.distributed.run"
    ]
    base, grad = _split(method)
    result: Dict[str, Any] = {
        "method": base,
        "grad_method": grad,
        "label": name,
        "flags": method_flags(method, args),
        "exit_code": code,
        "ok": code == 0,
        "wall_s": wall,
        "command": common.shell_join(shown),
        "run_dir": os.path.relpath(run_dir, out_dir),
        "contention": contention,
    }
    records = common.run_records(run_dir)
    if records is not None:
        result.update(summarize_curve(records, args.final_fraction))
    rep = common.run_json(run_dir, "comm_report.json")
    if rep is not None:
        result["final_valid_loss"] = rep.get("final_valid_loss")
        result["driver_mean_step_time_s"] = rep.get("mean_step_time_s")
        result["comm_all_ranks_per_step"] = (rep.get("comm") or {}).get("all_ranks_per_step")
    if code != 0:
        result["error_tail"] = common.stdout_tail(run_dir)
    return result


def add_gaps(results: List[Dict[str, Any]]) -> None:
    """``gap_pct``: (final loss - final loss of none) / final loss of none, in percent."""
    base = next(
        (
            r.get("final_loss")
            for r in results
            if r["method"] == "none" and not r.get("grad_method")
        ),
        None,
    )
    for r in results:
        f = r.get("final_loss")
        r["gap_pct"] = 100.0 * (f - base) / base if base and f is not None else None
        bv = next(
            (
                x.get("final_valid_loss")
                for x in results
                if x["method"] == "none" and not x.get("grad_method")
            ),
            None,
        )
        v = r.get("final_valid_loss")
        r["valid_gap_pct"] = 100.0 * (v - bv) / bv if bv and v is not None else None


def print_table(results: List[Dict[str, Any]], iters: int, fraction: float) -> None:
    """Final loss, gap to ``none``, step time and bytes per method."""
    rows = []
    for r in results:
        grad = (r.get("bytes_per_step_all_ranks") or {}).get("dp-grad") or {}
        rows.append(
            [
                r["label"],
                "ok" if r["ok"] else f"FAILED ({r['exit_code']})",
                r.get("final_loss"),
                r.get("gap_pct"),
                r.get("final_valid_loss"),
                r.get("mean_step_s"),
                grad.get("sent", 0.0) / 1e6 if grad else None,
                grad["dense_sent"] / grad["sent"] if grad.get("sent") else None,
                r.get("wall_s"),
            ]
        )
    n = max(1, int(round(fraction * iters)))
    print(f"final loss = mean training loss of iterations {iters - n + 1}-{iters}; gap vs none")
    print(
        common.format_table(
            [
                "method",
                "status",
                "final loss",
                "gap %",
                "valid loss",
                "step s (unshaped)",
                "dp-grad MB/step (mean)",
                "ratio",
                "wall s",
            ],
            rows,
        )
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.quick:
        defaults = build_parser().parse_args([])
        if args.methods is None:
            args.methods = {
                "grad": "none,separate",
                "p2p": "none,aqsgd",
                "subspace": "none,protocol",
            }.get(args.family, "none,topr")
        if args.iters == defaults.iters:
            args.iters = 20
        if args.lr_warmup_iters == defaults.lr_warmup_iters:
            args.lr_warmup_iters = 2
        if not hasattr(args, "powersgd_start_step"):
            args.powersgd_start_step = 2
        if args.quiet_wait == defaults.quiet_wait:
            args.quiet_wait = 0.0
    methods = common.family_methods(args, "convergence.py")
    if methods is None:
        return 2
    grad_methods = common.parse_list(args.grad_methods) if args.grad_methods else None
    if grad_methods:
        if args.family == "grad":
            print("convergence.py: error: --grad-methods needs --family p2p, linear or subspace")
            return 2
        if not common.check_methods(grad_methods, "grad", "convergence.py"):
            return 2
    if "none" not in methods:
        print("convergence.py: note: without 'none' there is no baseline for the gap")
    report = common.SweepReport("convergence", args)
    out, settings = report.out, report.settings
    chosen = common.MethodSettings(args, args.family)
    settings["method_options"] = {m: chosen.options(m) for m in methods}
    if grad_methods:
        grad_chosen = common.MethodSettings(args, "grad")
        settings["grad_method_options"] = {g: grad_chosen.options(g) for g in grad_methods}
    methods = run_names(methods, grad_methods)
    settings["final_loss_definition"] = (
        f"mean of the logged training losses (one per iteration) of the last "
        f"{args.final_fraction:.0%} of the iterations"
    )
    results: List[Dict[str, Any]] = []
    for i, m in enumerate(methods):
        print(f"[{i + 1}/{len(methods)}] {label(m, args)}: {args.iters} iterations ...", flush=True)
        res = run_one(args, m, out)
        results.append(res)
        add_gaps(results)
        print(
            f"    -> {'ok' if res['ok'] else 'FAILED'}: final loss "
            f"{res.get('final_loss') or float('nan'):.4f}, wall {res['wall_s']:.0f} s, other "
            f"processes {100 * ((res.get('contention') or {}).get('foreign_cpu_share') or 0):.0f}%"
            " CPU",
            flush=True,
        )
        report.write(results)
    print()
    print_table(results, args.iters, args.final_fraction)
    print(f"\nreport: {report.path}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
