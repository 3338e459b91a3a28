"""Interleaved CPU timing of the AQ-SGD buffer kernels and DiLoCo's outer-step kernels
against the chains they replaced, eager and compiled.

What it does:
    On a shared, loaded machine one configuration timed after another measures the load, not
    the code. Here the variants of one chain run in turn within every repetition (same
    process, same inputs, same moment), and each reports the median and the minimum of its
    wall and process-CPU milliseconds over ``--repeats`` repetitions after ``--warmup``:

    * ``aqsgd``: one revisited microbatch across a boundary, both sides' forward work for
      device buffers (``--numel`` activation elements as ``[k, seq, hidden]``, hidden
      ``--hidden``, seq at most 256; the buffer holds ``2k`` rows, every other one read): *chain* = what ran before the buffer kernels (``index_select`` of the
      rows, ``quant_pack``, ``aqsgd_decode_stage`` on each side, ``index_copy_`` of the
      staged rows at the commit); *fused* = ``aqsgd_encode_rows``, ``aqsgd_decode_rows``,
      ``aqsgd_commit_rows`` on each side (``megatron_ext/kernels/quant.py``);
    * ``outer``: DiLoCo's outer step of ``--numel`` fp32 values (Nesterov momentum, not the
      first step): *chain* = ``snap - current``, ``nonfinite``, ``outer_sgd_step``,
      ``nonfinite`` of its results; *fused* = ``pseudo_gradient``, ``outer_sgd_step_``
      (``megatron_ext/kernels/outer.py``);
    * ``copy``: ``dst.copy_(src)`` of the activation (the floor).

    *eager* runs the ops' pure functions as they are (``--fused-kernels off``), *compiled*
    by ``torch.compile`` (``on``; compiled during the warm-up, the compile time printed).

Usage:
    python benchmarks/kernels_ab.py --numel 1e6 --hidden 1024 --threads 1 --repeats 9

Constraints:
    CPU only; prints a table (no files). Timings are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_ext import kernels  # noqa: E402
from megatron_ext.kernels import quant as Q  # noqa: E402
from megatron_ext.kernels.finite import nonfinite  # noqa: E402
from megatron_ext.kernels.outer import outer_sgd_step_, pseudo_gradient  # noqa: E402
from megatron_ext.optim.diloco import outer_sgd_step  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _aqsgd(numel: int, hidden: int, dtype: torch.dtype) -> Dict[str, Callable[[], None]]:
    seq = min(256, max(1, numel // hidden))
    k = max(1, numel // (seq * hidden))
    gen = torch.Generator().manual_seed(0)
    send = torch.randn(2 * k, seq, hidden, generator=gen).to(dtype)
    recv = send.clone()
    index = torch.arange(0, 2 * k, 2)  # every other slot: a real gather
    x = (send[index].float() + 0.1 * torch.randn(k, seq, hidden, generator=gen)).to(dtype)
    src = x.clone()

    def chain():
        m = send.index_select(0, index)
        payload = Q.quant_pack(x, m, None, 4, "channel")
        staged_s, _, _, _ = Q.aqsgd_decode_stage(payload, m, 4, "channel", None)
        r = recv.index_select(0, index)
        staged_r, _, _, out = Q.aqsgd_decode_stage(payload, r, 4, "channel", dtype)
        send.index_copy_(0, index, staged_s)
        recv.index_copy_(0, index, staged_r)

    def fused():
        payload = Q.aqsgd_encode_rows(x, send, index, None, 4, "channel")
        Q.aqsgd_decode_rows(payload, recv, index, 4, "channel", dtype)
        Q.aqsgd_commit_rows(payload, send, index, 4, "channel")
        Q.aqsgd_commit_rows(payload, recv, index, 4, "channel")

    def copy():
        x.copy_(src)

    return {"copy": copy, "aqsgd chain": chain, "aqsgd fused": fused}


def _outer(numel: int) -> Dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(1)
    snap0, current, buf0 = (torch.randn(numel, generator=gen) for _ in range(3))
    snap, buf = snap0.clone(), buf0.clone()

    def chain():
        snap.copy_(snap0), buf.copy_(buf0)
        delta = snap - current
        nonfinite(delta).logical_not()
        outer_sgd_step(snap, buf, delta, lr=0.7, momentum=0.9, nesterov=True)
        bool(nonfinite(snap, buf).logical_not())

    def fused():
        snap.copy_(snap0), buf.copy_(buf0)
        delta, _ = pseudo_gradient(snap, current)
        bool(outer_sgd_step_(snap, buf, delta, 0.7, 0.9, True, False))

    def reset():
        snap.copy_(snap0), buf.copy_(buf0)

    # the two resets are timed in every variant; "outer reset" measures them alone
    return {"outer reset": reset, "outer chain": chain, "outer fused": fused}


def _time(fns: Dict[str, Callable[[], None]], warmup: int, repeats: int) -> Dict[str, tuple]:
    walls: Dict[str, List[float]] = {k: [] for k in fns}
    cpus: Dict[str, List[float]] = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                walls[name].append((t1 - t0) * 1e3)
                cpus[name].append((c1 - c0) * 1e3)
    return {
        k: (statistics.median(walls[k]), min(walls[k]), statistics.median(cpus[k]), min(cpus[k]))
        for k in fns
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=float, default=1e6, help="Elements (default 1e6).")
    p.add_argument("--hidden", type=int, default=1024, help="AQ-SGD hidden size (default 1024).")
    p.add_argument("--dtypes", default="fp32,bf16", help="AQ-SGD activation dtypes.")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = int(args.numel)
    print(f"numel {numel:.0e}, {args.threads} threads; ms: wall median / min, CPU median / min")
    print("| case | dtype | mode | wall median | wall min | CPU median | CPU min |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    cases = [(name, _DTYPES[name], None) for name in args.dtypes.split(",")]
    cases.append(("fp32", torch.float32, "outer"))
    for name, dtype, which in cases:
        for mode in ("off", "on"):
            kernels.set_mode(mode)
            fns = _outer(numel) if which else _aqsgd(numel, args.hidden, dtype)
            t = time.perf_counter()
            for fn in fns.values():
                fn()
            first = time.perf_counter() - t
            res = _time(fns, args.warmup, args.repeats)
            label = "eager" if mode == "off" else f"compiled (first call {first:.1f} s)"
            for case, (wm, wmin, cm, cmin) in res.items():
                print(
                    f"| {case} | {name} | {label} | {wm:.2f} | {wmin:.2f} | {cm:.2f} | {cmin:.2f} |"
                )
    kernels.set_mode(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
