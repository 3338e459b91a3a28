"""The AQ-SGD quantizer and bit packing: round-trip bounds, wire sizes, unbiasedness."""

import pytest
import torch

from megatron_ext.compressors.quantize import (
    GRANULARITIES,
    dequantize,
    pack_bits,
    packed_nbytes,
    quantize,
    quantized_nbytes,
    unpack_bits,
)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [1, 7, 8, 1001])
def test_bit_packing_round_trips_at_its_declared_size(bits, numel):
    codes = torch.randint(0, 1 << bits, (numel,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes.to(torch.uint8), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(numel, bits)
    assert torch.equal(unpack_bits(packed, bits, numel), codes.to(torch.uint8))


def test_packed_sizes_are_bits_over_eight():
    # 4 bits: two codes a byte; 3 bits: eight codes in three bytes; 2 bits: four a byte.
    assert packed_nbytes(1024, 4) == 512
    assert packed_nbytes(1024, 3) == 384
    assert packed_nbytes(1024, 2) == 256
    assert packed_nbytes(1024, 8) == 1024
    # Codes plus fp16 scales: [seq 128, hidden 256] at 4 bits, one scale per channel.
    assert quantized_nbytes((128, 256), 4, "channel") == 128 * 256 // 2 + 2 * 256
    assert quantized_nbytes((128, 256), 4, "token") == 128 * 256 // 2 + 2 * 128


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nearest_rounding_error_is_at_most_one_step(granularity, bits):
    x = torch.randn(3, 64, 32, generator=torch.Generator().manual_seed(0)) * 5
    q = quantize(x, bits, granularity=granularity)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < (1 << bits)
    assert q.scales.dtype == torch.float16
    step = q.scales.float() / (1 << (bits - 1))
    err = (x - dequantize(q)).abs()
    # Half a step inside the grid; up to one step where the largest values clip to the top
    # code (the grid is [-1, 1 - step] * scale); plus the fp16 rounding of the scale.
    slack = (
        x.abs().amax(dim=-2 if granularity == "channel" else -1, keepdim=True) - q.scales.float()
    ).abs()
    assert bool((err <= step + slack + 1e-6).all())
    inside = x.abs() < q.scales.float() * (1 - 2 / (1 << bits))
    assert bool((err[inside] <= step.expand_as(x)[inside] / 2 + 1e-5).all())


def test_stochastic_rounding_is_unbiased_inside_the_grid():
    gen = torch.Generator().manual_seed(1)
    x = torch.linspace(-0.9, 0.4, 64).view(1, 64, 1).expand(1, 64, 4).contiguous()
    x[0, 0] = 1.0  # sets the scale: every other value lies inside [-1, 1 - step] * scale
    total = torch.zeros_like(x)
    trials = 4000
    for _ in range(trials):
        total += dequantize(quantize(x, 2, stochastic=True, generator=gen))
    mean = total / trials
    # 2 bits: step 0.5; the standard error of the mean is below 0.25 / sqrt(4000) = 0.004.
    assert (mean[0, 1:] - x[0, 1:]).abs().max() < 0.02
    # Nearest rounding is biased on the same values (what stochastic rounding removes).
    nearest = dequantize(quantize(x, 2))
    assert (nearest[0, 1:] - x[0, 1:]).abs().max() > 0.1


def test_zero_input_stays_zero():
    q = quantize(torch.zeros(2, 4, 4), 3)
    assert torch.equal(dequantize(q), torch.zeros(2, 4, 4))


def test_stochastic_rounding_refuses_a_generator_on_another_device():
    # A CPU generator for a tensor elsewhere (meta here; CUDA in practice, where
    # torch.rand raises "Expected a 'cuda' device type for generator" deep inside).
    x = torch.empty(2, 8, 4, device="meta")
    with pytest.raises(ValueError, match="needs a generator on that device"):
        quantize(x, 4, stochastic=True, generator=torch.Generator())
    quantize(x, 4, stochastic=True)  # the device's default generator
