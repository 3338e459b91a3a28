"""Offline data preparation: documents tokenized into megatron-core's indexed format, once.

What it does:
    * :func:`write_indexed_dataset` tokenizes documents into megatron-core's indexed format
      (``<prefix>.bin``/``.idx``) with ``IndexedDatasetBuilder``, using the smallest token
      dtype that holds the vocabulary (as Megatron-LM's ``tools/preprocess_data.py``);
      :func:`indexed_dataset_stats` counts what such a file holds.
    * :func:`prepare_default_data`, :func:`prepare_embedded_data` and
      :func:`prepare_user_data` produce, once per cache directory, the tokenizer and
      tokenized data of the embedded corpus or of ``--data-files`` (see
      :mod:`megatron_ext.data.cache` for the once-only build).

Why apart from the runtime data:
    This runs before training (or in ``megatron-ext prepare-data``) and writes files; the
    datasets (:mod:`.datasets`) and samplers (:mod:`.sampling`) only read them.

Constraints:
    Every rank may call the ``prepare_*`` functions at once: the build happens once per
    cache directory (a lock and an atomic rename), so all ranks must see the same cache
    directory (a shared file system across nodes).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import numpy
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_ext.config import ConfigError
from megatron_ext.data.cache import build_once
from megatron_ext.data.config import default_cache_dir
from megatron_ext.data.corpus import (
    embedded_corpus_documents,
    embedded_corpus_fingerprint,
)
from megatron_ext.data.readers import files_fingerprint, iter_file_documents
from megatron_ext.data.tokenizers import (
    SentencePieceTokenizer,
    Tokenizer,
    tokenize_documents,
    train_sentencepiece,
)
from megatron_ext.logging import get_logger, log_rank_0

__all__ = [
    "DEFAULT_TOKENIZER_SEED",
    "DEFAULT_TOKENIZER_THREADS",
    "write_indexed_dataset",
    "indexed_dataset_stats",
    "prepare_default_data",
    "prepare_embedded_data",
    "prepare_user_data",
    "resolve_cache_dir",
]

logger = get_logger(__name__)

DEFAULT_TOKENIZER_SEED: int = 1234
"""Seed of the SentencePiece model trained on the embedded corpus."""

DEFAULT_TOKENIZER_THREADS: int = 2
"""Training threads of that model. Fixed, not the machine's core count: SentencePiece's BPE
trainer gives a different model for a different thread count, and the cached model must be
the same on every machine."""

_CORPUS_NAME = "corpus"
_TOKENIZER_NAME = "tokenizer"


def resolve_cache_dir(cache_dir: Optional[str]) -> str:
    """``cache_dir`` as an absolute path, or the default cache directory when None."""
    return os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()


def write_indexed_dataset(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    output_prefix: str,
    append_eod: bool = True,
    *,
    num_workers: int = 1,
) -> str:
    """Tokenize documents into ``<output_prefix>.bin`` and ``<output_prefix>.idx``.

    One document becomes one sequence of the indexed dataset (Megatron-LM's layout without
    ``--split-sentences``). Empty documents are skipped. Both files are written under
    temporary names and renamed when complete.

    Args:
        documents: the texts.
        tokenizer: the tokenizer; its ``vocab_size`` picks the token dtype (uint16 below
            65500 ids, else int32).
        output_prefix: path prefix of the two files; the directory is created if needed.
        append_eod: append ``tokenizer.eod`` after every document, as Megatron-LM's
            ``--append-eod`` (GPT pretraining needs it to mark document boundaries).
        num_workers: tokenization parallelism (see
            :func:`~megatron_ext.data.tokenizers.tokenize_documents`).

    Returns:
        ``output_prefix``.

    Raises:
        ValueError: when no document has any token.
    """
    output_prefix = os.fspath(output_prefix)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(
        get_bin_path(tmp_prefix), dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    eod = [tokenizer.eod] if append_eod else []
    num_documents = 0
    try:
        texts = (doc for doc in documents if doc)
        for ids in tokenize_documents(tokenizer, texts, num_workers=num_workers):
            ids = list(ids) + eod
            if not ids:
                continue
            builder.add_document(ids, [len(ids)])
            num_documents += 1
        builder.finalize(get_idx_path(tmp_prefix))
        if num_documents == 0:
            raise ValueError(f"{output_prefix}: no non-empty documents to write")
        os.replace(get_bin_path(tmp_prefix), get_bin_path(output_prefix))
        os.replace(get_idx_path(tmp_prefix), get_idx_path(output_prefix))
    except BaseException:
        builder.data_file.close()
        for path in (get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)):
            if os.path.exists(path):
                os.remove(path)
        raise
    return output_prefix


def indexed_dataset_stats(prefix: str) -> Tuple[int, int]:
    """Number of documents and of tokens of an indexed dataset.

    Args:
        prefix: path prefix of the ``.bin``/``.idx`` pair.

    Returns:
        ``(num_documents, num_tokens)``.
    """
    dataset = IndexedDataset(prefix, mmap=True)
    # Computed while `dataset` is alive: its arrays are views of a memory map it owns.
    num_documents = len(dataset.document_indices) - 1
    num_tokens = int(dataset.sequence_lengths.sum(dtype=numpy.int64))
    del dataset
    return num_documents, num_tokens


# --------------------------------------------------------------------------------------------
# Cached tokenizers and tokenized corpora
# --------------------------------------------------------------------------------------------


def prepare_default_data(
    cache_dir: Optional[str] = None, vocab_size: int = 8192
) -> Tuple[SentencePieceTokenizer, str]:
    """The SentencePiece tokenizer trained on the embedded corpus, and the tokenized corpus.

    Built once per cache directory under ``<cache_dir>/<corpus fingerprint>-v<vocab_size>/``
    (``tokenizer.model``, ``corpus.bin``, ``corpus.idx``); safe to call from many processes at
    once: one builds, the others wait and reuse. The first build takes a few seconds.

    Args:
        cache_dir: the cache root (default ``$MEGATRON_EXT_CACHE`` or
            ``~/.cache/megatron_ext``).
        vocab_size: pieces of the trained model.

    Returns:
        ``(tokenizer, prefix)`` where ``prefix`` names the indexed dataset.
    """
    root = resolve_cache_dir(cache_dir)
    target = os.path.join(root, f"{embedded_corpus_fingerprint()}-v{vocab_size}")

    def build(tmp_dir: str) -> Dict[str, Any]:
        documents = list(embedded_corpus_documents())
        start = time.time()
        model_path = train_sentencepiece(
            documents,
            os.path.join(tmp_dir, _TOKENIZER_NAME),
            vocab_size,
            seed=DEFAULT_TOKENIZER_SEED,
            num_threads=DEFAULT_TOKENIZER_THREADS,
        )
        train_seconds = time.time() - start
        prefix = write_indexed_dataset(
            documents,
            SentencePieceTokenizer(model_path),
            os.path.join(tmp_dir, _CORPUS_NAME),
            num_workers=DEFAULT_TOKENIZER_THREADS,
        )
        num_documents, num_tokens = indexed_dataset_stats(prefix)
        return {
            "num_documents": num_documents,
            "num_tokens": num_tokens,
            "num_characters": sum(len(d) for d in documents),
            "tokenizer_train_seconds": round(train_seconds, 3),
        }

    marker = build_once(target, build)
    if marker["built_here"]:
        info = marker["info"]
        log_rank_0(
            logger,
            logging.INFO,
            f"built the embedded corpus in {target}: {info['num_documents']} documents, "
            f"{info['num_tokens']} tokens at vocab {vocab_size} ({marker['build_seconds']} s)",
        )
    tokenizer = SentencePieceTokenizer(os.path.join(target, f"{_TOKENIZER_NAME}.model"))
    return tokenizer, os.path.join(target, _CORPUS_NAME)


def prepare_embedded_data(tokenizer: Tokenizer, cache_dir: Optional[str] = None) -> str:
    """The embedded corpus tokenized with a given tokenizer (e.g. the user's GPT-2 BPE).

    Cached under ``<cache_dir>/<corpus fingerprint>-tok<tokenizer identity>/``.

    Args:
        tokenizer: the tokenizer.
        cache_dir: the cache root (default as :func:`prepare_default_data`).

    Returns:
        The prefix of the indexed dataset.
    """
    root = resolve_cache_dir(cache_dir)
    target = os.path.join(root, f"{embedded_corpus_fingerprint()}-tok{tokenizer.identity()}")
    build_once(target, lambda tmp: _write_and_count(embedded_corpus_documents(), tokenizer, tmp))
    return os.path.join(target, _CORPUS_NAME)


def _write_and_count(
    documents: Iterable[str], tokenizer: Tokenizer, tmp_dir: str
) -> Dict[str, Any]:
    prefix = write_indexed_dataset(documents, tokenizer, os.path.join(tmp_dir, _CORPUS_NAME))
    num_documents, num_tokens = indexed_dataset_stats(prefix)
    return {"num_documents": num_documents, "num_tokens": num_tokens}


def prepare_user_data(
    files: Sequence[str],
    text_key: str,
    tokenizer: Tokenizer,
    cache_dir: Optional[str] = None,
) -> str:
    """Local files (``--data-files``) tokenized into a cached indexed dataset.

    The cache key hashes the files' absolute paths, sizes and modification times, the text
    column and the tokenizer's identity; editing a file or changing the tokenizer makes a new
    entry under ``<cache_dir>/files-<key>/``. ``datasets``' own Arrow cache is written to a
    temporary directory and deleted afterwards.

    Args:
        files: ``.txt``/``.json``/``.jsonl``/``.csv``/``.parquet`` files (see
            :mod:`megatron_ext.data.readers`).
        text_key: column holding the text.
        tokenizer: the tokenizer.
        cache_dir: the cache root (default as :func:`prepare_default_data`).

    Returns:
        The prefix of the indexed dataset.

    Raises:
        ConfigError: for missing or unreadable files (naming ``--data-files``) or a missing
            column (naming ``--data-text-key``).
    """
    root = resolve_cache_dir(cache_dir)
    key = files_fingerprint(files, text_key, tokenizer.identity())
    target = os.path.join(root, f"files-{key}")

    def build(tmp_dir: str) -> Dict[str, Any]:
        hf_cache = tempfile.mkdtemp(prefix="hf-", dir=tmp_dir)
        try:
            documents = iter_file_documents(files, text_key, hf_cache_dir=hf_cache)
            info = _write_and_count(documents, tokenizer, tmp_dir)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError("--data-files", str(err)) from err
        finally:
            shutil.rmtree(hf_cache, ignore_errors=True)
        return {**info, "files": [os.path.abspath(f) for f in files], "text_key": text_key}

    marker = build_once(target, build)
    if marker["built_here"]:
        log_rank_0(
            logger,
            logging.INFO,
            f"tokenized {len(files)} file(s) into {target}: {marker['info']['num_documents']} "
            f"documents, {marker['info']['num_tokens']} tokens ({marker['build_seconds']} s)",
        )
    return os.path.join(target, _CORPUS_NAME)
