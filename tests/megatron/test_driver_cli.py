"""``megatron-ext train`` end to end, as users launch it: torchrun, 2 CPU ranks, gloo.

The README's main job (tiny GPT, DP=2, embedded corpus) at fewer iterations; its PP=2
variant; resume through the command line (``--exit-interval`` then ``--load``) reproducing
the uninterrupted losses exactly; TensorBoard and JSON outputs; bad flags stopping before
training with exit code 2 and the flag named.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BASE = [
    "--cpu",
    "--model",
    "gpt-tiny",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "4",
    "--eval-iters",
    "1",
    "--no-progress",
]


def _torchrun(args, cwd, nproc=2, timeout=420, env=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "megatron_ext.train",
    ] + list(args)
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    return proc


def _log_lines(stdout):
    return [l for l in stdout.splitlines() if " iteration " in l and "lm loss" in l]


def _losses(path):
    return [json.loads(l)["lm_loss"] for l in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_readme_job_dp2_trains_and_reports_bytes(tmp_path):
    save = tmp_path / "run"
    proc = _torchrun(
        BASE
        + ["--train-iters", "12", "--save", str(save), "--tensorboard-dir", str(tmp_path / "tb")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = _log_lines(proc.stdout)
    assert len(lines) == 3, proc.stdout
    for line in lines:
        assert "bytes sent/step (all ranks): dp-grad 59.09 MB" in line, line
    losses = _losses(save / "log.jsonl")
    assert losses[-1] < losses[0], losses
    report = json.loads((save / "comm_report.json").read_text())
    per_step = report["comm"]["all_ranks_per_step"]["dp-grad"]
    # 7.39M fp32 gradients all-reduced by 2 ranks: 2 x 29.55 MB per step, dense.
    assert 59.0e6 < per_step["sent"] < 59.2e6 and per_step["sent"] == per_step["dense_sent"]
    assert len(report["comm"]["per_rank_total"]) == 2
    assert report["final_valid_loss"] is not None
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "12"


@pytest.mark.slow
def test_pp2_variant(tmp_path):
    proc = _torchrun(
        BASE
        + [
            "--train-iters",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--global-batch-size",
            "8",
            "--log-json",
            str(tmp_path / "l.jsonl"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = _log_lines(proc.stdout)
    assert lines and all("pp-act" in l and "pp-grad" in l for l in lines), proc.stdout
    # 4 microbatches x [128, 2, 256] fp32 activations = 1 MB each way per step.
    assert "pp-act 1.05 MB" in lines[-1] and "pp-grad 1.05 MB" in lines[-1]


@pytest.mark.slow
def test_command_line_resume_is_exact(tmp_path):
    args = BASE + [
        "--train-iters",
        "8",
        "--log-interval",
        "1",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--eval-iters",
        "0",
    ]
    full = _torchrun(args + ["--save", str(tmp_path / "a")], tmp_path)
    assert full.returncode == 0, full.stderr[-4000:]
    first = _torchrun(
        args + ["--save", str(tmp_path / "b"), "--save-interval", "4", "--exit-interval", "4"],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr[-4000:]
    second = _torchrun(
        args + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")], tmp_path
    )
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout
    assert _losses(tmp_path / "a" / "log.jsonl") == _losses(tmp_path / "b" / "log.jsonl")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--grad-compression", "topk"], "--grad-compression"),
        (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
        (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], "--num-layers"),
    ],
)
def test_bad_flags_stop_before_training(args, flag, tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext", "train", "--cpu", "--model", "gpt-tiny"] + args,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert flag in proc.stderr
    assert "iteration" not in proc.stdout


@pytest.mark.parametrize(
    "args, flag",
    [
        ([], "--fixed-samples"),  # a sample id must mean the same tokens every epoch
        (
            ["--fixed-samples", "32", "--aqsgd-buffer", "disk", "--aqsgd-buffer-dir", "FILE"],
            "--aqsgd-buffer-dir",
        ),
    ],
)
def test_aqsgd_refusals_name_the_flag_before_training(args, flag, tmp_path):
    (tmp_path / "FILE").write_text("not a directory")
    args = [str(tmp_path / a) if a == "FILE" else a for a in args]
    proc = _torchrun(
        BASE
        + ["--train-iters", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
        + ["--p2p-compression", "aqsgd"]
        + args,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "megatron-ext train: error:" in proc.stderr and flag in proc.stderr, proc.stderr[-3000:]
    assert not _log_lines(proc.stdout)


def test_aqsgd_bit_widths_outside_the_set_are_refused(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ext",
            "train",
            "--cpu",
            "--p2p-compression",
            "aqsgd",
            "--aqsgd-fw-bits",
            "9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2 and "--aqsgd-fw-bits" in proc.stderr


def test_finetune_loads_the_model_only_and_starts_at_iteration_zero(tmp_path):
    pre = _torchrun(
        BASE
        + [
            "--train-iters",
            "8",
            "--save",
            str(tmp_path / "pre"),
            "--log-json",
            str(tmp_path / "pre.jsonl"),
        ],
        cwd=tmp_path,
    )
    assert pre.returncode == 0, pre.stderr[-3000:]
    tuned = _torchrun(
        BASE
        + [
            "--train-iters",
            "4",
            "--load",
            str(tmp_path / "pre"),
            "--finetune",
            "--log-interval",
            "1",
            "--log-json",
            str(tmp_path / "ft.jsonl"),
        ],
        cwd=tmp_path,
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "fine-tuning from the model weights of" in tuned.stdout
    records = [json.loads(l) for l in (tmp_path / "ft.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]  # a fresh schedule from 0
    pretrained_end = _losses(tmp_path / "pre.jsonl")[-1]
    # The first fine-tuning step starts from the pretrained weights, not from scratch (~9).
    assert records[0]["lm_loss"] < pretrained_end + 0.3, (records[0], pretrained_end)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--grass-rank", "100000"], "--grass-rank"),  # larger than any projected dimension
        (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
        (["--grad-compression", "separate"], "--grad-compression"),
        (["--grass-layers", "no_such_layer"], "--grass-layers"),
    ],
)
def test_grass_refusals_name_the_flag_before_training(args, flag, tmp_path):
    proc = _torchrun(BASE + ["--train-iters", "4", "--grass-method", "topr"] + args, cwd=tmp_path)
    assert proc.returncode != 0
    assert "megatron-ext train: error:" in proc.stderr and flag in proc.stderr, proc.stderr[-3000:]
    assert not _log_lines(proc.stdout)
