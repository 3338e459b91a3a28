"""Megatron-LM's own pretrain_gpt.py trained on CPU (gloo) with megatron-ext, end to end.

Needs a Megatron-LM checkout of a supported release (core_v0.16.1, core_v0.19.0) in
``MEGATRON_LM_DIR`` (skipped otherwise; the checkout is never modified: the patched runs use a
copy). A tiny GPT on ``--mock-data``
(``configs/megatron_lm/gpt_tiny_separate_cpu.yaml``: 2 layers, hidden 64, seq 64, dropout
off), 2 processes:

* zero-touch (``megatron-ext pretrain --cpu``), DP=2 with ``--grad-compression separate``:
  bytes per category in Megatron-LM's iteration line (compressed dp-grad vs dense), the JSON
  report; a ``torch_dist`` checkpoint holding one megatron-ext ShardedObject per rank, and a
  resumed run that loads it and continues exactly as the uninterrupted run (SEPARATE's
  error feedback is in that state: without it iteration 3's grad norm differs, 3.228 vs
  3.304 when measured); the same in the ``torch`` format (per-rank files), compared
  bit for bit, its checksums covering every file (resumed with
  ``--no-verify-checkpoint-checksums``); a resume with other settings stops, naming
  ``--ext-state-on-mismatch``;
* DP=2 with ``--use-distributed-optimizer``: a resume continues exactly, its checksums
  verified first; a truncated ``.distcp`` file stops the load at the checksum check, named;
  without checksums (a checkpoint saved before megatron-ext wrote them), 1,024 NaN written
  into the stored embedding stop the load, naming the tensor and the ``.distcp`` file;
* zero-touch PP=2 through ``scripts/pretrain_gpt_ext.sh`` and the run file: pipeline bytes;
* patched (``megatron-ext patch`` on a copy, then ``torchrun pretrain_gpt.py``): DP=2, and
  PP=2 in bf16 with LLaMA-style layers (RMSNorm, SwiGLU, RoPE, GQA) on the local spec, where
  CPU execution turns off the CUDA-only fused softmax and RoPE itself;
* AQ-SGD fine-tuning at PP=2, Grass (full rank against dense training with activation
  recomputation, sparse with resume, under --fp16), Protocol Models at PP=2 with resume;
* refusals made once the optimizer exists (QuantizedAdam with SGD) or printed once per job
  under torchrun (Protocol Models with dropout). The refusals made when Megatron-LM
  validates its arguments run in one process (test_session.py).

Megatron-LM does not reset its loss accumulator on the first logged iteration, so with
``--log-interval 1`` the second iteration after a (re)start prints the mean of the first
two; the comparisons below account for that.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

from tests.helpers.quiet import noise_lines
from tests.helpers.refusal import assert_cause_last
from tests.megatron_lm.lm_runs import (
    REPO,
    TINY_RUN_FILE,
    checkout_release,
    iterations,
    pretrain,
    tiny_args,
)

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]


@pytest.fixture(scope="module")
def lm_dir() -> Path:
    return Path(os.environ["MEGATRON_LM_DIR"])


def _assert_dp_grad_bytes(iters, expected):
    assert sorted(iters) == expected, iters
    for it in expected:
        field = iters[it].get("bytes", "")
        # SEPARATE ratio 16 on DP=2: the compressed reduction vs what dense would send.
        assert field.startswith("dp-grad ") and "(dense " in field and ", x" in field, field


def _assert_resumed_at_2(full, resumed):
    """``resumed`` (loaded from iteration 2) printed iterations 3 and 4 as the uninterrupted
    ``full`` did: iteration 3's loss and grad norm exactly; iteration 4's grad norm exactly
    and, as Megatron prints the mean of iterations 3 and 4 there (see module docstring), its
    loss that mean. Returns both runs' :func:`iterations`."""
    a, b = iterations(full.stdout), iterations(resumed.stdout)
    assert sorted(b) == [3, 4], b
    assert (b[3]["loss"], b[3]["grad_norm"]) == (a[3]["loss"], a[3]["grad_norm"])
    assert b[4]["grad_norm"] == a[4]["grad_norm"]
    mean = (float(a[3]["loss"]) + float(a[4]["loss"])) / 2
    assert abs(float(b[4]["loss"]) - mean) <= 1e-6 * mean
    return a, b


# -- DP=2, SEPARATE, torch_dist checkpoint and resume ------------------------------------------


@pytest.fixture(scope="module")
def dp2_torch_dist(lm_dir, tmp_path_factory):
    """Uninterrupted 4 iterations, checkpoints (torch_dist) at 2 and 4."""
    root = tmp_path_factory.mktemp("dp2_torch_dist")
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(save=str(root / "ckpt"), save_interval="2", tensorboard_dir=str(root / "tb")),
        cwd=root,
    ).check()
    return root, run


def test_zero_touch_dp2_logs_bytes_and_writes_report(dp2_torch_dist):
    root, run = dp2_torch_dist
    assert f"> megatron-ext: hooked Megatron-LM {checkout_release().tag}:" in run.stdout
    assert "grad reducer SeparateReducer (--grad-compression separate)" in run.stdout
    _assert_dp_grad_bytes(iterations(run.stdout), [1, 2, 3, 4])
    report = json.loads((root / "ckpt" / "comm_report.json").read_text())
    assert report["megatron_lm_release"] == checkout_release().tag
    assert report["steps_this_run"] == 4 and report["layout"]["dp"] == 2
    dp_grad = report["comm"]["all_ranks_total"]["dp-grad"]
    assert 0 < dp_grad["sent"] < dp_grad["dense_sent"] / 8
    assert len(report["comm"]["per_rank_total"]) == 2
    # The same numbers through Megatron-LM's TensorBoard writer (last rank).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    sent = events.Scalars("comm/dp-grad bytes sent per step")
    dense = events.Scalars("comm/dp-grad dense bytes per step")
    assert [e.step for e in sent] == [1, 2, 3, 4]
    assert sent[-1].value * 4 == pytest.approx(dp_grad["sent"])
    assert dense[-1].value * 4 == pytest.approx(dp_grad["dense_sent"])


def test_torch_dist_checkpoint_holds_one_object_per_rank(dp2_torch_dist):
    from torch.distributed.checkpoint import FileSystemReader

    root, run = dp2_torch_dist
    directory = root / "ckpt" / "iter_0000002"
    keys = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    assert {k for k in keys if k.startswith("megatron_ext/")} == {
        "megatron_ext/rank_state/shard_0_2",
        "megatron_ext/rank_state/shard_1_2",
    }
    # core_v0.16 writes common.pt; 0.19 keeps the common state inside the torch_dist files.
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    meta = load_common_state_dict(str(directory))["megatron_ext_meta"]
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2}
    assert meta["settings"]["grad_compression"] == "separate"
    assert "saving the state of 2 ranks at iteration 2" in run.stdout


def test_torch_dist_resume_continues_exactly(dp2_torch_dist, lm_dir, tmp_path):
    root, full = dp2_torch_dist
    resumed = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(
            load=str(root / "ckpt"), ckpt_step="2", save=str(tmp_path / "ckpt"), save_interval="2"
        ),
        cwd=tmp_path,
    ).check()
    assert (
        f"> megatron-ext: loaded the state of 2 ranks from {root / 'ckpt' / 'iter_0000002'} "
        "(ShardedObject 'megatron_ext/rank_state'; objects: grad_reducer)" in resumed.stdout
    )
    # Quiet by default (megatron_ext/quiet.py): no Python warning, loads included, and no
    # rerun state machine line, in a first run and a resumed one.
    for run in (full, resumed):
        assert not noise_lines(run.output), noise_lines(run.output)
    _, b = _assert_resumed_at_2(full, resumed)
    _assert_dp_grad_bytes(b, [3, 4])


def test_resume_with_other_settings_stops_naming_the_flag(dp2_torch_dist, lm_dir, tmp_path):
    root, _ = dp2_torch_dist
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(load=str(root / "ckpt"), ckpt_step="2", separate_ratio="8"),
        cwd=tmp_path,
    )
    assert run.returncode != 0
    assert "megatron-ext: error: megatron-ext state in" in run.stderr
    assert "--ext-state-on-mismatch reset" in run.stderr
    assert_cause_last(run.output, "--ext-state-on-mismatch reset")
    assert not iterations(run.stdout)


# -- DP=2, distributed optimizer: resume and a corrupted checkpoint ---------------------------


def _distopt(cwd: Path, **flags: str):
    """pretrain_gpt.py on DP=2 with the distributed optimizer, no gradient compression."""
    script = Path(os.environ["MEGATRON_LM_DIR"]) / "pretrain_gpt.py"
    args = tiny_args(**flags, grad_compression="none") + ["--use-distributed-optimizer"]
    return pretrain(script, args, cwd=cwd)


@pytest.fixture(scope="module")
def dp2_distopt(tmp_path_factory):
    """Uninterrupted 4 iterations with the distributed optimizer, checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("dp2_distopt")
    run = _distopt(root, save=str(root / "ckpt"), save_interval="2").check()
    return root, run


def test_distributed_optimizer_resume_continues_exactly(dp2_distopt, tmp_path):
    """On CPU (torch Adam) the resume used to fail in the load template
    (``distrib_optimizer.state_dict: assert len(steps) == 1``); once loading, megatron-core's
    shared dummy Adam step made iteration 4 differ (grad norm 0.904 vs 0.902)."""
    root, full = dp2_distopt
    resumed = _distopt(tmp_path, load=str(root / "ckpt"), ckpt_step="2").check()
    # Its checksums (written before Megatron-LM moved its marker) checked before the load.
    assert "> verified the crc32 checksums of " in resumed.stdout
    assert f" in {root / 'ckpt' / 'iter_0000002'} (" in resumed.stdout
    _assert_resumed_at_2(full, resumed)


def test_non_finite_checkpoint_values_stop_the_load_naming_tensor_and_file(dp2_distopt, tmp_path):
    """4 KB of 0xFF inside the stored embedding (1,024 NaN) used to load silently. Without its
    checksums (as a checkpoint saved before megatron-ext wrote them), the finite check still
    names the tensor and the file."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ext.megatron.checksums import MANIFEST

    root, _ = dp2_distopt
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    directory = tmp_path / "ckpt" / "iter_0000002"
    (directory / MANIFEST).unlink()
    items = FileSystemReader(str(directory)).read_metadata().storage_data
    item = next(i for k, i in items.items() if k.fqn == "embedding.word_embeddings.weight")
    with open(directory / item.relative_path, "r+b") as f:
        f.seek(item.offset + 8192)
        f.write(b"\xff" * 4096)
    run = _distopt(tmp_path, load=str(tmp_path / "ckpt"), ckpt_step="2")
    assert run.returncode != 0
    stored = directory / item.relative_path
    assert f"megatron-ext: error: --load: non-finite values in {stored}" in run.stderr, run.stderr
    assert "'embedding.word_embeddings.weight'" in run.stderr and "1024 of" in run.stderr
    assert f"> {directory} has no {MANIFEST} (saved without checksums)" in run.stdout
    assert not iterations(run.stdout)


def test_truncated_checkpoint_file_stops_the_load_naming_it(dp2_distopt, tmp_path):
    """dist_checkpointing's own error (a CheckpointException per rank) names no file; the
    checksum check, before Megatron-LM reads anything, does."""
    root, _ = dp2_distopt
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    stored = tmp_path / "ckpt" / "iter_0000002" / "__1_0.distcp"
    with open(stored, "r+b") as f:
        f.truncate(stored.stat().st_size // 2)
    run = _distopt(tmp_path, load=str(tmp_path / "ckpt"), ckpt_step="2")
    assert run.returncode != 0
    assert (
        f"megatron-ext: error: --load: checksum check of {stored.parent} failed: {stored} has "
        in run.stderr
    ), run.stderr[-3000:]
    assert "--no-verify-checkpoint-checksums" in run.stderr
    assert not iterations(run.stdout)


# -- DP=2, SEPARATE, torch format ----------------------------------------------------------------


def _model_and_ext_state(directory: Path):
    model = torch.load(directory / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    ext = [
        torch.load(directory / "megatron_ext" / f"rank_{r:05d}.pt", weights_only=False)
        for r in range(2)
    ]
    return model, ext


def _assert_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")


def test_torch_format_checkpoint_and_resume(lm_dir, tmp_path):
    script = lm_dir / "pretrain_gpt.py"
    fmt = ["--ckpt-format", "torch"]
    full = pretrain(
        script, tiny_args(save=str(tmp_path / "a"), save_interval="2") + fmt, cwd=tmp_path
    ).check()
    from megatron_ext.megatron import checksums

    for it in (2, 4):
        files = sorted(p.name for p in (tmp_path / f"a/iter_000000{it}/megatron_ext").iterdir())
        assert files == ["rank_00000.pt", "rank_00001.pt"]
        # The checksums of every file, written once Megatron-LM's save returned.
        manifest, problem = checksums.verify_manifest(str(tmp_path / f"a/iter_000000{it}"))
        assert problem == "" and set(manifest["files"]) == {
            "mp_rank_00/model_optim_rng.pt",
            "megatron_ext/rank_00000.pt",
            "megatron_ext/rank_00001.pt",
        }
    resumed = pretrain(
        script,
        tiny_args(
            load=str(tmp_path / "a"), ckpt_step="2", save=str(tmp_path / "b"), save_interval="2"
        )
        + fmt
        + ["--no-verify-checkpoint-checksums"],
        cwd=tmp_path,
    ).check()
    assert "(megatron_ext/rank_XXXXX.pt; objects: grad_reducer)" in resumed.stdout
    assert f"> checksums of {tmp_path / 'a' / 'iter_0000002'} not verified (" in resumed.stdout
    a, b = iterations(full.stdout), iterations(resumed.stdout)
    assert (b[3]["loss"], b[3]["grad_norm"]) == (a[3]["loss"], a[3]["grad_norm"])
    # Bit for bit at iteration 4: model, Megatron's optimizer state, megatron-ext's state.
    model_a, ext_a = _model_and_ext_state(tmp_path / "a/iter_0000004")
    model_b, ext_b = _model_and_ext_state(tmp_path / "b/iter_0000004")
    _assert_equal(model_a["model"], model_b["model"], "model")
    _assert_equal(model_a["optimizer"]["state"], model_b["optimizer"]["state"], "optimizer")
    for rank in range(2):
        assert ext_a[rank]["state"]["layout"]["rank"] == rank
        _assert_equal(ext_a[rank]["state"]["objects"], ext_b[rank]["state"]["objects"], "ext")


# -- PP=2 through the launcher script -------------------------------------------------------------


def test_zero_touch_pp2_through_launcher_script(lm_dir, tmp_path):
    from tests.helpers.dist import free_port

    env = {
        **os.environ,
        "MEGATRON_LM_DIR": str(lm_dir),
        "CONFIG": str(TINY_RUN_FILE),
        "CPU": "1",
        "GPUS_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/pretrain_gpt_ext.sh"), "--pipeline-model-parallel-size", "2",
         "--train-iters", "3"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "P2P ExtP2PCommunicator (--p2p-compression none)" in proc.stdout
    iters = iterations(proc.stdout)
    assert sorted(iters) == [1, 2, 3]
    for record in iters.values():
        # Activations forward and gradients backward, the same size (fp32, [s, b, h]).
        assert record["bytes"].startswith("pp-act 131.07 KB, pp-grad 131.07 KB"), record
    # No --save: the report goes to a fresh run directory named at start-up, not to ./
    (path,) = [
        l.split("communication report: ")[1]
        for l in proc.stdout.splitlines()
        if l.startswith("> megatron-ext: communication report: ")
    ]
    assert "> megatron-ext: run directory: runs/" in proc.stdout
    assert Path(path).parent.parent == Path("runs"), path
    assert json.loads((tmp_path / path).read_text())["layout"]["pp"] == 2
    assert not (tmp_path / "comm_report.json").exists()
    # Megatron-LM's final evaluation runs forward-only through megatron-ext's communicator.
    assert "validation loss at iteration 3 on validation set" in proc.stdout


# -- AQ-SGD: fixed samples, first visits in full precision, then quantized deltas ------------


def _kb(field: str, category: str) -> float:
    """The KB of ``category`` in an iteration line's bytes field."""
    import re

    found = re.search(rf"{category} ([0-9.]+) (B|KB|MB)\b", field)
    assert found, f"no {category} in {field!r}"
    return float(found.group(1)) * {"B": 1e-3, "KB": 1.0, "MB": 1e3}[found.group(2)]


def test_zero_touch_pp2_aqsgd_finetunes_a_checkpoint(dp2_torch_dist, lm_dir, tmp_path):
    """PP=2 AQ-SGD fine-tuning (--finetune) of a DP=2 torch_dist checkpoint, on one global
    batch of fixed samples: iteration 1 visits every sample first (full precision) and
    iterations 2-4 revisit them (4-bit deltas)."""
    root, pretraining = dp2_torch_dist
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(train_iters="4", fixed_samples="8", p2p_compression="aqsgd",
                  grad_compression="none", aqsgd_fw_bits="4", aqsgd_bw_bits="8",
                  load=str(root / "ckpt"))
        + ["--pipeline-model-parallel-size", "2", "--finetune"],
        cwd=tmp_path,
    ).check()  # fmt: skip
    # The pre-trained weights are loaded: fine-tuning starts below the loss training began at.
    assert float(iterations(run.stdout)[1]["loss"]) < float(
        iterations(pretraining.stdout)[1]["loss"]
    )
    assert "P2P ExtP2PCommunicator (--p2p-compression aqsgd)" in run.stdout
    assert "fixed samples: 8 of the training split, 8 per data-parallel rank" in run.stdout
    iters = iterations(run.stdout)
    assert sorted(iters) == [1, 2, 3, 4]
    dense = 131.072  # fp32 [64, 2, 64] x 4 microbatches, KB
    first = iters[1]["bytes"]
    assert _kb(first, "pp-act") == pytest.approx(dense, rel=1e-3), first  # raw first visits
    for i in (2, 3, 4):
        field = iters[i]["bytes"]
        # 4-bit codes (dense / 8) plus a scale per channel and sample header.
        assert _kb(field, "pp-act") < dense / 6, field
        assert _kb(field, "pp-grad") < dense / 3, field
    losses = [float(r["loss"]) for r in iters.values()]
    assert all(0 < loss < 7.0 for loss in losses), iters


# -- Grass: virtual parameters added before Megatron-LM wraps the model ------------------------

# Every default layer of the tiny GPT (hidden 64, ffn 256) projects a 64-wide dimension.
GRASS_FULL_RANK = dict(grass_method="topr", grass_rank="64", grass_scale="1",
                       grass_rewarmup_steps="0", grass_update_interval="0")  # fmt: skip


# r=8 of 64 (norm2 sampling), reselected every 2 steps.
GRASS_SPARSE = dict(grad_compression="none", grass_method="norm2", grass_rank="8",
                    grass_update_interval="2", grass_rewarmup_steps="1")  # fmt: skip


def _dp_grad_kb(run) -> Dict[int, float]:
    return {it: _kb(r["bytes"], "dp-grad") for it, r in iterations(run.stdout).items()}


def _bucket_elements(run) -> int:
    import re

    # 0.16 prints the buckets on every rank, 0.19 on one (the ranks hold the same).
    found = dict(re.findall(r"Params for bucket (\d+) \((\d+) elements", run.stdout))
    assert found, "Megatron-LM printed no DDP bucket"
    return sum(map(int, found.values()))


# Megatron-LM's full activation recomputation: the backward re-runs each layer's forward,
# Grass's included. Dense training is the same with it or without.
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def dense_dp2(lm_dir, tmp_path_factory):
    """DP=2 without compression: 4 iterations of stock Megatron-LM training (plus accounting),
    with full activation recomputation."""
    root = tmp_path_factory.mktemp("dense_dp2")
    return pretrain(
        lm_dir / "pretrain_gpt.py", tiny_args(grad_compression="none") + RECOMPUTE, cwd=root
    ).check()


def test_zero_touch_grass_full_rank_reproduces_dense_training(dense_dp2, lm_dir, tmp_path):
    """All rows selected, alpha 1: Grass is dense training computed another way, so the
    virtual parameters (made inside setup_model_and_optimizer, before Megatron-LM's DDP and
    optimizer) must train exactly like the weights themselves, step for step, also when
    Megatron-LM's full activation recomputation re-runs Grass's forward inside the backward
    (both runs recompute; Grass without it: the sparse runs below)."""
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(grad_compression="none", **GRASS_FULL_RANK) + RECOMPUTE,
        cwd=tmp_path,
    ).check()
    assert "linear hooks (--grass-method topr)" in run.stdout
    assert "Grass (topr, r=64, K=0): 8 projected weights frozen" in run.stdout
    dense, grass = iterations(dense_dp2.stdout), iterations(run.stdout)
    assert sorted(grass) == [1, 2, 3, 4]
    for it in grass:
        for key in ("loss", "grad_norm"):
            assert float(grass[it][key]) == pytest.approx(float(dense[it][key]), rel=2e-5), it
    # Full rank: the same number of elements reduced (Grass's fp32 rows are not sent).
    assert _dp_grad_kb(run) == _dp_grad_kb(dense_dp2)


def test_grass_under_fp16_postpones_selections_while_the_loss_scale_overflows(lm_dir, tmp_path):
    """--fp16 starts at a loss scale of 2^32: the first steps overflow and are skipped, and
    their sketches are not finite. Top-r must not select from them (NaN would rank first and
    those rows would train for K steps): each such selection is postponed with a warning,
    and training proceeds with finite, falling losses once the scale has come down.
    Megatron-LM's replica check runs too: both data-parallel replicas select the same rows
    and hold bit-identical weights (before training, at 10 and 20)."""
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(grad_compression="none", grass_method="topr", grass_rank="8",
                  grass_update_interval="20", grass_rewarmup_steps="1", train_iters="20",
                  check_weight_hash_across_dp_replicas_interval="10")
        + ["--fp16", "--no-masked-softmax-fusion"],
        cwd=tmp_path,
    ).check()  # fmt: skip
    hashes = [l for l in run.stdout.splitlines() if l.startswith(">>> Weight hashes match")]
    assert hashes == [f">>> Weight hashes match after {i} iterations..." for i in (0, 10, 20)]
    assert "Grass: the gradient sketch of step 0 is not finite" in run.output
    losses = [float(r["loss"]) for _, r in sorted(iterations(run.stdout).items()) if "loss" in r]
    assert len(losses) >= 3 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


@pytest.fixture(scope="module")
def grass_sparse(lm_dir, tmp_path_factory):
    """r=8 of 64, reselected every 2 steps: 4 iterations, torch_dist checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("grass_sparse")
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(save=str(root / "ckpt"), save_interval="2", **GRASS_SPARSE),
        cwd=root,
    ).check()  # fmt: skip
    return root, run


def test_zero_touch_grass_sends_the_selected_rows_only(grass_sparse, dense_dp2):
    _, run = grass_sparse
    # 2 layers x (QKV 192x8 + proj 8x64 + fc1 256x8 + fc2 8x256) = 12288 trainable elements
    # instead of 98304; the rest of the model (embeddings, norms, biases) stays dense.
    assert "8 projected weights frozen; their gradient and optimizer state live in 0.012M " in (
        run.stdout
    )
    assert "instead of 0.098M (x0.125)" in run.stdout
    # DDP's buckets (as Megatron-LM prints them) hold 98304 - 12288 elements fewer.
    grass_numel, dense_numel = _bucket_elements(run), _bucket_elements(dense_dp2)
    assert dense_numel - grass_numel == 98304 - 12288
    grass, dense = _dp_grad_kb(run), _dp_grad_kb(dense_dp2)
    # Iterations 2 and 4 take no sketch (selection steps are 0 and 2, 0-based).
    for it in (2, 4):
        assert grass[it] / dense[it] == pytest.approx(grass_numel / dense_numel, rel=5e-3), (
            grass,
            dense,
        )
    # Selection steps add one all-reduce of every layer's sketch.
    assert grass[1] > grass[2] and grass[3] > grass[4]
    losses = [float(r["loss"]) for r in iterations(run.stdout).values()]
    assert all(0 < loss < 7.0 for loss in losses)


def test_zero_touch_grass_resumes_exactly_across_a_reselection(grass_sparse, lm_dir, tmp_path):
    root, full = grass_sparse
    resumed = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(load=str(root / "ckpt"), ckpt_step="2", **GRASS_SPARSE),
        cwd=tmp_path,
    ).check()  # fmt: skip
    assert "loaded the state of 2 ranks" in resumed.stdout
    assert "optimizer_hook.grass" in resumed.stdout
    a, b = iterations(full.stdout), iterations(resumed.stdout)
    # Iteration 3 reselects (sketch, all-reduce, new rows): exactly as uninterrupted.
    assert (b[3]["loss"], b[3]["grad_norm"]) == (a[3]["loss"], a[3]["grad_norm"])
    assert b[4]["grad_norm"] == a[4]["grad_norm"]
    # The same sketch all-reduce and rows ("other": Megatron-LM's own small collectives,
    # which differ on the first iterations after a start).
    assert [_kb(b[i]["bytes"], "dp-grad") for i in (3, 4)] == [
        _kb(a[i]["bytes"], "dp-grad") for i in (3, 4)
    ]


# -- patched checkout ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def patched_copy(lm_dir, tmp_path_factory):
    """A copy of the checkout (no tests/docs/examples), patched by ``megatron-ext patch``.

    Its megatron.core is the checkout's. Its dataset helpers (C++) are copied from the
    installed megatron-core wheel when that is the same release (same helpers.cpp); else
    megatron-ext's CPU shim builds them at start-up, which needs pybind11.
    """
    import importlib.util

    copy = tmp_path_factory.mktemp("patched") / "Megatron-LM"
    shutil.copytree(
        lm_dir, copy, ignore=shutil.ignore_patterns("tests", "docs", "examples", "__pycache__")
    )
    datasets = copy / "megatron" / "core" / "datasets"
    if not list(datasets.glob("helpers_cpp*")):
        import megatron.core.datasets as installed

        wheel = Path(installed.__file__).parent
        built = list(wheel.glob("helpers_cpp*"))
        source = (datasets / "helpers.cpp").read_bytes()
        if built and (wheel / "helpers.cpp").read_bytes() == source:
            shutil.copy2(built[0], datasets / built[0].name)
        elif importlib.util.find_spec("pybind11") is None:
            pytest.skip("the copy's dataset helpers are not built: no prebuilt helpers_cpp of "
                        "this release to copy and no pybind11 to build them")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext", "patch", str(copy)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "patched pretrain_gpt.py" in proc.stdout
    return copy


def _patched_run(patched_copy, tmp_path, layout):
    run = pretrain(
        patched_copy / "pretrain_gpt.py",
        tiny_args(train_iters="3") + layout,
        cwd=tmp_path,
        zero_touch=False,
    ).check()
    assert f"> megatron-ext: hooked Megatron-LM {checkout_release().tag}:" in run.stdout
    iters = iterations(run.stdout)
    assert sorted(iters) == [1, 2, 3]
    return run, iters


def test_patched_pretrain_gpt_trains_dp2_separate(patched_copy, tmp_path):
    _, iters = _patched_run(patched_copy, tmp_path, [])
    assert all(r["bytes"].startswith("dp-grad ") for r in iters.values()), iters


def test_patched_pretrain_gpt_refusal_is_the_last_line(patched_copy, tmp_path):
    """A refusal after Megatron-LM's ~790-line argument dump (megatron-ext's configuration
    is checked on the validated arguments) is still the cause on the last screen: torchrun's
    summary reprints it last, and it is printed nowhere else."""
    run = pretrain(
        patched_copy / "pretrain_gpt.py",
        tiny_args(outer_method="diloco", outer_interval="2", outer_groups="3"),
        cwd=tmp_path,
        zero_touch=False,
    )
    assert run.returncode != 0
    cause = "megatron-ext: error: --outer-groups"
    assert run.output.count(cause) == 1, run.output[-3000:]
    assert_cause_last(run.output, cause)
    assert not iterations(run.stdout)


def test_patched_pretrain_gpt_trains_pp2_bf16_llama_layers_without_the_fusion_flags(
    patched_copy, tmp_path
):
    """PP=2 with LLaMA-style layers in bf16 on the local spec. Megatron-LM's default fusions
    that exist only as CUDA kernels: the fused masked softmax (imports Apex's
    scaled_masked_softmax_cuda at the first bf16/fp16 forward) and the fused RoPE (needs
    Transformer Engine). CPU execution (here MEGATRON_EXT_CPU=1 on a patched
    pretrain_gpt.py; tests/megatron_lm/test_fp16.py covers fp16 zero-touch) turns them off
    itself and says so; before, the first was refused (or crashed at the first forward) and
    the second crashed at the first forward."""
    llama = ["--bf16", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
             "rope", "--untie-embeddings-and-output-weights", "--group-query-attention",
             "--num-query-groups", "2", "--disable-bias-linear"]  # fmt: skip
    pp2 = ["--pipeline-model-parallel-size", "2", "--grad-compression", "none"]
    run, iters = _patched_run(patched_copy, tmp_path, pp2 + llama)
    assert (
        "> megatron-ext: CPU execution on (set: --no-masked-softmax-fusion --no-rope-fusion)"
        in run.stdout
    ), run.stdout[-3000:]
    assert all(r["bytes"].startswith("pp-act ") for r in iters.values()), iters
    losses = [float(iters[it]["loss"]) for it in (1, 2, 3)]
    assert all(0 < loss < 10 for loss in losses), losses


# -- bad flags ----------------------------------------------------------------------------------


def test_quantized_adam_with_sgd_stops_before_training(lm_dir, tmp_path):
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(grad_compression="quantized-adam", optimizer="sgd"),
        cwd=tmp_path,
    )
    assert run.returncode != 0
    assert "megatron-ext: error: --grad-compression, --optimizer:" in run.stderr, run.output[-3000:]
    # Below Megatron-LM's argument dump and torchrun's summary, not above them.
    assert_cause_last(run.output, "megatron-ext: error: --grad-compression, --optimizer:")
    assert not iterations(run.stdout)


# -- Protocol Models: the residual stream confined before Megatron-LM wraps the model ----------

PROTOCOL = dict(grad_compression="none", subspace_method="protocol", subspace_rank="8",
                subspace_update_interval="2", subspace_lr="0.5")  # fmt: skip


def _protocol_pp2(cwd: Path, **flags: str):
    """pretrain_gpt.py with Protocol Models (``PROTOCOL``) in a pipeline of 2 stages."""
    script = Path(os.environ["MEGATRON_LM_DIR"]) / "pretrain_gpt.py"
    args = tiny_args(**PROTOCOL, **flags) + ["--pipeline-model-parallel-size", "2"]
    return pretrain(script, args, cwd=cwd)


@pytest.fixture(scope="module")
def protocol_pp2(tmp_path_factory):
    """PP=2 Protocol Models, 4 iterations with subspace updates after iterations 2 and 4,
    saving a torch_dist checkpoint at iteration 2."""
    root = tmp_path_factory.mktemp("protocol_pp2")
    run = _protocol_pp2(root, save=str(root / "ckpt"), save_interval="2").check()
    return root, run


def test_zero_touch_protocol_pp2_sends_k_of_d_and_moves_the_subspace(protocol_pp2):
    _, run = protocol_pp2
    assert "P2P ExtP2PCommunicator (--subspace-method protocol)" in run.stdout
    assert "Protocol Models: residual stream in a 8-dimensional subspace of 64" in run.stdout
    iters = iterations(run.stdout)
    assert sorted(iters) == [1, 2, 3, 4]
    dense = 131.072  # fp32 [64, 2, 64] x 4 microbatches, KB
    tokens = 64 * 2 * 4
    for it, record in iters.items():
        field = record["bytes"]
        # 8 of 64 coordinates per token (fp32) plus the int32 token id, forward; 8 backward
        assert _kb(field, "pp-act") == pytest.approx(tokens * 9 * 4 / 1e3, rel=1e-3), field
        assert _kb(field, "pp-grad") == pytest.approx(tokens * 8 * 4 / 1e3, rel=1e-3), field
        assert f"(dense {dense:.2f} KB" in field, field
        # the new basis goes down the pipeline after iterations 2 and 4 only
        assert ("subspace" in field) == (it in (2, 4)), field
    losses = [float(r["loss"]) for r in iters.values()]
    assert all(0 < loss < 7.0 for loss in losses), iters


def test_zero_touch_protocol_resumes_exactly_across_an_update(protocol_pp2, tmp_path):
    root, run = protocol_pp2
    resumed = _protocol_pp2(tmp_path, load=str(root / "ckpt"), ckpt_step="2").check()
    assert "loaded the state of 2 ranks" in resumed.stdout
    # Iteration 3 starts from the basis, weights and moments the update after iteration 2
    # re-projected, all restored from the checkpoint.
    full, again = _assert_resumed_at_2(run, resumed)
    assert [_kb(again[i]["bytes"], "subspace") for i in (4,)] == [
        _kb(full[i]["bytes"], "subspace") for i in (4,)
    ]


def test_protocol_with_hidden_dropout_stops_naming_the_flag(tmp_path):
    run = _protocol_pp2(tmp_path, hidden_dropout="0.1")
    assert run.returncode != 0
    # Once: printed by the first refusing rank, not lost when the other exits first, not
    # repeated per rank (megatron_ext.refusal).
    output = run.stderr + run.stdout
    assert output.count("megatron-ext: error: --subspace-method, --hidden-dropout:") == 1, output
    assert_cause_last(run.output, "megatron-ext: error: --subspace-method, --hidden-dropout:")
    assert not iterations(run.stdout)
