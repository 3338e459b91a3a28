"""Checkpoint checksums with 2 gloo ranks: the manifest the ranks write together equals the
digests of the files (each rank hashed its share), and a change in a file the other rank
hashes stops both ranks with the same message naming it."""

import os
from pathlib import Path

from megatron_ext.megatron import checksums
from tests.helpers.dist import run_ranks
from tests.unit.test_checksums import flip


def _two_ranks(rank, world, directory):
    import torch

    torch.distributed.init_process_group("gloo")
    it = Path(directory)
    (it / f"__{rank}_0.distcp").write_bytes(os.urandom(20_000 + rank))
    if rank == 0:
        (it / "common.pt").write_bytes(os.urandom(3_000))
        (it / "mp_rank_00").mkdir()
        (it / "mp_rank_00" / "model_optim_rng.pt").write_bytes(os.urandom(50_000))
    torch.distributed.barrier()
    manifest = checksums.write_manifest(directory)
    local = {rel: checksums.file_digest(str(it / rel)) for rel in manifest["files"]}
    clean = checksums.verify_manifest(directory)[1]
    if rank == 0:
        flip(it / "__1_0.distcp", 100)  # hashed by rank 1 at the next check
    torch.distributed.barrier()
    _, problem = checksums.verify_manifest(directory)
    return manifest, local, clean, problem


def test_two_ranks_write_one_manifest_and_agree_on_a_problem(tmp_path):
    results = run_ranks(_two_ranks, 2, str(tmp_path))
    (m0, local0, clean0, p0), (m1, _, clean1, p1) = results
    assert m0 == m1 and sorted(m0["files"]) == [
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "mp_rank_00/model_optim_rng.pt",
    ]
    assert {rel: e["digest"] for rel, e in m0["files"].items()} == local0
    assert clean0 == clean1 == ""
    assert p0 == p1 and str(tmp_path / "__1_0.distcp") in p0 and "checksum" in p0
