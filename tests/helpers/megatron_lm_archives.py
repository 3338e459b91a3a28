"""A Megatron-LM checkout for the ``megatron_lm`` tests, extracted from a source archive.

What it does:
    :func:`checkout_from_archives` picks, in a folder of Megatron-LM source archives (``git
    archive`` tarballs named ``<tag>.tar.gz``, e.g. ``core_v0.16.1.tar.gz``), the one of the
    Megatron-LM tag that goes with the installed megatron-core (0.16.x: ``core_v0.16.1``,
    0.19.x: ``core_v0.19.0``; :data:`megatron_ext.megatron.lm.releases.RELEASES`), extracts it
    into a directory the caller gives and checks that the tree is that release.

Why:
    Megatron-LM's training code (``pretrain_gpt.py``, ``megatron/training``) is not on the
    package index, so CI cannot install it. Given ``MEGATRON_LM_ARCHIVES`` the test session
    makes its own checkout of the right tag for each megatron-core pass of the README's test
    command (the main pass and ``scripts/test_megatron_core_release.sh``), so the tests
    users' ``pretrain_gpt.py`` runs depend on run on every submission.

Constraints:
    Every failure raises :class:`ArchiveError` naming the folder or file: a missing archive,
    a tarball that does not extract, or a tree of another release never turns into skipped
    tests. The caller gives the directory to extract into and removes it afterwards.
"""

from __future__ import annotations

import tarfile
from importlib import metadata
from pathlib import Path

__all__ = ["ArchiveError", "checkout_from_archives", "installed_release_tag"]


class ArchiveError(RuntimeError):
    """The archives cannot give a checkout for this test session."""


def installed_release_tag() -> str:
    """The Megatron-LM tag of the installed megatron-core (read from its metadata)."""
    from megatron_ext.megatron.lm.releases import release_for_version

    return release_for_version(metadata.version("megatron-core"), "the installed megatron-core").tag


def checkout_from_archives(archives: str, tag: str, into: Path) -> Path:
    """Extract ``<archives>/<tag>.tar.gz`` into ``into``.

    Args:
        archives: folder holding the archives.
        tag: the Megatron-LM tag to extract.
        into: an empty directory (the caller's temporary directory, which it removes).

    Returns:
        The checkout's root (the directory holding ``pretrain_gpt.py``).

    Raises:
        ArchiveError: naming what is missing or wrong.
    """
    from megatron_ext.megatron.lm.releases import detect_checkout_release

    archive = Path(archives) / f"{tag}.tar.gz"
    if not archive.is_file():
        found = (
            sorted(p.name for p in Path(archives).glob("*.tar.gz"))
            if Path(archives).is_dir()
            else None
        )
        raise ArchiveError(
            f"MEGATRON_LM_ARCHIVES={archives}: no {archive.name} for the installed "
            f"megatron-core's Megatron-LM tag {tag} "
            + (f"(the folder holds {found})" if found is not None else "(no such folder)")
        )
    root = Path(into)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ArchiveError(f"{archive} does not extract: {exc}") from exc
    # git archive puts the tree at the top, or under one --prefix folder.
    candidates = [root] + [p for p in root.iterdir() if p.is_dir()]
    checkout = next((p for p in candidates if (p / "pretrain_gpt.py").is_file()), None)
    if checkout is None:
        raise ArchiveError(f"{archive} holds no pretrain_gpt.py (at its top or one folder down)")
    release = detect_checkout_release(str(checkout))
    if release.tag != tag:
        raise ArchiveError(f"{archive} is Megatron-LM {release.tag}, not {tag}")
    return checkout
