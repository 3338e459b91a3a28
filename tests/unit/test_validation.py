"""Bad values are refused before start-up with one line naming the flag and its range.

Table-driven, in process (``megatron_ext.train.parse_args``: every rank of a run parses the
same flags before any process group exists): each row is a value that used to end in a
worker traceback (or an all-NaN model) and the flag(s) the refusal must name. The table of
ranges (``megatron_ext.validation.FLAG_RANGES``) must cover every numeric flag of the
driver's and megatron-ext's option dataclasses and accept their defaults; the same table
refuses Megatron-LM's parsed args in the session's ``validate_args`` hook. A few end-to-end
launches (exit code and last lines through torchrun) are in tests/megatron/test_driver_cli.py.
"""

import dataclasses
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ext.config import ConfigError, ext_config_classes, flag_of
from megatron_ext.validation import (
    FLAG_RANGES,
    Range,
    check_backend,
    check_fits_host_memory,
    check_writable,
    sample_index_bytes,
)

BASE = ["--cpu", "--model", "gpt-tiny"]
DILOCO = ["--outer-method", "diloco", "--outer-interval", "4"]

# (extra flags, the flag(s) the message must start with, a phrase of the range)
BAD = [
    (["--lr", "nan"], "--lr", "a finite number > 0"),
    (["--lr", "inf"], "--lr", "a finite number > 0"),
    (["--lr", "0"], "--lr", "> 0"),
    (["--min-lr", "nan"], "--min-lr", ">= 0"),
    (["--min-lr", "0.01"], "--min-lr, --lr", "min lr 0.01 > lr 0.001"),
    (["--adam-beta1", "2"], "--adam-beta1", "in [0, 1)"),
    (["--adam-beta2", "nan"], "--adam-beta2", "in [0, 1)"),
    (["--adam-beta2", "1"], "--adam-beta2", "in [0, 1)"),
    (["--adam-eps", "-1"], "--adam-eps", "> 0"),
    (["--adam-eps", "0"], "--adam-eps", "> 0"),
    (["--weight-decay", "-5"], "--weight-decay", ">= 0"),
    (["--clip-grad", "-1"], "--clip-grad", ">= 0"),
    (["--clip-grad", "inf"], "--clip-grad", ">= 0"),
    (["--init-method-std", "-1"], "--init-method-std", ">= 0"),
    (["--init-method-std", "nan"], "--init-method-std", ">= 0"),
    (["--seed", "-1"], "--seed", "an integer in [0, 2147483647]"),
    (["--seed", str(2**32)], "--seed", "an integer in [0, 2147483647]"),
    (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes", ">= 1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes", ">= 1"),
    (["--position-embedding-type", "rope", "--rotary-base", "0"], "--rotary-base", ">= 1"),
    (["--hidden-dropout", "nan"], "--hidden-dropout", "in [0, 1)"),
    (["--max-position-embeddings", "64"], "--max-position-embeddings, --seq-length", ">= 128"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings", ">= 1"),
    (["--split", "0,0,100"], "--split", "a share > 0"),
    (["--num-threads", "0"], "--num-threads", ">= 1"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters", ">= 1"),
    (["--ffn-hidden-size", "-4"], "--ffn-hidden-size", ">= 1"),
    (["--vocab-size", "0"], "--vocab-size", ">= 1"),
    (DILOCO + ["--outer-lr", "nan"], "--outer-lr", "a finite number > 0"),
    (DILOCO + ["--outer-lr", "inf"], "--outer-lr", "a finite number > 0"),
    (DILOCO + ["--outer-momentum", "nan"], "--outer-momentum", "in [0, 1)"),
    (DILOCO + ["--outer-merge-alpha", "inf"], "--outer-merge-alpha", "in [0, 1]"),
    (["--grad-compression", "separate", "--separate-ef-beta", "nan"], "--separate-ef-beta", ">= 0"),
    (["--grad-compression", "radius", "--radius-density", "nan"], "--radius-density", "(0, 1]"),
    (["--powersgd-min-compression-rate", "nan"], "--powersgd-min-compression-rate", ">= 1"),
    (["--grass-scale", "inf"], "--grass-scale", "> 0"),
    (["--subspace-lr", "inf"], "--subspace-lr", "> 0"),
    (["--subspace-compression-rate", "inf"], "--subspace-compression-rate", ">= 1"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl", "Transformer Engine"),
    (["--distributed-backend", "nccl"], "--distributed-backend, --cpu", "gloo"),
    # Schedules against --train-iters (also checked on Megatron-LM's flags).
    (
        ["--train-iters", "5", "--lr-warmup-iters", "5"],
        "--lr-warmup-iters, --train-iters",
        "must end before the decay does (--train-iters 5)",
    ),
    (
        ["--lr-decay-iters", "8", "--lr-warmup-iters", "8"],
        "--lr-warmup-iters, --lr-decay-iters",
        "pass --lr-warmup-iters below 8",
    ),
    (
        ["--outer-method", "diloco", "--outer-interval", "50", "--train-iters", "20"],
        "--outer-interval, --train-iters",
        "never synchronize; pass --outer-interval 20 or less",
    ),
    (
        DILOCO[:2] + ["--outer-interval", "50", "--outer-fragments", "5", "--train-iters", "20"],
        "--outer-interval, --train-iters",
        "fragment 0 would never be synchronized",
    ),
    # A short run hides no other refusal behind the warm-up's.
    (
        ["--train-iters", "4", "--separate-ef-beta", "nan", "--grad-compression", "separate"],
        "--separate-ef-beta",
        ">= 0",
    ),
]


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - not importable: the refusal is expected
        return False
    return True


def _parse(argv):
    from megatron_ext.train import parse_args

    return parse_args(argv)


@pytest.mark.parametrize("extra, flags, phrase", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_are_refused_naming_the_flag_and_the_range(extra, flags, phrase):
    if extra[:2] == ["--transformer-impl", "transformer_engine"] and _te_importable():
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ConfigError) as info:
        _parse(BASE + extra)
    message = str(info.value)
    assert message.startswith(flags + ":"), message
    assert phrase in message, message
    assert "\n" not in message


@pytest.mark.parametrize("iters, warmup", [(1, 0), (5, 4), (10, 9), (11, 10), (200, 10)])
def test_the_default_warm_up_scales_down_for_short_runs(iters, warmup):
    """10 iterations, or one less than a shorter decay: any --train-iters runs without a
    warm-up flag, and longer runs keep the warm-up they had."""
    cfg = _parse(BASE + ["--train-iters", str(iters)])
    assert cfg.training.lr_warmup_iters == warmup
    assert (
        _parse(BASE + ["--train-iters", "20", "--lr-decay-iters", "6"]).training.lr_warmup_iters
        == 5
    )


def test_diloco_interval_up_to_the_run_length_is_accepted():
    cfg = _parse(
        BASE + ["--outer-method", "diloco", "--outer-interval", "20", "--train-iters", "20"]
    )
    assert cfg.ext.methods["outer"] == "diloco"


def _numeric_fields():
    from megatron_ext.data.config import DataConfig
    from megatron_ext.train_config import DRIVER_CONFIG_CLASSES

    for cls in list(DRIVER_CONFIG_CLASSES) + [DataConfig] + list(ext_config_classes()):
        hints = __import__("typing").get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            args = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
            base = args[0] if args and len(args) == 1 else tp
            if base in (int, float):
                yield cls, f, base


def test_every_numeric_flag_has_a_range_and_its_default_is_in_it():
    missing, refused = [], []
    for cls, f, base in _numeric_fields():
        dest = flag_of(cls, f.name)[2:].replace("-", "_")
        if dest not in FLAG_RANGES:
            missing.append(flag_of(cls, f.name))
            continue
        assert FLAG_RANGES[dest].integer == (base is int), (dest, base)
        default = f.default
        if default is not None and not FLAG_RANGES[dest].admits(default):
            refused.append((dest, default))
    assert not missing, f"numeric flags without a range in FLAG_RANGES: {missing}"
    assert not refused, f"defaults outside their range: {refused}"


def test_megatron_lm_only_entries_are_megatron_lm_flags():
    """Entries that are no field of ours must be Megatron-LM flags (both releases), so a
    misspelt destination cannot silently check nothing."""
    ours = {flag_of(cls, f.name)[2:].replace("-", "_") for cls, f, _ in _numeric_fields()}
    data = Path(__file__).resolve().parents[1] / "data"
    for release in ("core_v0.16.1", "core_v0.19.0"):
        text = (data / f"megatron_lm_{release}_flags.txt").read_text()
        dests = {line[5:] for line in text.splitlines() if line.startswith("dest:")}
        foreign = sorted(d for d in FLAG_RANGES if d not in ours and d not in dests)
        assert not foreign, (release, foreign)


def test_range_descriptions_and_non_numbers():
    assert Range(low=0, high=1, high_open=True).describe() == "a finite number in [0, 1)"
    assert Range(low=1, integer=True).describe() == "an integer >= 1"
    assert not Range(integer=True).admits(1.0)  # a YAML float where an integer is expected
    assert not Range().admits("0.1") and not Range().admits(True)
    assert not Range().admits(math.nan) and not Range().admits(-math.inf)


def test_megatron_lm_args_are_checked_before_megatron_lm_validates_them():
    """The session's validate_args hook runs the same table on Megatron-LM's namespace (its
    own names; flags it lacks, or leaves None, are skipped)."""
    from megatron_ext.megatron.lm.session import MegatronLMSession

    session = MegatronLMSession.__new__(MegatronLMSession)
    args = SimpleNamespace(lr=None, min_lr=0.0, adam_beta1=0.9, loss_scale=None, seed=1234)
    session.check_values(args)  # None and defaults pass
    for attr, value, flag in [
        ("adam_beta1", 2.0, "--adam-beta1"),
        ("lr", math.nan, "--lr"),
        ("loss_scale", -1.0, "--loss-scale"),
        ("lr_warmup_fraction", 1.5, "--lr-warmup-fraction"),
    ]:
        bad = SimpleNamespace(**{**vars(args), attr: value})
        with pytest.raises(ConfigError) as info:
            session.check_values(bad)
        assert str(info.value).startswith(f"{flag}: must be"), str(info.value)


def test_environment_checks(tmp_path):
    check_backend("gloo", cpu=True)
    check_backend("auto", cpu=True)
    with pytest.raises(ConfigError, match="--distributed-backend, --cpu"):
        check_backend("nccl", cpu=True)
    check_writable(str(tmp_path / "a" / "b"), "--save")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as info:
        check_writable(str(blocker / "run"), "--save")
    assert str(info.value).startswith(f"--save: cannot write to {blocker / 'run'}")
    if os.geteuid() != 0:  # root writes through permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="--save: cannot write"):
            check_writable(str(locked / "run"), "--save")


def test_sample_index_estimate_and_the_memory_refusal():
    # The embedded corpus at --train-iters 10^9 (global batch 4): numpy's first allocation was
    # the (2, E, D) int64 mgrid of 69.7 GiB; the estimate's document-index term is 20 E D.
    need, epochs = sample_index_bytes(4 * 10**9, 128, 508_109, 4_643)
    assert epochs == 1_007_658
    assert 16 * epochs * 4_643 == pytest.approx(69.7 * 2**30, rel=1e-3)
    assert need >= 20 * epochs * 4_643
    small, one = sample_index_bytes(400, 128, 508_109, 4_643)
    assert one == 1 and small < 2**20
    check_fits_host_memory(small, "--train-iters", "x", available=2**30)
    with pytest.raises(ConfigError) as info:
        check_fits_host_memory(need, ["--train-iters"], "the index", available=2**30)
    assert str(info.value).startswith("--train-iters: the index needs about")
    assert "1.00 GiB available" in str(info.value)
