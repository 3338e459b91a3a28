"""Runtime datasets: from a DataConfig to the tokenizer and megatron-core's GPTDataset splits.

What it does:
    :func:`build_tokenizer` and :func:`build_gpt_datasets` turn a
    :class:`~megatron_ext.data.config.DataConfig` into a tokenizer and the train/valid/test
    ``GPTDataset`` splits via ``BlendedMegatronDatasetBuilder``, preparing the embedded
    corpus or ``--data-files`` first when the run names no indexed data
    (:mod:`.prepare`). Before building, the index memory and the token ids are checked
    against the run (:func:`check_index_memory`, :func:`check_token_ids`).

Why:
    megatron-core's ``GPTDataset`` does the document shuffling, sample packing across
    document boundaries and index caching; reusing it keeps our runs sample-for-sample
    comparable with Megatron-LM on the same data, split and seed.

Constraints:
    * Every rank must call :func:`build_gpt_datasets` (it is collective when
      ``torch.distributed`` is initialized: megatron-core builds the sample indices on rank 0,
      barriers, then the other ranks load them from the cache). All ranks must therefore see
      the same cache directory (a shared file system across nodes).
    * Blends of several ``--data-path`` datasets built without a process group do not cache
      the ``BlendedDataset`` indices (megatron-core 0.16 would call
      ``torch.distributed.get_rank()`` there; see :class:`_DatasetBuilder`).
    * A split that gets no documents of some dataset (tiny data with the default
      ``--split 969,30,1``) is refused with a :class:`~megatron_ext.config.ConfigError`;
      megatron-core would loop forever on it. Splits asked for zero samples are not built
      (``None``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

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
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.utils import Split

from megatron_ext.config import ConfigError
from megatron_ext.data.cache import build_once, exclusive_lock
from megatron_ext.data.config import DataConfig, TokenizerConfig
from megatron_ext.data.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    MissingPackageError,
    SentencePieceTokenizer,
    Tokenizer,
)
from megatron_ext.megatron.data.prepare import (
    prepare_default_data,
    prepare_embedded_data,
    prepare_user_data,
    resolve_cache_dir,
)

__all__ = [
    "build_tokenizer",
    "build_gpt_datasets",
    "check_index_memory",
    "check_token_ids",
    "max_token_id",
]


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
    root = resolve_cache_dir(cache_dir or data_cfg.cache_dir)
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
    with _index_build_lock(config.path_to_cache):
        train, valid, test = _DatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid, test


@contextlib.contextmanager
def _index_build_lock(path_to_cache: str) -> Iterator[None]:
    """Rank 0 (or a process without a process group) builds the dataset indices holding an
    exclusive lock on the cache directory; the job's other ranks load them after
    megatron-core's barrier. Separate jobs sharing the cache (DiLoCo's sites over torchft,
    runs started together) so never read another job's half-written index files: megatron-core
    writes them in place, and a job whose rank 0 finds them present lets its other ranks
    load them at once."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        yield
        return
    os.makedirs(path_to_cache, exist_ok=True)
    with exclusive_lock(os.path.join(path_to_cache, ".build.lock")):
        yield
