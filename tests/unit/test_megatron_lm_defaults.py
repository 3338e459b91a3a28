"""Megatron-LM flags whose default fails only after start-up are refused before it.

``megatron_ext.preflight.check_megatron_lm_defaults`` on an argument list, then its three
callers: ``python -m megatron_ext.preflight`` (before torchrun), the zero-touch launcher
``megatron-ext pretrain`` (before Megatron-LM is imported: the script given here would fail
the test if it ran) and a patched ``pretrain_gpt.py`` (the session's ``configure`` on
Megatron-LM's parsed arguments; end to end in tests/megatron_lm/test_refusals.py).
"""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_ext.preflight import PreflightError, _megatron_subset, check_megatron_lm_defaults
from tests.helpers.paths import REPO

# Everything a tiny GPT on mock data needs (configs/megatron_lm/gpt_tiny_separate_cpu.yaml).
COMPLETE = {
    "--eval-interval": ["1000"],
    "--train-iters": ["4"],
    "--lr": ["1e-3"],
    "--mock-data": [],
    "--tokenizer-type": ["NullTokenizer"],
    "--vocab-size": ["512"],
}


def _args(*, without=(), extra=()):
    out = []
    for flag, values in COMPLETE.items():
        if flag not in without:
            out += [flag, *values]
    return out + list(extra)


def _refusal(args):
    with pytest.raises(PreflightError) as info:
        check_megatron_lm_defaults(_megatron_subset(args))
    return str(info.value)


def test_complete_arguments_pass():
    check_megatron_lm_defaults(_megatron_subset(_args()))


@pytest.mark.parametrize(
    "without, extra, named",
    [
        (["--eval-interval"], [], "--eval-interval: Megatron-LM needs it"),
        (["--train-iters"], [], "--train-iters: Megatron-LM needs the run's length"),
        (["--lr"], [], "--lr: Megatron-LM has no default learning rate"),
        (["--mock-data"], [], "--data-path: no training data"),
        (["--vocab-size"], [], "--tokenizer-type NullTokenizer: needs --vocab-size"),
        ([], ["--save", "ckpt"], "--save-interval: Megatron-LM needs it with --save"),
        (
            ["--tokenizer-type", "--vocab-size"],
            [],
            "--tokenizer-type GPT2BPETokenizer: needs --vocab-file and --merge-file "
            "(pretrain_gpt.py's default)",
        ),
        (
            ["--tokenizer-type", "--vocab-size"],
            ["--tokenizer-type", "SentencePieceTokenizer"],
            "--tokenizer-type SentencePieceTokenizer: needs --tokenizer-model",
        ),
    ],
)
def test_each_missing_flag_is_named(without, extra, named):
    assert named in _refusal(_args(without=without, extra=extra))


def test_every_problem_is_named_in_one_line():
    message = _refusal([])
    assert "\n" not in message
    for flag in ("--eval-interval", "--train-iters", "--lr", "--data-path", "--tokenizer-type"):
        assert f"{flag}" in message, message


@pytest.mark.parametrize(
    "extra",
    [
        ["--train-samples", "32"],  # in place of --train-iters
        ["--data-path", "1.0", "/data/a_text_document"],  # in place of --mock-data
        ["--per-split-data-args-path", "splits.json"],
        ["--save", "ckpt", "--save-interval", "100"],
    ],
)
def test_the_alternatives_megatron_lm_accepts_pass(extra):
    flag = {"--train-samples": "--train-iters", "--save": "--no-such-flag"}.get(
        extra[0], "--mock-data"
    )
    check_megatron_lm_defaults(_megatron_subset(_args(without=[flag], extra=extra)))


def test_skip_train_or_full_validation_need_no_eval_interval():
    check_megatron_lm_defaults(
        _megatron_subset(_args(without=["--eval-interval"], extra=["--full-validation"]))
    )
    skip = _args(
        without=["--eval-interval", "--train-iters", "--mock-data"], extra=["--skip-train"]
    )
    check_megatron_lm_defaults(_megatron_subset(skip))


def test_a_yaml_run_is_left_to_the_parsed_arguments():
    check_megatron_lm_defaults(_megatron_subset(["--yaml-cfg", "run.yaml"]))


def test_megatron_lm_parsed_arguments_are_checked_too():
    """The session's path: Megatron-LM's namespace, every attribute present."""
    parsed = SimpleNamespace(
        eval_interval=None, skip_train=False, full_validation=False, train_iters=4,
        train_samples=None, lr=1e-3, mock_data=True, data_path=None, train_data_path=None,
        data_args_path=None, per_split_data_args_path=None, tokenizer_type="NullTokenizer",
        vocab_size=512, yaml_cfg=None,
    )  # fmt: skip
    with pytest.raises(PreflightError, match="^--eval-interval: "):
        check_megatron_lm_defaults(parsed)
    parsed.eval_interval = 100
    check_megatron_lm_defaults(parsed)


def _last_lines(proc, n=5):
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-n:])


def test_preflight_and_the_launcher_refuse_before_anything_starts(tmp_path):
    args = _args(without=["--eval-interval"])
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.preflight", "--", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "megatron-ext: error: --eval-interval: " in _last_lines(proc), proc.stderr

    # The launcher refuses once it knows the release, before it imports Megatron-LM or runs
    # the script (a stand-in checkout: core_v0.16.1's version file and a script that fails).
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('pretrain_gpt.py ran')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext", "pretrain", "--cpu", str(script), *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "megatron-ext pretrain: error: --eval-interval: " in _last_lines(proc)
    assert "pretrain_gpt.py ran" not in proc.stderr
