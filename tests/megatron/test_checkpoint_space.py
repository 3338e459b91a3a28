"""A save that cannot fit is refused before writing; a save that fails anyway leaves no torn
checkpoint behind.

Real megatron-core dist_checkpointing (torch_dist) on CPU/gloo, 2 ranks, through the
driver's :func:`megatron_ext.megatron.checkpoint.save_checkpoint`:

* the free-space check: the file system's free space is faked (``shutil.disk_usage`` as
  ``megatron_ext.megatron.checkpoint.space`` reads it) to be smaller than the estimate,
  which is the state's size for a first save and the last checkpoint's size afterwards;
  every rank gets the same one-line ``--save`` error naming the directory and the bytes,
  nothing is written and the latest marker does not move;
* a full disk during the save: a real tmpfs with room for one checkpoint and a half
  (mounted by the test, root only), the free-space check switched off (as if another job
  filled the disk right after it) so the second save runs out of space inside megatron-core
  (where torch reports only ``enforce fail at inline_container.cc ... unexpected pos``);
  the error says the disk is full in one line and the torn ``iter_`` directory is gone.
"""

import os
import subprocess

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import build, make_trainer, save_checkpoint, teardown, train


def _trainer():
    trainer = make_trainer([])
    build(trainer, stock=False)
    train(trainer, 1)
    return trainer


def _fake_free(space, free):
    real = space.shutil.disk_usage
    space.shutil.disk_usage = lambda path: real(path)._replace(free=free)
    return real


def _refused(trainer, root, iteration):
    from megatron_ext.config import ConfigError

    try:
        save_checkpoint(trainer, root, iteration)
    except ConfigError as exc:
        return str(exc)
    return None


def _space_check(rank, world, root):
    from megatron_ext.megatron import checkpoint as ckpt
    from megatron_ext.megatron.checkpoint import space

    trainer = _trainer()
    out = {}
    real = _fake_free(space, 1000)
    try:
        out["first"] = _refused(trainer, root, 1)
    finally:
        space.shutil.disk_usage = real
    out["after_first"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    save_checkpoint(trainer, root, 1)
    out["size"] = space._directory_bytes(ckpt.checkpoint_dir(root, 1))
    real = _fake_free(space, out["size"] // 2)
    try:
        out["second"] = _refused(trainer, root, 2)
    finally:
        space.shutil.disk_usage = real
    out["after_second"] = sorted(os.listdir(root))
    out["latest"] = ckpt.latest_iteration(root)
    teardown(trainer)
    return out


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_space_check, 2, root)
    first = results[0]["first"]
    assert first is not None and "\n" not in first
    assert first.startswith(
        f"--save: not enough free space in {root} for the checkpoint of iteration 1: about "
    )
    assert "the size of the model, optimizer and RNG state" in first
    assert "(1000 bytes) free" in first
    size = results[0]["size"]
    second = results[0]["second"]
    assert "the size of iteration 1's checkpoint" in second
    assert f"({size // 2} bytes) free" in second
    # The bytes needed are the last checkpoint's size plus the margin.
    assert f"({int(size * 1.05)} bytes) needed" in second, second
    for out in results:
        # Every rank refuses alike (one decision, broadcast), before anything is written.
        assert out["first"] == first and out["second"] == second
        assert out["after_first"] == []
        assert out["after_second"] == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert out["latest"] == 1


def _full_disk(rank, world, small, mounted_flag):
    import torch

    from megatron_ext.megatron import checkpoint as ckpt
    from megatron_ext.megatron.checkpoint import CheckpointSaveError, save as ckpt_save, space

    trainer = _trainer()
    root = os.path.join(small, "ckpt")
    if rank == 0:
        # Room for one checkpoint and a half: the size of one, measured on a normal disk.
        save_checkpoint(trainer, os.path.join(small, "probe"), 1)
        size = space._directory_bytes(os.path.join(small, "probe"))
    else:
        save_checkpoint(trainer, os.path.join(small, "probe"), 1)
    if rank == 0:
        kb = int(size * 1.5) // 1024
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", small + "/mnt"], check=True
        )
        open(mounted_flag, "w").close()
    torch.distributed.barrier()
    root = os.path.join(small, "mnt", "ckpt")
    save_checkpoint(trainer, root, 1)
    # The check passes (as when another job fills the disk right after it).
    real = ckpt_save.check_free_space
    ckpt_save.check_free_space = lambda *args: None
    try:
        save_checkpoint(trainer, root, 2)
        error = None
    except CheckpointSaveError as exc:
        error = str(exc)
        assert exc.detailed == (rank == 0)
    finally:
        ckpt_save.check_free_space = real
    torch.distributed.barrier()
    out = {
        "error": error,
        "listing": sorted(os.listdir(root)),
        "latest": ckpt.latest_iteration(root),
    }
    teardown(trainer)
    return out


def _can_mount(path):
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path]).returncode == 0
    if ok:
        subprocess.run(["umount", path], check=True)
    return ok


def test_a_save_that_runs_out_of_space_leaves_no_torn_checkpoint(tmp_path):
    small = str(tmp_path)
    if not _can_mount(small + "/mnt"):
        pytest.skip("needs root and permission to mount a tmpfs")
    flag = str(tmp_path / "mounted")
    try:
        results = run_ranks(_full_disk, 2, small, flag)
    finally:
        if os.path.exists(flag):
            subprocess.run(["umount", small + "/mnt"], check=True)
    root = os.path.join(small, "mnt", "ckpt")
    # Rank 0's error is the one reported (the others defer to it).
    error = results[0]["error"]
    assert error is not None, results
    assert all(out["error"] is not None for out in results)
    for error in [error]:
        assert "\n" not in error
        assert error.startswith(
            f"--save: the checkpoint of iteration 2 could not be written to {root}/iter_0000002 "
            "(no space left on the device"
        ), error
        assert error.endswith("removed the incomplete directory, latest checkpoint: iteration 1")
    for out in results:
        assert out["listing"] == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert out["latest"] == 1
