"""megatron-core version strings: the installed release, compared without local parts.

Which releases are supported, and the code path of each, is ``megatron_ext.megatron.mcore``.
"""

from __future__ import annotations

from typing import Tuple

__all__ = ["mcore_version", "public_version", "parse_version"]


def public_version(version: str) -> str:
    """``version`` without its PEP 440 local part: megatron-core 0.19's ``package_info``
    appends ``+<git sha>`` whenever its folder is inside a git work tree (a Megatron-LM
    checkout, or a virtual environment created inside any repository)."""
    return version.split("+", 1)[0]


def parse_version(version: str) -> Tuple[int, ...]:
    """``(major, minor, patch)`` of a version string (non-digits dropped)."""
    parts = []
    for piece in public_version(version).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def mcore_version() -> str:
    """The imported megatron-core version string (without a local ``+<git sha>`` part)."""
    from megatron.core import package_info

    return public_version(package_info.__version__)
