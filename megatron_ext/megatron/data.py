"""Pretraining data through megatron-core's datasets: indexed files, GPTDataset, sampling.

What it does:
    * :func:`write_indexed_dataset` tokenizes documents into megatron-core's indexed format
      (``<prefix>.bin``/``.idx``) with ``IndexedDatasetBuilder``, using the smallest token
      dtype that holds the vocabulary (as Megatron-LM's ``tools/preprocess_data.py``).
    * :func:`prepare_default_data`, :func:`prepare_embedded_data` and
      :func:`prepare_user_data` produce, once per cache directory, the tokenizer and
      tokenized data of the embedded corpus or of ``--data-files`` (see
      :mod:`megatron_ext.data.cache` for the once-only build).
    * :func:`build_tokenizer` and :func:`build_gpt_datasets` turn a
      :class:`~megatron_ext.data.config.DataConfig` into a tokenizer and the train/valid/test
      ``GPTDataset`` splits via ``BlendedMegatronDatasetBuilder``.
    * :func:`sample_indices` and :class:`MicrobatchIterator` feed microbatches exactly like
      Megatron-LM's ``MegatronPretrainingSampler`` (``--dataloader-type single``): from
      ``consumed_samples`` on, each step takes the next ``micro_batch_size * dp_size``
      consecutive sample indices and data-parallel rank ``r`` gets the ``r``-th slice.
      :class:`FixedSampleSampler` (``--fixed-samples``) maps those positions onto epochs over
      a fixed sample set, each sample always on the same data-parallel rank.

Why:
    megatron-core's ``GPTDataset`` does the document shuffling, sample packing across
    document boundaries and index caching; reusing it keeps our runs sample-for-sample
    comparable with Megatron-LM on the same data, split and seed. The sampler is a plain
    function of ``consumed_samples`` so a resumed run sees exactly the samples an
    uninterrupted run would, and so other code (pipeline schedules, accounting) can compute
    which samples a microbatch carries with :func:`sample_indices`.

Constraints:
    * Every rank must call :func:`build_gpt_datasets` (it is collective when
      ``torch.distributed`` is initialized: megatron-core builds the sample indices on rank 0,
      barriers, then the other ranks load them from the cache). All ranks must therefore see
      the same cache directory (a shared file system across nodes).
    * Blends of several ``--data-path`` datasets built without a process group do not cache
      the ``BlendedDataset`` indices (megatron-core 0.16 would call
      ``torch.distributed.get_rank()`` there; see :class:`_DatasetBuilder`).
    * The iterator never wraps around: ``GPTDataset`` is sized for the requested number of
      samples, so running past it raises :class:`DatasetExhaustedError`.
    * A split that gets no documents of some dataset (tiny data with the default
      ``--split 969,30,1``) is refused with a :class:`~megatron_ext.config.ConfigError`;
      megatron-core would loop forever on it. Splits asked for zero samples are not built
      (``None``).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.core.datasets.utils import Split

from megatron_ext.config import ConfigError
from megatron_ext.data.cache import build_once
from megatron_ext.data.config import DataConfig, TokenizerConfig, default_cache_dir
from megatron_ext.data.corpus import (
    embedded_corpus_documents,
    embedded_corpus_fingerprint,
)
from megatron_ext.data.readers import files_fingerprint, iter_file_documents
from megatron_ext.data.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    MissingPackageError,
    SentencePieceTokenizer,
    Tokenizer,
    tokenize_documents,
    train_sentencepiece,
)
from megatron_ext.logging import get_logger, log_rank_0

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
    "sample_indices",
    "SequentialSampler",
    "FixedSampleSampler",
    "fixed_sample_sampler",
    "FixedSampleBatchSampler",
    "MicrobatchIterator",
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


class DatasetExhaustedError(RuntimeError):
    """The sampler asked for samples past the end of the dataset."""


def _resolve_cache_dir(cache_dir: Optional[str]) -> str:
    return os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()


# --------------------------------------------------------------------------------------------
# Indexed datasets
# --------------------------------------------------------------------------------------------


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
    root = _resolve_cache_dir(cache_dir)
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
    root = _resolve_cache_dir(cache_dir)
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
    root = _resolve_cache_dir(cache_dir)
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


# --------------------------------------------------------------------------------------------
# From DataConfig to tokenizer and datasets
# --------------------------------------------------------------------------------------------


def _existing_file(path: str, flag: str) -> str:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError(flag, f"{path}: no such file")
    return full


def build_tokenizer(data_cfg: TokenizerConfig, cache_dir: Optional[str] = None) -> Tokenizer:
    """The tokenizer selected by ``data_cfg``.

    Without ``--tokenizer-model``, the SentencePiece model is trained on the embedded corpus
    and cached (:func:`prepare_default_data`).

    Args:
        data_cfg: the data (or just tokenizer) configuration.
        cache_dir: overrides ``data_cfg.cache_dir`` (a :class:`DataConfig`'s
            ``--data-cache-path``, else the default cache directory).

    Returns:
        The tokenizer.

    Raises:
        ConfigError: for missing or unreadable tokenizer files, naming the flag.
    """
    if data_cfg.tokenizer_type == "GPT2BPETokenizer":
        vocab = _existing_file(data_cfg.vocab_file, "--vocab-file")
        merges = _existing_file(data_cfg.merge_file, "--merge-file")
        try:
            return GPT2BPETokenizer(vocab, merges)
        except ValueError as err:
            raise ConfigError(["--vocab-file", "--merge-file"], str(err)) from err
    if data_cfg.tokenizer_type == "HuggingFaceTokenizer":
        try:
            return HuggingFaceTokenizer(data_cfg.tokenizer_model)
        except MissingPackageError as err:
            raise ConfigError("--tokenizer-type", str(err)) from None
        except ValueError as err:
            raise ConfigError("--tokenizer-model", str(err)) from err
    if data_cfg.tokenizer_model is not None:
        model = _existing_file(data_cfg.tokenizer_model, "--tokenizer-model")
        try:
            return SentencePieceTokenizer(model)
        except ValueError as err:
            raise ConfigError("--tokenizer-model", str(err)) from err
    if cache_dir is None and isinstance(data_cfg, DataConfig):
        cache_dir = data_cfg.cache_dir
    tokenizer, _ = prepare_default_data(cache_dir, data_cfg.vocab_size)
    return tokenizer


def _resolve_blend(
    data_cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str
) -> Tuple[List[str], Optional[List[float]]]:
    if data_cfg.data_path is not None:
        prefixes, weights = data_cfg.blend
        for prefix in prefixes:
            for path in (get_bin_path(prefix), get_idx_path(prefix)):
                if not os.path.isfile(path):
                    raise ConfigError("--data-path", f"{path}: no such file")
        return list(prefixes), weights
    if data_cfg.data_files is not None:
        prefix = prepare_user_data(
            data_cfg.data_files, data_cfg.data_text_key, tokenizer, cache_dir
        )
        return [prefix], None
    if data_cfg.trains_tokenizer:
        default_tokenizer, prefix = prepare_default_data(cache_dir, data_cfg.vocab_size)
        if default_tokenizer.unique_identifiers != tokenizer.unique_identifiers:
            raise ValueError(
                "build_gpt_datasets: the tokenizer is not the one of the embedded corpus data; "
                "pass the tokenizer returned by build_tokenizer(data_cfg)"
            )
        return [prefix], None
    return [prepare_embedded_data(tokenizer, cache_dir)], None


def _split_advice(lengths: numpy.ndarray, shares: Sequence[float]) -> str:
    """A ``--split`` value (percentages) that gives every split with a share some tokens of a
    dataset of these document ``lengths``: the shares of the splits that get none set to 0
    (all to training when training gets none)."""
    shares = list(shares)
    for _ in range(len(shares)):  # zeroing one split renormalizes the others' bookends
        total, beg, changed = sum(shares), 0.0, False
        for k, share in enumerate(shares):
            if share <= 0 or total <= 0:
                continue
            lo = int(round(beg / total * len(lengths)))
            hi = int(round((beg + share) / total * len(lengths)))
            beg += share
            if int(lengths[lo:hi].sum()) == 0:
                shares[k], changed = 0.0, True
                break
        if not changed:
            break
    if shares[0] <= 0:
        return "100,0,0"
    total = sum(shares)
    return ",".join(f"{100 * s / total:.4g}" for s in shares)


def _split_sizes(
    prefixes: Sequence[str], split_matrix: Sequence[Optional[Tuple[float, float]]]
) -> Dict[Tuple[str, Split], Tuple[int, int]]:
    """``(documents, tokens)`` of every requested split of every dataset.

    Refuses splits without tokens: megatron-core's epoch count would never terminate.
    """
    out: Dict[Tuple[str, Split], Tuple[int, int]] = {}
    shares = [0.0 if b is None else b[1] - b[0] for b in split_matrix]
    for prefix in prefixes:
        dataset = IndexedDataset(prefix, mmap=True)
        # Copy: the lengths are a view of a memory map that closes with the dataset object.
        lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)
        del dataset
        num_elements = len(lengths)
        for split in Split:
            bookends = split_matrix[split.value]
            if bookends is None:
                continue
            # The same rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
            beg = int(round(bookends[0] * float(num_elements)))
            end = int(round(bookends[1] * float(num_elements)))
            tokens = int(lengths[beg:end].sum())
            if tokens == 0:
                raise ConfigError(
                    "--split",
                    f"the {split.name} split of {prefix} gets no documents ({num_elements} "
                    f"documents in all); pass --split {_split_advice(lengths, shares)} "
                    "(the splits that get no documents set to 0), give it a larger share, "
                    "or ask for 0 samples of it",
                )
            out[prefix, split] = (end - beg, tokens)
    return out


_SPLIT_FLAGS = {
    Split.train: ["--train-iters", "--global-batch-size"],
    Split.valid: ["--eval-iters", "--eval-interval"],
    Split.test: ["--eval-iters"],
}


def check_index_memory(
    sizes: Dict[Tuple[str, Split], Tuple[int, int]],
    weights: Optional[Sequence[float]],
    num_samples: Sequence[int],
    seq_length: int,
    *,
    available: Optional[int] = None,
) -> None:
    """Refuse a run whose GPTDataset indices need more host memory than this node has.

    The estimate per dataset and split is
    :func:`~megatron_ext.validation.sample_index_bytes` (document index ``20 E D`` bytes at
    its peak, ``E`` epochs of ``D`` documents), for the samples megatron-core asks of that
    dataset: all of them with one dataset, ``ceil(ceil(S w) * 1.005)`` with blend weights
    ``w``, one epoch (``num_samples`` None) for a blend without weights. They are summed:
    a built dataset keeps its indices while the next one is built. Measured against
    ``MemAvailable`` (:func:`~megatron_ext.validation.check_fits_host_memory`), the
    smallest over the ranks when a process group exists (collective); a cached index would
    be memory-mapped instead, but needed the same memory where it was built.

    Raises:
        ConfigError: naming the flags that set the samples of the largest split.
    """
    import math

    from megatron_ext.validation import check_fits_host_memory, format_bytes, sample_index_bytes

    prefixes = list(dict.fromkeys(p for p, _ in sizes))
    if weights is not None:
        total = float(sum(weights))
        weights = [w / total for w in weights]
    total_bytes, largest = 0, None
    for i, prefix in enumerate(prefixes):
        for split in Split:
            if (prefix, split) not in sizes:
                continue
            docs, tokens = sizes[prefix, split]
            samples = num_samples[split.value]
            if len(prefixes) > 1:
                if weights is None:
                    samples = 0  # one epoch: megatron-core's num_samples None
                else:
                    samples = int(math.ceil(math.ceil(samples * weights[i]) * 1.005))
            need, epochs = sample_index_bytes(samples, seq_length, tokens, docs)
            total_bytes += need
            if largest is None or need > largest[0]:
                largest = (need, epochs, prefix, split, samples, docs, tokens)
    if largest is None:
        return
    if available is None:
        from megatron_ext.validation import agreed_minimum, available_host_memory

        # Every rank calls this (collective): one verdict and one line for all of them.
        available = agreed_minimum(available_host_memory())
    if available is None:
        return
    need, epochs, prefix, split, samples, docs, tokens = largest
    what = (
        f"megatron-core's sample index of the {split.name} split of {prefix} ({samples} "
        f"samples of {seq_length} tokens from {tokens} tokens in {docs} documents: {epochs} "
        f"epochs, {format_bytes(need)}; its document index alone takes 20 bytes per document "
        "and epoch)"
    )
    check_fits_host_memory(total_bytes, _SPLIT_FLAGS[split], what, available=available)


def max_token_id(prefix: str, cache_dir: str) -> int:
    """The largest token id in ``<prefix>.bin`` (-1 when empty), scanned once and cached.

    The scan reads the whole file (memory-mapped, in chunks of 64M tokens, about 1 GB/s on
    one core); its result is kept under ``<cache_dir>/token-range/``, keyed by the file's
    path, size and modification time, and one process scans while the others wait
    (:func:`~megatron_ext.data.cache.build_once`).
    """
    import hashlib

    path = os.path.abspath(get_bin_path(prefix))
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]

    def scan(_tmp_dir: str) -> Dict[str, Any]:
        dataset = IndexedDataset(prefix, mmap=True)
        dtype = numpy.dtype(dataset.index.dtype)
        del dataset
        tokens = numpy.memmap(path, dtype=dtype, mode="r")
        top, chunk = -1, 1 << 26
        for start in range(0, len(tokens), chunk):
            top = max(top, int(tokens[start : start + chunk].max()))
        del tokens
        return {"max_token_id": top}

    marker = build_once(os.path.join(cache_dir, "token-range", key), scan)
    return int(marker["info"]["max_token_id"])


def check_token_ids(prefixes: Sequence[str], tokenizer: Tokenizer, cache_dir: str) -> None:
    """Refuse ``--data-path`` datasets holding token ids the tokenizer cannot produce (data
    made with another tokenizer): checked on the index files before training, instead of
    an ``IndexError`` in the embedding at the first lookup of such a token.

    Raises:
        ConfigError: naming ``--data-path``, the file, its largest id and the vocabulary.
    """
    vocab = tokenizer.vocab_size
    for prefix in prefixes:
        top = max_token_id(prefix, cache_dir)
        if top >= vocab:
            raise ConfigError(
                ["--data-path", "--tokenizer-model"],
                f"{get_bin_path(prefix)} holds token id {top}, outside the tokenizer's "
                f"vocabulary of {vocab} ids: the data was made with another tokenizer; pass "
                "the one it was made with",
            )


class _DatasetBuilder(BlendedMegatronDatasetBuilder):
    """``BlendedMegatronDatasetBuilder`` that also builds blends without a process group.

    megatron-core 0.16's ``BlendedDataset`` calls ``torch.distributed.get_rank()`` on a miss
    of its index cache without checking that a process group exists. Without one, its
    indices (one cheap C++ pass) are therefore built without the cache; ``GPTDataset``
    indices are cached as usual. With a process group nothing changes.
    """

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        """``BlendedMegatronDatasetBuilder.build_generic_dataset`` with the fix above."""
        if cls is BlendedDataset and not torch.distributed.is_initialized():
            *rest, config = args
            config = copy.copy(config)
            config.path_to_cache = None
            args = (*rest, config)
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def build_gpt_datasets(
    data_cfg: DataConfig,
    *,
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    num_samples: Tuple[int, int, int],
    cache_dir: Optional[str] = None,
    create_attention_mask: bool = True,
) -> Tuple[Optional[GPTDataset], Optional[GPTDataset], Optional[GPTDataset]]:
    """Train, validation and test ``GPTDataset`` splits of the configured data.

    Collective when ``torch.distributed`` is initialized: call it on every rank. Every rank
    gets the datasets (megatron-core builds and caches the sample indices on rank 0 first;
    the other ranks load them after a barrier).

    Args:
        data_cfg: the data configuration.
        tokenizer: the tokenizer of the data (from :func:`build_tokenizer`).
        seq_length: tokens per sample (the labels are the next ``seq_length`` tokens).
        seed: seed of the document and sample shuffling.
        num_samples: samples wanted per split (train, valid, test); each split is sized to
            at least that many (repeating epochs if needed). A split asked for 0 samples is
            returned as None.
        cache_dir: overrides ``data_cfg.cache_dir``; the sample indices are cached in its
            ``indices/`` subdirectory.
        create_attention_mask: whether samples carry a ``[1, seq, seq]`` causal mask (not
            needed by attention kernels that build their own).

    Returns:
        ``(train, valid, test)``; a ``BlendedDataset`` instead of a ``GPTDataset`` when
        ``--data-path`` names several datasets.

    Raises:
        ConfigError: for missing data files, malformed blends or empty splits.
    """
    if len(num_samples) != 3 or any(n is None or n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three counts >= 0, got {num_samples!r}")
    root = _resolve_cache_dir(cache_dir or data_cfg.cache_dir)
    prefixes, weights = _resolve_blend(data_cfg, tokenizer, root)
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(data_cfg.split))
    # Unrequested splits are dropped; their bookends stay, so the others keep their documents.
    split_matrix = [None if n == 0 else bookends for bookends, n in zip(split_matrix, num_samples)]
    sizes = _split_sizes(prefixes, split_matrix)
    if data_cfg.data_path is not None:
        check_token_ids(prefixes, tokenizer, root)
    check_index_memory(sizes, weights, num_samples, seq_length)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=data_cfg.split,
        path_to_cache=os.path.join(root, "indices"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=True,
    )
    config.split_matrix = split_matrix
    sizes = [int(n) for n in num_samples]
    train, valid, test = _DatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid, test


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


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
