"""Checkpoint save -> fresh objects -> load -> continue equals an uninterrupted run, bitwise.

Real megatron-core dist_checkpointing (torch_dist) on CPU/gloo with 2 ranks, through the
driver's checkpoint functions. Dropout is off (with dropout the CPU emulation of the CUDA
generator makes masks depend on the CPU generator, which is restored too, but the
comparison is only meaningful without it). Compared bit for bit: losses of the continued
iterations, every parameter, every optimizer state tensor (main params and Adam moments),
and megatron_ext's per-rank state (a probe object registered in the ExtState whose value
differs on every rank, so a rank-mixing or deduplicating save would be caught).

Also, in one launch: what a load reads is checked. A garbage or binary tracker, a truncated
``common.pt`` / ``.metadata`` / ``.distcp``, a garbled stored item, 4 KB of 0xFF inside the
stored embedding (1,024 NaN), and non-finite megatron-ext and optimizer state saved as such
each stop the load on every rank with a ``CheckpointError`` naming the file (and tensor):
first the checksum check (megatron_ext/megatron/checksums.py), which also stops one flipped
bit that leaves the value finite, and, with it skipped (``--no-verify-checkpoint-checksums``,
or a checkpoint saved without checksums), the checks after it. Without the checksum check
the flipped bit loads silently.
"""

import contextlib
import os
from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.flag_sets import DISTOPT_OVERLAP
from tests.helpers.mcore import (
    build,
    first_difference,
    load_checkpoint,
    make_trainer,
    optimizer_state,
    params,
    save_checkpoint,
    teardown,
    train,
)


class _RankProbe:
    """A stateful object whose state differs per rank and per step."""

    elastic_rules = {"value": "reset", "count": "reset"}

    def __init__(self):
        import torch

        self.value = torch.zeros(3)
        self.count = 0

    def bump(self, rank):
        import torch

        self.value += torch.tensor([rank + 1.0, 0.5, -1.0])
        self.count += 1

    def state_dict(self):
        return {"value": self.value.clone(), "count": self.count}

    def load_state_dict(self, state):
        if set(state) != {"value", "count"}:
            raise ValueError(f"unexpected keys {sorted(state)}")
        self.value = state["value"].clone()
        self.count = state["count"]


def _resume(rank, world, flags, root):
    trainer = make_trainer(flags)
    gbs = trainer.sizes["gbs"]

    def fresh():
        build(trainer, stock=False)
        probe = _RankProbe()
        trainer.runtime.state.register("test_probe", probe)
        return probe

    def steps(probe, iterations):
        """Train one iteration at a time, bumping the probe after each; params synced."""
        losses = []
        for it in iterations:
            losses += train(trainer, 1, start=it)
            probe.bump(rank)
        trainer.sync_params()
        return losses

    probe = fresh()
    full_losses = steps(probe, range(6))
    full_params, full_opt = params(trainer), optimizer_state(trainer)
    full_probe = probe.state_dict()
    teardown(trainer)

    probe = fresh()
    first = steps(probe, range(3))
    save_checkpoint(trainer, root, 3)
    teardown(trainer)

    probe = fresh()
    loaded = load_checkpoint(trainer, root)
    assert loaded["iteration"] == 3 and loaded["consumed_samples"] == 3 * gbs
    second = steps(probe, range(3, 6))
    out = {
        "losses_equal": first + second == full_losses,
        "losses": (full_losses, first + second),
        "param_diff": first_difference(full_params, params(trainer)),
        "opt_diff": first_difference(full_opt, optimizer_state(trainer)),
        "probe_equal": probe.count == full_probe["count"]
        and bool((probe.value == full_probe["value"]).all()),
        "lr": trainer.optimizer.param_groups[0]["lr"],
    }
    teardown(trainer)
    return out


CASES = {
    "dp2": [],
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
    "dp2-distopt-overlap": DISTOPT_OVERLAP,
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bit_exact(case, tmp_path):
    results = run_ranks(_resume, 2, CASES[case], str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        assert out["losses_equal"], f"rank {rank}: {out['losses']}"
        assert out["param_diff"] is None, f"rank {rank}: {out['param_diff']}"
        assert out["opt_diff"] is None, f"rank {rank}: {out['opt_diff']}"
        assert out["probe_equal"], f"rank {rank}: per-rank megatron_ext state not restored"


# -- what a load reads is checked -------------------------------------------------------------


def _corrupt(root, name, directory, rank):
    """Copy ``root`` to ``directory`` and damage it as ``name`` says (rank 0; collective)."""
    import shutil

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    it = os.path.join(directory, "iter_0000002")
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(root, directory)
        items = FileSystemReader(it).read_metadata().storage_data
        embedding = next(i for k, i in items.items() if k.fqn == "embedding.word_embeddings.weight")
        if name == "tracker-text":
            Path(directory, "latest_checkpointed_iteration.txt").write_text("2 # step two\n")
        elif name == "tracker-bytes":
            Path(directory, "latest_checkpointed_iteration.txt").write_bytes(b"\xff" * 8)
        elif name == "common":
            _truncate(os.path.join(it, "common.pt"), 100)
        elif name == "metadata":
            _truncate(os.path.join(it, ".metadata"), 100)
        elif name == "distcp-truncated":
            _truncate(os.path.join(it, embedding.relative_path), embedding.offset + 10)
        elif name == "distcp-header":
            _overwrite(os.path.join(it, embedding.relative_path), embedding.offset, 64)
        elif name == "embedding-nan":
            # 4 KB of 0xFF inside the stored tensor's bytes: 1,024 float32 NaN.
            _overwrite(os.path.join(it, embedding.relative_path), embedding.offset + 8192, 4096)
        elif name == "optimizer-flip":
            # One bit in the middle of the largest stored optimizer tensor: one value changes
            # (by a factor of 4 if it hit an exponent bit) and stays finite.
            key, item = max(
                ((k, i) for k, i in items.items() if k.fqn.startswith("optimizer.")),
                key=lambda ki: ki[1].length,
            )
            with open(os.path.join(it, item.relative_path), "r+b") as f:
                f.seek(item.offset + item.length // 2)
                byte = f.read(1)[0]
                f.seek(-1, 1)
                f.write(bytes([byte ^ 0x01]))
            Path(directory, "flipped.txt").write_text(f"{item.relative_path} {key.fqn}")
        elif name == "no-manifest":
            os.remove(os.path.join(it, "megatron_ext_checksums.json"))
        else:
            raise AssertionError(name)
    torch.distributed.barrier()
    return it, embedding.relative_path if rank == 0 else None


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _overwrite(path, offset, size):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * size)


_COMMON = os.path.join("iter_0000002", "common.pt")

CORRUPTIONS = {
    # name: what every rank's error must contain (besides the file)
    "tracker-text": ["latest_checkpointed_iteration.txt", "is not an iteration number"],
    "tracker-bytes": ["latest_checkpointed_iteration.txt", "is not an iteration number"],
    "common": ["common.pt"],
    "metadata": [".metadata"],
    "distcp-truncated": ["is truncated", "embedding.word_embeddings.weight"],
    "distcp-header": ["embedding.word_embeddings.weight cannot be read"],
    "embedding-nan": ["'embedding.word_embeddings.weight'", "1024 of", "not finite"],
}
"""What each corruption gives with the checksum check skipped (--no-verify-checkpoint-
checksums, or a checkpoint saved without checksums): the checks after it still name the file."""

# The file each corruption damages (None: the embedding's .distcp file); the checksum check
# names it first.
_DAMAGED = {"common": "common.pt", "metadata": ".metadata"}


def _refused_save(trainer, root):
    """The message of a save that must be refused, and whether it left ``root`` without an
    ``iter_`` directory and without a latest marker."""
    from megatron_ext.megatron.checkpoint import CheckpointSaveError

    try:
        save_checkpoint(trainer, root, 2)
        return "saved", False
    except CheckpointSaveError as exc:
        empty = not os.path.exists(root) or not os.listdir(root)
        return str(exc), empty


@contextlib.contextmanager
def _unchecked_saves():
    """Saves without the finite check (how a non-finite checkpoint could still exist)."""
    from megatron_ext.megatron.checkpoint import save as ckpt_save

    # Replaced where save_checkpoint looks it up.
    original = ckpt_save.check_finite_for_save
    ckpt_save.check_finite_for_save = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ckpt_save.check_finite_for_save = original


def _load_checks(rank, world, flags, root):

    trainer = make_trainer(flags)
    build(trainer, stock=False)
    probe = _RankProbe()
    trainer.runtime.state.register("test_probe", probe)
    train(trainer, 2)
    trainer.sync_params()
    save_checkpoint(trainer, os.path.join(root, "good"), 2)
    out = {}
    for name in CORRUPTIONS:
        if name == "common" and not os.path.exists(os.path.join(root, "good", _COMMON)):
            out[name] = "skipped"  # megatron-core 0.19 keeps the common state in .distcp files
            continue
        _, stored = _corrupt(os.path.join(root, "good"), name, os.path.join(root, name), rank)
        for checked in (True, False):
            key = name if not checked else f"{name}/checked"
            try:
                load_checkpoint(trainer, os.path.join(root, name), verify_checksums=checked)
                out[key] = "loaded"
            except Exception as exc:  # noqa: BLE001 (the test reads the message)
                out[key] = f"{type(exc).__name__}: {exc}"
        out[f"{name}/file"] = stored
    # A finite change: refused by the checksum check, loaded silently without it (the
    # loaded optimizer state differs from the intact checkpoint's, every value finite).
    load_checkpoint(trainer, os.path.join(root, "good"))
    good = optimizer_state(trainer)
    for name in ("optimizer-flip", "no-manifest"):
        _corrupt(os.path.join(root, "good"), name, os.path.join(root, name), rank)
        for checked in (True, False):
            key = name if not checked else f"{name}/checked"
            try:
                load_checkpoint(trainer, os.path.join(root, name), verify_checksums=checked)
                loaded = optimizer_state(trainer)
                finite = all(bool(v.isfinite().all()) for v in loaded.values())
                out[key] = ("loaded", first_difference(good, loaded), finite)
            except Exception as exc:  # noqa: BLE001
                out[key] = f"{type(exc).__name__}: {exc}"
    out["optimizer-flip/file"] = Path(root, "optimizer-flip", "flipped.txt").read_text()
    # Non-finite values in megatron-ext state and optimizer state: refused at save; written
    # anyway (as a checkpoint of an older version, or corrupted after it was saved), refused
    # at load.
    probe.value[1] = float("inf")
    out["ext-inf/save"] = _refused_save(trainer, os.path.join(root, "ext-inf-refused"))
    with _unchecked_saves():
        save_checkpoint(trainer, os.path.join(root, "ext-inf"), 2)
    probe.value[1] = 0.0
    try:
        load_checkpoint(trainer, os.path.join(root, "ext-inf"))
        out["ext-inf"] = "loaded"
    except Exception as exc:  # noqa: BLE001
        out["ext-inf"] = f"{type(exc).__name__}: {exc}"
    inner = trainer.optimizer.chained_optimizers[0].optimizer
    state = next(iter(inner.state.values()))
    state["exp_avg_sq"][0] = float("nan")
    out["opt-nan/save"] = _refused_save(trainer, os.path.join(root, "opt-nan-refused"))
    with _unchecked_saves():
        save_checkpoint(trainer, os.path.join(root, "opt-nan"), 2)
    try:
        load_checkpoint(trainer, os.path.join(root, "opt-nan"))
        out["opt-nan"] = "loaded"
    except Exception as exc:  # noqa: BLE001
        out["opt-nan"] = f"{type(exc).__name__}: {exc}"
    # The intact checkpoint still loads.
    out["good"] = load_checkpoint(trainer, os.path.join(root, "good"))["iteration"]
    teardown(trainer)
    return out


def test_load_names_the_file_and_tensor_of_a_bad_checkpoint(tmp_path):
    """Truncated or garbage files, a garbage tracker and non-finite values stop the load on
    every rank with a CheckpointError naming the file (and the tensor); without the checks
    they raised EOFError / UnpicklingError / UnicodeDecodeError / ValueError naming nothing,
    or loaded 1,024 NaN silently."""
    results = run_ranks(_load_checks, 2, CASES["dp2-distopt-overlap"], str(tmp_path))
    for rank, out in enumerate(results):
        assert out["good"] == 2
        stored = results[0]["embedding-nan/file"]
        for name, needles in CORRUPTIONS.items():
            message = out[name]
            if message == "skipped":
                continue
            assert message.startswith("CheckpointError: --load: "), (rank, name, message)
            assert str(tmp_path / name) in message, (rank, name, message)
            for needle in needles:
                assert needle in message, (rank, name, message)
        for name in ("distcp-truncated", "distcp-header", "embedding-nan"):
            assert stored in out[name], (rank, name, out[name])
        # With the checksum check (the default): every damaged file is named by it first.
        flipped, flipped_key = out["optimizer-flip/file"].split(" ", 1)
        for name in [n for n in CORRUPTIONS if not n.startswith("tracker")] + ["optimizer-flip"]:
            if out.get(name) == "skipped":
                continue
            message = out[f"{name}/checked"]
            file = flipped if name == "optimizer-flip" else _DAMAGED.get(name, stored)
            damaged = str(tmp_path / name / "iter_0000002" / file)
            assert message.startswith("CheckpointError: --load: checksum check of "), message
            assert damaged in message and "--no-verify-checkpoint-checksums" in message, message
        for name in ("tracker-text", "tracker-bytes"):
            assert out[f"{name}/checked"] == out[name]
        # Without it, a finite change loads silently (finite values; which rank's optimizer
        # shard differs is checked below).
        assert out["optimizer-flip"][0] == "loaded" and out["optimizer-flip"][2], out
        # A checkpoint saved without checksums loads (unverified, saying so), intact.
        assert out["no-manifest/checked"] == out["no-manifest"] == ("loaded", None, True)
        message, empty = out["ext-inf/save"]
        assert message.startswith("--save: the checkpoint of iteration 2 was not written"), message
        assert "'megatron_ext/rank_state/objects.test_probe.value'" in message and empty, message
        assert "of rank 0 holds 1 non-finite values (NaN or inf) of 3" in message, message
        message, empty = out["opt-nan/save"]
        assert "was not written" in message and "exp_avg_sq" in message and empty, message
        message = out["ext-inf"]
        assert message.startswith("CheckpointError") and "'megatron_ext/rank_state'" in message
        assert "1 of 3 values are not finite" in message and ".distcp" in message, message
        message = out["opt-nan"]
        assert message.startswith("CheckpointError") and "optimizer." in message, message
        assert "exp_avg_sq" in message and ".distcp" in message, message
    differs = [out["optimizer-flip"][1] for out in results if out["optimizer-flip"][1]]
    assert len(differs) == 1, (flipped_key, differs)
