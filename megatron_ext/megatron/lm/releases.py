"""Which Megatron-LM releases megatron-ext can hook, and how a checkout's release is found.

What it does:
    :data:`RELEASES` maps a megatron-core version string (``megatron/core/package_info.py``)
    to a :class:`MegatronLMRelease`: its git tag, the module that installs the runtime hooks
    for it, the fingerprint (SHA-256) of its pristine ``pretrain_gpt.py`` and the folder of
    its source patch under ``patches/``. :func:`detect_checkout_release` reads a checkout on
    disk (without importing it) and :func:`release_for_version` resolves the release of the
    megatron-core that is imported at run time. Anything not in the table is refused with
    :class:`UnsupportedReleaseError`, whose message names the supported releases.

Why a table:
    Megatron-LM moves its seams between releases: 0.16 parses arguments inside
    ``pretrain()`` (``initialize.py`` imports ``parse_args``/``validate_args`` by name),
    0.18 parses them in ``pretrain_gpt.py``'s ``__main__`` through
    ``arguments.parse_and_validate_args``, 0.19 passes a ``p2p_communicator`` to
    ``train_step`` itself. Each verified release gets its own hook module; an unverified
    release is refused rather than half-hooked (a silently missing hook would train without
    compression, or lose megatron-ext state in checkpoints).

Constraints:
    Pure Python; never imports Megatron (the launcher and ``megatron-ext patch`` use it
    before ``sys.path`` holds a checkout).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megatron_ext.digests import file_digest

__all__ = [
    "MegatronLMRelease",
    "RELEASES",
    "UnsupportedReleaseError",
    "supported_releases_text",
    "read_checkout_version",
    "file_sha256",
    "detect_checkout_release",
    "release_for_version",
    "same_release_family",
]


@dataclass(frozen=True)
class MegatronLMRelease:
    """One Megatron-LM release that megatron-ext was verified against."""

    version: str
    """megatron-core version string as ``megatron/core/package_info.py`` builds it."""

    tag: str
    """Git tag of the release in NVIDIA/Megatron-LM."""

    hooks: str
    """``module:function`` that installs the runtime hooks for this release."""

    pretrain_gpt_sha256: str
    """SHA-256 of the release's unmodified ``pretrain_gpt.py``."""

    patch_dir: str
    """Folder under ``patches/`` holding the release's source patch."""

    requires_python: Tuple[int, int] = (3, 10)
    """Python the release declares; on an older one :mod:`~megatron_ext.megatron.lm.compat`
    backports what its training package imports."""


_CORE_V0_19_0_SHA256 = "7283c4aeb5a00c694bbf2930527a184fc0d5f607f548c74707c71cc240d05fae"

RELEASES: Dict[str, MegatronLMRelease] = {
    "0.16.1": MegatronLMRelease(
        version="0.16.1",
        tag="core_v0.16.1",
        hooks="megatron_ext.megatron.lm.core_v0_16:install_hooks",
        pretrain_gpt_sha256="5a5b8fe909610892146e4d2ef5b303bd9b73bb31dfc96d73f2d0afb8937d4b22",
        patch_dir="core_v0.16.1",
    ),
    # One Megatron-LM tag, three megatron-core version strings: the release 0.19.0 was built
    # from the tag's parent, the tag commit itself only bumps package_info.py to 0.19.1, and
    # the megatron-core 0.19.2 wheel ships the same megatron/training (it differs from the
    # tag in four megatron/core files outside every seam megatron-ext hooks).
    **{
        version: MegatronLMRelease(
            version=version,
            tag="core_v0.19.0",
            hooks="megatron_ext.megatron.lm.core_v0_19:install_hooks",
            pretrain_gpt_sha256=_CORE_V0_19_0_SHA256,
            patch_dir="core_v0.19.0",
            requires_python=(3, 12),
        )
        for version in ("0.19.0", "0.19.1", "0.19.2")
    },
}


class UnsupportedReleaseError(RuntimeError):
    """A Megatron-LM checkout or megatron-core whose release megatron-ext does not support."""


def supported_releases_text() -> str:
    """``core_v0.16.1 (megatron-core 0.16.1), ...`` for error messages."""
    versions: Dict[str, list] = {}
    for release in RELEASES.values():
        versions.setdefault(release.tag, []).append(release.version)
    return ", ".join(f"{tag} (megatron-core {', '.join(v)})" for tag, v in versions.items())


def same_release_family(a: str, b: str) -> bool:
    """Whether two megatron-core versions are supported releases of the same Megatron-LM tag."""
    return a in RELEASES and b in RELEASES and RELEASES[a].tag == RELEASES[b].tag


def read_checkout_version(checkout: str) -> Optional[str]:
    """The version in ``<checkout>/megatron/core/package_info.py``, or None if absent.

    The file is parsed, not imported: it assigns ``MAJOR``, ``MINOR``, ``PATCH`` and
    ``PRE_RELEASE`` literals and builds ``__version__`` from them.

    Raises:
        UnsupportedReleaseError: the file exists but does not have that shape.
    """
    path = os.path.join(checkout, "megatron", "core", "package_info.py")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    values: Dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                values[target.id] = node.value.value
    try:
        major, minor, patch = values["MAJOR"], values["MINOR"], values["PATCH"]
    except KeyError as exc:
        raise UnsupportedReleaseError(
            f"{path} does not define MAJOR/MINOR/PATCH (missing {exc}); cannot tell which "
            f"Megatron-LM release this is. Supported: {supported_releases_text()}."
        ) from None
    return f"{major}.{minor}.{patch}{values.get('PRE_RELEASE', '') or ''}"


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes."""
    return file_digest(path, "sha256")


def _unsupported(where: str, version: str) -> UnsupportedReleaseError:
    return UnsupportedReleaseError(
        f"{where} is Megatron-LM release {version}; megatron-ext supports "
        f"{supported_releases_text()}. Check out a supported tag (git checkout "
        f"{next(iter(RELEASES.values())).tag}) or see patches/README.md for the plan for "
        "newer releases."
    )


def detect_checkout_release(checkout: str) -> MegatronLMRelease:
    """The release of a Megatron-LM checkout on disk.

    Read from ``megatron/core/package_info.py``; a tree without that file (for example a
    checkout whose ``megatron/core`` was removed to use an installed megatron-core) is
    recognised by the fingerprint of its ``pretrain_gpt.py``.

    Args:
        checkout: the checkout's root directory (the one holding ``pretrain_gpt.py``).

    Raises:
        UnsupportedReleaseError: unknown release, or nothing to tell it by.
    """
    version = read_checkout_version(checkout)
    if version is not None:
        if version not in RELEASES:
            raise _unsupported(f"{checkout} (megatron/core/package_info.py)", version)
        return RELEASES[version]
    script = os.path.join(checkout, "pretrain_gpt.py")
    if os.path.isfile(script):
        digest = file_sha256(script)
        for release in RELEASES.values():
            if digest == release.pretrain_gpt_sha256:
                return release
    raise UnsupportedReleaseError(
        f"cannot tell the Megatron-LM release of {checkout}: it has no "
        "megatron/core/package_info.py and its pretrain_gpt.py matches no supported "
        f"release's. Supported: {supported_releases_text()}."
    )


def release_for_version(
    version: str, where: str = "the imported megatron-core"
) -> MegatronLMRelease:
    """The release entry of a megatron-core version string.

    Raises:
        UnsupportedReleaseError: the version is not in :data:`RELEASES`.
    """
    if version not in RELEASES:
        raise _unsupported(where, version)
    return RELEASES[version]
