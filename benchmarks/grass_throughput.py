"""Grass throughput: backward and step time of the projected linear layers, dense vs Grass.

What it does:
    For each projected linear layer of a model preset (attention QKV and output, MLP fc1 and
    fc2, the default ``--grass-layers``; shapes from the preset as megatron-core builds them
    with TP=1), times on ``tokens`` tokens:

    * ``forward``: ``y = x W^T``;
    * ``backward``: dense autograd (``dX`` and the full ``dW``) vs Grass's backward
      (:func:`megatron_ext.autograd.grass.grass_linear`: ``dX`` and the ``r`` selected rows
      of ``dW``, one ``(r x tokens) x (tokens x n)`` matmul);
    * ``step``: AdamW on ``W`` (``m x n``) vs AdamW on the virtual parameter (``r x n``) plus
      Grass's row write-back into the frozen weight;

    for ``--grass-method none`` and each rank ``r``, and sums the layer times over the
    model's layers (each shape times ``num_layers``). The printed speedups are dense time /
    Grass time of the projected layers only: embeddings, attention, norms and the head are
    the same in both and are not timed here.

Usage:
    python benchmarks/grass_throughput.py [--model llama-1b] [--ranks 64,128,256]
        [--tokens 1024] [--repeats 5] [--out runs/bench-grass-throughput]

Constraints:
    CPU timing in one process (``torch.get_num_threads()`` threads); no Megatron needed. The
    weights of one layer at a time are allocated (1B shapes: at most 10922 x 2048 fp32).
    On a GPU (``--device cuda``) times are taken with ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    format_table,
    load_model_preset,
    parse_list,
    write_results,
)


def layer_shapes(preset: Dict[str, Any]) -> List[Tuple[str, int, int]]:
    """``(name, out, in)`` of each projected layer of one transformer layer (TP=1)."""
    h = preset["hidden_size"]
    heads = preset["num_attention_heads"]
    groups = preset.get("num_query_groups") if preset.get("group_query_attention") else None
    kv = (groups or heads) * (h // heads)
    ffn = preset.get("ffn_hidden_size") or 4 * h
    fc1_out = 2 * ffn if preset.get("swiglu") else ffn
    return [
        ("linear_qkv", h + 2 * kv, h),
        ("linear_proj", h, h),
        ("linear_fc1", fc1_out, h),
        ("linear_fc2", h, ffn),
    ]


def _timed(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_layer(
    m: int, n: int, tokens: int, rank: int, repeats: int, device: str, seed: int = 0
) -> Dict[str, float]:
    """Forward, backward and step seconds of one ``m x n`` layer (rank 0: dense)."""
    import torch

    from megatron_ext.autograd.grass import GrassLayer, grass_linear, projected_dim

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(tokens, m, generator=gen).to(device)
    weight = (torch.randn(m, n, generator=gen) * 0.02).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if rank == 0:
        w = torch.nn.Parameter(weight)
        opt = torch.optim.AdamW([w], lr=1e-4)

        def forward():
            return x.matmul(w.t())

        def step():
            opt.step()

        param = w
    else:
        mode, size = projected_dim((m, n))
        shape = (rank, n) if mode == "row" else (m, rank)
        param = torch.nn.Parameter(torch.zeros(shape, device=device))
        layer = GrassLayer(
            fqn="bench", weight=weight, param=param, mode=mode, rank=rank, method="topr",
            sketch_size=0, seed=seed,
        )  # fmt: skip
        index = torch.randperm(size, generator=gen)[:rank]
        layer.set_selection(index, torch.ones(rank), param.data)
        opt = torch.optim.AdamW([param], lr=1e-4)

        def forward():
            return grass_linear(x, weight, None, layer)

        def step():
            opt.step()
            layer.write_rows(param.data)

    fwd_s = _timed(lambda: forward(), repeats, sync)
    y = forward()

    def backward():
        x.grad = None
        param.grad = None
        y.backward(dy, retain_graph=True)

    bwd_s = _timed(backward, repeats, sync)
    step_s = _timed(step, repeats, sync)
    return {"forward_s": fwd_s, "backward_s": bwd_s, "step_s": step_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/grass_throughput.py",
        description="Backward and step time of the projected linear layers, dense vs Grass.",
    )
    p.add_argument("--model", default="llama-1b", help="Model preset (default llama-1b).")
    p.add_argument("--ranks", default="64,128,256", help="Grass ranks (default 64,128,256).")
    p.add_argument(
        "--tokens", type=int, default=1024, help="Tokens per micro-batch (default 1024)."
    )
    p.add_argument("--repeats", type=int, default=5, help="Timed calls per median (5).")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda.")
    p.add_argument("--out", default=None, help="Run directory (default runs/bench-...).")
    args = p.parse_args(argv)
    import torch

    preset = load_model_preset(args.model)
    shapes = layer_shapes(preset)
    num_layers = preset["num_layers"]
    ranks = [0] + [int(r) for r in parse_list(args.ranks)]
    results: List[Dict[str, Any]] = []
    totals: Dict[int, Dict[str, float]] = {}
    for rank in ranks:
        total = {"forward_s": 0.0, "backward_s": 0.0, "step_s": 0.0}
        for name, m, n in shapes:
            if rank > min(m, n):
                raise SystemExit(f"grass_throughput.py: rank {rank} exceeds {name} ({m} x {n})")
            t = measure_layer(m, n, args.tokens, rank, args.repeats, args.device)
            results.append({"layer": name, "out": m, "in": n, "rank": rank, **t})
            for key in total:
                total[key] += t[key] * num_layers
            label = "dense" if rank == 0 else f"r={rank}"
            print(
                f"{name:12s} {m:6d} x {n:6d} {label:6s}: forward {t['forward_s'] * 1e3:8.1f} ms "
                f"backward {t['backward_s'] * 1e3:8.1f} ms step {t['step_s'] * 1e3:8.1f} ms",
                flush=True,
            )
        totals[rank] = total
    dense = totals[0]
    rows = []
    for rank, total in totals.items():
        everything = sum(total.values())
        rows.append(
            [
                "none" if rank == 0 else f"grass r={rank}",
                f"{total['forward_s']:.3f}",
                f"{total['backward_s']:.3f}",
                f"{total['step_s']:.3f}",
                f"{everything:.3f}",
                f"{dense['backward_s'] / total['backward_s']:.2f}x",
                f"{sum(dense.values()) / everything:.2f}x",
            ]
        )
    print(
        f"\n{args.model}: {num_layers} layers x {len(shapes)} projected linear layers, "
        f"{args.tokens} tokens, {torch.get_num_threads()} threads, {args.device}; seconds "
        "summed over the model's projected layers"
    )
    header = ["method", "forward s", "backward s", "step s", "total s", "backward speedup",
              "fwd+bwd+step speedup"]  # fmt: skip
    print(format_table(header, rows))
    summary = [
        {"rank": rank, **total, "backward_speedup": dense["backward_s"] / total["backward_s"],
         "total_speedup": sum(dense.values()) / sum(total.values())}
        for rank, total in totals.items()
    ]  # fmt: skip
    path = write_results("grass_throughput", args, results, args.out, model_totals=summary)
    print(f"\nreport: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
