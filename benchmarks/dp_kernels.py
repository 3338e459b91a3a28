"""Wall time of the DP reducers' fused kernels, eager against compiled, against a copy.

What it does:
    For one gradient bucket laid out as megatron-core lays out a transformer's (weight
    matrices with their biases and norms between them), times each kernel of
    ``megatron_ext/kernels/`` (SEPARATE's compress and decompress, PowerSGD's, Radius's) run
    eager (``--fused-kernels off``: the reducers' chain) and compiled (``on``:
    ``torch.compile``, C++ on the CPU, Triton on CUDA), and one device copy of the bucket
    (the floor every kernel is compared with). Reports the median of ``--repeats`` calls
    after a warm-up, in ms and as a multiple of the copy, and the first compiled call's
    time (the compile).

Why:
    The policy (``megatron_ext/kernels/__init__.py``) runs kernels eager on the CPU and
    compiled on accelerators; this measures what that choice costs or gains per kernel.

Usage:
    python benchmarks/dp_kernels.py                     # CPU, 1e7 elements, fp32 and bf16
    python benchmarks/dp_kernels.py --device cuda --numel 100000000

Constraints:
    Needs a C++ compiler (CPU) or triton (CUDA) for the compiled runs. Timings on a shared
    machine are noisy: compare eager and compiled from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_ext import kernels  # noqa: E402
from megatron_ext.kernels.packing import Runs  # noqa: E402
from megatron_ext.kernels.powersgd import powersgd_compress, powersgd_decompress  # noqa: E402
from megatron_ext.kernels.radius import radius_compress, radius_decompress  # noqa: E402
from megatron_ext.kernels.separate import separate_compress, separate_decompress  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` calls (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _layout(numel: int, hidden: int):
    """``(matrix starts, matrix numel, 1-D starts, total)``: square ``hidden`` matrices, each
    followed by a ``hidden`` bias, until ``numel`` elements."""
    starts, pos = [], 0
    while pos + hidden * hidden + hidden <= numel:
        starts.append(pos)
        pos += hidden * hidden + hidden
    return starts, hidden * hidden, pos


def _cases(grad: torch.Tensor, starts: List[int], n: int, args) -> Dict[str, Callable]:
    device = grad.device
    gen = torch.Generator(device=device).manual_seed(0)
    # SEPARATE: block 256, ratio 16, beta 1/16, a staged error
    runs = Runs.build(starts, [n] * len(starts), device)
    block, k = 256, 16
    rows = math.ceil(runs.total / block)
    error = torch.randn(rows, block, generator=gen, device=device)
    omega = torch.linalg.qr(torch.randn(block, k, generator=gen, device=device))[0] * 16.0
    sep = (runs.table, runs.chunk, runs.total, runs.starts, runs.offsets, runs.numels)
    p = torch.randn(rows, k, generator=gen, device=device)
    # The write-back region's (first, last, dst, src, lengths), separate_decompress's last five.
    region = dataclasses.astuple(runs.region(0, grad.numel()))
    # PowerSGD: every matrix one batch, rank 32 (SEPARATE-16's bytes at this shape)
    hidden = int(math.isqrt(n))
    batch, rank = len(starts), 32
    perr = torch.randn(runs.total, generator=gen, device=device)
    qs = [torch.randn(batch, hidden, rank, generator=gen, device=device)]
    dims = [batch, hidden, hidden]
    pgs = (runs.table, runs.chunk, runs.starts, runs.offsets, runs.numels, dims)
    ps = [torch.randn(batch, hidden, rank, generator=gen, device=device)]
    m = torch.randn(runs.total, generator=gen, device=device)
    # Radius: density 0.1 of the matrices, every 1-D entry
    residual = torch.randn(grad.numel(), generator=gen, device=device)
    selected = torch.rand(grad.numel(), generator=gen, device=device) < 0.1
    unselected = ~selected
    index = torch.nonzero(selected).view(-1)
    empty = torch.empty(0, dtype=torch.bool, device=device)
    values = torch.randn(index.numel(), generator=gen, device=device)
    out = grad.clone()
    return {
        "separate compress": lambda: separate_compress(grad, error, omega, *sep, 1 / 16, True),
        "separate decompress": lambda: separate_decompress(
            p, omega, out, runs.table, runs.chunk, 0, *region
        ),
        "powersgd compress": lambda: powersgd_compress(grad, perr, qs, *pgs),
        "powersgd decompress": lambda: powersgd_decompress(m, ps, qs, 0.125, True, out, *pgs),
        "radius compress": lambda: radius_compress(grad, residual, unselected, index, empty),
        "radius decompress": lambda: radius_decompress(out, unselected, index, values),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--numel", type=int, default=10_000_000, help="bucket elements")
    parser.add_argument("--hidden", type=int, default=1024, help="matrix side (default 1024)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls (default 7)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.numel <= 0 or args.repeats <= 0 or args.hidden <= 0:
        parser.error("--numel, --hidden and --repeats must be positive")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    why = kernels.fused_unavailable(device.type)
    if why:
        parser.error(f"--device {args.device}: {why}")
    starts, n, total = _layout(args.numel, args.hidden)
    if not starts:
        parser.error("--numel must hold at least one --hidden x --hidden matrix and its bias")
    print(
        f"# {device}, {torch.get_num_threads()} threads, bucket of {total} elements, torch {torch.__version__}"
    )
    print(
        "| kernel | dtype | copy ms | eager ms | compiled ms | eager / copy | compiled / copy | compile s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(total, device=device).to(dtype)
        dst = torch.empty_like(grad)
        copy = _time(lambda: dst.copy_(grad), device, args.repeats)
        for name, fn in _cases(grad, starts, n, args).items():
            kernels.set_mode("off")
            fn()
            eager = _time(fn, device, args.repeats)
            kernels.set_mode("on")
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            compile_s = time.perf_counter() - start
            compiled = _time(fn, device, args.repeats)
            kernels.set_mode(None)
            print(
                f"| {name} | {str(dtype)[6:]} | {copy:.2f} | {eager:.2f} | {compiled:.2f} | "
                f"{eager / copy:.1f} | {compiled / copy:.1f} | {compile_s:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
