"""Read documents from local text, JSON, JSONL, CSV and Parquet files with HF ``datasets``.

What it does:
    :func:`iter_file_documents` yields the document texts of a list of files, in the order
    the files are given and, within a file, in row order. The Hugging Face builder is chosen
    by extension: ``.txt``/``.text`` -> ``text`` (the whole file is one document), ``.json``
    and ``.jsonl`` -> ``json`` (JSON lines, or a top-level array of objects), ``.csv`` ->
    ``csv``, ``.parquet`` -> ``parquet``. A trailing ``.gz``/``.bz2``/``.xz``/``.zst`` is
    decompressed by ``datasets``. :func:`files_fingerprint` names a file list for caches.

Why:
    ``datasets`` already parses these formats robustly and streams them from Arrow memory
    maps, so large JSONL/Parquet corpora do not have to fit in memory. Its Arrow cache goes
    to a directory the caller chooses (normally a temporary one that is deleted after
    tokenization) so nothing accumulates in ``~/.cache/huggingface``.

Constraints:
    * Pure Python (``datasets``); never imports Megatron or torch.
    * A ``.txt`` file is read into memory as one document.
    * Rows whose text is null are skipped; non-string text is an error, as is a missing
      column. Errors name the flag the files came from.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator, List, Optional, Sequence, Tuple

from megatron_ext.options.base import ConfigError

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "builder_for",
    "check_files",
    "files_fingerprint",
    "iter_file_documents",
]

_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")

SUPPORTED_EXTENSIONS: Tuple[str, ...] = tuple(_BUILDERS)
"""File extensions :func:`iter_file_documents` reads (each optionally compressed)."""

_BATCH_ROWS = 1024


def builder_for(path: str, flag: str = "--data-files") -> str:
    """Name of the ``datasets`` builder for ``path``.

    Args:
        path: a file name.
        flag: flag named in the error message.

    Raises:
        ConfigError: for an unsupported extension.
    """
    name = path.lower()
    for suffix in _COMPRESSIONS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    ext = os.path.splitext(name)[1]
    if ext not in _BUILDERS:
        raise ConfigError(
            flag,
            f"{path}: unsupported file type {ext or '(none)'!r}; supported: "
            f"{', '.join(SUPPORTED_EXTENSIONS)} (optionally {'/'.join(_COMPRESSIONS)})",
        )
    return _BUILDERS[ext]


def check_files(files: Sequence[str], flag: str = "--data-files") -> List[str]:
    """Absolute paths of ``files``, after checking that each exists and has a known type.

    Args:
        files: the files.
        flag: flag named in the error message.

    Raises:
        ConfigError: for an empty list, a missing file or an unsupported extension.
    """
    if not files:
        raise ConfigError(flag, "needs at least one file")
    paths = []
    for f in files:
        path = os.path.abspath(os.path.expanduser(f))
        if not os.path.isfile(path):
            what = "is not a file" if os.path.exists(path) else "no such file"
            raise ConfigError(flag, f"{f}: {what}")
        builder_for(path, flag)
        paths.append(path)
    return paths


def files_fingerprint(files: Sequence[str], *extra: str, flag: str = "--data-files") -> str:
    """Short hash of a file list: absolute paths, sizes and modification times, in order.

    Args:
        files: the files; they must exist.
        extra: further strings that belong to the key (text column, tokenizer identity).
        flag: flag named in error messages.

    Returns:
        16 hexadecimal characters.
    """
    entries = []
    for path in check_files(files, flag):
        st = os.stat(path)
        entries.append([path, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"files": entries, "extra": list(extra)}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _runs_by_builder(paths: List[str], flag: str) -> List[Tuple[str, List[str]]]:
    """Consecutive files with the same builder, so one load_dataset call reads each run."""
    runs: List[Tuple[str, List[str]]] = []
    for path in paths:
        builder = builder_for(path, flag)
        if runs and runs[-1][0] == builder:
            runs[-1][1].append(path)
        else:
            runs.append((builder, [path]))
    return runs


def iter_file_documents(
    files: Sequence[str],
    text_key: str = "text",
    *,
    hf_cache_dir: Optional[str] = None,
    files_flag: str = "--data-files",
    key_flag: str = "--data-text-key",
) -> Iterator[str]:
    """Yield the documents of local files, in file order then row order.

    Args:
        files: the files.
        text_key: column holding the text (ignored for ``.txt`` files).
        hf_cache_dir: where ``datasets`` writes its Arrow cache (default: its own,
            ``~/.cache/huggingface/datasets``).
        files_flag: flag named in errors about the files.
        key_flag: flag named in errors about ``text_key``.

    Yields:
        Document texts (empty strings included; the writer skips them).

    Raises:
        ConfigError: for a missing or unsupported file, a missing column or non-text values.
    """
    import datasets

    paths = check_files(files, files_flag)
    for builder, run in _runs_by_builder(paths, files_flag):
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        try:
            dataset = datasets.load_dataset(
                builder, data_files=run, split="train", cache_dir=hf_cache_dir, **kwargs
            )
        except Exception as err:
            raise ConfigError(files_flag, f"cannot read {', '.join(run)}: {err}") from err
        column = "text" if builder == "text" else text_key
        if column not in dataset.column_names:
            raise ConfigError(
                key_flag,
                f"no column {column!r} in {', '.join(run)}; columns: "
                f"{', '.join(dataset.column_names)}",
            )
        for batch in dataset.select_columns([column]).iter(batch_size=_BATCH_ROWS):
            for text in batch[column]:
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise ConfigError(
                        key_flag,
                        f"column {column!r} of {', '.join(run)} holds {type(text).__name__} "
                        "values, not text",
                    )
                yield text
