"""``megatron-ext prepare-data``: tokenize local files into a Megatron indexed dataset.

What it does:
    Reads ``--input`` files (``.txt``, ``.json``, ``.jsonl``, ``.csv``, ``.parquet``, optionally
    compressed) through Hugging Face ``datasets``, tokenizes every document with

    * GPT-2 byte-level BPE (``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``),
    * a Hugging Face tokenizer (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model
      FOLDER_OR_NAME``; needs ``transformers``: ``pip install 'megatron-ext[hf]'``, checked
      before anything is read),
    * a SentencePiece model (``--tokenizer-model``), or
    * a SentencePiece model trained here on the input itself (``--vocab-size``; saved as
      ``<output-prefix>.model``),

    and writes ``<output-prefix>.bin``/``.idx`` with an end-of-document token after each
    document. It prints the document and token counts and the time taken. The result is
    used with ``--data-path <output-prefix>`` and the same tokenizer flags, in
    ``megatron-ext train`` and in Megatron-LM (whose ``--tokenizer-type`` names these
    tokenizers the same way; the tokens are the ones its ``tools/preprocess_data.py`` writes).

Why:
    Megatron-LM's ``tools/preprocess_data.py`` reads only JSON lines and needs Megatron-LM's
    tokenizer stack; this command covers the common local formats with the tokenizers of
    :mod:`megatron_ext.data.tokenizers`, and the files it writes are read by megatron-core
    (and Megatron-LM) unchanged.

Constraints:
    * It writes megatron-core's indexed format, so it lives with the other megatron-core
      adapters; megatron-core is imported lazily (by :func:`prepare_data`), so importing
      this module (for ``--help``) is cheap.
    * ``--workers`` parallelizes tokenization only; reading is sequential. The output is the
      same for any number of workers; a trained SentencePiece model always uses 2 training
      threads, because SentencePiece's result depends on the thread count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Sequence, Tuple

from megatron_ext.config import ConfigError, add_config_args, config_from_args, flag_of
from megatron_ext.data.config import TokenizerConfig
from megatron_ext.data.readers import check_files, iter_file_documents
from megatron_ext.data.tokenizers import (
    MissingPackageError,
    SentencePieceTokenizer,
    check_transformers,
    train_sentencepiece,
)

__all__ = ["PrepareDataConfig", "build_parser", "prepare_data", "main"]


@dataclass(frozen=True, kw_only=True)
class PrepareDataConfig(TokenizerConfig):
    """Inputs, output and tokenizer of ``megatron-ext prepare-data``."""

    ARG_GROUP: ClassVar[str] = "megatron-ext prepare-data"
    ARG_PREFIX: ClassVar[str] = ""

    tokenizer_model: Optional[str] = None
    """SentencePiece .model file, or with HuggingFaceTokenizer a tokenizer folder or model
    name. Default (with SentencePieceTokenizer): train a byte-fallback BPE model with
    --vocab-size pieces on the input and save it as <output-prefix>.model."""

    input: Optional[Tuple[str, ...]] = None
    """Input files: .txt (one document per file), .json/.jsonl/.csv/.parquet (one document per
    row, text in --data-text-key); .gz/.bz2/.xz/.zst compression is undone. Required."""

    output_prefix: Optional[str] = None
    """Output path prefix: writes <output-prefix>.bin and <output-prefix>.idx. Required."""

    data_text_key: str = "text"
    """Column (JSON key) holding the document text."""

    workers: int = 1
    """Tokenization processes (threads for SentencePiece)."""

    append_eod: bool = True
    """Append the end-of-document token after every document (GPT pretraining needs the
    boundaries)."""

    def __post_init__(self):
        super().__post_init__()
        cls = type(self)
        if not self.input:
            raise ConfigError(flag_of(cls, "input"), "is required (one or more files)")
        if not self.output_prefix:
            raise ConfigError(flag_of(cls, "output_prefix"), "is required")
        if self.output_prefix.endswith((".bin", ".idx")):
            raise ConfigError(
                flag_of(cls, "output_prefix"), "give the prefix, without the .bin/.idx suffix"
            )
        if self.workers < 1:
            raise ConfigError(flag_of(cls, "workers"), f"must be >= 1, got {self.workers}")
        if not self.data_text_key:
            raise ConfigError(flag_of(cls, "data_text_key"), "must not be empty")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``megatron-ext prepare-data``."""
    parser = argparse.ArgumentParser(
        prog="megatron-ext prepare-data",
        description=(
            "Tokenize local text/JSON/JSONL/CSV/Parquet files into a Megatron indexed "
            "dataset (<output-prefix>.bin/.idx) for --data-path."
        ),
    )
    return add_config_args(parser, PrepareDataConfig)


def _format_bytes(num: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.1f} {unit}" if unit != "B" else f"{num} B"
        num /= 1024
    return f"{num} B"


def prepare_data(cfg: PrepareDataConfig, out=None) -> Tuple[int, int]:
    """Run ``prepare-data`` for a parsed configuration.

    Args:
        cfg: the configuration.
        out: where the report is printed (default: ``sys.stdout`` at the time of the call).

    Returns:
        ``(num_documents, num_tokens)`` written.

    Raises:
        ConfigError: for missing or unreadable inputs or tokenizer files, naming the flag.
    """
    out = sys.stdout if out is None else out
    cls = type(cfg)
    if cfg.tokenizer_type == "HuggingFaceTokenizer":
        try:  # before megatron-core is imported and any input is read
            check_transformers()
        except MissingPackageError as err:
            raise ConfigError(flag_of(cls, "tokenizer_type"), str(err)) from None
    with warnings.catch_warnings():
        # megatron-core warns at import about optional GPU libraries this command never uses.
        warnings.simplefilter("ignore")
        from megatron_ext.megatron.data import (
            DEFAULT_TOKENIZER_SEED,
            DEFAULT_TOKENIZER_THREADS,
            build_tokenizer,
            indexed_dataset_stats,
            write_indexed_dataset,
        )

    start = time.time()
    input_flag, key_flag = flag_of(cls, "input"), flag_of(cls, "data_text_key")
    files: List[str] = check_files(cfg.input, input_flag)
    output_prefix = os.path.abspath(os.path.expanduser(cfg.output_prefix))
    try:
        os.makedirs(os.path.dirname(output_prefix), exist_ok=True)
    except OSError as err:
        raise ConfigError(flag_of(cls, "output_prefix"), str(err)) from err

    hf_cache = tempfile.mkdtemp(prefix="megatron-ext-prepare-")
    try:

        def documents():
            return iter_file_documents(
                files,
                cfg.data_text_key,
                hf_cache_dir=hf_cache,
                files_flag=input_flag,
                key_flag=key_flag,
            )

        if cfg.trains_tokenizer:
            t0 = time.time()
            try:
                model_path = train_sentencepiece(
                    documents(),
                    output_prefix,
                    cfg.vocab_size,
                    seed=DEFAULT_TOKENIZER_SEED,
                    num_threads=DEFAULT_TOKENIZER_THREADS,
                )
            except ValueError as err:
                if isinstance(err, ConfigError):
                    raise
                raise ConfigError(flag_of(cls, "vocab_size"), str(err)) from err
            tokenizer = SentencePieceTokenizer(model_path)
            print(
                f"trained SentencePiece model: {model_path} (vocab {tokenizer.vocab_size}, "
                f"{time.time() - t0:.1f} s)",
                file=out,
            )
        else:
            tokenizer = build_tokenizer(cfg)
        t0 = time.time()
        try:
            write_indexed_dataset(
                documents(),
                tokenizer,
                output_prefix,
                append_eod=cfg.append_eod,
                num_workers=cfg.workers,
            )
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(input_flag, str(err)) from err
        tokenize_seconds = time.time() - t0
    finally:
        shutil.rmtree(hf_cache, ignore_errors=True)

    num_documents, num_tokens = indexed_dataset_stats(output_prefix)
    total = time.time() - start
    size = os.path.getsize(f"{output_prefix}.bin") + os.path.getsize(f"{output_prefix}.idx")
    print(f"tokenizer: {tokenizer!r}", file=out)
    print(f"input: {len(files)} file(s)", file=out)
    print(
        f"wrote {output_prefix}.bin/.idx ({_format_bytes(size)}): {num_documents} documents, "
        f"{num_tokens} tokens ({num_tokens / max(num_documents, 1):.1f} per document)",
        file=out,
    )
    print(
        f"time: {total:.1f} s total, {tokenize_seconds:.1f} s reading and tokenizing "
        f"({num_tokens / max(tokenize_seconds, 1e-9):,.0f} tokens/s)",
        file=out,
    )
    return num_documents, num_tokens


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``megatron-ext prepare-data``.

    Args:
        argv: arguments after the subcommand (default ``sys.argv[1:]``).

    Returns:
        0 on success; configuration errors exit with status 2 and a message naming the flag.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        prepare_data(config_from_args(PrepareDataConfig, args))
    except ConfigError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
