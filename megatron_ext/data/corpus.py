"""The embedded default corpus: CPython's own documentation text and docstrings.

What it does:
    :func:`embedded_corpus_documents` yields English prose that exists on every machine with a
    Python installation, without any download: the help topics of ``pydoc_data.topics`` (the
    language reference sections that ``help("FOR")`` shows) followed by the module, class and
    function docstrings of the standard library's ``.py`` sources. Docstrings are read with
    :mod:`ast`; no module is imported, so nothing of the standard library executes.
    :func:`embedded_corpus_fingerprint` names the corpus for caches (tokenizer model, indexed
    dataset): it changes whenever the text could change.

Why:
    A training driver needs real text to show a falling loss, and tests and CPU smoke runs
    must work offline. The standard library's documentation is a few MB of natural-language
    text with code mixed in, which suits a small GPT and a small tokenizer.

Constraints:
    * Pure Python (stdlib only); never imports Megatron or torch.
    * Deterministic for a given Python installation: files are visited in sorted order, and
      ``test``/``tests``/``idlelib``/``lib2to3``/``site-packages`` directories are skipped (the
      last one holds whatever the user installed, which would make the corpus
      machine-dependent). Files that do not parse under the running interpreter are skipped.
    * Different Python versions give different corpora; the fingerprint includes the version
      and the bytes of every source file, so caches never mix them up.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from functools import lru_cache
from typing import Iterator, List, Tuple

__all__ = [
    "MIN_DOCSTRING_CHARS",
    "CORPUS_FORMAT_VERSION",
    "embedded_corpus_documents",
    "embedded_corpus_fingerprint",
    "stdlib_source_files",
]

MIN_DOCSTRING_CHARS: int = 64
"""Docstrings shorter than this (after ``inspect.cleandoc``) are not documents of their own:
they are mostly one-line summaries such as "Return self." that add little text."""

CORPUS_FORMAT_VERSION: int = 2
"""Bumped whenever the extraction rules below change, so that caches keyed by the
fingerprint are rebuilt."""

_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
)

_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


@lru_cache(maxsize=None)
def stdlib_source_files() -> Tuple[str, ...]:
    """Paths of the standard library ``.py`` files the corpus reads, sorted.

    Returns:
        Absolute paths, in the order the documents are produced.
    """
    root = _stdlib_root()
    paths: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk from descending into skipped directories.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return tuple(sorted(paths))


def _topics() -> List[Tuple[str, str]]:
    from pydoc_data.topics import topics

    return sorted(topics.items())


def _docstrings(source: bytes) -> List[str]:
    """Docstrings of the module, its classes and functions, in source order."""
    tree = ast.parse(source)
    docs = []
    # ast.walk is breadth-first; sorting by position gives reading order instead.
    nodes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, _DOCSTRING_NODES)),
        key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)),
    )
    for node in nodes:
        doc = (ast.get_docstring(node, clean=True) or "").strip()
        if len(doc) >= MIN_DOCSTRING_CHARS:
            docs.append(doc)
    return docs


def embedded_corpus_documents() -> Iterator[str]:
    """Yield the documents of the embedded corpus, always in the same order.

    One document per ``pydoc_data`` help topic (sorted by topic name), then one per docstring
    of at least :data:`MIN_DOCSTRING_CHARS` characters, file by file in sorted path order.
    A full pass takes a few seconds (it parses about 600 files).

    Yields:
        Document texts, stripped of leading and trailing whitespace, never empty.
    """
    for _, text in _topics():
        text = text.strip()
        if text:
            yield text
    for path in stdlib_source_files():
        try:
            with open(path, "rb") as f:
                source = f.read()
            docs = _docstrings(source)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            # A file for another Python version (or an unreadable one) is not corpus text.
            continue
        yield from docs


@lru_cache(maxsize=None)
def embedded_corpus_fingerprint() -> str:
    """A short name for the embedded corpus of this Python installation.

    It hashes the extraction rules' version, the Python version, the help topics and the raw
    bytes of every source file the corpus reads (with their paths relative to the standard
    library root). Hashing bytes instead of extracted docstrings keeps it cheap (no parsing;
    a fraction of a second), and any change of the corpus text changes it. Cached per process.

    Returns:
        16 hexadecimal characters, e.g. ``"3f2a9c0d1b7e4a55"``.
    """
    h = hashlib.sha256()
    h.update(f"megatron_ext-corpus-v{CORPUS_FORMAT_VERSION}\0".encode())
    h.update(f"{sys.implementation.name}-{sys.version}\0".encode())
    h.update(f"min-chars={MIN_DOCSTRING_CHARS}\0".encode())
    for name, text in _topics():
        h.update(name.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    root = _stdlib_root()
    for path in stdlib_source_files():
        h.update(os.path.relpath(path, root).encode("utf-8", "surrogateescape") + b"\0")
        try:
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()[:16]
