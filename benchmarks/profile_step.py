"""Where a training step's time goes: torch.profiler over steady steps of the driver's Trainer.

What it does:
    Builds the production driver's :class:`~megatron_ext.train.Trainer` in this process
    (world size 1, the flags given after ``--``), runs ``--warmup`` steps, then profiles
    ``--steps`` steps with :mod:`torch.profiler` (CPU and CUDA activities) and prints:

    * wall time per step, and the device's busy time per step (the sum of kernel and copy
      times, which is what a step costs when the host keeps ahead of the device);
    * the ``--top`` operators by self device time, and by self host time;
    so that a method's own kernels (the projection's ``mm``, ``topk``, ``linalg_qr``,
      copies, many small element-wise launches) can be told from the model's.

    Everything is written to ``<out>/profile_<label>.txt`` (and a Chrome trace with
    ``--trace``).

Usage:
    python benchmarks/profile_step.py --label separate -- --model gpt2-345m --bf16 \\
        --no-masked-softmax-fusion --no-persist-layer-norm --micro-batch-size 8 \\
        --grad-compression separate

Constraints:
    Needs CUDA for device times (on CPU, ``--cpu`` in the driver flags, only host times).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: profile_step.py [options] -- DRIVER FLAGS", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="run")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--out", default="runs/profile")
    args = p.parse_args(argv[:cut])
    driver_flags = argv[cut + 1 :]

    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_ext.train import Trainer, parse_args

    iters = args.warmup + args.steps
    cfg = parse_args(
        ["--train-iters", str(iters + 1), "--lr-warmup-iters", "1", "--eval-iters", "0"]
        + driver_flags
    )
    trainer = Trainer(cfg)
    trainer.setup_distributed()
    trainer.build_data()
    trainer.build_model()
    trainer.build_optimizer()
    trainer.install_ext()
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    cuda = torch.cuda.is_available() and not cfg.training.cpu

    def step(it: int) -> None:
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        trainer.runtime.end_step(update_successful=ok)

    for it in range(args.warmup):
        step(it)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for it in range(args.warmup, iters):
            step(it)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    lines = [f"profile {args.label}: {' '.join(driver_flags)}"]
    lines.append(f"wall per step: {wall * 1e3:.1f} ms")
    if cuda:
        busy = sum(e.self_device_time_total for e in events) / 1e3 / args.steps
        lines.append(f"device busy per step (sum of self device times): {busy:.1f} ms")
        lines.append(
            events.table(
                sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60
            )
        )
    lines.append(
        events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60)
    )
    text = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{args.label}.txt"), "w") as f:
        f.write(text + "\n")
    if args.trace:
        prof.export_chrome_trace(os.path.join(args.out, f"trace_{args.label}.json"))
    print(text)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
