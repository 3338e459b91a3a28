"""``megatron-ext train`` end to end, as users launch it: torchrun, 2 CPU ranks, gloo.

The README's main job (tiny GPT, DP=2, embedded corpus) at fewer iterations; its PP=2
variant; resume through the command line (``--exit-interval`` then ``--load``) reproducing
the uninterrupted losses exactly; resume semantics as Megatron-LM's (a ``--load`` without a
checkpoint refused, ``--load DIR/iter_XXXXXXX``, the learning-rate schedule check and its
two flags, the distributed optimizer toggled); TensorBoard and JSON outputs; bad flags
stopping before training with exit code 2 and the flag named.
"""

import json
import math
import sys
from pathlib import Path

import pytest

from tests.helpers.driver import base_flags, run_command, run_driver
from tests.helpers.quiet import noise_lines
from tests.helpers.refusal import assert_cause_last, torchrun_summary

BASE = base_flags()


# The driver's own resume, fine-tuning and refusal logic on top of megatron-core's
# checkpointing and model: run once, in the main pass. Every release runs the seams they go
# through in tests/megatron/test_checkpoint_resume.py and test_elastic_resume.py (the
# distributed optimizer's checkpoints, model and optimizer loads), tests/megatron/test_grass.py
# (the model's layers Grass selects from) and tests/megatron_lm/test_pretrain_gpt.py (the
# schedule check and Megatron-LM's fine-tuning).
release_covered = pytest.mark.release_covered


def _log_lines(stdout):
    return [l for l in stdout.splitlines() if " iteration " in l and "lm loss" in l]


def _losses(path):
    return [json.loads(l)["lm_loss"] for l in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_readme_job_dp2_trains_and_reports_bytes(tmp_path):
    save = tmp_path / "run"
    proc = run_driver(
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
    proc = run_driver(
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
    # No --save: the report goes to a fresh run directory named at start-up, not to ./
    (run_dir,) = [l.split()[3] for l in proc.stdout.splitlines() if "> run directory:" in l]
    assert Path(run_dir).parent == Path("runs"), run_dir
    assert json.loads((tmp_path / run_dir / "comm_report.json").read_text())["layout"]["pp"] == 2
    assert not (tmp_path / "comm_report.json").exists()


# 8 iterations without dropout, logged every iteration.
_EXACT = BASE + [
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


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted run of ``_EXACT`` saved under ``a/`` (its ``log.jsonl`` there): the
    reference of the resume test and the pretrained model of the fine-tuning test."""
    root = tmp_path_factory.mktemp("full_run")
    proc = run_driver(_EXACT + ["--save", str(root / "a")], root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, proc


@release_covered
@pytest.mark.slow
def test_command_line_resume_is_exact(full_run, tmp_path):
    args = _EXACT
    root, full = full_run
    # --load equal to --save with nothing there yet: a first run (auto-resume convention).
    first = run_driver(
        args
        + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]
        + ["--save-interval", "4", "--exit-interval", "4"],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr[-4000:]
    assert "(the --save directory) yet; starting from scratch" in first.stdout
    second = run_driver(
        args + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")], tmp_path
    )
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout
    assert _losses(root / "a" / "log.jsonl") == _losses(tmp_path / "b" / "log.jsonl")
    # Quiet by default: no Python warning (dist-checkpoint loads included) and no rerun state
    # machine line; MEGATRON_EXT_VERBOSE_WARNINGS=1 shows them (megatron_ext/quiet.py).
    for run in (full, second):
        assert not noise_lines(run.stdout + run.stderr), noise_lines(run.stdout + run.stderr)
    # The resume added its segment to the run's report instead of replacing it.
    report = json.loads((tmp_path / "b" / "comm_report.json").read_text())
    segments = [(s["start_iteration"], s["iterations"]) for s in report["segments"]]
    assert segments == [(0, 4), (4, 8)], segments


@pytest.mark.release_independent
def test_a_refusal_ends_the_process_with_code_2(tmp_path):
    """The process-level contract of every refusal of ``_EARLY_REFUSALS`` below (checked
    there in this process, one launch for all): exit code 2, the flag on stderr, nothing
    trained. One real launch of the command line shows it holds outside the test's call."""
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    args, flag = ["--grad-compression", "topk"], "--grad-compression"
    proc = run_command(
        [sys.executable, "-m", "megatron_ext", "train", "--cpu", "--model", "gpt-tiny"] + args,
        tmp_path,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert flag in proc.stderr
    assert "iteration" not in proc.stdout


@pytest.mark.parametrize(
    "args, line",
    [
        # 10^10 iterations of 4 samples on the embedded corpus: about 1.3 TiB of indices.
        (
            ["--train-iters", "10000000000"],
            "--train-iters, --global-batch-size: megatron-core's sample index of the train "
            "split",
        ),
    ],
    ids=["sample-index-memory"],
)
@release_covered
def test_bad_values_end_in_one_line_naming_the_flag(args, line, tmp_path):
    """What used to end in worker tracebacks is refused before training: here numpy
    allocating the sample index, refused on the data's index before it is built, after the
    ranks started (the refusals at parse time and start-up, such as a NaN --lr or an
    unwritable --save, are in ``_EARLY_REFUSALS``). One line (printed once for both ranks),
    no worker traceback, no iteration."""
    (tmp_path / "FILE").write_text("not a directory")
    args = [str(tmp_path / a) if a.startswith("FILE") else a for a in args]
    line = line.replace("FILE", str(tmp_path / "FILE"))
    proc = run_driver(BASE + ["--train-iters", "4"] + args, cwd=tmp_path)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if "megatron-ext train: error:" in l]
    assert len(errors) == 1, proc.stderr[-3000:]
    # torchrun's summary reprints it as the failure's "traceback", its last line but one.
    assert f"megatron-ext train: error: {line}" in errors[0], errors[0]
    assert_cause_last(proc.stdout + proc.stderr, f"megatron-ext train: error: {line}")
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert not _log_lines(proc.stdout)
    # A refusal after the run directory was made (no --save) leaves no empty runs/<stamp>.
    assert not list(tmp_path.glob("runs/*")), list(tmp_path.glob("runs/*"))


@pytest.mark.release_independent
@pytest.mark.parametrize(
    "args, flag",
    [
        ([], "--fixed-samples"),  # a sample id must mean the same tokens every epoch
        (
            ["--fixed-samples", "16", "--aqsgd-buffer", "disk", "--aqsgd-buffer-dir", "FILE"],
            "--aqsgd-buffer-dir",
        ),
        # A warm-up epoch of 32 samples at 8 a step outlasts the 4 training steps.
        (["--fixed-samples", "32"], "--aqsgd-warmup-epochs, --train-iters"),
    ],
)
def test_aqsgd_refusals_name_the_flag_before_training(args, flag, tmp_path):
    (tmp_path / "FILE").write_text("not a directory")
    args = [str(tmp_path / a) if a == "FILE" else a for a in args]
    proc = run_driver(
        BASE
        + ["--train-iters", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
        + ["--p2p-compression", "aqsgd"]
        + args,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "megatron-ext train: error:" in proc.stderr and flag in proc.stderr, proc.stderr[-3000:]
    # Refused after the process groups and the model exist (pipeline stages differ): printed
    # once per job, not once per rank (the parse-time case on 8 ranks is in
    # test_exit_and_failures.py).
    assert proc.stderr.count("megatron-ext train: error:") == 1, proc.stderr[-3000:]
    assert_cause_last(proc.stdout + proc.stderr, "megatron-ext train: error:")
    assert not _log_lines(proc.stdout)
    assert not list(tmp_path.glob("runs/*")), list(tmp_path.glob("runs/*"))


# name: (arguments, the cause the last lines must hold); refused before the ranks talk, so
# checked in this process. The refusals met later (data, model, checkpoint) are launches
# above and below, with the same check on their real output.
_EARLY_REFUSALS = {
    "unknown-method": (["--grad-compression", "topk"], "--grad-compression"),
    "tp-3": (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    "layers-pp": (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        "--num-layers, --pipeline-model-parallel-size",
    ),
    "lr-nan": (["--lr", "nan"], "--lr: must be a finite number > 0, got nan"),
    "lr-typo": (["--lr", "1e-3x"], "argument --lr: invalid float value: '1e-3x'"),
    "unwritable-save": (["--save", "FILE/run"], "--save: cannot write to"),
    "aqsgd-bits": (["--p2p-compression", "aqsgd", "--aqsgd-fw-bits", "9"], "--aqsgd-fw-bits"),
    # A --load naming no checkpoint stops before anything is built (it used to train from
    # scratch and, with --save, overwrite the checkpoints it was meant to resume): a typo of
    # the --save directory; a directory without the tracker (RUN: iter_0000004 only).
    "load-typo": (["--load", "rnu", "--save", "run"], "--load: rnu does not exist"),
    "load-no-tracker": (
        ["--load", "RUN", "--save", "new"],
        "--load: RUN holds no checkpoint (no latest_checkpointed_iteration.txt); it has "
        "iter_0000004: pass one of them as --load",
    ),
    "diloco-interval": (
        ["--outer-method", "diloco", "--outer-interval", "50", "--train-iters", "20"],
        "--outer-interval, --train-iters",
    ),
    "warm-up": (["--train-iters", "5", "--lr-warmup-iters", "5"], "--lr-warmup-iters"),
    "grass-distopt": (
        ["--grass-method", "topr", "--use-distributed-optimizer"],
        "--grass-method, --use-distributed-optimizer",
    ),
    "grass-compression": (
        ["--grass-method", "topr", "--grad-compression", "separate"],
        "--grass-method, --grad-compression",
    ),
    # FINISHED: a checkpoint directory at iteration 4 (made by the test; no model in it, so
    # the refusal must come before anything is built or loaded).
    "finished-load": (
        ["--load", "FINISHED", "--train-iters", "4"],
        "--load, --train-iters: FINISHED holds a finished run (iteration 4, --train-iters 4)",
    ),
}


@pytest.mark.release_independent
def test_early_refusals_are_the_last_lines_underrun_driver(tmp_path, monkeypatch, capsys):
    """Each refusal of the lists above that stops before the ranks talk, through the
    driver's main() as a torchrun worker runs it: nothing on stderr (the line would sit
    above torchrun's summary), the line in the worker's error file, and so in the last
    lines of torchrun's summary (rendered by torch's own formatter)."""
    from megatron_ext.train import main

    (tmp_path / "FILE").write_text("not a directory")
    finished = tmp_path / "FINISHED"
    (finished / "iter_0000004").mkdir(parents=True)
    (finished / "iter_0000004" / "metadata.json").write_text("{}")
    (finished / "latest_checkpointed_iteration.txt").write_text("4")
    (tmp_path / "RUN" / "iter_0000004").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, (args, cause) in _EARLY_REFUSALS.items():
        error_file = tmp_path / f"{name}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        args = [str(tmp_path / a) if a.startswith(("FILE", "FINISHED", "RUN")) else a for a in args]
        cause = cause.replace("FINISHED", str(finished)).replace("RUN", str(tmp_path / "RUN"))
        try:
            code = main(["--cpu", "--model", "gpt-tiny", "--no-progress", *args])
        except SystemExit as exc:  # argparse
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, (name, code, err[-2000:])
        assert "error:" not in err, (name, err[-2000:])
        message = json.loads(error_file.read_text())["message"]["message"]
        assert message.startswith("megatron-ext train: error: ") and cause in message, message
        assert_cause_last(torchrun_summary(str(error_file)), cause)


@release_covered
def test_finetune_loads_the_model_only_and_starts_at_iteration_zero(full_run, tmp_path):
    pre = full_run[0] / "a"  # 8 iterations
    tuned = run_driver(
        BASE
        + [
            "--train-iters",
            "4",
            "--load",
            str(pre),
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
    pretrained_end = _losses(pre / "log.jsonl")[-1]
    # The first fine-tuning step starts from the pretrained weights, not from scratch (~9).
    assert records[0]["lm_loss"] < pretrained_end + 0.3, (records[0], pretrained_end)


@pytest.mark.parametrize(
    "args, flag",
    [
        # Decided on the model megatron-core built (the combinations with the distributed
        # optimizer and a gradient compressor are in _EARLY_REFUSALS).
        (["--grass-rank", "100000"], "--grass-rank"),  # larger than any projected dimension
        (["--grass-layers", "no_such_layer"], "--grass-layers"),
    ],
)
@release_covered
def test_grass_refusals_name_the_flag_before_training(args, flag, tmp_path):
    proc = run_driver(BASE + ["--train-iters", "4", "--grass-method", "topr"] + args, cwd=tmp_path)
    assert proc.returncode != 0
    assert "megatron-ext train: error:" in proc.stderr and flag in proc.stderr, proc.stderr[-3000:]
    assert_cause_last(proc.stdout + proc.stderr, flag)
    assert not _log_lines(proc.stdout)


# -- resume semantics -----------------------------------------------------------------------


def _records(path):
    return {r["iteration"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def _tiny(*extra):
    from tests.helpers.mcore import TINY

    return list(TINY) + ["--train-iters", "4", "--log-interval", "1"] + list(extra)


@pytest.fixture(scope="module")
def distopt_run(tmp_path_factory):
    """4 iterations with the distributed optimizer; checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("distopt_run")
    proc = run_driver(
        _tiny("--use-distributed-optimizer", "--save", str(root / "ckpt"))
        + ["--save-interval", "2", "--log-json", str(root / "full.jsonl")],
        root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@release_covered
def test_load_of_an_iteration_directory_continues_the_saved_schedule(distopt_run, tmp_path):
    """--load DIR/iter_0000002 loads iteration 2 (not the latest, 4); with
    --use-checkpoint-opt-param-scheduler a new --lr is ignored; the distributed optimizer
    resumes exactly (losses and learning rates of iterations 3 and 4 as uninterrupted)."""
    proc = run_driver(
        _tiny("--use-distributed-optimizer", "--load", str(distopt_run / "ckpt" / "iter_0000002"))
        + ["--lr", "5e-4", "--use-checkpoint-opt_param-scheduler"]
        + ["--log-json", str(tmp_path / "resumed.jsonl")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at iteration 2" in proc.stdout, proc.stdout[-3000:]
    full, resumed = _records(distopt_run / "full.jsonl"), _records(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert (resumed[it]["lm_loss"], resumed[it]["lr"]) == (full[it]["lm_loss"], full[it]["lr"])


@release_covered
def test_override_opt_param_scheduler_takes_this_runs_schedule(distopt_run, tmp_path):
    proc = run_driver(
        _tiny("--use-distributed-optimizer", "--load", str(distopt_run / "ckpt" / "iter_0000002"))
        + ["--lr", "5e-4", "--min-lr", "5e-5", "--train-iters", "6"]
        + ["--override-opt-param-scheduler", "--log-json", str(tmp_path / "resumed.jsonl")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    full, resumed = _records(distopt_run / "full.jsonl"), _records(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [3, 4, 5, 6]
    # This run's cosine from 5e-4 to 5e-5 over 6 iterations (warm-up 2), continued from the
    # checkpoint's step: at iteration 3 (12 of 24 samples) 5e-5 + 4.5e-4 * (1 + cos(pi / 4)) / 2;
    # the saved schedule was at 1e-4 + 9e-4 / 2 there and at its own minimum 1e-4 at 4.
    assert resumed[3]["lr"] == pytest.approx(5e-5 + 4.5e-4 * (1 + math.cos(math.pi / 4)) / 2)
    assert full[3]["lr"] == pytest.approx(5.5e-4)
    assert resumed[6]["lr"] == pytest.approx(5e-5)


@pytest.mark.parametrize(
    "flags, needles",
    [
        (
            ["--use-distributed-optimizer", "--lr", "5e-4"],
            [
                "--lr, --override-opt-param-scheduler, --use-checkpoint-opt-param-scheduler:",
                "max_lr (--lr): checkpoint 0.001, this run 0.0005",
            ],
        ),
        ([], ["--use-distributed-optimizer:", "saved with the distributed optimizer on"]),
    ],
    ids=["lr", "distopt-off"],
)
@release_covered
def test_resume_with_other_settings_is_refused_naming_the_flag(
    distopt_run, tmp_path, flags, needles
):
    """Megatron-LM refuses a schedule that differs from the checkpoint's (it used to be
    silently replaced by the checkpoint's); toggling the distributed optimizer used to end
    in a KeyError."""
    # Iteration 2: --load of the finished run (iteration 4) is refused before the load.
    load = str(distopt_run / "ckpt" / "iter_0000002")
    proc = run_driver(_tiny("--load", load, *flags), tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "megatron-ext train: error:" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]
    assert_cause_last(proc.stdout + proc.stderr, needles[0])
    assert not _log_lines(proc.stdout)
