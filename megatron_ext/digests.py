"""Digests of files: the one streaming reader behind every file hash megatron-ext keeps.

What it does:
    :func:`file_digest` reads a file in 16 MiB chunks into ``zlib.crc32`` or any ``hashlib``
    algorithm and returns the hex digest.

Why:
    Checkpoint manifests (crc32, ``megatron_ext/megatron/checksums.py``), the release check of
    Megatron-LM's ``pretrain_gpt.py`` (sha256) and the tokenizer files' identifiers (sha256)
    hash files the same way.

Constraints:
    Standard library only; a first-level module that imports no other megatron_ext module, so
    every layer may use it.
"""

from __future__ import annotations

import hashlib
import zlib

__all__ = ["file_digest"]

_CHUNK = 16 * 2**20


def file_digest(path: str, algorithm: str) -> str:
    """The hex digest of the file ``path`` (``crc32`` or any ``hashlib`` algorithm)."""
    with open(path, "rb") as f:
        if algorithm == "crc32":
            value = 0
            while chunk := f.read(_CHUNK):
                value = zlib.crc32(chunk, value)
            return f"{value:08x}"
        h = hashlib.new(algorithm)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        return h.hexdigest()
