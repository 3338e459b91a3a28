"""The megatron-core releases megatron-ext supports, and the one code path per release.

What it does:
    The adapters in ``megatron_ext.megatron`` re-implement a few megatron-core method bodies
    around our seams (the DP bucket group's ``start_grad_sync``, the P2P communicator's
    ``_communicate``). Those bodies differ between releases, so each supported release has
    one module here (``core_v0_16``, ``core_v0_19``) holding everything release-specific
    (``start_grad_sync``, ``bucket_grad``; ``_communicate`` is identical in both);
    :func:`release` picks the module of the installed megatron-core and nothing else in
    megatron-ext branches on versions. A release not in :data:`SUPPORTED` (0.17 and 0.18
    included) is refused before training with :class:`~megatron_ext.config.ConfigError`
    naming the installed version and the supported ones.

Constraints:
    Imports megatron only inside the release modules.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Tuple

from megatron_ext.config import ConfigError
from megatron_ext.megatron.version import mcore_version, parse_version

__all__ = ["SUPPORTED", "release", "supported_text"]

SUPPORTED: Dict[Tuple[int, int], str] = {
    (0, 16): "megatron_ext.megatron.mcore.core_v0_16",
    (0, 19): "megatron_ext.megatron.mcore.core_v0_19",
}
"""(major, minor) of megatron-core -> the module of that release line."""


def _major_minor(version: str) -> Tuple[int, int]:
    major, minor = parse_version(version)[:2]
    return major, minor


def supported_text() -> str:
    """Human-readable list of the supported release lines."""
    return ", ".join(f"{a}.{b}.x" for a, b in sorted(SUPPORTED))


_cache: Dict[str, ModuleType] = {}


def release(version: str = "") -> ModuleType:
    """The release module of the installed megatron-core (or of ``version``).

    Raises:
        ConfigError: the release is not supported (names it and the supported ones).
    """
    version = version or mcore_version()
    name = SUPPORTED.get(_major_minor(version))
    if name is None:
        raise ConfigError(
            "megatron-core",
            f"megatron-core {version} is not supported; megatron-ext supports "
            f"{supported_text()} (its seams re-implement megatron-core methods whose bodies "
            "change between releases, so other releases are refused rather than half-hooked)",
        )
    if name not in _cache:
        _cache[name] = importlib.import_module(name)
    return _cache[name]
