"""Grass memory: gradient and optimizer bytes of the projected weights, measured in megatron-core.

What it does:
    For each model preset, builds the model through the production driver in one process
    (CPU/gloo, world size 1), takes one training step (so Adam's state exists), and reads
    what megatron-core actually allocated: the DDP gradient buffers and every optimizer
    tensor (fp32 main copies where mixed precision keeps them, ``exp_avg``,
    ``exp_avg_sq``), for ``--grass-method none`` and for Grass at each rank. Bytes are
    split into the projected weights (the default ``--grass-layers``: attention QKV and
    output, MLP fc1 and fc2; with Grass their virtual parameters plus Grass's fp32 rows)
    and everything else. The ratio is compared with the paper's Table 1 (gradient ``m n ->
    r n`` and optimizer ``2 m n -> 2 r n`` per weight, ``r`` rows of the smaller
    dimension).

Usage:
    python benchmarks/grass_memory.py --models llama-60m,llama-350m --ranks 128,256
        [--bf16] [--out runs/bench-grass-memory]

Constraints:
    Builds full models on the CPU: llama-1b needs about 30 GB; the default presets fit the
    project machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, write_results  # noqa: E402


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def measure(model: str, method: str, rank: int, bf16: bool) -> Dict[str, Any]:
    """Build, step once, and count the bytes (see module docstring)."""
    import torch

    from megatron_ext.megatron.naming import global_param_names
    from megatron_ext.megatron.optimizer import MegatronOptimizerView
    from megatron_ext.state import StepClock
    from megatron_ext.train import Trainer, parse_args

    flags = ["--cpu", "--model", model, "--micro-batch-size", "1", "--global-batch-size", "1"]
    flags += ["--train-iters", "2", "--lr-warmup-iters", "1", "--eval-iters", "0"]
    flags += ["--vocab-size", "512", "--no-progress", "--log-interval", "1000"]
    flags += ["--split", "98,2,0", "--grass-method", method]
    if method != "none":
        flags += ["--grass-rank", str(rank), "--grass-sketch-size", "16"]
    if bf16:
        flags += ["--bf16"]
    trainer = Trainer(parse_args(flags))
    trainer.setup_distributed()
    trainer.build_data()
    trainer.build_model()
    trainer.build_optimizer()
    trainer.install_ext()
    iterator = trainer._iterator(trainer.train_ds, 0)
    t0 = time.time()
    trainer.train_step(0, 0, iterator)
    trainer.runtime.end_step()
    step_s = time.time() - t0
    chunk = trainer.model[0]
    names = global_param_names(chunk)
    hooks = trainer.runtime.components["linear"].optimizer_hooks
    layers = hooks[0].layers if hooks else {}
    from megatron_ext.config import DEFAULT_LINEAR_LAYERS

    pattern = re.compile(DEFAULT_LINEAR_LAYERS)

    def projected(fqn: str) -> bool:
        owner = fqn.rsplit(".", 1)[0]
        return bool(pattern.search(owner))

    grad = {"projected": 0, "other": 0}
    for buf in chunk.buffers:
        for p in buf.params:
            key = "projected" if projected(names[p]) else "other"
            grad[key] += p.numel() * buf.grad_data.element_size()
    opt = {"projected": 0, "other": 0}
    view = MegatronOptimizerView(trainer.optimizer, trainer.model, StepClock())
    for fqn in view.fqns():
        st = view.param_state(fqn)
        key = "projected" if projected(fqn) else "other"
        if st.main_param is not st.model_param:
            opt[key] += _bytes(st.main_param)
        opt[key] += sum(_bytes(v) for v in st.state.values() if torch.is_tensor(v) and v.dim())
    extra = sum(_bytes(layer.base) for layer in layers.values() if layer.base is not None)
    shapes = [
        tuple(param.shape)
        for param, fqn in names.items()
        if projected(fqn) and fqn.endswith(".weight")
    ]
    return {
        "model": model,
        "method": method,
        "rank": rank if method != "none" else None,
        "bf16": bf16,
        "grad_projected": grad["projected"],
        "grad_other": grad["other"],
        "optim_projected": opt["projected"],
        "optim_other": opt["other"],
        "grass_rows": extra,
        "projected_shapes": shapes,
        "step_s": step_s,
    }


def table1(shapes: List[tuple], rank: int) -> float:
    """Table 1's ratio of Grass to full-rank gradient + optimizer elements."""
    full = sum(3 * m * n for m, n in shapes)
    grass = sum(3 * rank * (n if m <= n else m) for m, n in shapes)
    return grass / full


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-60m,llama-350m")
    parser.add_argument("--ranks", default="128,256")
    parser.add_argument("--method", default="topr")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", default="runs/bench-grass-memory")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        model, method, rank = args.measure.split(",")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", WORLD_SIZE="1")
        os.environ.update(RANK="0", LOCAL_RANK="0")
        print(json.dumps(measure(model, method, int(rank), args.bf16)))
        return 0
    results = []
    for model in args.models.split(","):
        base = None
        for method, rank in [("none", 0)] + [(args.method, int(r)) for r in args.ranks.split(",")]:
            # one process per build: a fresh megatron-core (process groups, globals)
            cmd = [sys.executable, __file__, "--measure", f"{model},{method},{rank}"]
            cmd += ["--bf16"] if args.bf16 else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if method == "none":
                base = row
            else:
                dense = base["grad_projected"] + base["optim_projected"]
                ours = row["grad_projected"] + row["optim_projected"]
                row["measured_ratio"] = ours / dense
                row["measured_ratio_with_rows"] = (ours + row["grass_rows"]) / dense
                row["table1_ratio"] = table1(row["projected_shapes"], rank)
            results.append(row)
            print(f"{model} {method} r={rank}: done in {row['step_s']:.1f} s step", flush=True)
    mb = 1 / 2**20
    header = ["model", "method", "r", "grad proj MB", "optim proj MB", "fp32 rows MB"]
    header += ["other MB", "ratio", "Table 1", "ratio+rows"]
    rows = []
    for r in results:
        rows.append(
            [
                r["model"],
                r["method"],
                r["rank"] or "-",
                f"{r['grad_projected'] * mb:.1f}",
                f"{r['optim_projected'] * mb:.1f}",
                f"{r['grass_rows'] * mb:.1f}",
                f"{(r['grad_other'] + r['optim_other']) * mb:.1f}",
                f"{r.get('measured_ratio', 1.0):.4f}",
                f"{r.get('table1_ratio', 1.0):.4f}",
                f"{r.get('measured_ratio_with_rows', 1.0):.4f}",
            ]
        )
    print(format_table(header, rows))
    path = write_results("grass_memory", args, results, args.out)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
