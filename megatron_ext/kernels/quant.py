"""The k-bit quantizer as fused kernels: scale, round, bit-pack; unpack, dequantize, accumulate.

What it does:
    The quantizer of AQ-SGD, DirectQ and the quantized data-parallel exchange
    (``megatron_ext/compressors/quantize.py`` states it) written once, as pure torch
    functions on a *group layout* that is a parameter: codes in ``[0, 2^b)`` and one fp16
    max-abs scale per group, the groups taken along one dimension of a tensor (``dim``):

    * AQ-SGD / DirectQ ``[k, rows, cols]`` samples: ``channel`` (over the rows: ``[k, 1,
      cols]`` scales), ``token`` (over the columns: ``[k, rows, 1]``), ``microbatch`` (the
      samples stacked along the rows: ``[1, 1, cols]``);
    * the quantized exchange: rows of ``block`` values (``[W, rows, block]``, over the
      block) of a bucket spread into ``W`` partitions.

    The building blocks (:func:`quantize_codes`, :func:`dequantize_codes`,
    :func:`pack_codes`, :func:`unpack_codes`, :func:`uniform_noise`) are composed into the
    chains the methods run, each exposed as one ``torch.library`` op (module docstring of
    :mod:`megatron_ext.kernels`): ``quant_pack`` (scale, round and pack ``x - sub`` into a
    payload: DirectQ, gradients, AQ-SGD deltas), ``unpack_dequant`` (its inverse, cast to
    the activation dtype), ``aqsgd_decode_stage`` (unpack, dequantize, add to the
    per-sample buffer rows and stage the new rows with their finite / clamped flags: both
    sides of an AQ-SGD boundary run this same op on the same bytes, so their buffers stay
    bit-identical compiled or eager), ``aqsgd_stage`` (first visits), their forms on a
    whole device buffer that read (and, at the commit, update in place) only the
    addressed rows (``aqsgd_encode_rows``, ``aqsgd_decode_rows``, ``aqsgd_commit_rows``),
    and the quantized exchange's ``quantized_encode_rows`` (spread, add the worker error, quantize, new worker
    error, non-finite flag, pack), ``quantized_reduce_rows`` (unpack and reduce the
    received partitions, then the server error and re-quantization) and
    ``quantized_decode_rows_into`` (unpack, dequantize, write the gradient).

    Stochastic rounding adds uniform noise drawn from a counter-based hash
    (:func:`uniform_noise`: two rounds of the ``lowbias32`` integer hash of the element's
    flat index mixed with a 64-bit seed drawn on the tensor's device, :func:`draw_seed`), so
    the eager and the compiled kernel draw the same noise. Like ``torch.rand`` it has 24
    bits of resolution, so ``floor(y) + (u < frac(y))`` is unbiased up to ``2^-24`` of a
    step.

Why one family:
    Before, ``compressors/quantize.py``'s functions were shared by every method and the
    methods chained them with slicing, casts, concatenations and error updates: 12-125
    passes through memory per transfer (``docs/performance/cost/report.md``). Here each
    method's whole chain is one op (one kernel launch in the cost model's terms; inductor
    may split it into a reduction for the scales and the pointwise rest) built from the same
    blocks, so codes, packing and scales agree bit for bit across methods and modes.

Constraints:
    Pure torch (no Megatron, no ``torch.distributed``). Codes and packed bytes of finite
    inputs are bit-identical eager and compiled (``torch.compile`` keeps eager's fp16
    rounding of the scales: :mod:`megatron_ext.kernels` compiles with
    ``emulate_precision_casts``); dequantized values may differ by one rounding where a
    compiler contracts a multiply-add (CUDA). A group holding a non-finite value has a
    non-finite scale, so every value decoded from it is non-finite whatever its codes (the
    codes of such groups are not specified). Bytes are little-endian (x86, ARM, GPUs).
"""

from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_ext.kernels import ROW_GATHERS, define_op, run

__all__ = [
    "EPS",
    "GRANULARITIES",
    "draw_seed",
    "uniform_noise",
    "quantize_codes",
    "dequantize_codes",
    "pack_codes",
    "unpack_codes",
    "packed_nbytes",
    "sample_scale_shape",
    "rows_layout",
    "quant_pack",
    "unpack_dequant",
    "aqsgd_decode_stage",
    "aqsgd_stage",
    "aqsgd_encode_rows",
    "aqsgd_decode_rows",
    "aqsgd_commit_rows",
    "quantized_encode_rows",
    "quantized_reduce_rows",
    "quantized_decode_rows_into",
]

EPS = 1e-6
"""Added to the scale before dividing (AQ-SGD's public code)."""

GRANULARITIES = ("channel", "token", "microbatch")
"""Scale groups of ``[k, rows, cols]`` samples (module docstring)."""

_MASK32 = 0xFFFFFFFF


# -- the building blocks -----------------------------------------------------------------------


def draw_seed(device: torch.device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Two 32-bit words (int64 ``[2]``) drawn on ``device`` from ``generator`` (None: the
    device's default generator): the seed of :func:`uniform_noise`, with no host copy."""
    return torch.randint(0, 1 << 32, (2,), device=device, generator=generator, dtype=torch.int64)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)`` without int64 overflow (products
    stay below ``2^49``; signed overflow is undefined in the compiled C++)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` (C. Wellons' integer hash): a bijection of ``[0, 2^32)`` with low bias."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 noise of ``shape`` uniform on ``{0, 1, ..., 2^24 - 1} / 2^24``: element ``i`` (its
    row-major index) gets ``hash(hash(lo32(i) ^ s0) ^ hi32(i) ^ s1) >> 8`` for ``seed = (s0,
    s1)`` (:func:`draw_seed`)."""
    numel = 1
    for d in shape:
        numel *= d
    idx = torch.arange(numel, device=device, dtype=torch.int64).view(shape)
    h = _hash32((idx & _MASK32) ^ seed[0])
    h = _hash32(h ^ (idx >> 32) ^ seed[1])
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _levels(bits: int) -> float:
    return float(1 << (bits - 1))


def quantize_codes(
    h: torch.Tensor, bits: int, dim: int, seed: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes (``h``'s shape) and fp16 scales (``dim`` kept as 1) of fp32 ``h``, one
    scale per group along ``dim``: ``q = clip(round(h / (scale + eps) * 2^(b-1)), -2^(b-1),
    2^(b-1) - 1) + 2^(b-1)``, nearest rounding or, with ``seed``, stochastic."""
    levels = _levels(bits)
    scale = h.abs().amax(dim=dim, keepdim=True).half()
    y = h / (scale.float() + EPS) * levels
    if seed is None:
        y = y.round()
    else:
        floor = y.floor()
        y = floor + (uniform_noise(seed, tuple(y.shape), y.device) < (y - floor)).float()
    y = y.clamp(-levels, levels - 1)
    return (y + levels).to(torch.uint8), scale


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``(codes - 2^(b-1)) / 2^(b-1) * scale`` (scales broadcast over their groups)."""
    levels = _levels(bits)
    return (codes.float() - levels) / levels * scales.float()


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed codes: groups of 8 codes in ``bits`` bytes (8 bits: one byte
    each, unpadded)."""
    if bits == 8:
        return numel
    return -(-numel // 8) * bits


def pack_codes(codes: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """``[P, L]`` uint8 codes (``< 2^bits``), each row zero-padded to ``width`` codes (a
    multiple of 8 below 8 bits), packed: ``[P, packed_nbytes(width, bits)]``; every 8 codes
    become ``bits`` bytes, little-endian within the group."""
    parts = codes.shape[0]
    if width != codes.shape[1]:
        codes = F.pad(codes, (0, width - codes.shape[1]))
    if bits == 8:
        return codes.clone() if width == codes.shape[1] else codes
    if 8 % bits == 0:
        per = 8 // bits
        g = codes.view(parts, width // per, per)
        out = g[..., 0]
        for i in range(1, per):
            out = out | (g[..., i] << (bits * i))
        return out
    g = codes.view(parts, width // 8, 8).to(torch.int64)
    word = g[..., 0]
    for i in range(1, 8):
        word = word | (g[..., i] << (bits * i))
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], dim=-1)
    return out.to(torch.uint8).view(parts, -1)


def unpack_codes(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[P, width]`` uint8 codes of ``[P, nbytes]`` bytes."""
    parts = packed.shape[0]
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        out = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1)
        return out.view(parts, width)
    g = packed.reshape(parts, width // 8, bits).to(torch.int64)
    word = g[..., 0]
    for j in range(1, bits):
        word = word | (g[..., j] << (8 * j))
    out = torch.stack([(word >> (bits * i)) & mask for i in range(8)], dim=-1)
    return out.to(torch.uint8).view(parts, width)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of fp16 or fp32 ``t``: ``[..., n]`` -> uint8 ``[..., n * size]``
    (integer arithmetic, so any layout and offset compiles)."""
    size = t.element_size()
    word = t.view(torch.int16 if size == 2 else torch.int32).to(torch.int64) & (
        (1 << (8 * size)) - 1
    )
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(size)], dim=-1)
    return out.to(torch.uint8).flatten(-2)


def _from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_bytes_of`: uint8 ``[..., n * size]`` -> ``dtype`` ``[..., n]``
    (reads bytes at any offset: a slice of a payload need not be aligned)."""
    size = 2 if dtype == torch.float16 else 4
    g = raw.reshape(raw.shape[:-1] + (raw.shape[-1] // size, size)).to(torch.int64)
    word = g[..., 0]
    for j in range(1, size):
        word = word | (g[..., j] << (8 * j))
    # Two's complement narrowing: the top bit becomes the sign bit of the integer type.
    bits = 8 * size
    word = word - ((word >> (bits - 1)) << bits)
    return word.to(torch.int16 if size == 2 else torch.int32).view(dtype)


def sample_scale_shape(k: int, rows: int, cols: int, granularity: str) -> Tuple[int, ...]:
    """Shape of the fp16 scales of ``k`` ``[rows, cols]`` samples at ``granularity``."""
    if granularity == "channel":
        return (k, 1, cols)
    if granularity == "token":
        return (k, rows, 1)
    if granularity == "microbatch":
        return (1, 1, cols)
    raise ValueError(f"unknown granularity {granularity!r} (choose from {GRANULARITIES})")


def _groups(h: torch.Tensor, granularity: str) -> Tuple[torch.Tensor, int]:
    """``[k, rows, cols]`` as the tensor whose ``dim`` holds the groups (module docstring)."""
    if granularity == "microbatch":
        return h.reshape(1, -1, h.shape[-1]), 1
    sample_scale_shape(1, 1, 1, granularity)  # refuses unknown names
    return h, 1 if granularity == "channel" else 2


def _pad8(n: int) -> int:
    return n + (-n) % 8


def _static(*values: int) -> Tuple[int, ...]:
    """``values`` as Python ints. Under ``torch.compile`` (dynamic shapes) this makes them
    compile-time constants (guarded): the bit width, the row length and the hidden size do
    not change within a run, and the index arithmetic of packing with a constant row is
    shifts instead of divisions (measured on the CPU, 1e7 values: 4x faster); sizes that do
    vary (samples, bucket lengths) stay symbolic. Eager: a no-op."""
    return tuple(operator.index(v) for v in values)  # int() would leave a SymInt symbolic


def _pack_rows(codes: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """``[A, B, C]`` codes as ``[A, packed_nbytes(width, bits)]`` bytes: each of the ``A``
    parts' ``B x C`` codes in order, zero-padded to ``width`` (>= ``B x C``), packed. With
    ``C`` a multiple of 8 every row of ``C`` codes packs on its own into the same bytes (and
    ``width`` is ``B x C``), which compiles to kernels without divisions by ``B``."""
    a, b, c = codes.shape
    if c % 8 == 0:
        return pack_codes(codes.reshape(a * b, c), bits, c).view(a, -1)
    return pack_codes(codes.reshape(a, b * c), bits, width)


def _unpack_rows(raw: torch.Tensor, bits: int, b: int, c: int, width: int) -> torch.Tensor:
    """Inverse of :func:`_pack_rows`: ``[A, nbytes]`` bytes -> ``[A, B, C]`` codes."""
    a = raw.shape[0]
    if c % 8 == 0:
        return unpack_codes(raw.reshape(a * b, -1), bits, c).view(a, b, c)
    return unpack_codes(raw, bits, width)[:, : b * c].reshape(a, b, c)


def _sample_codes_nbytes(k: int, rows: int, cols: int, bits: int) -> int:
    return k * packed_nbytes(_pad8(rows * cols), bits)


# -- pipeline samples (AQ-SGD, DirectQ) ---------------------------------------------------------
#
# Payload of k quantized [rows, cols] samples: every sample's codes (padded to a multiple of 8
# values, so samples stay byte-aligned), packed, then the fp16 scales of
# :func:`sample_scale_shape` in row-major order.


def _quant_pack(
    x: torch.Tensor,
    sub: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    bits: int,
    granularity: str,
) -> torch.Tensor:
    """Payload (uint8, see above) of ``k`` samples ``x - sub`` (``[k, rows, cols]``, any
    float dtype and strides; ``sub`` None: ``x``), quantized to ``bits`` with scales per
    ``granularity``, stochastic rounding when ``seed`` (:func:`draw_seed`) is given."""
    (bits,) = _static(bits)
    k = x.shape[0]
    rows, cols = _static(x.shape[1], x.shape[2])
    h = x.float() if sub is None else x.float() - sub.float()
    grouped, dim = _groups(h, granularity)
    codes, scales = quantize_codes(grouped, bits, dim, seed)
    packed = _pack_rows(codes.view(k, rows, cols), bits, _pad8(rows * cols))
    return torch.cat([packed.reshape(-1), _bytes_of(scales.reshape(1, -1)).reshape(-1)])


def _unpack_samples(
    payload: torch.Tensor, bits: int, granularity: str, k: int, rows: int, cols: int
) -> torch.Tensor:
    """fp32 ``[k, rows, cols]`` of a payload (see above)."""
    bits, rows, cols = _static(bits, rows, cols)
    ncodes = _sample_codes_nbytes(k, rows, cols, bits)
    sshape = sample_scale_shape(k, rows, cols, granularity)
    nscales = 2 * sshape[0] * sshape[1] * sshape[2]
    codes = _unpack_rows(payload[:ncodes].view(k, -1), bits, rows, cols, _pad8(rows * cols))
    scales = _from_bytes(payload[ncodes : ncodes + nscales].view(1, -1), torch.float16)
    return dequantize_codes(codes, scales.view(sshape), bits)


def _unpack_dequant(
    payload: torch.Tensor,
    bits: int,
    granularity: str,
    k: int,
    rows: int,
    cols: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[k, rows, cols]`` values of ``dtype`` of a :func:`quant_pack` payload."""
    return _unpack_samples(payload, bits, granularity, k, rows, cols).to(dtype)


def _stage_values(
    v: torch.Tensor, dtype: torch.dtype, old: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``v`` (fp32 ``[k, rows, cols]``) as buffer rows of ``dtype``: per sample whether it
    is finite and whether it was clamped to ``dtype``'s range (finite values beyond it are
    stored clamped, never as inf); with ``old`` (the rows' current values), non-finite
    samples keep their old row."""
    finite = torch.isfinite(v).flatten(1).all(dim=1)
    if dtype == torch.float32:
        clamped = torch.zeros_like(finite)
    else:
        top = torch.finfo(dtype).max
        clamped = (v.abs() > top).flatten(1).any(dim=1) & finite
        v = v.clamp(-top, top)
    staged = v.to(dtype)
    if old is not None:
        staged = torch.where(finite.view(-1, 1, 1), staged, old)
    return staged, finite, clamped


def _rows_plus_deltas(
    payload: torch.Tensor, m: torch.Tensor, bits: int, granularity: str
) -> torch.Tensor:
    """``m`` (``[k, rows, cols]``, buffer rows) plus the payload's dequantized deltas, fp32."""
    k, rows, cols = m.shape
    return m.float() + _unpack_samples(payload, bits, granularity, k, rows, cols)


def _aqsgd_decode_stage(
    payload: torch.Tensor,
    m: torch.Tensor,
    bits: int,
    granularity: str,
    out_dtype: Optional[torch.dtype],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """AQ-SGD's buffer update of ``k`` revisited samples: ``v = m + dequantize(payload)``
    (fp32; ``m`` the buffer rows ``[k, rows, cols]``), returned as

    * the rows to store (``m``'s dtype; clamped to its range; ``m`` where ``v`` is not
      finite),
    * per sample: finite, clamped (bool ``[k]``),
    * ``v`` in ``out_dtype`` (what the receiver computes with), or an empty tensor when
      ``out_dtype`` is None (the sender)."""
    v = _rows_plus_deltas(payload, m, bits, granularity)
    staged, finite, clamped = _stage_values(v, m.dtype, m)
    out = v.to(out_dtype) if out_dtype is not None else v.new_empty(0)
    return staged, finite, clamped, out


def _aqsgd_stage(
    v: torch.Tensor, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-precision samples ``v`` (``[k, rows, cols]``) as buffer rows of ``dtype`` with
    their finite and clamped flags (the rows of non-finite samples are not to be stored)."""
    # A copy: an op's outputs must not alias its inputs (fp32 rows of fp32 values).
    return _stage_values(v.to(torch.float32, copy=True), dtype, None)


quant_pack = define_op("megatron_ext::quant_pack", _quant_pack)


def _payload_nbytes(k: int, rows: int, cols: int, bits: int, granularity: str) -> int:
    sshape = sample_scale_shape(k, rows, cols, granularity)
    return _sample_codes_nbytes(k, rows, cols, bits) + 2 * sshape[0] * sshape[1] * sshape[2]


@quant_pack.register_fake
def _(x, sub, seed, bits, granularity):
    return x.new_empty(_payload_nbytes(*x.shape, bits, granularity), dtype=torch.uint8)


unpack_dequant = define_op("megatron_ext::unpack_dequant", _unpack_dequant)


@unpack_dequant.register_fake
def _(payload, bits, granularity, k, rows, cols, dtype):
    return payload.new_empty((k, rows, cols), dtype=dtype)


aqsgd_decode_stage = define_op("megatron_ext::aqsgd_decode_stage", _aqsgd_decode_stage)


@aqsgd_decode_stage.register_fake
def _(payload, m, bits, granularity, out_dtype):
    k = m.shape[0]
    flags = m.new_empty(k, dtype=torch.bool)
    out = m.new_empty(m.shape, dtype=out_dtype) if out_dtype is not None else m.new_empty(0)
    return torch.empty_like(m), flags, torch.empty_like(flags), out


aqsgd_stage = define_op("megatron_ext::aqsgd_stage", _aqsgd_stage)


@aqsgd_stage.register_fake
def _(v, dtype):
    flags = v.new_empty(v.shape[0], dtype=torch.bool)
    return v.new_empty(v.shape, dtype=dtype), flags, torch.empty_like(flags)


# -- AQ-SGD on the whole buffer: the row gather and the in-place update inside the kernels -------
#
# The ops above take the buffer rows ``m`` as a tensor: a device buffer had to gather them
# (``index_select``, a read and a write of every row) and scatter the staged rows back at the
# commit (``index_copy_``, another read and write), about 5 of the 7.7 copies of a step's
# activations the forward direction cost. The three ops below take the whole buffer
# ``table`` (``[num_slots, rows, cols]``) and the rows' slots ``index`` (on the table's
# device) instead and read only those rows; the commit updates them in place. The sender
# quantizes against the rows (``aqsgd_encode_rows``), the receiver computes its activations
# from them (``aqsgd_decode_rows``), and both sides apply the payload at the end of the step
# (``aqsgd_commit_rows``: the same op on the same bytes and rows, so the buffers stay
# bit-identical compiled too). Deferring the update to the commit keeps AQ-SGD's rule that
# an uncommitted (replayed or skipped) step leaves the buffers as they were, at the price of
# reading the rows again at the commit; no staged copy of the rows is kept (the payload is).


def _check_index(_: torch.Tensor, table: torch.Tensor, index: torch.Tensor, *__: object) -> None:
    """The arguments of an op below (a tensor, the buffer ``table``, its slots ``index``,
    the rest): an index on another device than the buffer would be copied per access (a
    host synchronization on a GPU): refused."""
    if index.device != table.device or index.dtype != torch.int64:
        raise ValueError(
            f"AQ-SGD buffer slots must be int64 on the buffer's device ({table.device}), got "
            f"{index.dtype} on {index.device}"
        )


def _aqsgd_encode_rows(
    x: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    seed: Optional[torch.Tensor],
    bits: int,
    granularity: str,
) -> torch.Tensor:
    """The sender's payload of ``k`` revisited samples: :func:`quant_pack` of ``x -
    table[index]`` (``x`` ``[k, rows, cols]``; ``index`` int64 ``[k]`` on ``table``'s
    device), the rows read inside the kernel."""
    return _quant_pack(x, table.index_select(0, index), seed, bits, granularity)


def _aqsgd_decode_rows(
    payload: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    bits: int,
    granularity: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The receiver's activations of ``k`` revisited samples: ``table[index] +
    dequantize(payload)`` (fp32 arithmetic) in ``out_dtype``, ``[k, rows, cols]``; the
    buffer is not written (:func:`aqsgd_commit_rows` does, at the end of the step)."""
    m = table.index_select(0, index)
    return _rows_plus_deltas(payload, m, bits, granularity).to(out_dtype)


def _aqsgd_commit_rows(
    payload: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    bits: int,
    granularity: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """AQ-SGD's buffer update of ``k`` revisited samples in place: rows ``table[index]``
    (distinct slots) become ``table[index] + dequantize(payload)`` clamped to the table
    dtype's range, except the rows of samples whose new value is not finite, which keep
    their value; returns the per-sample finite and clamped flags (bool ``[k]``). The same
    rows and flags as :func:`aqsgd_decode_stage` of the gathered rows."""
    m = table.index_select(0, index)
    v = _rows_plus_deltas(payload, m, bits, granularity)
    staged, finite, clamped = _stage_values(v, table.dtype, m)
    table.index_copy_(0, index, staged)
    return finite, clamped


aqsgd_encode_rows = define_op(
    "megatron_ext::aqsgd_encode_rows", _aqsgd_encode_rows, check=_check_index
)


@aqsgd_encode_rows.register_fake
def _(x, table, index, seed, bits, granularity):
    _check_index(x, table, index)
    return x.new_empty(_payload_nbytes(*x.shape, bits, granularity), dtype=torch.uint8)


aqsgd_decode_rows = define_op(
    "megatron_ext::aqsgd_decode_rows", _aqsgd_decode_rows, check=_check_index
)


@aqsgd_decode_rows.register_fake
def _(payload, table, index, bits, granularity, out_dtype):
    _check_index(payload, table, index)
    return table.new_empty((index.shape[0],) + tuple(table.shape[1:]), dtype=out_dtype)


aqsgd_commit_rows = define_op(
    "megatron_ext::aqsgd_commit_rows",
    _aqsgd_commit_rows,
    mutates_args=("table",),
    check=_check_index,
)


@aqsgd_commit_rows.register_fake
def _(payload, table, index, bits, granularity):
    _check_index(payload, table, index)
    flags = table.new_empty(index.shape[0], dtype=torch.bool)
    return flags, torch.empty_like(flags)


ROW_GATHERS["megatron_ext::aqsgd_encode_rows"] = ("table", "index")
ROW_GATHERS["megatron_ext::aqsgd_decode_rows"] = ("table", "index")
ROW_GATHERS["megatron_ext::aqsgd_commit_rows"] = ("table", "index")


# -- the quantized data-parallel exchange ------------------------------------------------------
#
# A bucket of n values is cut into W partitions of ``part`` values, each padded to ``rows``
# rows of ``block`` values (``padded``); on the wire a partition is its codes (padded to
# ``width``), packed, then its ``rows`` fp16 scales, then (worker side) 4 bytes of the
# sender's fp32 non-finite flag.


def rows_layout(part: int, block: int, bits: int) -> Tuple[int, int, int, int]:
    """``(rows, padded, width, nbytes)`` of a partition of ``part`` values: rows of
    ``block``, values padded to whole rows, codes padded to whole groups of 8 below 8 bits,
    bytes on the wire without the flag."""
    rows = -(-part // block)
    padded = rows * block
    width = padded if bits == 8 else _pad8(padded)
    return rows, padded, width, packed_nbytes(width, bits) + 2 * rows


def _encode_rows(
    h: torch.Tensor, seed: Optional[torch.Tensor], bits: int, block: int, width: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[P, padded]`` fp32 -> (``[P, nbytes]`` wire bytes, ``[P, padded]`` dequantized)."""
    parts, padded = h.shape
    rows = padded // block
    codes, scales = quantize_codes(h.view(parts, rows, block), bits, 2, seed)
    deq = dequantize_codes(codes, scales, bits).view(parts, padded)
    packed = _pack_rows(codes, bits, width)
    return torch.cat([packed, _bytes_of(scales.view(parts, -1))], dim=1), deq


def _decode_rows(raw: torch.Tensor, bits: int, block: int, padded: int) -> torch.Tensor:
    """Inverse of :func:`_encode_rows`: ``[P, nbytes]`` -> ``[P, padded]`` fp32."""
    parts = raw.shape[0]
    rows = padded // block
    width = padded if bits == 8 else _pad8(padded)
    ncodes = packed_nbytes(width, bits)
    codes = _unpack_rows(raw[:, :ncodes], bits, rows, block, width)
    scales = _from_bytes(raw[:, ncodes : ncodes + 2 * rows], torch.float16)
    values = dequantize_codes(codes, scales.view(parts, rows, 1), bits)
    return values.view(parts, padded)


def _spread(flat: torch.Tensor, size: int, part: int, padded: int) -> torch.Tensor:
    """``[size, padded]`` fp32: partition ``j`` of ``flat`` in row ``j``, zeros past it."""
    x = flat.float()
    x = F.pad(x, (0, size * part - x.shape[0])).view(size, part)
    return F.pad(x, (0, padded - part)) if padded != part else x


def _quantized_encode_rows(
    grad: torch.Tensor,
    error: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    bits: int,
    block: int,
    size: int,
    part: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exchange's worker side of one bucket ``grad`` (flat, any float dtype):
    ``h = spread(grad) + error`` (``[size, padded]`` fp32; ``error`` None: no error
    feedback), quantized in rows of ``block``; returns the ``[size, nbytes + 4]`` bytes to
    send (partition ``j`` in row ``j``, its flag bytes last) and the new worker error
    ``h - dequantize`` (empty without error feedback)."""
    bits, block, size = _static(bits, block, size)
    _, padded, width, _ = rows_layout(part, block, bits)
    h = _spread(grad, size, part, padded)
    if error is not None:
        h = h + error
    wire, deq = _encode_rows(h, seed, bits, block, width)
    new_error = h - deq if error is not None else h.new_empty(0)
    # The sender's non-finite flag (any NaN / Inf in its input h), 4 bytes per partition.
    flag = torch.isfinite(h).logical_not().any().to(torch.float32).reshape(1, 1)
    flag_bytes = _bytes_of(flag).expand(size, 4)
    return torch.cat([wire, flag_bytes], dim=1), new_error


def _quantized_reduce_rows(
    recv: torch.Tensor,
    error: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    bits: int,
    block: int,
    part: int,
    mean: bool,
    requantize: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exchange's server side: the ``W`` received partitions (``[W, nbytes + 4]``)
    unpacked, dequantized and summed (``mean``: divided by ``W``) into ``r``; returns
    ``(flag, r, wire, new_error)``: the summed flags (``[1]``), then either ``r``
    (``[padded]`` fp32; ``requantize`` False) or ``s = r + error`` quantized again (its
    ``[nbytes]`` wire bytes and the new server error ``s - dequantize``; empty tensors in
    the unused places)."""
    bits, block, size = _static(bits, block, recv.shape[0])
    _, padded, width, nbytes = rows_layout(part, block, bits)
    flag = _from_bytes(recv[:, nbytes:], torch.float32).sum().reshape(1)
    r = _decode_rows(recv[:, :nbytes], bits, block, padded).sum(dim=0)
    if mean:
        r = r / size
    if not requantize:
        return flag, r, r.new_empty(0, dtype=torch.uint8), r.new_empty(0)
    s = r + error if error is not None else r
    wire, deq = _encode_rows(s.view(1, padded), seed, bits, block, width)
    new_error = s - deq.view(-1) if error is not None else r.new_empty(0)
    return flag, r.new_empty(0), wire.view(-1), new_error


def _quantized_decode_rows_into(
    gathered: torch.Tensor, bits: int, block: int, part: int, out: torch.Tensor
) -> None:
    bits, block, _ = _static(bits, block, gathered.shape[0])
    _, padded, _, _ = rows_layout(part, block, bits)
    values = _decode_rows(gathered, bits, block, padded)
    out.copy_(values[:, :part].reshape(-1)[: out.shape[0]].to(out.dtype))


quantized_encode_rows = define_op("megatron_ext::quantized_encode_rows", _quantized_encode_rows)


@quantized_encode_rows.register_fake
def _(grad, error, seed, bits, block, size, part):
    _, padded, _, nbytes = rows_layout(part, block, bits)
    send = grad.new_empty((size, nbytes + 4), dtype=torch.uint8)
    new_error = grad.new_empty((size, padded) if error is not None else 0, dtype=torch.float32)
    return send, new_error


quantized_reduce_rows = define_op("megatron_ext::quantized_reduce_rows", _quantized_reduce_rows)


@quantized_reduce_rows.register_fake
def _(recv, error, seed, bits, block, part, mean, requantize):
    _, padded, _, nbytes = rows_layout(part, block, bits)
    flag = recv.new_empty(1, dtype=torch.float32)
    empty = recv.new_empty(0, dtype=torch.float32)
    if not requantize:
        return flag, recv.new_empty(padded, dtype=torch.float32), empty.to(torch.uint8), empty
    new_error = recv.new_empty(padded, dtype=torch.float32) if error is not None else empty
    return flag, empty, recv.new_empty(nbytes, dtype=torch.uint8), new_error


# A schema of its own: ``out`` is keyword-only (written, not read; torch.library.custom_op
# takes no keyword-only tensors).
torch.library.define(
    "megatron_ext::quantized_decode_rows_into",
    "(Tensor gathered, int bits, int block, int part, *, Tensor(a!) out) -> ()",
)


@torch.library.impl("megatron_ext::quantized_decode_rows_into", "CompositeExplicitAutograd")
def _quantized_decode_rows_into_impl(gathered, bits, block, part, *, out):
    run(_quantized_decode_rows_into, gathered, bits, block, part, out)


@torch.library.register_fake("megatron_ext::quantized_decode_rows_into")
def _(gathered, bits, block, part, *, out):
    return None


def quantized_decode_rows_into(
    gathered: torch.Tensor, bits: int, block: int, part: int, *, out: torch.Tensor
) -> None:
    """The gathered partitions (``[W, nbytes]``) unpacked, dequantized and written into the
    flat bucket ``out`` (its dtype; ``out`` is written, not read)."""
    torch.ops.megatron_ext.quantized_decode_rows_into(gathered, bits, block, part, out=out)
