"""Low-bit quantization with fp16 max-abs scales and real bit packing (AQ-SGD, DirectQ).

What it does:
    :func:`quantize` maps a float tensor ``x`` of shape ``(..., n)`` to ``bits``-bit signed
    integer codes with one fp16 scale per group, the quantizer of AQ-SGD's public code
    (``DS3Lab/AC-SGD``, ``compress/fixpoint.py``), restated:

    * ``scale = max |x|`` over the group, rounded to fp16;
    * ``q = clip(round(x / (scale + 1e-6) * 2^(b-1)), -2^(b-1), 2^(b-1) - 1)`` (nearest, or
      stochastic rounding: floor plus a Bernoulli draw with the fractional part, unbiased);
    * dequantized ``x_hat = q / 2^(b-1) * scale``, so ``|x - x_hat| <= scale / 2^(b-1)``
      with nearest rounding (half a step, one step where ``2^(b-1) * scale`` clips).

    Groups (``granularity``): ``"channel"``, one scale per column of the last dimension
    taken over the second-to-last (per sample and hidden channel over the sequence for a
    ``[k, seq, hidden]`` tensor; the public AQ-SGD code's per-channel scale when its
    micro-batch is 1, since it takes the maximum over the micro-batch too); ``"token"``,
    one scale per row (over the hidden channels of a token).

    :func:`pack_bits` / :func:`unpack_bits` store ``b``-bit codes densely: every 8 codes
    become ``b`` bytes (4 bits: two codes a byte; 3 bits: eight codes in three bytes; 2 bits:
    four a byte; 8 bits: one a byte, unpadded), little-endian within the group of 8.
    :func:`packed_nbytes` is the size on
    the wire, a pure function of (numel, bits), so a receiver can allocate it in advance.

Constraints:
    Pure torch; no torch.distributed, no Megatron. Deterministic given the input (and the
    generator for stochastic rounding): sender and receiver that dequantize the same codes
    get bit-identical results. A generator must live on the device of the tensor it
    rounds (torch draws CUDA noise from CUDA generators only); a mismatch is refused with a
    ``ValueError`` naming both devices instead of failing inside ``torch.rand``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = [
    "GRANULARITIES",
    "Quantized",
    "quantize",
    "dequantize",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "scale_shape",
    "quantized_nbytes",
]

GRANULARITIES = ("channel", "token")
_EPS = 1e-6


@dataclass
class Quantized:
    """Codes and scales of one quantized tensor (codes unpacked, one uint8 per value)."""

    codes: torch.Tensor
    """uint8 codes ``q + 2^(b-1)`` in ``[0, 2^b)``, shape of the input."""

    scales: torch.Tensor
    """fp16 scales (:func:`scale_shape`)."""

    bits: int
    """Bits per code."""


def scale_shape(shape: Tuple[int, ...], granularity: str) -> Tuple[int, ...]:
    """Shape of the scales of a tensor of ``shape`` (at least 2-D) at ``granularity``."""
    if len(shape) < 2:
        raise ValueError(f"quantize needs a tensor with >= 2 dimensions, got shape {shape}")
    if granularity == "channel":
        return tuple(shape[:-2]) + (1, shape[-1])
    if granularity == "token":
        return tuple(shape[:-1]) + (1,)
    raise ValueError(f"unknown granularity {granularity!r} (choose from {GRANULARITIES})")


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")


def quantize(
    x: torch.Tensor,
    bits: int,
    *,
    granularity: str = "channel",
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
) -> Quantized:
    """Quantize ``x`` (see module docstring); computed in fp32.

    Args:
        x: tensor of shape ``(..., rows, cols)``.
        bits: bits per code (1-8; one is the sign).
        granularity: "channel" or "token".
        stochastic: stochastic rounding (unbiased) instead of nearest.
        generator: random source of stochastic rounding, on ``x``'s device (None: torch's
            default generator of that device).

    Raises:
        ValueError: ``generator`` lives on another device type than ``x``.
    """
    _check_bits(bits)
    if stochastic and generator is not None and generator.device.type != x.device.type:
        raise ValueError(
            f"stochastic rounding of a tensor on {x.device} needs a generator on that device, "
            f"got one on {generator.device}"
        )
    xf = x.float()
    if granularity == "channel":
        scale = xf.abs().amax(dim=-2, keepdim=True)
    elif granularity == "token":
        scale = xf.abs().amax(dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown granularity {granularity!r} (choose from {GRANULARITIES})")
    scale = scale.half()
    levels = float(1 << (bits - 1))
    y = xf / (scale.float() + _EPS) * levels
    if stochastic:
        floor = y.floor()
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        y = floor + (noise < (y - floor)).float()
    else:
        y = y.round()
    y = y.clamp_(-levels, levels - 1)
    codes = (y + levels).to(torch.uint8)
    return Quantized(codes=codes, scales=scale, bits=bits)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 values of ``q``: ``(codes - 2^(b-1)) / 2^(b-1) * scale``."""
    levels = float(1 << (q.bits - 1))
    return (q.codes.float() - levels) / levels * q.scales.float()


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of :func:`pack_bits` for ``numel`` codes (groups of 8 codes -> ``bits`` bytes;
    8-bit codes are stored as they are)."""
    _check_bits(bits)
    if bits == 8:
        return numel
    return -(-numel // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2^bits) into ``packed_nbytes(numel, bits)`` bytes."""
    _check_bits(bits)
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.clone()
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if 8 % bits == 0:
        # 1, 2, 4 bits: whole codes per byte, combined in uint8 (same layout as below).
        per = 8 // bits
        groups = flat.view(-1, per)
        out = groups[:, 0].clone()
        for i in range(1, per):
            out |= groups[:, i] << (bits * i)
        return out
    groups = flat.view(-1, 8).to(torch.int64)
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    word = (groups << shifts).sum(dim=1)  # 8 * bits <= 64 bits per group
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    out = (word.unsqueeze(1) >> byte_shifts) & 0xFF
    return out.to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` uint8 codes."""
    _check_bits(bits)
    if packed.numel() != packed_nbytes(numel, bits):
        raise ValueError(
            f"{packed.numel()} bytes do not hold {numel} codes of {bits} bits "
            f"({packed_nbytes(numel, bits)} expected)"
        )
    if bits == 8:
        return packed.reshape(-1)[:numel].clone()
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        flat = packed.reshape(-1)
        out = torch.stack([(flat >> (bits * i)) & mask for i in range(per)], dim=1)
        return out.reshape(-1)[:numel]
    groups = packed.reshape(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (groups << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(-1)[:numel]


def quantized_nbytes(shape: Tuple[int, ...], bits: int, granularity: str) -> int:
    """Wire bytes of a tensor of ``shape``: packed codes plus fp16 scales."""
    numel = 1
    for d in shape:
        numel *= d
    scales = 1
    for d in scale_shape(tuple(shape), granularity):
        scales *= d
    return packed_nbytes(numel, bits) + 2 * scales
