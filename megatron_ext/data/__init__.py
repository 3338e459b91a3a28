"""Pretraining data of megatron_ext: embedded corpus, tokenizers, file readers, config.

What it does:
    Collects the pure-Python half of the data pipeline: the embedded default corpus
    (:mod:`.corpus`), SentencePiece and GPT-2 BPE tokenizers (:mod:`.tokenizers`), readers
    for local text/JSON/Parquet files (:mod:`.readers`), the once-only cache builder
    (:mod:`.cache`) and the :class:`DataConfig` flags (:mod:`.config`). The half that needs
    megatron-core (indexed datasets, ``GPTDataset``, the sampler) is
    :mod:`megatron_ext.megatron.data`; ``megatron-ext prepare-data`` is :mod:`.prepare`.

Why:
    The split keeps Megatron imports in ``megatron_ext/megatron/`` only, so tokenizers and
    corpus can be used and tested without megatron-core.

Constraints:
    Importing this package never imports Megatron or torch.
"""

from megatron_ext.data.config import DataConfig, TokenizerConfig, default_cache_dir
from megatron_ext.data.corpus import (
    embedded_corpus_documents,
    embedded_corpus_fingerprint,
)
from megatron_ext.data.tokenizers import (
    GPT2BPETokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    tokenize_documents,
    train_sentencepiece,
)

__all__ = [
    "DataConfig",
    "TokenizerConfig",
    "default_cache_dir",
    "embedded_corpus_documents",
    "embedded_corpus_fingerprint",
    "Tokenizer",
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "tokenize_documents",
    "train_sentencepiece",
]
