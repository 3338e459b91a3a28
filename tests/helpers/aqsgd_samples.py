"""AQ-SGD's sample space (megatron_ext/methods/registry.py) for a codec tested on its own: a
fixed set of samples, one data-parallel rank."""

from __future__ import annotations


def fixed_samples(num_samples, micro_batch_size, num_microbatches, seq_length):
    """A :class:`~megatron_ext.methods.registry.SampleSpace` of ``num_samples`` fixed samples
    on data-parallel rank 0 of 1."""
    from megatron_ext.methods.registry import SampleSpace

    return SampleSpace(
        fixed=True,
        num_samples=num_samples,
        dp_rank=0,
        dp_size=1,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
    )
