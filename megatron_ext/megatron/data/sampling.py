"""Runtime sampling: which samples each microbatch of each data-parallel rank carries.

What it does:
    :func:`sample_indices` and :class:`MicrobatchIterator` feed microbatches exactly like
    Megatron-LM's ``MegatronPretrainingSampler`` (``--dataloader-type single``): from
    ``consumed_samples`` on, each step takes the next ``micro_batch_size * dp_size``
    consecutive sample indices and data-parallel rank ``r`` gets the ``r``-th slice.
    :class:`FixedSampleSampler` (``--fixed-samples``) maps those positions onto epochs over
    a fixed sample set, each sample always on the same data-parallel rank
    (:class:`FixedSampleBatchSampler`: the same as a ``DataLoader`` batch sampler).

Why:
    The sampler is a plain function of ``consumed_samples`` so a resumed run sees exactly
    the samples an uninterrupted run would, and so other code (pipeline schedules,
    accounting) can compute which samples a microbatch carries with :func:`sample_indices`.

Constraints:
    The iterator never wraps around: ``GPTDataset`` is sized for the requested number of
    samples, so running past it raises :class:`DatasetExhaustedError`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Union

import numpy
import torch

from megatron_ext.config import ConfigError

__all__ = [
    "DatasetExhaustedError",
    "sample_indices",
    "SequentialSampler",
    "FixedSampleSampler",
    "fixed_sample_sampler",
    "FixedSampleBatchSampler",
    "MicrobatchIterator",
]


class DatasetExhaustedError(RuntimeError):
    """The sampler asked for samples past the end of the dataset."""


def _check_sampling_args(micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    if dp_size <= 0:
        raise ValueError(f"dp_size must be > 0, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")


def sample_indices(
    consumed_samples: int, microbatch: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> torch.LongTensor:
    """Dataset indices of one microbatch on one data-parallel rank.

    ``consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    + j`` for ``j < micro_batch_size``: the layout of Megatron-LM's
    ``MegatronPretrainingSampler``, where the ``dp_size`` ranks split each block of
    ``micro_batch_size * dp_size`` consecutive indices. :class:`MicrobatchIterator` uses
    exactly this function.

    Args:
        consumed_samples: samples consumed by all data-parallel ranks together before the
            first microbatch (e.g. at the start of the global batch).
        microbatch: microbatch number counted from there.
        micro_batch_size: samples per microbatch per rank.
        dp_rank: data-parallel rank.
        dp_size: data-parallel size.

    Returns:
        ``[micro_batch_size]`` int64 indices.
    """
    _check_sampling_args(micro_batch_size, dp_rank, dp_size)
    if consumed_samples < 0 or microbatch < 0:
        raise ValueError(
            f"consumed_samples and microbatch must be >= 0, got {consumed_samples}, {microbatch}"
        )
    start = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return torch.arange(start, start + micro_batch_size, dtype=torch.long)


class SequentialSampler:
    """Megatron-LM's ``MegatronPretrainingSampler`` layout: :func:`sample_indices`.

    Args:
        micro_batch_size: samples per microbatch per rank.
        dp_rank: data-parallel rank.
        dp_size: data-parallel size.
    """

    fixed = False

    def __init__(self, micro_batch_size: int, dp_rank: int, dp_size: int):
        _check_sampling_args(micro_batch_size, dp_rank, dp_size)
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def indices(self, consumed_samples: int, microbatch: int = 0) -> torch.LongTensor:
        """Dataset indices of microbatch ``microbatch`` counted from ``consumed_samples``."""
        return sample_indices(
            consumed_samples, microbatch, self.micro_batch_size, self.dp_rank, self.dp_size
        )


class FixedSampleSampler(SequentialSampler):
    """Fixed-sample mode (``--fixed-samples``): epochs over a fixed set of sample ids.

    The ``num_samples`` samples are cut once (the first ``num_samples`` of a ``GPTDataset``
    built for exactly that many); ``num_samples`` is rounded down to a multiple of
    ``dp_size``. Sample id ``i`` belongs to data-parallel rank ``i % dp_size`` in every
    epoch, so per-sample state kept on a rank (AQ-SGD's activation buffers) always finds
    its sample there. Each rank walks its ``num_samples / dp_size`` ids epoch after epoch,
    in a new order per epoch (a permutation seeded by ``(seed, epoch, rank)``). A position
    is a pure function of ``consumed_samples``, so a resumed run sees exactly the samples
    an uninterrupted one would.

    Args:
        num_samples: fixed samples over all ranks.
        micro_batch_size: samples per microbatch per rank.
        dp_rank: data-parallel rank.
        dp_size: data-parallel size.
        seed: seed of the per-epoch orders.
    """

    fixed = True

    def __init__(
        self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int
    ):
        super().__init__(micro_batch_size, dp_rank, dp_size)
        self.per_rank = num_samples // dp_size
        if self.per_rank < 1:
            raise ValueError(f"{num_samples} fixed samples do not cover {dp_size} ranks")
        self.num_samples = self.per_rank * dp_size
        self.seed = seed
        self._epoch = -1
        self._order: Optional[torch.Tensor] = None

    def local_ids(self) -> torch.LongTensor:
        """The sample ids this rank owns (``dp_rank + dp_size * k``)."""
        return self.dp_rank + self.dp_size * torch.arange(self.per_rank, dtype=torch.long)

    def _order_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            from megatron_ext.compressors.seeding import seeded_generator

            gen = seeded_generator("fixed-samples", self.seed, epoch, self.dp_rank)
            self._order = torch.randperm(self.per_rank, generator=gen)
            self._epoch = epoch
        return self._order

    def indices(self, consumed_samples: int, microbatch: int = 0) -> torch.LongTensor:
        positions = super().indices(consumed_samples, microbatch)
        mbs, dp = self.micro_batch_size, self.dp_size
        # This rank's running count of samples: its slice of every block of mbs * dp.
        k = (positions // (mbs * dp)) * mbs + positions % mbs
        epochs, pos = k // self.per_rank, k % self.per_rank
        out = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():  # one epoch, two at an epoch boundary
            mask = epochs == epoch
            out[mask] = self.dp_rank + dp * self._order_of(epoch)[pos[mask]]
        return out


def fixed_sample_sampler(
    num_samples: int,
    micro_batch_size: int,
    num_microbatches: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
) -> FixedSampleSampler:
    """The :class:`FixedSampleSampler` of ``--fixed-samples``, checked against the step size.

    Raises:
        ConfigError: naming ``--fixed-samples`` (and ``--global-batch-size``) when a rank
            owns fewer fixed samples than one step takes (a sample would repeat within a
            step, and per-sample state would be read and written in the same step).
    """
    if num_samples < dp_size:
        raise ConfigError(
            "--fixed-samples",
            f"{num_samples} fixed samples do not give each of the {dp_size} data-parallel "
            "ranks one",
        )
    sampler = FixedSampleSampler(num_samples, micro_batch_size, dp_rank, dp_size, seed)
    per_step = micro_batch_size * num_microbatches
    if sampler.per_rank < per_step:
        raise ConfigError(
            ["--fixed-samples", "--global-batch-size"],
            f"{sampler.per_rank} fixed samples per data-parallel rank are fewer than the "
            f"{per_step} one step takes on a rank: a sample would repeat within a step",
        )
    return sampler


class FixedSampleBatchSampler:
    """A ``torch.utils.data.DataLoader`` batch sampler over a :class:`FixedSampleSampler`.

    From ``consumed_samples`` on it yields this rank's microbatches (lists of sample ids)
    one after another, epoch after epoch, without end: training stops it. It is what
    Megatron-LM's ``MegatronPretrainingSampler`` would yield, with positions mapped onto the
    fixed sample set, so Megatron-LM's data iterator and megatron-ext's sample ids (which
    the pipeline stages compute from ``consumed_samples`` without reading data) agree.

    Args:
        sampler: the fixed-sample sampler of this rank.
        consumed_samples: samples consumed by all data-parallel ranks before the first
            microbatch.
    """

    def __init__(self, sampler: FixedSampleSampler, consumed_samples: int):
        self.sampler = sampler
        self.consumed_samples = int(consumed_samples)

    def __iter__(self) -> Iterator[List[int]]:
        microbatch = 0
        while True:
            yield self.sampler.indices(self.consumed_samples, microbatch).tolist()
            microbatch += 1


def _collate(samples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    batch: Dict[str, torch.Tensor] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(values[0], numpy.ndarray):
            batch[key] = torch.from_numpy(numpy.stack(values))
        else:
            batch[key] = torch.tensor(values)
    return batch


class MicrobatchIterator:
    """Microbatches of one data-parallel rank, resumable from a sample count.

    Each ``next()`` takes the microbatch ``sample_indices(consumed_samples, 0, ...)`` and
    advances ``consumed_samples`` by ``micro_batch_size * dp_size`` (the samples all ranks
    consume together). An iterator built with ``consumed_samples=C`` therefore yields exactly
    what an uninterrupted one yields after ``C / (micro_batch_size * dp_size)`` microbatches.

    Each microbatch is a dict of ``tokens`` ``[mbs, seq]`` int64, ``labels`` ``[mbs, seq]``
    int64, ``loss_mask`` ``[mbs, seq]`` float32, ``position_ids`` ``[mbs, seq]`` int64,
    ``attention_mask`` ``[mbs, 1, seq, seq]`` bool (only when the dataset creates masks),
    ``sample_index`` ``[mbs]`` int64 and, for blended datasets, ``dataset_id`` ``[mbs]``.

    Args:
        dataset: a ``GPTDataset`` or ``BlendedDataset`` (anything indexable returning dicts).
        micro_batch_size: samples per microbatch on this rank.
        dp_rank: data-parallel rank.
        dp_size: data-parallel size.
        consumed_samples: samples consumed by all ranks before the first microbatch; a
            multiple of ``micro_batch_size * dp_size`` in normal use.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        sampler: Optional[SequentialSampler] = None,
    ):
        _check_sampling_args(micro_batch_size, dp_rank, dp_size)
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.sampler = sampler or SequentialSampler(micro_batch_size, dp_rank, dp_size)
        self._consumed_samples = int(consumed_samples)

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all data-parallel ranks so far (Megatron-LM's
        ``consumed_train_samples``)."""
        return self._consumed_samples

    @property
    def samples_per_microbatch(self) -> int:
        """Samples consumed per ``next()`` over all ranks: ``micro_batch_size * dp_size``."""
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Microbatches left before the dataset is exhausted (unbounded with fixed samples:
        the epochs repeat; reported as ``sys.maxsize``)."""
        if self.sampler.fixed:
            import sys

            return sys.maxsize
        remaining = len(self.dataset) - self._consumed_samples
        return max(0, remaining // self.samples_per_microbatch)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        end = self._consumed_samples + self.samples_per_microbatch
        if not self.sampler.fixed and end > len(self.dataset):
            raise DatasetExhaustedError(
                f"the dataset has {len(self.dataset)} samples but the next microbatch needs "
                f"samples [{self._consumed_samples}, {end}) over all {self.dp_size} "
                "data-parallel rank(s); build the datasets with more samples (num_samples)"
            )
        indices = self.sampler.indices(self._consumed_samples, 0)
        batch = _collate([self.dataset[int(i)] for i in indices])
        batch["sample_index"] = indices
        self._consumed_samples = end
        return batch

    def state_dict(self) -> Dict[str, int]:
        """``{"consumed_samples": int}``."""
        return {"consumed_samples": self._consumed_samples}

    def load_state_dict(self, state_dict: Dict[str, Union[int, torch.Tensor]]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            ValueError: when the keys are not exactly ``{"consumed_samples"}``.
        """
        if set(state_dict) != {"consumed_samples"}:
            raise ValueError(
                f"MicrobatchIterator state has keys {sorted(state_dict)}, expected "
                "['consumed_samples']"
            )
        consumed = int(state_dict["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed}")
        self._consumed_samples = consumed
