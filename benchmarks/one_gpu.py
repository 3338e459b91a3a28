"""One-GPU training through the driver: tokens/s, peak memory, each method's per-step overhead.

What it does:
    For one model preset (default ``gpt2-345m``) it runs the training driver
    (``python -m megatron_ext.train --model M --bf16 ...``) once per method on one GPU (world
    size 1: NCCL, no peer; a data-parallel compressor still compresses and decompresses every
    bucket each step, the all-reduce of its payload is a no-op), with ``--log-interval 1`` so
    that ``log.jsonl`` holds every step's time. From each run it takes:

    * the median step time over the steps after ``--skip`` (first steps: allocation, cuBLAS
      heuristics, and the methods' dense warm-up / selection steps, which are excluded on
      purpose: they are not the steady state the overhead target is about);
    * tokens/s = global batch x sequence length / that median;
    * peak GPU memory (``torch.cuda.max_memory_allocated``, the driver's summary);
    * the overhead against ``none``: (median - median of none) / median of none;
    * the last logged loss (finite, as a sanity check, not a quality figure).

    Methods (``--methods``): ``none``; the data-parallel compressors ``separate`` (ratio 16,
    block 256), ``powersgd`` (the rank that sends about SEPARATE-16's bytes on this model,
    compressing from step 2), ``radius`` (density 0.1, 2 dense steps, reselection every 1000
    steps), ``quantized`` (its default bits), ``quantized-adam`` (dense warm-up ending 2 steps before
    the measured ones: too short for quality, its loss rises);
    ``grass`` (``--grass-method topr --grass-rank R``, reselection every 1000 steps);
    ``diloco`` (one site, the outer step every 4 iterations: its iterations' median is
    reported apart as ``outer_step_ms``, the others' as the step). Pipeline
    codecs (AQ-SGD, Protocol Models) need 2 stages and so 2 GPUs; their kernel cost is in
    ``benchmarks/kernels.py``.

Usage:
    python benchmarks/one_gpu.py --model gpt2-345m --iters 30
    python benchmarks/one_gpu.py --model llama-1b --methods none,grass --grass-rank 256 \\
        --micro-batch-size 16
    python benchmarks/one_gpu.py --cpu --model gpt-tiny --iters 6 --skip 2   # smoke (CPU)

Output:
    ``<out>/one_gpu.json`` (see :mod:`benchmarks.common`), each run's log under
    ``<out>/<method>/``, and a table on stdout.

Constraints:
    Needs CUDA (or ``--cpu`` for a smoke run; CPU figures are not GPU figures). One process,
    one GPU; a run that fails is reported with its return code and the tail of its log, and
    the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

__all__ = ["build_parser", "main", "method_flags"]

METHODS = (
    "none",
    "separate",
    "powersgd",
    "radius",
    "quantized",
    "quantized-adam",
    "grass",
    "diloco",
)
# DiLoCo's outer step every this many iterations (one site at world size 1).
DILOCO_INTERVAL = 4


def method_flags(method: str, args: Any) -> List[str]:
    """Driver flags selecting ``method`` as this benchmark runs it."""
    if method == "none":
        return []
    if method == "separate":
        return ["--grad-compression", "separate", "--separate-ratio", "16"]
    if method == "powersgd":
        preset = dict(common.load_model_preset(args.model))
        preset.setdefault("vocab_size", 8192)  # the driver's default (--vocab-size)
        rank = common.equal_bytes_rank_for_shapes(common.gpt_matrix_shapes(preset), 16)
        return [
            "--grad-compression",
            "powersgd",
            "--powersgd-approx-rank",
            str(rank),
            "--powersgd-start-step",
            "2",
        ]
    if method == "radius":
        return [
            "--grad-compression",
            "radius",
            "--radius-density",
            "0.1",
            "--radius-dense-steps",
            "2",
            "--radius-interval",
            "1000",
        ]
    if method == "quantized":
        return ["--grad-compression", "quantized"]
    if method == "quantized-adam":
        # Dense warm-up ending before the measured steps (too short for quality: with the
        # variance frozen this early the loss rises; the step time is what is measured).
        warmup = max(1, args.skip - 2)
        return [
            "--grad-compression",
            "quantized-adam",
            "--quantized-adam-warmup-steps",
            str(warmup),
        ]
    if method == "grass":
        return [
            "--grass-method",
            "topr",
            "--grass-rank",
            str(args.grass_rank),
            "--grass-update-interval",
            "1000",
        ]
    if method == "diloco":
        return ["--outer-method", "diloco", "--outer-groups", "1"] + [
            "--outer-interval",
            str(DILOCO_INTERVAL),
        ]
    raise ValueError(f"--methods: unknown method {method!r} (choose from {', '.join(METHODS)})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-345m", help="Model preset (default gpt2-345m).")
    p.add_argument("--methods", default=",".join(METHODS), help="Comma-separated methods.")
    p.add_argument("--iters", type=int, default=30, help="Training iterations per run.")
    p.add_argument("--skip", type=int, default=8, help="Steps left out of the median.")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--grass-rank", type=int, default=256)
    p.add_argument("--no-bf16", action="store_true", help="fp32 instead of --bf16.")
    p.add_argument("--cpu", action="store_true", help="Smoke run on CPU (not a GPU figure).")
    p.add_argument(
        "--extra",
        default="",
        help="Extra driver flags for every run (one string, split on spaces).",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds per run.")
    p.add_argument("--out", default=None, help="Run directory (default runs/bench-one-gpu-<time>).")
    return p


def _driver_argv(args: Any, method: str, run_dir: str) -> List[str]:
    argv = [sys.executable, "-m", "megatron_ext.train", "--model", args.model]
    argv += ["--train-iters", str(args.iters), "--lr-warmup-iters", "1", "--eval-iters", "0"]
    argv += ["--log-interval", "1", "--micro-batch-size", str(args.micro_batch_size)]
    if args.global_batch_size:
        argv += ["--global-batch-size", str(args.global_batch_size)]
    argv += ["--log-json", os.path.join(run_dir, "log.jsonl")]
    argv += ["--comm-report", os.path.join(run_dir, "summary.json")]
    if args.cpu:
        argv.append("--cpu")
    elif not args.no_bf16:
        argv.append("--bf16")
    argv += method_flags(method, args)
    argv += [x for x in args.extra.split() if x]
    return argv


def run_one(args: Any, method: str, out_dir: str) -> Dict[str, Any]:
    """Run the driver for ``method``; the row of the table (with ``error`` on failure)."""
    run_dir = os.path.join(out_dir, method)
    os.makedirs(run_dir, exist_ok=True)
    argv = _driver_argv(args, method, run_dir)
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    t0 = time.time()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        try:
            rc = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    row: Dict[str, Any] = {"method": method, "flags": argv[3:], "rc": rc}
    row["wall_s"] = time.time() - t0
    if rc != 0:
        with open(os.path.join(run_dir, "stdout.log")) as f:
            row["error"] = f.read()[-3000:]
        return row
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    records = []
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steady = [r["step_time_s"] for r in records if r["iteration"] > args.skip]
    outer = None
    if method == "diloco":
        # The outer step lands in the iterations that are multiples of the interval: report
        # their median apart, the median of the others is the inner step.
        at = [r["iteration"] > args.skip and r["iteration"] % DILOCO_INTERVAL == 0 for r in records]
        outer = common.median([r["step_time_s"] for r, a in zip(records, at) if a])
        steady = [
            r["step_time_s"] for r, a in zip(records, at) if r["iteration"] > args.skip and not a
        ]
    step = common.median(steady)
    tokens = summary["layout"]["gbs"] * common.load_model_preset(args.model)["seq_length"]
    row.update(
        step_ms=None if step is None else step * 1000,
        steady_steps=len(steady),
        tokens_per_s=None if not step else tokens / step,
        peak_gib=(summary.get("peak_memory") or {}).get("max_allocated_gib"),
        reserved_gib=(summary.get("peak_memory") or {}).get("max_reserved_gib"),
        final_loss=summary.get("final_lm_loss"),
        gbs=summary["layout"]["gbs"],
    )
    if outer is not None:
        row["outer_step_ms"] = outer * 1000
    return row


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    methods = common.parse_list(args.methods)
    for m in methods:
        method_flags(m, args)  # unknown names fail before any run
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("one_gpu.py: no CUDA device (use --cpu for a smoke run)", file=sys.stderr)
            return 2
    out_dir = args.out or common.default_out_dir("bench-one-gpu")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for m in methods:
        row = run_one(args, m, out_dir)
        rows.append(row)
        status = "ok" if row["rc"] == 0 else f"FAILED rc={row['rc']}"
        step = f", median step {row['step_ms']:.1f} ms" if row.get("step_ms") else ""
        print(f"[one_gpu] {args.model} {m}: {status} ({row['wall_s']:.0f} s{step})", flush=True)
        if row["rc"] != 0:
            print(row["error"][-1500:], flush=True)
    base = next((r for r in rows if r["method"] == "none" and r.get("step_ms")), None)
    for r in rows:
        if base and r.get("step_ms"):
            r["overhead_pct"] = 100.0 * (r["step_ms"] - base["step_ms"]) / base["step_ms"]
    path = common.write_results("one_gpu", args, rows, out_dir)
    keys = ("method", "step_ms", "overhead_pct", "tokens_per_s", "peak_gib", "final_loss", "rc")
    heads = ("method", "step ms", "overhead %", "tokens/s", "peak GiB", "loss", "rc")
    if any("outer_step_ms" in r for r in rows):
        keys, heads = keys + ("outer_step_ms",), heads + ("outer step ms",)
    print(f"{args.model}, {'CPU (smoke)' if args.cpu else 'one GPU'}, {args.iters} iterations:")
    print(common.format_table(heads, [[r.get(k) for k in keys] for r in rows], digits=2))
    print(f"report: {path}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
