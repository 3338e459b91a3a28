"""Protocol Models' own compute: the codec, the optimizer correction, the Grassmann update.

What it does:
    At one model shape (default: the paper's 2B base model, ``d = 4096``, ``k = 40``, SwiGLU
    11008, a 1024-token microbatch, a 32,000-token vocabulary), times on this machine:

    * the codec per microbatch and direction: forward encode (``(X - T_fixed[ids]) U`` and
      packing the ids) and decode (``C U^T + T_fixed[ids]``), backward encode (``G U``, and
      with the subspace moving the ``A += G^T G`` accumulation) and decode (``G U U^T``);
    * the optimizer's extra work per transformer layer (``linear_proj`` ``d x d`` and
      ``linear_fc2`` ``d x ffn``): projecting the gradients, the first moment, the mean of
      the second moment along ``d`` and the recomputed AdamW step, against megatron's plain
      AdamW step on the same weights;
    * one Grassmann update (normalization, Riemannian step, QR) of ``d x d``.

    Prints a table and writes ``subspace_overhead.json``. What a pipeline saves is in
    ``benchmarks/step_time.py --family subspace``; this says what the method costs.

Usage:
    python benchmarks/subspace_overhead.py [--hidden-size 4096] [--rank 40] [--tokens 1024]

Constraints:
    One process, ``torch.get_num_threads()`` threads; ``--device cuda`` synchronizes around
    each timed call. No Megatron needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import default_out_dir, format_table, write_results  # noqa: E402


def _time(fn: Callable[[], Any], repeats: int, device: str) -> float:
    import torch

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The timed operations (seconds, median of ``args.repeats``)."""
    import torch

    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.collectives.subspace import SubspaceCodec
    from megatron_ext.compressors.subspace import Subspace, grassmann_step
    from megatron_ext.optim.subspace import SubspaceOptimizerHook
    from megatron_ext.protocols import OptimizerView, ParamOptimState

    d, k, dev = args.hidden_size, args.rank, args.device
    sub = Subspace(d, k, seed=0).to(dev)
    sub.make_fixed(args.vocab_size, 0.02, torch.float32, dev)
    fwd = P2PContext("forward", 0, None, 0, False)
    bwd = P2PContext("backward", 0, None, 0, False)
    shape = (args.tokens, 1, d)
    ids = torch.randint(0, args.vocab_size, shape[:2], device=dev)
    x = sub.fixed[ids] + torch.randn(*shape[:2], k, device=dev) @ sub.u.t()
    g = torch.randn(shape, device=dev)
    send, recv = SubspaceCodec(sub), SubspaceCodec(sub, sends_forward=False)
    moving = SubspaceCodec(sub, sends_forward=False, accumulate=True)

    def encode_fwd():
        send.push_token_ids(ids)
        return send.encode(x, fwd)

    payload = encode_fwd()
    gpay = recv.encode(g, bwd)
    out: List[Dict[str, Any]] = []
    rows = {
        "codec forward encode": lambda: encode_fwd(),
        "codec forward decode": lambda: recv.decode(payload, fwd, shape, torch.float32),
        "codec backward encode (fixed U)": lambda: recv.encode(g, bwd),
        "codec backward encode (+ A += G^T G)": lambda: moving.encode(g, bwd),
        "codec backward decode": lambda: recv.decode(gpay, bwd, shape, torch.float32),
    }
    for name, fn in rows.items():
        out.append({"operation": name, "per": "microbatch", "s": _time(fn, args.repeats, dev)})

    # One layer's constrained weights through megatron's AdamW, plain and corrected.
    ffn = args.ffn_hidden_size
    weights = {"linear_proj": (d, d), "linear_fc2": (d, ffn)}
    params = {n: torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for n, s in weights.items()}
    grads = {n: torch.randn(s, device=dev) * 1e-3 for n, s in weights.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, weight_decay=0.1)
    hook = SubspaceOptimizerHook(sub, {n: 0 for n in params}, update_interval=0,
                                 reproject_interval=0)  # fmt: skip

    class View(OptimizerView):
        def fqns(self):
            return list(params)

        def param_state(self, fqn):
            p = params[fqn]
            return ParamOptimState(fqn, p, p, opt.state.get(p, {}), None, opt.param_groups[0])

        @property
        def step(self):
            return 1

    view = View()

    def plain():
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()

    def corrected():
        for n, p in params.items():
            p.grad = grads[n].clone()
        hook.pre_step(view)
        opt.step()
        hook.post_step(view, True)

    out.append(
        {"operation": "AdamW step, one layer", "per": "step", "s": _time(plain, args.repeats, dev)}
    )
    out.append({"operation": "subspace AdamW step, one layer", "per": "step",
                "s": _time(corrected, args.repeats, dev)})  # fmt: skip
    a = torch.randn(d, d, device=dev)
    a = a @ a.t()
    out.append({"operation": "Grassmann update (d x d)", "per": "update",
                "s": _time(lambda: grassmann_step(sub.u, a, 0.1), max(1, args.repeats // 2), dev)})  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/subspace_overhead.py",
        description="Compute cost of Protocol Models' codec, optimizer and subspace update.",
    )
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--rank", type=int, default=40, help="k (default 40).")
    p.add_argument("--ffn-hidden-size", type=int, default=11008)
    p.add_argument("--tokens", type=int, default=1024, help="Tokens per microbatch (1024).")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5, help="Timed calls per median (5).")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda.")
    p.add_argument("--out", default=None, help="Run directory (default runs/bench-...).")
    args = p.parse_args(argv)
    import torch

    results = measure(args)
    print(
        f"d={args.hidden_size} k={args.rank} ffn={args.ffn_hidden_size}, {args.tokens} tokens a "
        f"microbatch, {torch.get_num_threads()} threads, {args.device}"
    )
    rows = [[r["operation"], r["per"], f"{r['s'] * 1e3:.2f}"] for r in results]
    print(format_table(["operation", "per", "ms"], rows))
    path = write_results(
        "subspace_overhead", args, results, args.out or default_out_dir("subspace_overhead")
    )
    print(f"\nreport: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
