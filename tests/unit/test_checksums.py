"""Checkpoint checksums (``megatron_ext/megatron/checksums.py``): written, verified, refused.

Without a process group (one rank): the manifest lists every file with its size and crc32
(the same as ``zlib.crc32`` of the bytes); a finite change of one byte, a truncated file, a
missing file and an unreadable manifest are each reported naming the file; a checkpoint
without a manifest is reported as such; ``verify_checkpoint`` raises a ``CheckpointError``
naming the file and the flag that skips the check, and with the check skipped says so and
raises nothing. Which rank hashes which file: its writer when the name says so (torch_dist's
``__R_N.distcp``, the torch format's ``rank_R.pt``), the rest balanced by size. (With 2
ranks: tests/distributed/test_checksums.py.)
"""

import json
import os
import zlib
from pathlib import Path

import pytest

from megatron_ext.megatron import checksums
from megatron_ext.megatron.checkpoint import CheckpointError


def _checkpoint(root: Path) -> Path:
    it = root / "iter_0000004"
    (it / "megatron_ext").mkdir(parents=True)
    (it / "__0_0.distcp").write_bytes(os.urandom(40_000))
    (it / "__1_0.distcp").write_bytes(os.urandom(30_000))
    (it / ".metadata").write_bytes(os.urandom(1_000))
    (it / "common.pt").write_bytes(os.urandom(2_000))
    (it / "megatron_ext" / "rank_00001.pt").write_bytes(os.urandom(500))
    return it


def flip(path: Path, offset: int, mask: int = 0x40) -> None:
    """XOR one byte of ``path`` with ``mask``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_crc32(tmp_path):
    it = _checkpoint(tmp_path)
    manifest = checksums.write_manifest(str(it))
    on_disk = json.loads((it / checksums.MANIFEST).read_text())
    assert on_disk == manifest and manifest["algorithm"] == "crc32"
    expected = {
        str(p.relative_to(it)): {
            "size": p.stat().st_size,
            "digest": f"{zlib.crc32(p.read_bytes()):08x}",
        }
        for p in it.rglob("*")
        if p.is_file() and p.name != checksums.MANIFEST
    }
    assert manifest["files"] == expected and len(expected) == 5
    assert checksums.verify_manifest(str(it)) == (manifest, "")


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "manifest"])
def test_a_damaged_file_is_named(tmp_path, damage):
    it = _checkpoint(tmp_path)
    checksums.write_manifest(str(it))
    target = it / "__1_0.distcp"
    if damage == "flip":
        flip(target, 12_345)  # one bit of one byte: the size stays, the content changes
        needle = "does not match its checksum"
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
        needle = "has 29999 bytes"
    elif damage == "missing":
        target.unlink()
        needle = "is missing"
    else:
        target = it / checksums.MANIFEST
        target.write_text("{not json")
        needle = "cannot be read"
    manifest, problem = checksums.verify_manifest(str(it))
    assert str(target) in problem and needle in problem, problem
    with pytest.raises(CheckpointError) as info:
        checksums.verify_checkpoint(str(it), verify=True)
    message = str(info.value)
    assert message.startswith("--load: checksum check of ") and str(target) in message
    assert checksums.SKIP_FLAG in message


def test_without_manifest_or_with_the_check_skipped_nothing_is_raised(tmp_path, capsys):
    it = _checkpoint(tmp_path)
    assert checksums.verify_manifest(str(it)) == (None, "")
    checksums.verify_checkpoint(str(it), verify=True)
    assert f"{it} has no {checksums.MANIFEST}" in capsys.readouterr().out
    checksums.write_manifest(str(it))
    flip(it / "__0_0.distcp", 7)
    checksums.verify_checkpoint(str(it), verify=False)
    assert f"checksums of {it} not verified ({checksums.SKIP_FLAG})" in capsys.readouterr().out


def test_files_are_hashed_by_their_writer_and_the_rest_balanced():
    files = [
        ("__0_0.distcp", 10),
        ("__0_1.distcp", 10),
        ("__1_0.distcp", 5),
        ("__7_0.distcp", 4),  # written by a rank this world lacks (another DP size)
        ("megatron_ext/rank_00001.pt", 1),
        ("mp_rank_00/model_optim_rng.pt", 30),
        ("common.pt", 2),
    ]
    shares = checksums._assign(files, 2)
    assert sorted(sum(shares, [])) == sorted(name for name, _ in files)
    assert {"__0_0.distcp", "__0_1.distcp"} <= set(shares[0])
    assert {"__1_0.distcp", "megatron_ext/rank_00001.pt"} <= set(shares[1])
    # Rank 1 (6 bytes) takes the largest unowned file first.
    assert "mp_rank_00/model_optim_rng.pt" in shares[1]
