"""Data and tokenizer configuration of the training driver, and the flags generated from it.

What it does:
    :class:`TokenizerConfig` selects the tokenizer; :class:`DataConfig` extends it with where
    the training text comes from. Both are frozen, keyword-only dataclasses turned into
    argparse flags by :func:`megatron_ext.config.add_config_args`. Three data sources, one per
    run:

    * ``--data-path``: Megatron indexed datasets (``<prefix>.bin``/``.idx``), optionally
      weighted, in Megatron-LM's blend syntax (``p1 p2`` or ``w1 p1 w2 p2``);
    * ``--data-files``: local text/JSON/JSONL/Parquet files, tokenized once into an indexed
      dataset in the cache;
    * neither: the embedded corpus (:mod:`megatron_ext.data.corpus`).

Why:
    Flag names are Megatron-LM's wherever the concept exists (``--data-path``, ``--split``,
    ``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``,
    ``--vocab-size``, ``--data-cache-path``) so Megatron-LM users can reuse their command
    lines with our driver. For that reason these classes are *not* meant for Megatron-LM's
    own parser (``extra_args_provider``): the names would collide on purpose.

Constraints:
    Pure Python; never imports Megatron, torch or sentencepiece. File existence is checked
    when the data is prepared, not here, so configs can be built on any machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional, Tuple

from megatron_ext.options.base import ConfigError, arg, flag_of

__all__ = [
    "TOKENIZER_TYPES",
    "CACHE_ENV_VAR",
    "default_cache_dir",
    "parse_blend",
    "TokenizerConfig",
    "DataConfig",
]

TOKENIZER_TYPES: Tuple[str, ...] = (
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
)
"""Values of ``--tokenizer-type`` (Megatron-LM's names for the same tokenizers)."""

CACHE_ENV_VAR: str = "MEGATRON_EXT_CACHE"
"""Environment variable naming the cache directory when ``--data-cache-path`` is not given."""

# 256 byte pieces plus <unk>, <s>, </s>, <pad>: a trained vocabulary must be larger.
_MIN_TRAINED_VOCAB_SIZE = 261

_SPLIT_PATTERN = re.compile(r"\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*")


def default_cache_dir() -> str:
    """``$MEGATRON_EXT_CACHE`` if set, else ``~/.cache/megatron_ext``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext")


def _as_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(
    items: Optional[Tuple[str, ...]], flag: str = "--data-path"
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Parse Megatron-LM's blend list into megatron-core's ``(prefixes, weights)``.

    ``p1 p2 ...`` gives weights ``None`` (megatron-core then weighs by dataset size);
    ``w1 p1 w2 p2 ...`` gives explicit weights. Unlike Megatron-LM, which falls back to
    treating every item as a prefix, a list where only some weight positions are numbers is
    an error, as are negative weights, weights summing to zero and prefixes that end in
    ``.bin``/``.idx``.

    Args:
        items: the flag's values, or None.
        flag: flag name used in error messages.

    Returns:
        ``(prefixes, weights)``, or None when ``items`` is None.

    Raises:
        ConfigError: when the list is malformed.
    """
    if items is None:
        return None
    items = list(items)
    if not items:
        raise ConfigError(flag, "needs at least one dataset prefix")
    numbers = [_as_float(x) is not None for x in items]
    if len(items) % 2 == 1 or not any(numbers[0::2]):
        if len(items) > 1 and numbers[0]:
            raise ConfigError(
                flag,
                f"{items!r} looks like 'weight prefix' pairs but has an odd number of items",
            )
        prefixes, weights = items, None
    else:
        if not all(numbers[0::2]):
            raise ConfigError(
                flag,
                f"{items!r}: give either only prefixes or 'weight prefix' pairs "
                "(every odd position a number)",
            )
        weights = [float(x) for x in items[0::2]]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(flag, f"weights must be >= 0 with a positive sum, got {weights}")
    for prefix in prefixes:
        if prefix.endswith((".bin", ".idx")):
            raise ConfigError(
                flag, f"{prefix!r}: give the dataset prefix, without the .bin/.idx suffix"
            )
    return prefixes, weights


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Which tokenizer turns text into token ids."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: tokenizer"
    ARG_PREFIX: ClassVar[str] = ""

    tokenizer_type: str = field(
        default="SentencePieceTokenizer", metadata=arg(choices=TOKENIZER_TYPES)
    )
    """Tokenizer: 'SentencePieceTokenizer' (see --tokenizer-model), 'GPT2BPETokenizer'
    (GPT-2 byte-level BPE from --vocab-file and --merge-file) or 'HuggingFaceTokenizer'
    (transformers.AutoTokenizer from --tokenizer-model, a folder or a model name; needs
    pip install 'megatron-ext[hf]')."""

    tokenizer_model: Optional[str] = None
    """SentencePiece .model file, or with HuggingFaceTokenizer a tokenizer folder or model
    name. Default (SentencePiece): train a byte-fallback BPE model on the embedded corpus (a
    few seconds, once; cached under --data-cache-path)."""

    vocab_file: Optional[str] = None
    """GPT-2 vocabulary (encoder.json / vocab.json) for GPT2BPETokenizer."""

    merge_file: Optional[str] = None
    """GPT-2 BPE merges (merges.txt) for GPT2BPETokenizer."""

    vocab_size: int = 8192
    """Number of pieces of the SentencePiece model trained when --tokenizer-model is not
    given (256 byte pieces and 4 special pieces included)."""

    def __post_init__(self):
        cls = type(self)
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ConfigError(
                flag_of(cls, "tokenizer_type"),
                f"invalid value {self.tokenizer_type!r} (choose from {', '.join(TOKENIZER_TYPES)})",
            )
        if self.vocab_size <= 0:
            raise ConfigError(flag_of(cls, "vocab_size"), f"must be > 0, got {self.vocab_size}")
        if self.tokenizer_type == "GPT2BPETokenizer":
            missing = [
                flag_of(cls, name)
                for name in ("vocab_file", "merge_file")
                if getattr(self, name) is None
            ]
            if missing:
                raise ConfigError(
                    [flag_of(cls, "tokenizer_type"), *missing],
                    f"GPT2BPETokenizer needs {' and '.join(missing)}",
                )
            if self.tokenizer_model is not None:
                raise ConfigError(
                    flag_of(cls, "tokenizer_model"),
                    "is a SentencePiece model; it is not used by GPT2BPETokenizer",
                )
        else:
            for name in ("vocab_file", "merge_file"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        flag_of(cls, name),
                        "is only used with --tokenizer-type GPT2BPETokenizer",
                    )
            if self.tokenizer_type == "HuggingFaceTokenizer" and self.tokenizer_model is None:
                raise ConfigError(
                    [flag_of(cls, "tokenizer_type"), flag_of(cls, "tokenizer_model")],
                    "HuggingFaceTokenizer needs --tokenizer-model (a folder written by "
                    "save_pretrained, or a model name such as meta-llama/Meta-Llama-3-8B)",
                )
            if self.tokenizer_model is None and self.vocab_size < _MIN_TRAINED_VOCAB_SIZE:
                raise ConfigError(
                    flag_of(cls, "vocab_size"),
                    f"must be at least {_MIN_TRAINED_VOCAB_SIZE} for a trained SentencePiece "
                    f"model (256 byte pieces + 4 special pieces + merges), got {self.vocab_size}",
                )

    @property
    def trains_tokenizer(self) -> bool:
        """Whether the SentencePiece model is trained (no --tokenizer-model given)."""
        return self.tokenizer_type == "SentencePieceTokenizer" and self.tokenizer_model is None


@dataclass(frozen=True, kw_only=True)
class DataConfig(TokenizerConfig):
    """Tokenizer plus the source, split and cache of the pretraining data."""

    ARG_GROUP: ClassVar[str] = "megatron-ext: data and tokenizer"
    ARG_PREFIX: ClassVar[str] = ""

    data_path: Optional[Tuple[str, ...]] = None
    """Megatron indexed datasets (<prefix>.bin/.idx, e.g. from 'megatron-ext prepare-data' or
    Megatron-LM's tools/preprocess_data.py), as Megatron-LM's blend: 'prefix1 prefix2 ...'
    (weighted by size) or 'weight1 prefix1 weight2 prefix2 ...'. Needs the tokenizer the data
    was made with. Default: the embedded corpus, unless --data-files is given."""

    split: str = "969,30,1"
    """Comma-separated proportions of documents for the training, validation and test splits,
    applied to every --data-path dataset (Megatron-LM's --split)."""

    data_files: Optional[Tuple[str, ...]] = None
    """Local .txt, .json, .jsonl, .csv or .parquet files (optionally .gz/.bz2/.xz/.zst
    compressed), read with Hugging Face datasets and tokenized once into an indexed dataset
    in the cache. A .txt file is one document; JSON/CSV/Parquet rows are documents, their text
    in --data-text-key."""

    data_text_key: str = "text"
    """Column (JSON key) holding the document text in --data-files."""

    data_cache_path: Optional[str] = None
    """Directory for cached tokenizers, tokenized data and megatron-core's sample indices;
    must be visible to every rank of a run. Default: $MEGATRON_EXT_CACHE, else
    ~/.cache/megatron_ext."""

    fixed_samples: Optional[int] = None
    """Fixed-sample mode: cut the training split into this many samples once (rounded down
    to a multiple of the data-parallel size) and train in epochs over them, each epoch in a
    new order, every sample always on the same data-parallel rank. A sample id then means
    the same tokens in every epoch (megatron-core's GPTDataset otherwise repacks documents
    per epoch); methods that keep state per training sample (--p2p-compression aqsgd)
    need it. Default: off (one pass over as many samples as the run consumes)."""

    def __post_init__(self):
        super().__post_init__()
        cls = type(self)
        if self.data_path is not None and self.data_files is not None:
            raise ConfigError(
                [flag_of(cls, "data_path"), flag_of(cls, "data_files")],
                "give one data source, not both",
            )
        parse_blend(self.data_path, flag_of(cls, "data_path"))
        if self.data_path is not None and self.trains_tokenizer:
            raise ConfigError(
                [flag_of(cls, "data_path"), flag_of(cls, "tokenizer_model")],
                "indexed datasets hold token ids of a specific tokenizer; pass the one they "
                "were made with (--tokenizer-model, --tokenizer-type GPT2BPETokenizer with "
                "--vocab-file/--merge-file, or --tokenizer-type HuggingFaceTokenizer with "
                "--tokenizer-model)",
            )
        if self.data_files is not None and not self.data_files:
            raise ConfigError(flag_of(cls, "data_files"), "needs at least one file")
        if not self.data_text_key:
            raise ConfigError(flag_of(cls, "data_text_key"), "must not be empty")
        if not _SPLIT_PATTERN.fullmatch(self.split):
            raise ConfigError(
                flag_of(cls, "split"),
                f"expected up to three comma-separated numbers like '969,30,1', got "
                f"{self.split!r}",
            )
        if sum(float(x) for x in re.findall(r"[.0-9]+", self.split)) <= 0:
            raise ConfigError(flag_of(cls, "split"), f"proportions sum to zero: {self.split!r}")
        if self.fixed_samples is not None and self.fixed_samples <= 0:
            raise ConfigError(
                flag_of(cls, "fixed_samples"), f"must be > 0, got {self.fixed_samples}"
            )

    @property
    def blend(self) -> Optional[Tuple[List[str], Optional[List[float]]]]:
        """``--data-path`` as megatron-core's ``(prefixes, weights)``, or None."""
        return parse_blend(self.data_path, flag_of(type(self), "data_path"))

    @property
    def cache_dir(self) -> str:
        """``--data-cache-path``, or :func:`default_cache_dir`, as an absolute path."""
        if self.data_cache_path:
            return os.path.abspath(os.path.expanduser(self.data_cache_path))
        return default_cache_dir()
