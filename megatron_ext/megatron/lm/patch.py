"""``megatron-ext patch``: apply (or revert) megatron-ext's source patch to a Megatron-LM checkout.

What it does:
    Detects the checkout's release (:func:`~megatron_ext.megatron.lm.releases.
    detect_checkout_release`), loads the unified diffs of that release from
    ``patches/<tag>/*.patch`` and applies them: for ``core_v0.16.1`` two hunks in
    ``pretrain_gpt.py`` that install megatron-ext's hooks before Megatron-LM is imported and
    chain megatron-ext's flags into the ``extra_args_provider`` it already passes. It says
    what it changed, recognises a checkout that is already patched (a second run changes
    nothing), and ``--revert`` restores the original bytes. ``--dry-run`` prints the diff
    and changes nothing.

Why our own applier:
    Checkouts are often tarballs or pip source trees without git, and the result must be
    exact: a hunk applies only where its context matches line for line (anywhere in the
    file, nearest to the recorded line number wins), never with fuzz. A file matching
    neither the original nor the patched context is refused, naming the hunk.

Constraints:
    Pure Python; never imports Megatron. Files are rewritten atomically (temporary file
    plus rename) with their permissions kept.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from megatron_ext.megatron.lm.releases import (
    MegatronLMRelease,
    UnsupportedReleaseError,
    detect_checkout_release,
    file_sha256,
)

__all__ = [
    "Hunk",
    "FilePatch",
    "PatchError",
    "parse_unified_diff",
    "apply_hunks",
    "patches_dir",
    "load_release_patches",
    "patch_status",
    "main",
]

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A patch that cannot be parsed or does not match the file it targets."""


@dataclass
class Hunk:
    """One ``@@`` hunk: its recorded position and its lines (`` ``, ``-``, ``+`` prefixed)."""

    old_start: int
    new_start: int
    lines: List[Tuple[str, str]] = field(default_factory=list)

    def image(self, reverse: bool) -> Tuple[List[str], List[str]]:
        """(lines to find, lines to put) when applying forward or in reverse."""
        before = [text for tag, text in self.lines if tag in (" ", "-")]
        after = [text for tag, text in self.lines if tag in (" ", "+")]
        return (after, before) if reverse else (before, after)


@dataclass
class FilePatch:
    """The hunks of one target file (path relative to the checkout root)."""

    path: str
    hunks: List[Hunk] = field(default_factory=list)


def _strip_prefix(path: str) -> str:
    path = path.split("\t")[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_unified_diff(text: str) -> List[FilePatch]:
    """Parse a unified diff (``diff -u`` / ``git diff`` output) into file patches.

    Raises:
        PatchError: malformed diff.
    """
    patches: List[FilePatch] = []
    current: Optional[FilePatch] = None
    hunk: Optional[Hunk] = None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("--- "):
            hunk = None
            continue
        if line.startswith("+++ "):
            current = FilePatch(_strip_prefix(line[4:]))
            patches.append(current)
            hunk = None
            continue
        match = _HUNK_HEADER.match(line)
        if match:
            if current is None:
                raise PatchError(f"line {number}: hunk before a '+++' file header")
            hunk = Hunk(old_start=int(match.group(1)), new_start=int(match.group(3)))
            current.hunks.append(hunk)
            continue
        if hunk is None:
            continue
        if line.startswith("\\"):
            # "\ No newline at end of file": our targets always end with a newline.
            continue
        tag = line[:1] if line else " "
        if tag not in (" ", "-", "+"):
            raise PatchError(f"line {number}: unexpected line in a hunk: {line!r}")
        hunk.lines.append((tag, line[1:]))
    if not patches or any(not p.hunks for p in patches):
        raise PatchError("the patch holds no hunks")
    return patches


def _find(lines: List[str], block: List[str], near: int) -> List[int]:
    """Start indices where ``block`` occurs in ``lines``, nearest to ``near`` first."""
    hits = [i for i in range(len(lines) - len(block) + 1) if lines[i : i + len(block)] == block]
    return sorted(hits, key=lambda i: abs(i - near))


def apply_hunks(lines: List[str], hunks: Sequence[Hunk], *, reverse: bool = False) -> List[str]:
    """Apply ``hunks`` to ``lines`` (no newline characters) and return the new lines.

    Each hunk's context must match exactly; the match nearest to the recorded line number
    is used. Hunks are applied in order, later ones searched after the earlier ones.

    Raises:
        PatchError: a hunk's context is not in the file (names the hunk and its first
            line).
    """
    out: List[str] = []
    position = 0
    shift = 0
    for index, hunk in enumerate(hunks, start=1):
        find, put = hunk.image(reverse)
        recorded = (hunk.new_start if reverse else hunk.old_start) - 1
        hits = [h for h in _find(lines, find, recorded + shift) if h >= position]
        if not hits:
            first = next((text for text in find if text.strip()), "")
            raise PatchError(
                f"hunk {index} (near line {recorded + 1}, {first.strip()!r}) does not match"
            )
        start = hits[0]
        out.extend(lines[position:start])
        out.extend(put)
        position = start + len(find)
        shift += len(put) - len(find)
    out.extend(lines[position:])
    return out


def patches_dir() -> str:
    """Folder holding ``<tag>/*.patch``: ``$MEGATRON_EXT_PATCHES``, the repository's
    ``patches/`` (source or editable install) or ``<prefix>/share/megatron-ext/patches``."""
    candidates = []
    if os.environ.get("MEGATRON_EXT_PATCHES"):
        candidates.append(os.environ["MEGATRON_EXT_PATCHES"])
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.join(here, "..", "..", "..", "patches"))
    candidates.append(os.path.join(sys.prefix, "share", "megatron-ext", "patches"))
    for path in candidates:
        if os.path.isdir(path):
            return os.path.normpath(path)
    raise PatchError(
        f"megatron-ext's patches/ folder was not found (looked in {', '.join(candidates)}); "
        "set MEGATRON_EXT_PATCHES to it"
    )


def load_release_patches(release: MegatronLMRelease) -> List[FilePatch]:
    """Every file patch of ``release`` (``patches/<tag>/*.patch``, in name order)."""
    folder = os.path.join(patches_dir(), release.patch_dir)
    names = (
        sorted(n for n in os.listdir(folder) if n.endswith(".patch"))
        if os.path.isdir(folder)
        else []
    )
    if not names:
        raise PatchError(f"no *.patch files in {folder}")
    patches: List[FilePatch] = []
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            patches.extend(parse_unified_diff(f.read()))
    return patches


def _read_lines(path: str) -> List[str]:
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if "\r\n" in text:
        raise PatchError(f"{path} has Windows line endings; the patch expects '\\n'")
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def _write_lines(path: str, lines: List[str]) -> None:
    mode = os.stat(path).st_mode & 0o7777
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".megatron-ext-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def patch_status(path: str, file_patch: FilePatch) -> str:
    """``"unpatched"``, ``"patched"`` or raise :class:`PatchError` (neither matches)."""
    lines = _read_lines(path)
    try:
        apply_hunks(lines, file_patch.hunks)
        return "unpatched"
    except PatchError as forward_error:
        try:
            apply_hunks(lines, file_patch.hunks, reverse=True)
            return "patched"
        except PatchError:
            raise PatchError(
                f"{path} matches neither the original nor the patched {file_patch.path}: "
                f"{forward_error}. Restore the release's file (git checkout -- "
                f"{file_patch.path}) and run again."
            ) from None


def _diff_text(file_patch: FilePatch, reverse: bool) -> str:
    out = [f"--- a/{file_patch.path}", f"+++ b/{file_patch.path}"]
    for hunk in file_patch.hunks:
        find, put = hunk.image(reverse)
        start_find, start_put = (
            (hunk.new_start, hunk.old_start) if reverse else (hunk.old_start, hunk.new_start)
        )
        out.append(f"@@ -{start_find},{len(find)} +{start_put},{len(put)} @@")
        for tag, text in hunk.lines:
            if reverse and tag != " ":
                tag = "+" if tag == "-" else "-"
            out.append(f"{tag}{text}")
    return "\n".join(out)


def _summary(file_patch: FilePatch, reverse: bool) -> str:
    added = sum(1 for h in file_patch.hunks for tag, _ in h.lines if tag == "+")
    removed = sum(1 for h in file_patch.hunks for tag, _ in h.lines if tag == "-")
    if reverse:
        added, removed = removed, added
    return f"{len(file_patch.hunks)} hunks, +{added} -{removed} lines"


def run_patch(checkout: str, *, revert: bool = False, dry_run: bool = False, out=None) -> int:
    """Apply or revert the release patch of ``checkout``; returns an exit code.

    Raises:
        UnsupportedReleaseError: unknown release.
        PatchError: the files match neither the original nor the patched release.
    """
    out = out or sys.stdout
    release = detect_checkout_release(checkout)
    file_patches = load_release_patches(release)
    targets = []
    for fp in file_patches:
        path = os.path.join(checkout, fp.path)
        if not os.path.isfile(path):
            raise PatchError(f"{path} not found (the {release.tag} patch targets {fp.path})")
        targets.append((fp, path, patch_status(path, fp)))
    wanted = "patched" if revert else "unpatched"
    todo = [(fp, path) for fp, path, status in targets if status == wanted]
    print(f"Megatron-LM {release.tag} at {checkout}", file=out)
    if not todo:
        state = "not patched; nothing to revert" if revert else "already patched; nothing to do"
        for fp, _, _ in targets:
            print(f"  {fp.path}: {state}", file=out)
        return 0
    for fp, path in todo:
        lines = _read_lines(path)
        new_lines = apply_hunks(lines, fp.hunks, reverse=revert)
        verb = "would revert" if revert else "would patch"
        if not dry_run:
            _write_lines(path, new_lines)
            verb = "reverted" if revert else "patched"
        print(f"  {verb} {fp.path} ({_summary(fp, revert)})", file=out)
        if dry_run:
            print(_diff_text(fp, revert), file=out)
        elif revert and fp.path == "pretrain_gpt.py":
            pristine = file_sha256(path) == release.pretrain_gpt_sha256
            relation = "byte-identical to" if pristine else "restored, but differs from"
            print(
                f"  {fp.path} is {relation} the {release.tag} release file",
                file=out,
            )
    for fp, _, status in targets:
        if status != wanted:
            print(f"  {fp.path}: already {'unpatched' if revert else 'patched'}", file=out)
    if not dry_run and not revert:
        print(
            "Launch pretrain_gpt.py as before (torchrun ... pretrain_gpt.py ...); it now accepts "
            "megatron-ext flags such as --grad-compression separate. On CPU set "
            f"MEGATRON_EXT_CPU=1. 'megatron-ext patch --revert {checkout}' undoes the change.",
            file=out,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """``megatron-ext patch`` options."""
    parser = argparse.ArgumentParser(
        prog="megatron-ext patch",
        description="Patch a Megatron-LM checkout's pretrain_gpt.py to load megatron-ext "
        "(release detected from megatron/core/package_info.py).",
    )
    parser.add_argument(
        "path",
        help="Megatron-LM checkout (the folder holding pretrain_gpt.py) or its pretrain_gpt.py",
    )
    parser.add_argument("--dry-run", action="store_true", help="show the change, write nothing")
    parser.add_argument("--revert", action="store_true", help="restore the original files")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    checkout = args.path
    if os.path.isfile(checkout) and os.path.basename(checkout) == "pretrain_gpt.py":
        checkout = os.path.dirname(os.path.abspath(checkout))
    checkout = os.path.abspath(checkout)
    if not os.path.isdir(checkout):
        print(f"megatron-ext patch: error: {args.path}: no such directory", file=sys.stderr)
        return 2
    try:
        return run_patch(checkout, revert=args.revert, dry_run=args.dry_run)
    except (UnsupportedReleaseError, PatchError) as exc:
        print(f"megatron-ext patch: error: {exc}", file=sys.stderr)
        return 2
