"""Pretraining data through megatron-core's datasets: preparation, datasets, sampling.

One module per job:

* :mod:`.prepare` (offline, writes files): documents tokenized into megatron-core's indexed
  format (:func:`write_indexed_dataset`), the embedded corpus and ``--data-files`` prepared
  once per cache directory (:func:`prepare_default_data`, :func:`prepare_embedded_data`,
  :func:`prepare_user_data`);
* :mod:`.datasets` (runtime): a :class:`~megatron_ext.data.config.DataConfig` to the
  tokenizer and the train/valid/test ``GPTDataset`` splits (:func:`build_tokenizer`,
  :func:`build_gpt_datasets`), with the index-memory and token-id checks;
* :mod:`.sampling` (runtime): which samples each microbatch of each data-parallel rank
  carries, as Megatron-LM's ``MegatronPretrainingSampler`` (:func:`sample_indices`,
  :class:`MicrobatchIterator`, the ``--fixed-samples`` samplers).

The names below are re-exported here, so ``megatron_ext.megatron.data.<name>`` keeps working.
Torch-free pieces (the corpus, file readers, tokenizers, the once-only cache) are in
:mod:`megatron_ext.data`.
"""

from megatron_ext.megatron.data.datasets import (
    build_gpt_datasets,
    build_tokenizer,
    check_index_memory,
    check_token_ids,
    max_token_id,
)
from megatron_ext.megatron.data.prepare import (
    DEFAULT_TOKENIZER_SEED,
    DEFAULT_TOKENIZER_THREADS,
    indexed_dataset_stats,
    prepare_default_data,
    prepare_embedded_data,
    prepare_user_data,
    write_indexed_dataset,
)
from megatron_ext.megatron.data.sampling import (
    DatasetExhaustedError,
    FixedSampleBatchSampler,
    FixedSampleSampler,
    MicrobatchIterator,
    SequentialSampler,
    fixed_sample_sampler,
    sample_indices,
)

__all__ = [
    "DEFAULT_TOKENIZER_SEED",
    "DEFAULT_TOKENIZER_THREADS",
    "DatasetExhaustedError",
    "write_indexed_dataset",
    "indexed_dataset_stats",
    "prepare_default_data",
    "prepare_embedded_data",
    "prepare_user_data",
    "build_tokenizer",
    "build_gpt_datasets",
    "check_index_memory",
    "check_token_ids",
    "max_token_id",
    "sample_indices",
    "SequentialSampler",
    "FixedSampleSampler",
    "fixed_sample_sampler",
    "FixedSampleBatchSampler",
    "MicrobatchIterator",
]
