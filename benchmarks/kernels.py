"""Compression kernel cost per element: SEPARATE vs PowerSGD at equal bytes vs a memory copy.

What it does:
    For each tensor size (default 1e5, 1e6, 1e7, 1e8 fp32 elements), each torch thread
    count (default 1 and 2) and each device (CPU, and CUDA when available) it times, with
    the functions of our package and no process group (the all-reduce is left out: the
    "averaged" payload is the local one, which has the same shape):

    * **SEPARATE** (:mod:`megatron_ext.collectives.separate`, ratio 16, block sizes
      64/128/256/512/1024), as ``SeparateReducer.launch`` / ``_decompress`` do per bucket:
      *compress* = pack the gradient into ``rows x block`` (copy), ``h = work + e``,
      ``P = project(h, Omega)``, local estimate ``reconstruct(P, Omega)``,
      ``update_error(e, h, estimate, beta=1/ratio)``, zero the padding of ``e``;
      *decompress* = ``reconstruct(P_avg, Omega)`` and the copy back into the gradient.
      The per-step generation of ``Omega`` (``projection_block``: a seeded ``c x k``
      Gaussian and its float64 QR, independent of the tensor size) is timed separately and
      reported as ``omega_ms``, not in the per-element numbers.
    * **PowerSGD** (:mod:`megatron_ext.collectives.powersgd`) on the same number of
      elements as a square-ish ``n x m`` matrix at the rank that sends about the same bytes
      as SEPARATE at that ratio (``r = n m / (ratio (n + m))``, rounded, at least 1):
      *compress* = ``M = G + E``, ``P = M Q``, ``orthogonalize(P)`` (QR), ``Q = M^T P``
      (everything before the second all-reduce); *decompress* = ``M_hat = P Q^T``,
      ``E = M - M_hat``, the copy into the gradient and keeping ``Q`` as the warm start.
    * **copy**: ``dst.copy_(src)`` of the same fp32 tensor, the memory-bandwidth floor,
      reported as ns/element and GB/s (tensor bytes / time; the memory traffic is twice
      that: one read and one write).

    Each number is the median of ``--repeats`` timed repetitions after ``--warmup``
    untimed ones (CUDA: synchronised around each phase).

Usage:
    python benchmarks/kernels.py                       # full sizes, threads 1 and 2
    python benchmarks/kernels.py --quick               # smoke run (seconds)
    python benchmarks/kernels.py --sizes 1e6 --block-sizes 256 --threads 1

Output:
    ``<out>/kernels.json`` (see :mod:`benchmarks.common`) and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    CpuMonitor,
    add_machine_args,
    default_out_dir,
    environment,
    equal_bytes_rank,
    format_table,
    make_report,
    median,
    parse_list,
    set_priority,
    squareish_shape,
    wait_for_quiet,
    write_report,
)

__all__ = ["build_parser", "main", "time_separate", "time_powersgd", "time_copy"]

DEFAULT_SIZES = (100_000, 1_000_000, 10_000_000, 100_000_000)
DEFAULT_BLOCK_SIZES = (64, 128, 256, 512, 1024)
QUICK_SIZES = (10_000, 100_000)
QUICK_BLOCK_SIZES = (64, 256)

# Peak resident bytes per element (fp32 tensors alive at once), for the memory check:
# SEPARATE: grad, work, error, P-sized (small), estimate, h - estimate, reconstruction;
# PowerSGD: grad, error, M, M_hat, M - M_hat.
_BYTES_PER_ELEMENT = 4 * 7


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/kernels.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/kernels.py",
        description="Compress + decompress time per element: SEPARATE (block sizes) vs "
        "PowerSGD at equal bytes vs a memory copy.",
    )
    p.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="Comma-separated tensor sizes in elements (default 1e5,1e6,1e7,1e8; sizes that "
        "do not fit in memory are skipped and reported).",
    )
    p.add_argument(
        "--block-sizes",
        default=",".join(str(b) for b in DEFAULT_BLOCK_SIZES),
        help="SEPARATE block sizes (default 64,128,256,512,1024).",
    )
    p.add_argument("--ratio", type=int, default=16, help="Compression ratio (default 16).")
    p.add_argument(
        "--threads",
        default="1,2",
        help="torch.set_num_threads values, comma-separated (default 1,2: 1 matches one "
        "thread per rank of the step-time benchmark).",
    )
    p.add_argument("--repeats", type=int, default=7, help="Timed repetitions (default 7).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed repetitions (default 2).")
    p.add_argument(
        "--devices",
        default="auto",
        help="cpu, cuda or auto (cpu, plus cuda when torch.cuda.is_available()).",
    )
    p.add_argument("--no-powersgd", action="store_true", help="Skip PowerSGD.")
    # Each result records the CPU share other processes used while it was measured.
    add_machine_args(p, quiet_wait=60.0, what="size")
    p.add_argument(
        "--quick",
        action="store_true",
        help="Smoke run: sizes 1e4,1e5, block sizes 64,256, threads 1, 2 repeats "
        "(explicit --sizes/--block-sizes still win).",
    )
    p.add_argument("--out", default=None, help="Run directory (default runs/bench-kernels-<time>).")
    return p


# -- timing --------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_phases(
    phases: List[Callable[[Any], Any]], device, warmup: int, repeats: int
) -> Tuple[List[List[float]], List[List[float]]]:
    """Run the chained ``phases`` (each gets the previous result); time each phase.

    Returns:
        (wall seconds, process CPU seconds), each a list per phase of the timed repetitions.
        With one thread and no other process on the CPU the two agree; CPU time is less
        sensitive to other processes (it excludes time the process waited for a CPU).
    """
    walls: List[List[float]] = [[] for _ in phases]
    cpus: List[List[float]] = [[] for _ in phases]
    for i in range(warmup + repeats):
        value = None
        for j, phase in enumerate(phases):
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            value = phase(value)
            _sync(device)
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                walls[j].append(t1 - t0)
                cpus[j].append(c1 - c0)
    return walls, cpus


def _phase_stats(walls: List[List[float]], cpus: List[List[float]]) -> Dict[str, Any]:
    t_c, t_d = walls if len(walls) == 2 else (walls[0], [0.0] * len(walls[0]))
    c_c, c_d = cpus if len(cpus) == 2 else (cpus[0], [0.0] * len(cpus[0]))
    return {
        "compress_s": median(t_c),
        "decompress_s": median(t_d),
        "total_s": median([a + b for a, b in zip(t_c, t_d)]),
        "cpu_total_s": median([a + b for a, b in zip(c_c, c_d)]),
        "compress_samples_s": t_c,
        "decompress_samples_s": t_d,
    }


def time_separate(
    numel: int, block_size: int, ratio: int, device, warmup: int, repeats: int
) -> Dict[str, Any]:
    """Time SEPARATE's local math on ``numel`` elements (see the module docstring)."""
    import torch

    from megatron_ext.compressors.separate import (
        project,
        projection_block,
        reconstruct,
        update_error,
    )

    k = block_size // ratio
    rows = math.ceil(numel / block_size)
    beta = 1.0 / ratio
    gen = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(numel, generator=gen).to(device)
    work = torch.zeros(rows, block_size, device=device)
    error = (0.01 * torch.randn(rows, block_size, generator=gen)).to(device)
    error.view(-1)[numel:].zero_()
    # The reconstruction goes to a separate buffer of the gradient's size (same memory
    # traffic as the reducer's write-back, but the input stays the same every repetition).
    out = torch.empty_like(grad)
    omega_times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        omega = projection_block(42, i, "bench", block_size, k, device=device)
        _sync(device)
        if i >= warmup:
            omega_times.append(time.perf_counter() - t0)

    def compress(_):
        flat = work.view(-1)
        flat[:numel].copy_(grad)
        h = work.add_(error)
        p = project(h, omega)
        update_error(error, h, reconstruct(p, omega), beta, reset=False)
        error.view(-1)[numel:].zero_()
        return p

    def decompress(p_avg):
        recon = reconstruct(p_avg, omega).view(-1)
        out.copy_(recon[:numel])

    stats = _phase_stats(*_timed_phases([compress, decompress], device, warmup, repeats))
    return {
        "method": "separate",
        "block_size": block_size,
        "num_projections": k,
        "rows": rows,
        "payload_elements": rows * k,
        "omega_ms": 1e3 * median(omega_times),
        **stats,
    }


def time_powersgd(numel: int, ratio: int, device, warmup: int, repeats: int) -> Dict[str, Any]:
    """Time PowerSGD's local math on a square-ish matrix of ``numel`` elements."""
    import torch

    from megatron_ext.compressors.lowrank import orthogonalize

    n, m = squareish_shape(numel)
    r = equal_bytes_rank(n, m, ratio)
    gen = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(numel, generator=gen).to(device)
    error = (0.01 * torch.randn(n, m, generator=gen)).to(device)
    out = torch.empty_like(grad)
    state = {"q": orthogonalize(torch.randn(m, r, generator=gen)).to(device)}

    def compress(_):
        mat = grad.view(n, m).float() + error
        p = mat @ state["q"]
        # (first all-reduce of P here)
        p = orthogonalize(p)
        q = mat.t() @ p
        return mat, p, q

    def decompress(value):
        mat, p, q_avg = value
        # (second all-reduce of Q here)
        approx = p @ q_avg.t()
        error.copy_(mat - approx)
        out.view(n, m).copy_(approx)
        state["q"] = q_avg.clone()

    stats = _phase_stats(*_timed_phases([compress, decompress], device, warmup, repeats))
    return {
        "method": "powersgd",
        "shape": [n, m],
        "approx_rank": r,
        "payload_elements": (n + m) * r,
        **stats,
    }


def time_copy(numel: int, device, warmup: int, repeats: int) -> Dict[str, Any]:
    """Time ``dst.copy_(src)`` of ``numel`` fp32 elements (the memory-bandwidth floor)."""
    import torch

    src = torch.randn(numel).to(device)
    dst = torch.empty_like(src)
    stats = _phase_stats(*_timed_phases([lambda _: dst.copy_(src)], device, warmup, repeats))
    return {
        "method": "copy",
        "payload_elements": numel,
        "gb_per_s": numel * 4 / stats["total_s"] / 1e9,
        **stats,
    }


# -- driver --------------------------------------------------------------------------------


def _available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fits(numel: int, device) -> Tuple[bool, str]:
    import torch

    need = numel * _BYTES_PER_ELEMENT
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        have = free
    else:
        have = _available_bytes()
    if have is not None and need > 0.8 * have:
        return False, f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"
    return True, ""


def _devices(spec: str) -> List[str]:
    import torch

    if spec == "auto":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = parse_list(spec)
    for d in out:
        if d not in ("cpu", "cuda"):
            raise SystemExit(f"kernels.py: error: unknown device {d!r} (cpu, cuda, auto)")
        if d == "cuda" and not torch.cuda.is_available():
            raise SystemExit("kernels.py: error: --devices cuda but no CUDA device is available")
    return out


def _per_element(res: Dict[str, Any], numel: int) -> Dict[str, Any]:
    for key in ("compress", "decompress", "total", "cpu_total"):
        res[f"{key}_ns_per_element"] = 1e9 * res[f"{key}_s"] / numel
    return res


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the measurements of ``args``; returns the report dict."""
    import torch

    sizes = parse_list(args.sizes, int)
    blocks = parse_list(args.block_sizes, int)
    threads = parse_list(args.threads, int)
    for b in blocks:
        if b % args.ratio:
            raise SystemExit(f"kernels.py: error: ratio {args.ratio} must divide block {b}")
    results: List[Dict[str, Any]] = []
    skipped: List[Dict[str, Any]] = []
    for dev_name in _devices(args.devices):
        device = torch.device(dev_name)
        dev_label = "cpu" if dev_name == "cpu" else f"cuda ({torch.cuda.get_device_name(0)})"
        # Threads only matter for CPU math; on CUDA one pass is enough.
        for nthreads in threads if dev_name == "cpu" else threads[:1]:
            torch.set_num_threads(nthreads)
            for numel in sizes:
                ok, why = _fits(numel, device)
                if not ok:
                    skipped.append({"device": dev_label, "numel": numel, "reason": why})
                    print(f"skip {numel:.0e} elements on {dev_name}: {why}", flush=True)
                    continue
                quiet = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
                base = {"device": dev_label, "threads": nthreads, "numel": numel}
                cases: List[Tuple[str, Callable[[], Dict[str, Any]]]] = [
                    ("copy", lambda: time_copy(numel, device, args.warmup, args.repeats))
                ]
                for b in blocks:
                    cases.append(
                        (
                            f"separate b{b}",
                            lambda b=b: time_separate(
                                numel, b, args.ratio, device, args.warmup, args.repeats
                            ),
                        )
                    )
                if not args.no_powersgd:
                    cases.append(
                        (
                            "powersgd",
                            lambda: time_powersgd(
                                numel, args.ratio, device, args.warmup, args.repeats
                            ),
                        )
                    )
                for label, case in cases:
                    with CpuMonitor() as mon:
                        res = _per_element(case(), numel)
                    res.update(base)
                    res["contention"] = dict(mon.result(), quiet_wait=quiet)
                    res["ratio"] = args.ratio
                    res["bytes_ratio"] = numel / res["payload_elements"]
                    results.append(res)
                    gc.collect()
                    print(
                        f"{dev_name} threads={nthreads} n={numel:.0e} {label:<14} "
                        f"total {res['total_ns_per_element']:.3f} ns/el "
                        f"({mon.wall_s:.1f} s, other processes "
                        f"{100 * (mon.foreign_share or 0):.0f}% CPU)",
                        flush=True,
                    )
    settings = {
        "sizes": sizes,
        "block_sizes": blocks,
        "ratio": args.ratio,
        "threads": threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "devices": args.devices,
        "quick": args.quick,
        "quiet_wait_s": args.quiet_wait,
        "priority": args.priority,
        "dtype": "float32",
        "timed": {
            "separate": "compress: pack copy, h = work + e, P = H Omega, local reconstruction, "
            "error update (beta = 1/ratio); decompress: reconstruction of P and copy into the "
            "gradient; Omega generation reported separately (omega_ms)",
            "powersgd": "compress: M = G + E, P = M Q, QR(P), Q = M^T P; decompress: "
            "M_hat = P Q^T, E = M - M_hat, copy into the gradient, keep Q",
            "copy": "dst.copy_(src); gb_per_s = tensor bytes / time",
            "excluded": "all collectives (no process group)",
        },
    }
    return make_report(
        "kernels",
        settings,
        results,
        environment(num_threads=threads),
        skipped=skipped,
        summary=summarize(results),
    )


def summarize(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (device, threads, size): best SEPARATE block size vs PowerSGD vs copy."""
    groups: Dict[Tuple[str, int, int], Dict[str, Any]] = {}
    for r in results:
        key = (r["device"], r["threads"], r["numel"])
        g = groups.setdefault(key, {"separate": {}})
        if r["method"] == "separate":
            g["separate"][r["block_size"]] = r["total_ns_per_element"]
        else:
            g[r["method"]] = r["total_ns_per_element"]
    out = []
    for (device, threads, numel), g in groups.items():
        row: Dict[str, Any] = {"device": device, "threads": threads, "numel": numel}
        sep = g["separate"]
        if sep:
            best = min(sep, key=sep.get)
            row["separate_best_block_size"] = best
            row["separate_best_ns_per_element"] = sep[best]
            row["separate_ns_per_element"] = {str(b): v for b, v in sorted(sep.items())}
        row["powersgd_ns_per_element"] = g.get("powersgd")
        row["copy_ns_per_element"] = g.get("copy")
        if sep and g.get("powersgd"):
            row["powersgd_over_separate_best"] = g["powersgd"] / sep[best]
            row["separate_cheaper_block_sizes"] = sorted(
                b for b, v in sep.items() if v < g["powersgd"]
            )
        out.append(row)
    return out


def print_tables(report: Dict[str, Any]) -> None:
    """Per-element totals per size, one column per method."""
    blocks = report["settings"]["block_sizes"]
    print()
    print(f"device: {report['environment']['device']}")
    headers = ["device", "threads", "elements", "copy ns/el", "copy GB/s"]
    headers += [f"SEP b{b}" for b in blocks] + ["PowerSGD", "PSGD rank", "best SEP / PSGD"]
    rows = []
    by_key: Dict[Tuple, Dict[str, Dict[str, Any]]] = {}
    for r in report["results"]:
        key = (r["device"], r["threads"], r["numel"])
        name = r["method"] if r["method"] != "separate" else f"b{r['block_size']}"
        by_key.setdefault(key, {})[name] = r
    for (device, threads, numel), cases in by_key.items():
        copy = cases.get("copy", {})
        psgd = cases.get("powersgd")
        sep = [cases.get(f"b{b}", {}).get("total_ns_per_element") for b in blocks]
        best = min((v for v in sep if v is not None), default=None)
        rows.append(
            [
                device.split(" ")[0],
                threads,
                f"{numel:.0e}",
                copy.get("total_ns_per_element"),
                copy.get("gb_per_s"),
            ]
            + sep
            + [
                psgd["total_ns_per_element"] if psgd else None,
                psgd["approx_rank"] if psgd else None,
                best / psgd["total_ns_per_element"] if psgd and best else None,
            ]
        )
    print("compress + decompress, ns per element (median; lower is better)")
    print(format_table(headers, rows))
    if report.get("skipped"):
        for s in report["skipped"]:
            print(f"skipped {s['numel']:.0e} on {s['device']}: {s['reason']}")
    if "cuda" not in report["environment"]["device"]:
        print("GPU: not measured (no GPU lent; torch.cuda.is_available() is False)")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.quick:
        defaults = build_parser().parse_args([])
        if args.sizes == defaults.sizes:
            args.sizes = ",".join(str(s) for s in QUICK_SIZES)
        if args.block_sizes == defaults.block_sizes:
            args.block_sizes = ",".join(str(b) for b in QUICK_BLOCK_SIZES)
        if args.threads == defaults.threads:
            args.threads = "1"
        if args.repeats == defaults.repeats:
            args.repeats = 2
        if args.warmup == defaults.warmup:
            args.warmup = 1
        if args.quiet_wait == defaults.quiet_wait:
            args.quiet_wait = 0.0
    if args.priority is not None:
        # Before torch starts its threads, which inherit the value.
        set_priority(os.getpid(), args.priority)
    out = args.out or default_out_dir("kernels")
    os.makedirs(out, exist_ok=True)
    report = run(args)
    path = write_report(report, out)
    print_tables(report)
    print(f"\nreport: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
