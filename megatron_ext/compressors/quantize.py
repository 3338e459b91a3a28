"""Low-bit quantization with fp16 max-abs scales and real bit packing (AQ-SGD, DirectQ).

What it does:
    :func:`quantize` maps a float tensor ``x`` of shape ``(..., n)`` to ``bits``-bit signed
    integer codes with one fp16 scale per group, the quantizer of AQ-SGD's public code
    (``DS3Lab/AC-SGD``, ``compress/fixpoint.py``), restated:

    * ``scale = max |x|`` over the group, rounded to fp16;
    * ``q = clip(round(x / (scale + 1e-6) * 2^(b-1)), -2^(b-1), 2^(b-1) - 1)`` (nearest, or
      stochastic rounding: floor plus a Bernoulli draw with the fractional part, unbiased;
      the uniform noise is a counter-based hash of the element index and a seed drawn
      from the generator on the tensor's device, as the fused kernels draw it);
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

    The arithmetic is :mod:`megatron_ext.kernels.quant`'s (the building blocks of the fused
    kernels the methods call), so these functions and the methods' kernels agree bit for bit.

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

from megatron_ext.kernels import quant as _core

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
    if granularity == "channel":
        dim = -2
    elif granularity == "token":
        dim = -1
    else:
        raise ValueError(f"unknown granularity {granularity!r} (choose from {GRANULARITIES})")
    seed = _core.draw_seed(x.device, generator) if stochastic else None
    codes, scale = _core.quantize_codes(x.float(), bits, dim, seed)
    return Quantized(codes=codes, scales=scale, bits=bits)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 values of ``q``: ``(codes - 2^(b-1)) / 2^(b-1) * scale``."""
    return _core.dequantize_codes(q.codes, q.scales, q.bits)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of :func:`pack_bits` for ``numel`` codes (groups of 8 codes -> ``bits`` bytes;
    8-bit codes are stored as they are)."""
    _check_bits(bits)
    return _core.packed_nbytes(numel, bits)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2^bits) into ``packed_nbytes(numel, bits)`` bytes."""
    _check_bits(bits)
    flat = codes.reshape(1, -1)
    n = flat.shape[1]
    width = n if bits == 8 else n + (-n) % 8
    return _core.pack_codes(flat, bits, width).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` uint8 codes."""
    _check_bits(bits)
    if packed.numel() != packed_nbytes(numel, bits):
        raise ValueError(
            f"{packed.numel()} bytes do not hold {numel} codes of {bits} bits "
            f"({packed_nbytes(numel, bits)} expected)"
        )
    width = numel if bits == 8 else numel + (-numel) % 8
    codes = _core.unpack_codes(packed.reshape(1, -1), bits, width).reshape(-1)[:numel]
    return codes.clone() if bits == 8 else codes


def quantized_nbytes(shape: Tuple[int, ...], bits: int, granularity: str) -> int:
    """Wire bytes of a tensor of ``shape``: packed codes plus fp16 scales."""
    numel = 1
    for d in shape:
        numel *= d
    scales = 1
    for d in scale_shape(tuple(shape), granularity):
        scales *= d
    return packed_nbytes(numel, bits) + 2 * scales
