"""Compression kernel cost per element against the device-to-device copy floor.

What it does:
    For each device (CPU, and CUDA when available), gradient / activation dtype (``--dtypes``;
    default CPU fp32, CUDA fp32 and bf16), tensor size (``--sizes``; default CPU 1e5, 1e6,
    1e7, 1e8 elements, CUDA 1e6, 1e7, 1e8, 1e9) and, on the CPU, torch thread count
    (default 1 and 2), it times the local math of each method (``--methods``; default CPU
    copy, SEPARATE and PowerSGD as before, CUDA all of them) with the functions of our
    package and no process group (the collectives are left out: the "reduced" payload is
    the local one, which has the same shape and bytes):

    * **copy**: ``dst.copy_(src)`` of the tensor in its dtype, the memory-bandwidth floor:
      ns/element and GB/s counting the bytes read plus written (``2 x numel x itemsize``).
    * **SEPARATE** (:mod:`megatron_ext.collectives.separate`, ratio 16, block sizes
      64/128/256/512/1024) as ``_SeparateReduction.launch`` / ``_decompress`` /
      ``end_step`` do per segment. A bf16 gradient is handled as the reducer handles it:
      ``h`` and the error are fp32 (the pack copy casts), the reconstruction is cast back
      into the bf16 gradient. *compress* = ``h = zeros`` (fp32, allocated per step as the
      reducer does), pack copy of the gradient, ``h += e``, ``P = h Omega``, the input
      flag, the residual ``h -= reconstruct(P, Omega)``, the error feedback
      ``e <- (1 - beta) e + beta h`` (beta = 1/ratio, the reducer's ``end_step``) and the
      zeroed padding; *decompress* = ``reconstruct(P_avg, Omega)`` and the copy into the
      gradient. The per-step generation of ``Omega`` (``projection_block``, independent of
      the tensor size) is timed separately (``omega_ms``).
    * **PowerSGD** (:mod:`megatron_ext.collectives.powersgd`, warm start and error feedback,
      the defaults) on the same number of elements as a square-ish ``n x m`` matrix at the
      rank that sends about the same bytes as SEPARATE (``r = n m / (ratio (n + m))``,
      rounded, at least 1). Like the reducer, a bf16 gradient becomes an fp32 ``M``
      (``torch.stack(...).float()``), and the approximation is cast back into it.
      *compress* = ``M = G + E``, ``Q = orthogonalize(Q_prev)``, ``P = M Q``, the input
      flag (everything before the first all-reduce); *decompress* = ``orthogonalize(P)``,
      ``Q = M^T P``, ``M_hat = P Q^T``, ``E = M - M_hat``, the copy into the gradient and
      the warm start ``Q``.
    * **quantized-<b>bit** (the k-bit DP exchange, :mod:`megatron_ext.collectives.quantized`,
      rows of 256 values with an fp16 scale each, nearest rounding, error feedback; bits
      ``--quant-bits``, default 4 then 8 and 2) with the reduction's own methods
      (``encode_worker``, ``reduce_server``, ``decode_gathered``: one fused kernel each) for
      one rank (W = 1, no distributed optimizer): *compress* = the worker side
      (``h = spread(g.float()) + e_w``, quantize, ``e_w = h - dequantize``, flag, pack);
      *decompress* = the received input flags and partitions (unpacked, dequantized,
      summed), the server side (``s = r + e_s``, quantize, ``e_s``, pack), unpack and
      dequantize the gathered partitions into the gradient.
    * **aqsgd** (:class:`megatron_ext.collectives.aqsgd.AQSGDCodec`, default options:
      forward 4 bits, scales per sample and channel, device buffers in the activation
      dtype) on an activation ``[seq, micro-batch, hidden]`` (hidden ``--hidden``, seq up to
      1024, micro-batch the rest: numel within rounding of the size) whose samples were
      visited once (untimed): *compress* = the sender's ``encode`` (delta against the
      per-sample buffer, quantize, pack) and ``end_step`` (the buffer update);
      *decompress* = the receiver's ``decode`` (unpack, dequantize, add to its buffer) and
      ``end_step``. ``begin_step`` (the host-side indices of the step) is untimed.
    * **directq** (:class:`~megatron_ext.collectives.aqsgd.DirectQCodec`, 4 bits): the
      activation itself quantized (encode) and dequantized (decode).
    * **protocol** (:class:`megatron_ext.collectives.subspace.SubspaceCodec`, k from the
      default ``--subspace-compression-rate`` / ``--subspace-min-rank`` for the hidden
      size, 32 for 1024 and 2048): forward *compress* = ``C = (X - T_fixed[ids]) U`` and the
      packed token ids; *decompress* = ``X = C U^T + T_fixed[ids]`` in the activation dtype.

    Every row reports time per phase, ns/element, the ratio to the copy floor of the same
    device, dtype and size (per element), and a target: SEPARATE <= 3x the floor and cheaper
    than PowerSGD at equal bytes; the codecs (quantized, aqsgd, directq, protocol) <= 2x the
    floor. PowerSGD is the reference (no target).

Fused kernels (``--fused-kernels``):
    ``off`` (default) runs the methods' fused kernels (``megatron_ext/kernels``) as eager
    torch ops, the reference; ``on`` runs them compiled by ``torch.compile`` (C++ loops on
    the CPU, Triton on CUDA), compiled during the untimed warm-up. Two runs with the same
    rows compare eager and compiled; each row records its mode (``fused_kernels``).

Timing:
    Each number is the median of ``--repeats`` timed repetitions after ``--warmup`` untimed
    ones. CPU: ``time.perf_counter`` around each phase. CUDA: a
    ``torch.cuda.Event(enable_timing=True)`` before and after each phase (the device
    timeline, synchronised once per repetition); inputs are drawn on the device by a
    device generator before the timed region. On CUDA the whole run aims at
    ``--cuda-budget-s`` seconds: each row gets the budget left divided by the rows left and
    runs fewer repetitions (at least one after one warm-up) when its warm-up says they
    would not fit; past 1.5 times the budget the remaining rows are skipped with a printed
    reason (default 150 s: the run ends within about 4 minutes). The report is rewritten
    after every row (``complete``: false until the end), so a run killed by a time limit
    leaves what it measured. Before each CUDA row its estimated peak memory is checked against
    ``torch.cuda.mem_get_info``; a row that would not fit (or runs out of memory anyway) is
    skipped and reported, and memory is freed between rows.

Usage:
    python benchmarks/kernels.py                       # CPU (and CUDA if present), full sizes
    python benchmarks/kernels.py --quick               # smoke run (seconds)
    python benchmarks/kernels.py --devices cuda        # GPU rows only, 1e6..1e9, fp32 + bf16
    python benchmarks/kernels.py --sizes 1e6 --block-sizes 256 --threads 1 --dtypes fp32
    python benchmarks/kernels.py --methods quantized,aqsgd,directq --fused-kernels on

Output:
    ``<out>/kernels.json`` (see :mod:`benchmarks.common`) and a table on stdout (last).

Constraints:
    Times the package's production functions, never re-implementations; no process group.
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

from benchmarks import common  # noqa: E402

__all__ = [
    "build_parser",
    "main",
    "time_separate",
    "time_powersgd",
    "time_copy",
    "time_quantized",
    "time_aqsgd",
    "time_directq",
    "time_protocol",
    "activation_shape",
]

DEFAULT_SIZES = (100_000, 1_000_000, 10_000_000, 100_000_000)
DEFAULT_CUDA_SIZES = (1_000_000, 10_000_000, 100_000_000, 1_000_000_000)
DEFAULT_BLOCK_SIZES = (64, 128, 256, 512, 1024)
DEFAULT_QUANT_BITS = (4, 8, 2)
QUICK_SIZES = (10_000, 100_000)
QUICK_CUDA_SIZES = (100_000, 1_000_000)
QUICK_BLOCK_SIZES = (64, 256)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_DTYPES = {"cpu": "fp32", "cuda": "fp32,bf16"}
DEFAULT_METHODS = {"cpu": "copy,separate,powersgd", "cuda": "all"}
CODECS = ("quantized", "aqsgd", "directq", "protocol")
"""Methods with the codec target (<= 2x the copy floor)."""

SEPARATE_TARGET = 3.0
CUDA_CUTOFF = 1.5
"""Past this many times ``--cuda-budget-s`` the remaining CUDA rows are skipped."""
CODEC_TARGET = 2.0


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/kernels.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/kernels.py",
        description="Compress + decompress time per element of SEPARATE (block sizes), "
        "PowerSGD at equal bytes, the quantizers and the AQ-SGD / DirectQ / Protocol codecs, "
        "against a device-to-device copy.",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="Comma-separated tensor sizes in elements (default: CPU 1e5,1e6,1e7,1e8; CUDA "
        "1e6,1e7,1e8,1e9; rows that do not fit in memory are skipped and reported).",
    )
    p.add_argument(
        "--dtypes",
        default=None,
        help="Gradient / activation dtypes, comma-separated from fp32, bf16 (default: CPU "
        "fp32, CUDA fp32,bf16; SEPARATE, PowerSGD and the quantizer compute in fp32 as "
        "their reducers do).",
    )
    p.add_argument(
        "--block-sizes",
        default=",".join(str(b) for b in DEFAULT_BLOCK_SIZES),
        help="SEPARATE block sizes (default 64,128,256,512,1024).",
    )
    p.add_argument("--ratio", type=int, default=16, help="Compression ratio (default 16).")
    p.add_argument(
        "--quant-bits",
        default=",".join(str(b) for b in DEFAULT_QUANT_BITS),
        help="Bits of the quantized DP exchange rows (default 4,8,2: its default, then 8 and "
        "2; choices 2, 3, 4, 8).",
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=2048,
        help="Hidden size of the AQ-SGD / DirectQ / Protocol activations (default 2048).",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="Comma-separated subset of copy,separate,powersgd,quantized,aqsgd,directq,"
        "protocol, or all (default: CPU copy,separate,powersgd; CUDA all; copy always "
        "runs, it is the floor).",
    )
    p.add_argument(
        "--threads",
        default="1,2",
        help="torch.set_num_threads values for the CPU rows, comma-separated (default 1,2: "
        "1 matches one thread per rank of the step-time benchmark; CUDA rows use the first).",
    )
    p.add_argument("--repeats", type=int, default=7, help="Timed repetitions (default 7).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed repetitions (default 2).")
    p.add_argument(
        "--cuda-budget-s",
        type=float,
        default=150.0,
        help="Target wall time of all CUDA rows together (default 150): rows run fewer "
        "repetitions when needed; past 1.5 times this the remaining rows are skipped (so the "
        "default run stays inside benchmarks/gpu_session.sh's 240 s stage limit; the report "
        "is rewritten after every row in any case).",
    )
    p.add_argument(
        "--devices",
        default="auto",
        help="cpu, cuda or auto (cpu, plus cuda when torch.cuda.is_available()).",
    )
    p.add_argument("--no-powersgd", action="store_true", help="Skip PowerSGD.")
    p.add_argument(
        "--fused-kernels",
        choices=("off", "on"),
        default="off",
        help="How the methods' fused kernels (megatron_ext/kernels) run: off (default) eager "
        "torch ops, the reference; on: compiled by torch.compile (C++ on the CPU, Triton "
        "on CUDA; compiled during the untimed warm-up). Same rows, so two runs compare them.",
    )
    # Each result records the CPU share other processes used while it was measured.
    common.add_machine_args(p, quiet_wait=60.0, what="size")
    p.add_argument(
        "--quick",
        action="store_true",
        help="Smoke run: sizes 1e4,1e5 (CUDA 1e5,1e6), block sizes 64,256, threads 1, "
        "2 repeats (explicit --sizes/--block-sizes still win).",
    )
    p.add_argument("--out", default=None, help="Run directory (default runs/bench-kernels-<time>).")
    return p


# -- timing --------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_phases(
    phases: List[Callable[[Any], Any]],
    device,
    warmup: int,
    repeats: int,
    before: Optional[Callable[[], None]] = None,
    budget_s: Optional[float] = None,
) -> Tuple[List[List[float]], List[List[float]]]:
    """Run the chained ``phases`` (each gets the previous result); time each phase.

    Args:
        phases: callables, the first gets None.
        device: where they compute (CUDA: timed with CUDA events).
        warmup: untimed repetitions first (at least one when ``budget_s`` is given).
        repeats: timed repetitions (fewer when ``budget_s`` says they would not fit).
        before: untimed call before every repetition (host-side preparation).
        budget_s: wall seconds the timed repetitions may take, judged from the last
            warm-up; None: no limit.

    Returns:
        (seconds, process CPU seconds), each a list per phase of the timed repetitions.
        CPU: wall time; with one thread and no other process on the CPU the two agree
        (CPU time excludes time the process waited for a CPU). CUDA: device time between
        the events; the CPU-second lists repeat it (process time means nothing there).
    """
    import torch

    cuda = device.type == "cuda"
    if budget_s is not None:
        warmup = max(1, warmup)
    walls: List[List[float]] = [[] for _ in phases]
    cpus: List[List[float]] = [[] for _ in phases]
    i = 0
    while i < warmup + repeats:
        if before is not None:
            before()
        _sync(device)
        start = time.perf_counter()
        value = None
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
            events[0].record()
        for j, phase in enumerate(phases):
            if cuda:
                value = phase(value)
                events[j + 1].record()
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            value = phase(value)
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                walls[j].append(t1 - t0)
                cpus[j].append(c1 - c0)
        if cuda:
            events[-1].synchronize()
            if i >= warmup:
                for j in range(len(phases)):
                    seconds = events[j].elapsed_time(events[j + 1]) / 1e3
                    walls[j].append(seconds)
                    cpus[j].append(seconds)
        value = None
        _sync(device)
        if budget_s is not None and i == warmup - 1:
            per_repeat = time.perf_counter() - start
            repeats = max(1, min(repeats, int(budget_s / max(per_repeat, 1e-9))))
        i += 1
    return walls, cpus


def _phase_stats(walls: List[List[float]], cpus: List[List[float]]) -> Dict[str, Any]:
    t_c, t_d = walls if len(walls) == 2 else (walls[0], [0.0] * len(walls[0]))
    c_c, c_d = cpus if len(cpus) == 2 else (cpus[0], [0.0] * len(cpus[0]))
    return {
        "compress_s": common.median(t_c),
        "decompress_s": common.median(t_d),
        "total_s": common.median([a + b for a, b in zip(t_c, t_d)]),
        "cpu_total_s": common.median([a + b for a, b in zip(c_c, c_d)]),
        "compress_samples_s": t_c,
        "decompress_samples_s": t_d,
        "repeats": len(t_c),
    }


def _dtype(name: str):
    import torch

    if name in DTYPES:
        name = DTYPES[name]
    return getattr(torch, str(name).replace("torch.", ""))


def _randn(shape, device, dtype, seed: int, scale: float = 1.0):
    """Gaussian values drawn on ``device`` by that device's generator (no host copy)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if scale != 1.0:
        out.mul_(scale)
    return out.to(_dtype(dtype))


def _flag(*tensors):
    from megatron_ext.collectives.grad_reducer import CompressedReduction

    return CompressedReduction.input_flag(tensors[0].device, *tensors)


# -- the rows ------------------------------------------------------------------------------


def time_copy(
    numel: int, device, warmup: int, repeats: int, dtype="float32", budget_s=None
) -> Dict[str, Any]:
    """Time ``dst.copy_(src)`` of ``numel`` elements of ``dtype`` (the memory floor)."""
    import torch

    src = _randn(numel, device, dtype, 0)
    dst = torch.empty_like(src)
    walls, cpus = _timed_phases(
        [lambda _: dst.copy_(src)], device, warmup, repeats, budget_s=budget_s
    )
    stats = _phase_stats(walls, cpus)
    moved = 2 * numel * src.element_size()
    return {
        "method": "copy",
        "payload_elements": numel,
        # Bytes read plus written per second.
        "gb_per_s": moved / stats["total_s"] / 1e9,
        "bytes_moved": moved,
        **stats,
    }


def time_separate(
    numel: int,
    block_size: int,
    ratio: int,
    device,
    warmup: int,
    repeats: int,
    dtype="float32",
    budget_s=None,
) -> Dict[str, Any]:
    """Time SEPARATE's local math on ``numel`` elements (see the module docstring)."""
    import torch

    from megatron_ext.compressors.separate import project, projection_block, reconstruct

    k = block_size // ratio
    rows = math.ceil(numel / block_size)
    beta = 1.0 / ratio
    grad = _randn(numel, device, dtype, 0)
    error = _randn((rows, block_size), device, torch.float32, 1, scale=0.01)
    error.view(-1)[numel:].zero_()
    # The reconstruction goes to a separate buffer of the gradient's size and dtype (the
    # reducer's write-back traffic, but the input stays the same every repetition).
    out = torch.empty_like(grad)
    omega_times = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        omega = projection_block(42, i, "bench", block_size, k, device=device)
        _sync(device)
        if i >= warmup:
            omega_times.append(time.perf_counter() - t0)

    def compress(_):
        # _SeparateReduction.launch: a fresh fp32 h, the (casting) pack copy, h += e.
        h = torch.zeros(rows, block_size, dtype=torch.float32, device=device)
        torch._foreach_copy_([h.view(-1)[:numel]], [grad])
        h.add_(error)
        p = project(h, omega)
        flag = _flag(h)
        residual = h.sub_(reconstruct(p, omega))
        payload = torch.cat([p.reshape(-1), flag])
        # end_step: e <- (1 - beta) e + beta (h - H_hat_local), padding zeroed.
        error.mul_(1.0 - beta).add_(residual, alpha=beta)
        error.view(-1)[numel:].zero_()
        return payload

    def decompress(payload):
        p_avg = payload[:-1].view(rows, k)
        recon = reconstruct(p_avg, omega).view(-1)
        torch._foreach_copy_([out], [recon[:numel]])  # casts into a bf16 gradient

    stats = _phase_stats(
        *_timed_phases([compress, decompress], device, warmup, repeats, budget_s=budget_s)
    )
    return {
        "method": "separate",
        "block_size": block_size,
        "num_projections": k,
        "rows": rows,
        "payload_elements": rows * k,
        "omega_ms": 1e3 * common.median(omega_times),
        **stats,
    }


def time_powersgd(
    numel: int, ratio: int, device, warmup: int, repeats: int, dtype="float32", budget_s=None
) -> Dict[str, Any]:
    """Time PowerSGD's local math on a square-ish matrix of ``numel`` elements."""
    import torch

    from megatron_ext.compressors.lowrank import orthogonalize

    n, m = common.squareish_shape(numel)
    r = common.equal_bytes_rank(n, m, ratio)
    grad = _randn(numel, device, dtype, 0)
    out = torch.empty_like(grad)
    state = {
        "error": _randn((1, n, m), device, torch.float32, 1, scale=0.01),
        "q": orthogonalize(_randn((1, m, r), device, torch.float32, 2)),
    }

    def compress(_):
        # _PowerSGDReduction.launch: [B, n, m] fp32 (a fresh tensor), warm start.
        mat = torch.stack([grad.view(n, m)]).float()
        mat.add_(state["error"])
        q = orthogonalize(state["q"])
        p = torch.bmm(mat, q)
        payload = torch.cat([p.reshape(-1), _flag(mat)])
        return mat, payload

    def decompress(value):
        mat, payload = value
        # _second_round: orthogonalize P, Q = M^T P (second all-reduce), M_hat = P Q^T.
        p = orthogonalize(payload[:-1].view(1, n, r))
        q = torch.bmm(mat.transpose(1, 2), p).reshape(-1).view(1, m, r)
        approx = torch.bmm(p, q.transpose(1, 2))
        error = mat.sub_(approx)
        torch._foreach_copy_([out.view(n, m)], [approx[0]])
        # end_step: the new error and the warm start.
        state["error"], state["q"] = error, q.clone()

    stats = _phase_stats(
        *_timed_phases([compress, decompress], device, warmup, repeats, budget_s=budget_s)
    )
    return {
        "method": "powersgd",
        "shape": [n, m],
        "approx_rank": r,
        "payload_elements": (n + m) * r,
        **stats,
    }


def time_quantized(
    numel: int, bits: int, device, warmup: int, repeats: int, dtype="float32", budget_s=None
) -> Dict[str, Any]:
    """Time the k-bit DP exchange's local math for one rank (see the module docstring)."""
    import types

    import torch

    from megatron_ext.collectives.quantized import _Partitioned, _QuantizedReduction
    from megatron_ext.methods.quantized import QuantizedConfig

    cfg = QuantizedConfig(bits=bits)
    grad = _randn(numel, device, dtype, 0)
    bucket = types.SimpleNamespace(grad=grad, shard=None)
    layout = _Partitioned(bucket, 1, cfg.block_size)
    # The reduction's own kernels on one bucket of one rank (no process group: the spec
    # holds only what they read).
    red = _QuantizedReduction.__new__(_QuantizedReduction)
    red.cfg = cfg
    red.spec = types.SimpleNamespace(buckets=[bucket], op=torch.distributed.ReduceOp.SUM)
    red.layouts = [layout]
    red.worker_error = [_randn((1, layout.padded), device, torch.float32, 1, scale=0.01)]
    red.server_error = [_randn(layout.padded, device, torch.float32, 2, scale=0.01)]
    red._staged = {}
    nbytes = red._partition_nbytes(layout)

    def compress(_):
        return red.encode_worker(0).reshape(-1)

    def decompress(recv):
        flag, mine = red.reduce_server(0, recv.view(1, nbytes + 4), requantize=True)
        red.decode_gathered(0, mine.view(1, nbytes))
        red.end_step(True)  # the staged errors become the state (no device op)
        return flag

    stats = _phase_stats(
        *_timed_phases([compress, decompress], device, warmup, repeats, budget_s=budget_s)
    )
    return {
        "method": f"quantized-{bits}bit",
        "bits": bits,
        "block_size": cfg.block_size,
        "payload_bytes": nbytes + 4,
        "payload_elements": numel,
        **stats,
    }


def activation_shape(numel: int, hidden: int) -> Tuple[int, int, int]:
    """``(seq, micro-batch, hidden)`` with about ``numel`` elements: ``numel / hidden``
    tokens (rounded, at least 1), a sequence of at most 1024 of them, the micro-batch the
    rest (rounded, at least 1)."""
    tokens = max(1, round(numel / hidden))
    seq = min(1024, tokens)
    return seq, max(1, round(tokens / seq)), hidden


def time_aqsgd(
    numel: int, hidden: int, device, warmup: int, repeats: int, dtype="float32", budget_s=None
) -> Dict[str, Any]:
    """Time AQ-SGD's sender encode and receiver decode of revisited samples."""
    import torch

    from megatron_ext.collectives.aqsgd import AQSGDCodec
    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.methods.aqsgd import AQSGDConfig
    from megatron_ext.methods.registry import SampleSpace

    seq, mb, h = activation_shape(numel, hidden)
    dt = _dtype(dtype)
    cfg = AQSGDConfig()
    samples = SampleSpace(
        fixed=True,
        num_samples=mb,
        dp_rank=0,
        dp_size=1,
        micro_batch_size=mb,
        num_microbatches=1,
        seq_length=seq,
    )
    sender, receiver = AQSGDCodec(cfg, None), AQSGDCodec(cfg, None)
    for codec, stage in ((sender, 0), (receiver, 1)):
        codec.allocate(
            samples, seq, h, stage=stage, num_stages=2, device=device, activation_dtype=dt
        )
    ids = torch.arange(mb)
    x = _randn((seq, mb, h), device, dt, 0)
    shape = tuple(x.shape)
    step = {"i": 0}

    def ctx():
        return P2PContext("forward", 0, ids, step["i"], False)

    def begin():
        step["i"] += 1
        for codec in (sender, receiver):
            codec.begin_step(lambda _mb: ids)

    # First visit (full precision, untimed): the timed steps send deltas.
    begin()
    receiver.decode(sender.encode(x, ctx()), ctx(), shape, dt)
    sender.end_step()
    receiver.end_step()

    def encode(_):
        payload = sender.encode(x, ctx())
        sender.end_step()
        return payload

    def decode(payload):
        receiver.decode(payload, ctx(), shape, dt)
        receiver.end_step()

    stats = _phase_stats(
        *_timed_phases([encode, decode], device, warmup, repeats, begin, budget_s=budget_s)
    )
    payload_bytes = receiver.payload_spec(shape, dt, ctx())[0][0]
    return {
        "method": "aqsgd",
        "shape": list(shape),
        "bits": cfg.fw_bits,
        "payload_bytes": payload_bytes,
        "payload_elements": seq * mb * h,
        **stats,
    }


def time_directq(
    numel: int, hidden: int, device, warmup: int, repeats: int, dtype="float32", budget_s=None
) -> Dict[str, Any]:
    """Time DirectQ's encode (quantize + pack) and decode of an activation."""
    from megatron_ext.collectives.aqsgd import DirectQCodec
    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.methods.aqsgd import AQSGDConfig

    seq, mb, h = activation_shape(numel, hidden)
    dt = _dtype(dtype)
    cfg = AQSGDConfig()
    codec = DirectQCodec(cfg, None)
    ctx = P2PContext("forward", 0, None, 0, False)
    x = _randn((seq, mb, h), device, dt, 0)
    shape = tuple(x.shape)
    stats = _phase_stats(
        *_timed_phases(
            [lambda _: codec.encode(x, ctx), lambda p: codec.decode(p, ctx, shape, dt)],
            device,
            warmup,
            repeats,
            budget_s=budget_s,
        )
    )
    return {
        "method": "directq",
        "shape": list(shape),
        "bits": cfg.fw_bits,
        "payload_bytes": codec.payload_spec(shape, dt, ctx)[0][0],
        "payload_elements": seq * mb * h,
        **stats,
    }


PROTOCOL_VOCAB = 32_000
"""Rows of ``T_fixed`` in the Protocol rows (a typical vocabulary)."""


def time_protocol(
    numel: int, hidden: int, device, warmup: int, repeats: int, dtype="float32", budget_s=None
) -> Dict[str, Any]:
    """Time the Protocol Models forward codec: project (k of d) and reconstruct."""
    import torch

    from megatron_ext.collectives.p2p import P2PContext
    from megatron_ext.collectives.subspace import SubspaceCodec
    from megatron_ext.compressors.subspace import Subspace
    from megatron_ext.methods.protocol import SubspaceConfig

    seq, mb, h = activation_shape(numel, hidden)
    dt = _dtype(dtype)
    k = SubspaceConfig().rank_for(h)
    sub = Subspace(h, k, seed=0).to(device)
    sub.make_fixed(PROTOCOL_VOCAB, 0.02, dt, device)
    sender = SubspaceCodec(sub)
    receiver = SubspaceCodec(sub, sends_forward=False)
    gen = torch.Generator(device=device).manual_seed(3)
    ids = torch.randint(0, PROTOCOL_VOCAB, (seq, mb), generator=gen, device=device)
    x = _randn((seq, mb, h), device, dt, 0)
    shape = tuple(x.shape)
    ctx = P2PContext("forward", 0, None, 0, False)
    stats = _phase_stats(
        *_timed_phases(
            [lambda _: sender.encode(x, ctx), lambda p: receiver.decode(p, ctx, shape, dt)],
            device,
            warmup,
            repeats,
            lambda: sender.push_token_ids(ids),
            budget_s=budget_s,
        )
    )
    return {
        "method": "protocol",
        "shape": list(shape),
        "rank": k,
        "payload_elements": sender.payload_spec(shape, dt, ctx)[0][0],
        **stats,
    }


def _peak_bytes(method: str, numel: int, itemsize: int) -> int:
    """Estimated peak memory of a row (tensors of the size alive at once, temporaries
    included), for the fit check before it runs: at or above the peak resident memory
    measured on the CPU at 2e7 elements (fp32 and bf16)."""
    per_element = {
        # Inputs are drawn in fp32 and cast: a bf16 input briefly needs both copies.
        "copy": max(2 * itemsize, itemsize + 4),
        # grad, h, error, the reconstruction (and its sub), the input flag's bool tensor.
        "separate": itemsize + 4 * 4 + 1,
        # grad, the stacked copy and its fp32 M, error, M_hat, the flag's bool tensor.
        "powersgd": 2 * itemsize + 14,
        # grad, the fp32 copy, h, two errors, quantize / dequantize temporaries.
        "quantized": itemsize + 33,
        # activation, two buffers, value, m, delta, quantize temporaries, staged copies.
        "aqsgd": 4 * itemsize + 33,
        # activation, its fp32 copy, quantize temporaries, codes, the dequantized output.
        "directq": itemsize + 16,
        # activation, T_fixed[ids] and its fp32 copy, v, the rebuilt fp32 and output.
        "protocol": itemsize + 14,
    }[method.split("-")[0]]
    return numel * per_element


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


def _fits(method: str, numel: int, itemsize: int, device) -> Tuple[bool, str]:
    import torch

    need = _peak_bytes(method, numel, itemsize)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        have = free
    else:
        have = _available_bytes()
    if have is not None and need > 0.9 * have:
        return False, f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"
    return True, ""


def _devices(spec: str) -> List[str]:
    import torch

    if spec == "auto":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = common.parse_list(spec)
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


def _set_fused_kernels(value: str) -> None:
    """Put megatron_ext's fused kernels in mode ``value`` (``--fused-kernels``); a mode this
    process cannot run exits naming the flag."""
    from megatron_ext import kernels as fused

    try:
        fused.set_mode(value)
    except ValueError as err:
        raise SystemExit(f"kernels.py: error: {err}")


def _check_args(args: argparse.Namespace) -> Dict[str, Any]:
    """Parsed lists of ``args``; a bad value exits naming its flag."""

    def fail(flag: str, why: str):
        raise SystemExit(f"kernels.py: error: {flag}: {why}")

    out: Dict[str, Any] = {}
    try:
        out["sizes"] = common.parse_list(args.sizes, int) if args.sizes else None
        out["blocks"] = common.parse_list(args.block_sizes, int)
        out["threads"] = common.parse_list(args.threads, int)
        out["bits"] = list(dict.fromkeys(common.parse_list(args.quant_bits, int)))
    except ValueError as err:
        fail("--sizes/--block-sizes/--threads/--quant-bits", str(err))
    if out["sizes"] is not None and any(s < 1 for s in out["sizes"]):
        fail("--sizes", "sizes must be >= 1")
    for b in out["blocks"]:
        if b < 1 or b % args.ratio:
            fail("--block-sizes", f"ratio {args.ratio} must divide block {b}")
    for b in out["bits"]:
        if b not in (2, 3, 4, 8):
            fail("--quant-bits", f"invalid bits {b} (2, 3, 4, 8)")
    # Per device: the option when given, else that device's default.
    out["dtypes"], out["methods"] = {}, {}
    known = ("copy", "separate", "powersgd") + CODECS
    for dev in ("cpu", "cuda"):
        dtypes = common.parse_list(args.dtypes or DEFAULT_DTYPES[dev])
        for d in dtypes:
            if d not in DTYPES:
                fail("--dtypes", f"unknown dtype {d!r} (fp32, bf16)")
        if not dtypes:
            fail("--dtypes", "no dtype given")
        out["dtypes"][dev] = dtypes
        spec = args.methods or DEFAULT_METHODS[dev]
        methods = list(known) if spec == "all" else common.parse_list(spec)
        for m in methods:
            if m not in known:
                fail("--methods", f"unknown method {m!r} ({', '.join(known)}, all)")
        if args.no_powersgd and "powersgd" in methods:
            methods.remove("powersgd")
        out["methods"][dev] = methods
    if args.hidden < 8:
        fail("--hidden", f"must be >= 8, got {args.hidden}")
    if args.cuda_budget_s <= 0:
        fail("--cuda-budget-s", f"must be > 0, got {args.cuda_budget_s}")
    return out


def _cases(
    args: argparse.Namespace, lists: Dict[str, Any], numel: int, device, dtype: str
) -> List[Tuple[str, str, Callable[..., Dict[str, Any]]]]:
    """(label, method kind, call(budget_s)) of every row at one (device, size, dtype)."""
    w, r = args.warmup, args.repeats
    methods = lists["methods"]
    cases: List[Tuple[str, str, Callable[..., Dict[str, Any]]]] = [
        ("copy", "copy", lambda b: time_copy(numel, device, w, r, dtype, b))
    ]
    if "separate" in methods:
        for blk in lists["blocks"]:
            cases.append(
                (
                    f"separate b{blk}",
                    "separate",
                    lambda b, blk=blk: time_separate(
                        numel, blk, args.ratio, device, w, r, dtype, b
                    ),
                )
            )
    if "powersgd" in methods:
        cases.append(
            (
                "powersgd",
                "powersgd",
                lambda b: time_powersgd(numel, args.ratio, device, w, r, dtype, b),
            )
        )
    if "quantized" in methods:
        for bits in lists["bits"]:
            cases.append(
                (
                    f"quantized {bits}b",
                    "quantized",
                    lambda b, bits=bits: time_quantized(numel, bits, device, w, r, dtype, b),
                )
            )
    hidden = args.hidden
    if "aqsgd" in methods:
        cases.append(
            ("aqsgd", "aqsgd", lambda b: time_aqsgd(numel, hidden, device, w, r, dtype, b))
        )
    if "directq" in methods:
        cases.append(
            ("directq", "directq", lambda b: time_directq(numel, hidden, device, w, r, dtype, b))
        )
    if "protocol" in methods:
        cases.append(
            (
                "protocol",
                "protocol",
                lambda b: time_protocol(numel, hidden, device, w, r, dtype, b),
            )
        )
    return cases


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, out_dir: Optional[str] = None) -> Dict[str, Any]:
    """Run the measurements of ``args``; returns the report dict (``complete``: True).

    Args:
        args: the parsed options.
        out_dir: where the report so far is written after every row (``complete``: False),
            so a run killed by a time limit leaves what it measured; None: only at the end.
    """
    import torch

    lists = _check_args(args)
    _set_fused_kernels(args.fused_kernels)
    threads = lists["threads"]
    results: List[Dict[str, Any]] = []
    skipped: List[Dict[str, Any]] = []
    sizes_used: Dict[str, List[int]] = {}
    devices = _devices(args.devices)
    settings = {
        "sizes": sizes_used,
        "block_sizes": lists["blocks"],
        "ratio": args.ratio,
        "quant_bits": lists["bits"],
        "hidden": args.hidden,
        "dtypes": {d: lists["dtypes"][d] for d in devices},
        "methods": {d: lists["methods"][d] for d in devices},
        "threads": threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "cuda_budget_s": args.cuda_budget_s,
        "fused_kernels": args.fused_kernels,
        # torch's defaults are left alone (the reducers run under the training's setting).
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "devices": args.devices,
        "quick": args.quick,
        "quiet_wait_s": args.quiet_wait,
        "priority": args.priority,
        "targets": {
            "separate": f"<= {SEPARATE_TARGET:g}x the copy floor and < PowerSGD at equal bytes",
            "codecs": f"<= {CODEC_TARGET:g}x the copy floor ({', '.join(CODECS)})",
        },
        "timed": {
            "separate": "compress: fresh fp32 h, pack copy (casts bf16), h += e, P = h Omega, "
            "input flag, h -= reconstruction, error feedback (beta = 1/ratio) and padding; "
            "decompress: reconstruction of P and copy into the gradient; Omega generation "
            "reported separately (omega_ms)",
            "powersgd": "compress: M = stack(G).float() + E, Q = orth(Q_prev), P = M Q, input "
            "flag; decompress: orth(P), Q = M^T P, M_hat = P Q^T, E = M - M_hat, copy into "
            "the gradient, keep Q",
            "quantized": "one rank (W = 1): compress: h = spread(g) + e_w, quantize rows of "
            "256, e_w, flag, pack; decompress: unpack + dequantize, server e_s, quantize, "
            "pack, unpack + dequantize, copy into the gradient",
            "aqsgd": "revisited samples: compress = sender encode + end_step (buffer update); "
            "decompress = receiver decode + end_step",
            "directq": "compress = quantize + pack; decompress = unpack + dequantize",
            "protocol": "forward: compress = (X - T_fixed[ids]) U + packed ids; decompress = "
            "C U^T + T_fixed[ids]",
            "copy": "dst.copy_(src); gb_per_s = bytes read + written / time",
            "excluded": "all collectives (no process group)",
            "cuda": "CUDA events around each phase, one synchronisation per repetition",
        },
    }
    for dev_name in devices:
        cuda = dev_name == "cuda"
        # With its index (cuda:0), as the tensors' devices compare.
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dev_label = "cpu" if not cuda else f"cuda ({torch.cuda.get_device_name(0)})"
        sizes = lists["sizes"]
        if sizes is None:
            quick = QUICK_CUDA_SIZES if cuda else QUICK_SIZES
            sizes = list(quick if args.quick else DEFAULT_CUDA_SIZES if cuda else DEFAULT_SIZES)
        sizes_used[dev_name] = sizes
        dev_lists = dict(lists, dtypes=lists["dtypes"][dev_name])
        dev_lists["methods"] = lists["methods"][dev_name]
        # Threads only matter for CPU math; on CUDA one pass is enough.
        dev_threads = threads if not cuda else threads[:1]
        plan = [
            (nthreads, numel, dtype)
            for nthreads in dev_threads
            for numel in sizes
            for dtype in dev_lists["dtypes"]
        ]
        rows_left = sum(len(_cases(args, dev_lists, n, device, d)) for _, n, d in plan)
        t_start = time.perf_counter()
        for nthreads, numel, dtype in plan:
            torch.set_num_threads(nthreads)
            itemsize = torch.empty((), dtype=_dtype(dtype)).element_size()
            quiet = None
            if args.quiet_wait > 0 and not cuda:
                quiet = common.wait_for_quiet(args.quiet_wait)
            base = {
                "device": dev_label,
                "threads": nthreads,
                "numel": numel,
                "dtype": dtype,
                "fused_kernels": args.fused_kernels,
            }
            for label, kind, case in _cases(args, dev_lists, numel, device, dtype):
                rows_left -= 1
                budget = None
                if cuda:
                    spent = time.perf_counter() - t_start
                    if spent > CUDA_CUTOFF * args.cuda_budget_s:
                        why = (
                            f"CUDA budget exhausted ({spent:.1f} s > {CUDA_CUTOFF:g} x "
                            "--cuda-budget-s)"
                        )
                        skipped.append({**base, "method": label, "reason": why})
                        print(f"skip {label} {numel:.0e} {dtype} on {dev_name}: {why}")
                        continue
                    budget = max(0.0, args.cuda_budget_s - spent) / (rows_left + 1)
                ok, why = _fits(kind, numel, itemsize, device)
                if not ok:
                    skipped.append({**base, "method": label, "reason": why})
                    print(f"skip {label} {numel:.0e} {dtype} on {dev_name}: {why}", flush=True)
                    continue
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                oom = None
                try:
                    with common.CpuMonitor() as mon:
                        res = case(budget)
                except torch.cuda.OutOfMemoryError as err:
                    # The message only: the traceback's frames still hold the row's tensors.
                    oom = f"out of memory: {str(err).splitlines()[0]}"
                if oom is not None:
                    skipped.append({**base, "method": label, "reason": oom})
                    print(f"skip {label} {numel:.0e} {dtype} on {dev_name}: {oom}", flush=True)
                    _free(device)
                    continue
                row_numel = _row_numel(res, numel)
                res = _per_element(res, row_numel)
                res.update(base)
                res["row_numel"] = row_numel
                if cuda:
                    res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                res["contention"] = dict(mon.result(), quiet_wait=quiet)
                res["ratio"] = args.ratio
                res["bytes_ratio"] = row_numel / res["payload_elements"]
                results.append(res)
                del res
                if out_dir:  # what is measured so far survives a kill (a stage time limit)
                    common.write_report(
                        _report(settings, results, skipped, threads, False), out_dir
                    )
                _free(device)
                last = results[-1]
                print(
                    f"{dev_name} {dtype} threads={nthreads} n={numel:.0e} {label:<16} "
                    f"total {last['total_ns_per_element']:.4f} ns/el "
                    f"({last['repeats']} repeats, {mon.wall_s:.1f} s)",
                    flush=True,
                )
    return _report(settings, results, skipped, threads, final=True)


def _report(settings, results, skipped, threads, final: bool) -> Dict[str, Any]:
    """The report of ``results`` so far (targets filled in); ``complete`` says if final."""
    _add_targets(results)
    return common.make_report(
        "kernels",
        settings,
        results,
        common.environment(num_threads=threads),
        skipped=skipped,
        summary=summarize(results),
        complete=final,
    )


def _row_numel(res: Dict[str, Any], numel: int) -> int:
    shape = res.get("shape")
    if res["method"] in ("aqsgd", "directq", "protocol") and shape:
        return int(math.prod(shape))
    return numel


def _key(r: Dict[str, Any]) -> Tuple:
    return (r["device"], r["threads"], r["numel"], r.get("dtype", "fp32"))


def _add_targets(results: List[Dict[str, Any]]) -> None:
    """Ratio to the copy floor of the same (device, threads, size, dtype), and the target."""
    copies = {_key(r): r for r in results if r["method"] == "copy"}
    psgd = {_key(r): r for r in results if r["method"] == "powersgd"}
    for r in results:
        copy = copies.get(_key(r))
        r["copy_ratio"] = r["total_ns_per_element"] / copy["total_ns_per_element"] if copy else None
        kind = r["method"].split("-")[0]
        if kind == "separate":
            ref = psgd.get(_key(r))
            r["target"] = f"<={SEPARATE_TARGET:g}x, <PowerSGD"
            r["meets"] = (
                r["copy_ratio"] is not None
                and r["copy_ratio"] <= SEPARATE_TARGET
                and ref is not None
                and r["total_ns_per_element"] < ref["total_ns_per_element"]
            )
        elif kind in CODECS:
            r["target"] = f"<={CODEC_TARGET:g}x"
            r["meets"] = r["copy_ratio"] is not None and r["copy_ratio"] <= CODEC_TARGET
        else:
            r["target"], r["meets"] = ("floor" if kind == "copy" else "reference"), None


def summarize(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (device, threads, size, dtype): best SEPARATE block size vs PowerSGD vs copy."""
    groups: Dict[Tuple, Dict[str, Any]] = {}
    for r in results:
        g = groups.setdefault(_key(r), {"separate": {}, "codecs": {}})
        if r["method"] == "separate":
            g["separate"][r["block_size"]] = r["total_ns_per_element"]
        elif r["method"].split("-")[0] in CODECS:
            g["codecs"][r["method"]] = r.get("copy_ratio")
        else:
            g[r["method"]] = r["total_ns_per_element"]
    out = []
    for (device, threads, numel, dtype), g in groups.items():
        row: Dict[str, Any] = {"device": device, "threads": threads, "numel": numel}
        row["dtype"] = dtype
        sep = g["separate"]
        if sep:
            best = min(sep, key=sep.get)
            row["separate_best_block_size"] = best
            row["separate_best_ns_per_element"] = sep[best]
            row["separate_ns_per_element"] = {str(b): v for b, v in sorted(sep.items())}
        row["powersgd_ns_per_element"] = g.get("powersgd")
        row["copy_ns_per_element"] = g.get("copy")
        if sep and g.get("copy"):
            row["separate_best_copy_ratio"] = sep[best] / g["copy"]
        if sep and g.get("powersgd"):
            row["powersgd_over_separate_best"] = g["powersgd"] / sep[best]
            row["separate_cheaper_block_sizes"] = sorted(
                b for b, v in sep.items() if v < g["powersgd"]
            )
        row["codec_copy_ratios"] = g["codecs"]
        out.append(row)
    return out


def print_tables(report: Dict[str, Any]) -> None:
    """One line per row: time per phase, ns/element, ratio to the copy floor, target."""
    print()
    fused = report["settings"].get("fused_kernels", "off")
    print(f"device: {report['environment']['device']}; fused kernels: {fused}")
    headers = ["device", "thr", "dtype", "elements", "method", "compress ms", "decompress ms"]
    headers += ["total ms", "ns/el", "x copy", "target", "meets", "reps"]
    rows = []
    for r in report["results"]:
        label = r["method"] if r["method"] != "separate" else f"separate b{r['block_size']}"
        if r["method"] == "powersgd":
            label += f" r={r['approx_rank']}"
        elif r["method"] == "copy":
            label += f" ({r['gb_per_s']:.0f} GB/s)"
        elif r["method"] == "protocol":
            label += f" k={r['rank']}/{r['shape'][-1]}"
        meets = r.get("meets")
        rows.append(
            [
                r["device"].split(" ")[0],
                r["threads"],
                r.get("dtype", "fp32"),
                f"{r['numel']:.0e}",
                label,
                1e3 * r["compress_s"],
                1e3 * r["decompress_s"],
                1e3 * r["total_s"],
                r["total_ns_per_element"],
                r.get("copy_ratio"),
                r.get("target"),
                "-" if meets is None else ("yes" if meets else "NO"),
                r.get("repeats"),
            ]
        )
    print("compress + decompress per row (median; lower is better; x copy = ns/el over the")
    print("copy's ns/el at the same device, threads, dtype and size)")
    print(common.format_table(headers, rows, digits=4))
    if report.get("skipped"):
        for s in report["skipped"]:
            what = s.get("method", "")
            print(
                f"skipped {what} {s['numel']:.0e} {s.get('dtype', '')} on {s['device']}: "
                f"{s['reason']}"
            )
    if "cuda" not in report["environment"]["device"]:
        print("GPU: not measured (no GPU lent; torch.cuda.is_available() is False)")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.quick:
        defaults = build_parser().parse_args([])
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
        common.set_priority(os.getpid(), args.priority)
    out = args.out or common.default_out_dir("kernels")
    os.makedirs(out, exist_ok=True)
    report = run(args, out)
    path = common.write_report(report, out)
    print_tables(report)
    print(f"\nreport: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
