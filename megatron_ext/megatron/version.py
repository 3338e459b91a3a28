"""megatron-core version checks for the adapters.

Each adapter that re-implements a piece of megatron-core (rather than calling a public
seam) states the releases it was verified against and refuses others with a message that
names the feature and the versions, instead of silently dropping upstream behaviour.
"""

from __future__ import annotations

from typing import Tuple

from megatron_ext.config import ConfigError

__all__ = ["mcore_version", "public_version", "require_mcore"]


def public_version(version: str) -> str:
    """``version`` without its PEP 440 local part: megatron-core 0.19's ``package_info``
    appends ``+<git sha>`` whenever its folder is inside a git work tree (a Megatron-LM
    checkout, or a virtual environment created inside any repository)."""
    return version.split("+", 1)[0]


def _parse(version: str) -> Tuple[int, ...]:
    parts = []
    for piece in public_version(version).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def mcore_version() -> str:
    """The imported megatron-core version string (without a local ``+<git sha>`` part)."""
    from megatron.core import package_info

    return public_version(package_info.__version__)


def require_mcore(feature: str, minimum: str, below: str) -> None:
    """Raise ConfigError unless ``minimum <= megatron-core < below``.

    Args:
        feature: what needs the check (named in the error).
        minimum: lowest verified release.
        below: first release not verified.
    """
    version = mcore_version()
    if not (_parse(minimum) <= _parse(version) < _parse(below)):
        raise ConfigError(
            "megatron-core",
            f"{feature} is verified for megatron-core >= {minimum}, < {below}; found "
            f"{version}. Its hook re-implements a megatron-core method whose body changed "
            "in later releases, so it refuses to run rather than drop upstream steps.",
        )
