"""megatron-ext's Megatron-LM integration without training: patch, releases, launcher, run files.

Without a checkout: release detection and refusal on fake trees in tmp_path, the patch
applied / re-applied / reverted / refused on a synthetic ``pretrain_gpt.py`` made of the
patch's own context, the launcher refusing an unknown release before importing anything,
the flag chaining, the CPU flag check, run files and the launcher scripts' syntax.
With ``MEGATRON_LM_DIR``: the same on a copy of the real ``pretrain_gpt.py`` of the
checkout's release (the checkout itself is never modified).
"""

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_ext.megatron.lm import megatron_lm_extra_args, patch as lm_patch
from megatron_ext.megatron.lm.releases import (
    RELEASES,
    UnsupportedReleaseError,
    detect_checkout_release,
    file_sha256,
)
from tests.helpers.paths import REPO

PACKAGE_INFO = """\
MAJOR = {major}
MINOR = {minor}
PATCH = {patch}
PRE_RELEASE = ''
VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])
"""


def _fake_checkout(root: Path, version=(0, 16, 1), script: str = "print('hi')\n") -> Path:
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    major, minor, patch = version
    info.write_text(PACKAGE_INFO.format(major=major, minor=minor, patch=patch))
    (root / "pretrain_gpt.py").write_text(script)
    return root


def _synthetic_pretrain_gpt(version: str = "0.16.1") -> str:
    """A file holding exactly the original context of every hunk, with filler between."""
    (file_patch,) = lm_patch.load_release_patches(RELEASES[version])
    lines = []
    for hunk in file_patch.hunks:
        lines += [f"filler_{len(lines)} = 1"] * 3
        lines += hunk.image(reverse=False)[0]
    return "\n".join(lines + ["end = 1"]) + "\n"


def _run_patch(capsys, *argv):
    code = lm_patch.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- releases --------------------------------------------------------------------------------


def test_release_table_entries_are_complete():
    for version, release in RELEASES.items():
        assert release.version == version
        assert release.tag.startswith("core_v")
        module, function = release.hooks.split(":")
        assert module.startswith("megatron_ext.megatron.lm.") and function
        assert len(release.pretrain_gpt_sha256) == 64
        assert (REPO / "patches" / release.patch_dir).is_dir()


def test_release_detected_from_package_info(tmp_path):
    release = detect_checkout_release(str(_fake_checkout(tmp_path)))
    assert release.tag == "core_v0.16.1"


@pytest.mark.parametrize("version", [(0, 17, 0), (0, 16, 2), (0, 18, 0), (0, 19, 3)])
def test_unknown_release_refused_naming_the_supported_ones(tmp_path, version):
    checkout = _fake_checkout(tmp_path, version)
    with pytest.raises(UnsupportedReleaseError) as info:
        detect_checkout_release(str(checkout))
    message = str(info.value)
    assert ".".join(map(str, version)) in message
    assert "core_v0.16.1" in message


@pytest.mark.parametrize("version", [(0, 19, 0), (0, 19, 1), (0, 19, 2)])
def test_the_versions_of_core_v0_19_0_share_its_hooks_and_patch(tmp_path, version):
    release = detect_checkout_release(str(_fake_checkout(tmp_path, version)))
    assert release.tag == "core_v0.19.0" and release.patch_dir == "core_v0.19.0"
    assert release.hooks == "megatron_ext.megatron.lm.core_v0_19:install_hooks"
    assert release.requires_python == (3, 12)


def test_supported_releases_are_named_once_per_tag():
    from megatron_ext.megatron.lm.releases import same_release_family, supported_releases_text

    assert supported_releases_text() == (
        "core_v0.16.1 (megatron-core 0.16.1), "
        "core_v0.19.0 (megatron-core 0.19.0, 0.19.1, 0.19.2)"
    )
    assert same_release_family("0.19.1", "0.19.2")
    assert not same_release_family("0.16.1", "0.19.1") and not same_release_family(
        "0.19.3", "0.19.1"
    )


def test_tree_without_package_info_and_unknown_script_refused(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("print('not megatron')\n")
    with pytest.raises(UnsupportedReleaseError, match="cannot tell the Megatron-LM release"):
        detect_checkout_release(str(tmp_path))


# -- the patch -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.16.1", "0.19.1"])
def test_shipped_patch_targets_pretrain_gpt_with_two_hunks(version):
    (file_patch,) = lm_patch.load_release_patches(RELEASES[version])
    assert file_patch.path == "pretrain_gpt.py"
    added = [text for hunk in file_patch.hunks for tag, text in hunk.lines if tag == "+"]
    assert any("install_megatron_lm_hooks()" == line for line in added)
    assert any("megatron_lm_extra_args(add_modelopt_args" in line for line in added)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.1"])
def test_patch_applies_is_idempotent_and_reverts(tmp_path, capsys, version):
    original = _synthetic_pretrain_gpt(version)
    checkout = _fake_checkout(tmp_path, tuple(int(v) for v in version.split(".")), script=original)
    script = checkout / "pretrain_gpt.py"

    code, out, _ = _run_patch(capsys, checkout, "--dry-run")
    assert (
        code == 0 and "would patch pretrain_gpt.py" in out and "+install_megatron_lm_hooks()" in out
    )
    assert script.read_text() == original

    code, out, _ = _run_patch(capsys, checkout)
    assert code == 0 and "patched pretrain_gpt.py (2 hunks, +6 -1 lines)" in out
    patched = script.read_text()
    assert "install_megatron_lm_hooks()" in patched
    assert "megatron_lm_extra_args(add_modelopt_args if has_nvidia_modelopt else None)" in patched
    # The hooks go in before anything of Megatron-LM is imported.
    assert patched.index("install_megatron_lm_hooks()") < patched.index("from functools import")

    code, out, _ = _run_patch(capsys, checkout)
    assert code == 0 and "already patched; nothing to do" in out
    assert script.read_text() == patched

    code, out, _ = _run_patch(capsys, script, "--revert")  # the file path works too
    assert code == 0 and "reverted pretrain_gpt.py" in out
    assert script.read_text() == original

    code, out, _ = _run_patch(capsys, checkout, "--revert")
    assert code == 0 and "not patched; nothing to revert" in out


def test_patch_refuses_a_file_it_does_not_match(tmp_path, capsys):
    checkout = _fake_checkout(tmp_path, script="import os\nprint('locally modified')\n")
    code, _, err = _run_patch(capsys, checkout)
    assert code == 2
    assert "matches neither the original nor the patched pretrain_gpt.py" in err
    assert "hunk 1" in err
    assert (checkout / "pretrain_gpt.py").read_text() == "import os\nprint('locally modified')\n"


def test_patch_refuses_unknown_release(tmp_path, capsys):
    checkout = _fake_checkout(tmp_path, (0, 18, 0), script=_synthetic_pretrain_gpt())
    before = (checkout / "pretrain_gpt.py").read_text()
    code, _, err = _run_patch(capsys, checkout)
    assert code == 2
    assert "release 0.18.0" in err and "core_v0.16.1" in err
    assert (checkout / "pretrain_gpt.py").read_text() == before


def test_patch_keeps_file_mode(tmp_path, capsys):
    checkout = _fake_checkout(tmp_path, script=_synthetic_pretrain_gpt())
    script = checkout / "pretrain_gpt.py"
    script.chmod(0o750)
    assert _run_patch(capsys, checkout)[0] == 0
    assert script.stat().st_mode & 0o777 == 0o750


# -- launcher --------------------------------------------------------------------------------


def test_launcher_splits_its_options_from_megatron_args():
    from megatron_ext.megatron.lm.launcher import parse_launcher_args

    options, script, rest = parse_launcher_args(
        ["--core-from", "checkout", "x/pretrain_gpt.py", "--num-layers", "2", "--cpu", "--bf16"]
    )
    assert options["cpu"] and options["core_from"] == "checkout"
    assert script == "x/pretrain_gpt.py"
    assert rest == ["--num-layers", "2", "--bf16"]
    with pytest.raises(ValueError, match="--num-layers: unknown launcher option"):
        parse_launcher_args(["--num-layers", "2", "x/pretrain_gpt.py"])
    with pytest.raises(ValueError, match="--core-from"):
        parse_launcher_args(["--core-from", "elsewhere", "x/pretrain_gpt.py"])


def test_launcher_refuses_unknown_release_before_importing_it(tmp_path, capsys):
    from megatron_ext.megatron.lm.launcher import main

    checkout = _fake_checkout(tmp_path, (0, 17, 1), script="raise SystemExit('must not run')\n")
    code = main(["--cpu", str(checkout / "pretrain_gpt.py"), "--num-layers", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "megatron-ext pretrain: error:" in err and "0.17.1" in err and "core_v0.16.1" in err
    assert str(checkout) not in os.sys.path


def test_launcher_core_from_installed_accepts_a_wheel_of_the_same_tag(monkeypatch, tmp_path):
    from megatron_ext.megatron.lm import launcher

    checkout = str(tmp_path)
    monkeypatch.setattr(os.sys, "path", list(os.sys.path))
    monkeypatch.setattr(launcher, "_installed_core_version", lambda: "0.19.2")
    # auto: the wheel only when it is exactly the checkout's version.
    assert launcher.setup_sys_path(checkout, "0.19.1", "auto") == "checkout"
    assert os.sys.path[0] == checkout
    assert launcher.setup_sys_path(checkout, "0.19.2", "auto") == "installed"
    assert os.sys.path[-1] == checkout and os.sys.path.count(checkout) == 1
    # installed: any version of the same Megatron-LM tag, never another tag's.
    assert launcher.setup_sys_path(checkout, "0.19.1", "installed") == "installed"
    with pytest.raises(
        ValueError, match="installed megatron-core is 0.19.2, the checkout is 0.16.1"
    ):
        launcher.setup_sys_path(checkout, "0.16.1", "installed")


def test_megatron_core_versions_compare_without_the_git_suffix():
    from megatron_ext.megatron.version import parse_version, public_version

    # megatron-core 0.19's package_info appends '+<sha>' inside any git work tree.
    assert public_version("0.19.1+5be9626709") == "0.19.1"
    assert parse_version("0.19.1+5be9626709") == (0, 19, 1)
    assert public_version("0.16.1") == "0.16.1"


def test_python_shims_only_below_the_declared_python(monkeypatch):
    import typing

    from megatron_ext.megatron.lm.compat import apply_python_shims

    if hasattr(typing, "override") and getattr(typing.override, "__module__", "") == "typing":
        pytest.skip("this Python has typing.override itself")
    monkeypatch.delattr(typing, "override", raising=False)
    assert apply_python_shims((3, 10)) == []
    assert not hasattr(typing, "override")
    assert apply_python_shims((3, 12)) == ["typing.override"]

    @typing.override
    def f():
        return 1

    assert f.__override__ is True and f() == 1
    assert apply_python_shims((3, 12)) == []  # present now: left as it is


def test_requirements_are_named_all_at_once_before_anything_runs(tmp_path, monkeypatch, capsys):
    from megatron_ext.megatron.lm import requirements

    found = {"six", "yaml", "psutil"}
    monkeypatch.setattr(
        requirements.importlib.util,
        "find_spec",
        lambda name: object() if name in found else None,
    )
    # A checkout with megatron/core but no built dataset helpers: pybind11 is needed too.
    checkout = _fake_checkout(tmp_path)
    (checkout / "megatron" / "core" / "datasets").mkdir()
    code = requirements.main([str(checkout), "--cpu", "--core-from", "checkout"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Megatron-LM core_v0.16.1 needs Python packages that are not installed" in err
    assert "regex (pip: regex)" in err and "pydantic (pip: pydantic)" in err
    assert "pybind11 (pip: pybind11)" in err and "triton" not in err  # --cpu: stand-in
    assert "pip install pybind11 pydantic regex" in err
    found |= {"regex", "pydantic", "pybind11"}
    assert requirements.main([str(checkout), "--cpu", "--core-from", "checkout"]) == 0
    # 0.19 needs none of the tokenizer / RL packages, and triton only off CPU.
    checkout19 = _fake_checkout(tmp_path / "v19", (0, 19, 1))
    found.clear()
    found.add("psutil")
    assert requirements.missing_requirements("core_v0.19.0", cpu=True) == []
    assert [r.module for r in requirements.missing_requirements("core_v0.19.0", cpu=False)] == [
        "triton"
    ]
    assert requirements.main([str(checkout19), "--cpu", "--core-from", "checkout"]) == 0


def test_missing_triton_points_at_cpu_execution_not_at_pip(tmp_path, monkeypatch, capsys):
    # triton is in no extra and pip's triton does not make a CPU machine run Megatron-LM:
    # the fix on a machine without a GPU is CPU execution, which the message names.
    from megatron_ext.megatron.lm import requirements

    monkeypatch.setattr(
        requirements.importlib.util, "find_spec", lambda name: None if name == "triton" else 1
    )
    checkout19 = _fake_checkout(tmp_path, (0, 19, 1))
    assert requirements.main([str(checkout19), "--core-from", "checkout"]) == 2
    err = capsys.readouterr().err
    assert "triton (pip: triton)" in err and "GPU runs only" in err
    assert "pip install" not in err and "megatron-ext[megatron-lm]" not in err
    assert "megatron-ext pretrain --cpu" in err and "MEGATRON_EXT_CPU=1" in err
    # With a package pip does install, that one is named with its command and the extra.
    message = requirements.format_missing(
        "core_v0.16.1", [r for r in requirements.REQUIREMENTS["core_v0.16.1"] if r.module in (
            "six", "triton")]  # fmt: skip
    )
    assert "pip install six   (or: pip install 'megatron-ext[megatron-lm]')" in message
    assert "pip install six triton" not in message and "--cpu" in message
    # The extra named is the one setup.py declares.
    setup_py = (REPO / "setup.py").read_text()
    listed = str(list(requirements.EXTRA_PACKAGES)).replace("'", '"')
    assert f"_MEGATRON_LM = {listed}" in setup_py and '"megatron-lm": _MEGATRON_LM' in setup_py


def test_gpu_launch_without_cuda_names_cpu_execution_before_importing_megatron_lm(
    tmp_path, monkeypatch, capsys
):
    # Without it: "No module named 'triton'" (0.16's initialize.py) or Megatron-LM's bare
    # "AssertionError: Megatron requires CUDA." after start-up.
    import torch

    from megatron_ext.megatron.lm import install_megatron_lm_hooks
    from megatron_ext.megatron.lm.launcher import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("MEGATRON_EXT_CPU", raising=False)
    checkout = _fake_checkout(tmp_path, script="raise SystemExit('must not run')\n")
    assert main([str(checkout / "pretrain_gpt.py"), "--num-layers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ext pretrain: error: torch sees no CUDA device"), err
    assert "add --cpu (megatron-ext pretrain --cpu PATH/pretrain_gpt.py ...)" in err
    assert "--distributed-backend gloo --transformer-impl local" in err
    assert str(checkout) not in os.sys.path
    # A patched pretrain_gpt.py calls install_megatron_lm_hooks() first thing.
    with pytest.raises(SystemExit) as info:
        install_megatron_lm_hooks()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ext: error: torch sees no CUDA device") and (
        "add MEGATRON_EXT_CPU=1" in err
    ), err


def test_cli_lists_patch_and_pretrain():
    from megatron_ext.cli import SUBCOMMANDS

    assert SUBCOMMANDS["patch"][0] == "megatron_ext.megatron.lm.patch"
    assert SUBCOMMANDS["pretrain"][0] == "megatron_ext.megatron.lm.launcher"


# -- arguments -------------------------------------------------------------------------------


def test_extra_args_chain_keeps_the_given_provider_and_adds_ours_once():
    calls = []

    def modelopt_like(parser):
        calls.append(1)
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    provider = megatron_lm_extra_args(modelopt_like)
    # Patched pretrain_gpt.py chains it, and the hooked parse_args chains it again.
    provider = megatron_lm_extra_args(provider)
    parser = provider(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--grad-compression", "separate", "--export-te-mcore-model"])
    assert calls == [1]
    assert args.grad_compression == "separate" and args.export_te_mcore_model
    # A parser that has our flags already is left alone (no argparse conflict).
    assert megatron_lm_extra_args(None)(parser) is parser


def test_cpu_check_names_every_missing_flag():
    from megatron_ext.config import ConfigError
    from megatron_ext.megatron.lm.cpu import check_cpu_args

    ok = argparse.Namespace(
        distributed_backend="gloo",
        transformer_impl="local",
        gradient_accumulation_fusion=False,
        no_persist_layer_norm=True,
    )
    check_cpu_args(ok)
    bad = argparse.Namespace(
        **{**vars(ok), "distributed_backend": "nccl", "transformer_impl": "transformer_engine"}
    )
    with pytest.raises(ConfigError) as info:
        check_cpu_args(bad)
    assert info.value.flags == ("--distributed-backend", "--transformer-impl")
    assert "--distributed-backend gloo --transformer-impl local" in str(info.value)


# -- run files and scripts -------------------------------------------------------------------


def test_run_file_format(tmp_path, monkeypatch):
    from megatron_ext.megatron.lm.runfile import RunFileError, run_file_args

    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "model:\n  num-layers: 2\n  hidden-size: 64\n"
        "data:\n  data-path: ${PREFIX}\n  split: ${SPLIT:-949,50,1}\n"
        "bf16: true\nfp16: false\nload: null\neval-iters: [3]\n"
        "grad-compression: separate\nlr: 6.0e-4\n"
    )
    monkeypatch.setenv("PREFIX", "/data/owt text_document")
    assert run_file_args(str(run_file)) == [
        "--num-layers", "2", "--hidden-size", "64",
        "--data-path", "/data/owt text_document", "--split", "949,50,1",
        "--bf16", "--eval-iters", "3", "--grad-compression", "separate", "--lr", "0.0006",
    ]  # fmt: skip
    monkeypatch.delenv("PREFIX")
    with pytest.raises(RunFileError, match="data.data-path: environment variable PREFIX"):
        run_file_args(str(run_file))
    run_file.write_text("a:\n  b:\n    c: 1\n")
    with pytest.raises(RunFileError, match="one level"):
        run_file_args(str(run_file))
    run_file.write_text("--num-layers: 2\n")
    with pytest.raises(RunFileError, match="without '--'"):
        run_file_args(str(run_file))


def test_shipped_run_files_parse_and_follow_the_naming(monkeypatch):
    from megatron_ext.megatron.lm.runfile import run_file_args

    for name in (
        "DATA_PREFIX",
        "VOCAB_FILE",
        "MERGE_FILE",
        "RUN_DIR",
        "PRETRAINED",
        "TOKENIZER_MODEL",
    ):
        monkeypatch.setenv(name, f"/{name.lower()}")
    monkeypatch.setenv("FIXED_SAMPLES", "2304")
    monkeypatch.setenv("TRAIN_ITERS", "720")
    files = sorted((REPO / "configs" / "megatron_lm").glob("*.yaml"))
    names = {f.stem for f in files}
    assert {
        "gpt2_345m_separate_8gpu",
        "gpt_355m_radius_64gpu",
        "gpt_2.0b_radius_64gpu",
        "gpt_tiny_separate_cpu",
        "gpt2_1.5b_aqsgd_8gpu",
        "llama_60m_grass_8gpu",
        "llama_350m_grass_8gpu",
        "llama_1b_grass_8gpu",
        "llama_13b_grass_1gpu",
        "llama_2b_protocol_8gpu",
        "llama_640m_protocol_8gpu",
        "llama_8b_protocol_64gpu",
    } <= names
    for path in files:
        assert len(path.stem.split("_")) == 4, f"{path.name}: <model>_<size>_<algo>_<cluster>"
        args = run_file_args(str(path))
        assert "--grad-compression" in args
    separate = run_file_args(str(REPO / "configs/megatron_lm/gpt2_345m_separate_8gpu.yaml"))
    for flag, value in [("--lr", "0.0006"), ("--min-lr", "6e-05"), ("--lr-warmup-iters", "2000"),
                        ("--train-iters", "50000"), ("--adam-beta2", "0.95"),
                        ("--weight-decay", "0.1"), ("--clip-grad", "1.0")]:  # fmt: skip
        assert separate[separate.index(flag) + 1] == value, flag
    radius = run_file_args(str(REPO / "configs/megatron_lm/gpt_2.0b_radius_64gpu.yaml"))
    assert radius[radius.index("--radius-dense-steps") + 1] == "60000"
    assert radius[radius.index("--global-batch-size") + 1] == "512"
    aqsgd = run_file_args(str(REPO / "configs/megatron_lm/gpt2_1.5b_aqsgd_8gpu.yaml"))
    for flag, value in [("--pipeline-model-parallel-size", "8"), ("--hidden-size", "1600"),
                        ("--num-layers", "48"), ("--micro-batch-size", "1"),
                        ("--global-batch-size", "32"), ("--lr", "5.0e-6"),
                        ("--fixed-samples", "2304"), ("--p2p-compression", "aqsgd"),
                        ("--load", "/pretrained")]:  # fmt: skip
        assert aqsgd[aqsgd.index(flag) + 1] == value, flag
    assert "--finetune" in aqsgd and "--lr-decay-style" in aqsgd
    # Grass Table 2 / appendix I: seq 256, 1024 x 256 tokens a step, K=200, alpha 0.25,
    # rank 128/128/256, Top-r with state reset for 60M/350M, NR sampling without for 1B.
    monkeypatch.delenv("TRAIN_ITERS")
    for size, steps, rank, method in [("60m", "3800", "128", "topr"),
                                      ("350m", "20600", "128", "topr"),
                                      ("1b", "33600", "256", "norm2-nr")]:  # fmt: skip
        grass = run_file_args(str(REPO / f"configs/megatron_lm/llama_{size}_grass_8gpu.yaml"))
        for flag, value in [("--seq-length", "256"), ("--global-batch-size", "1024"),
                            ("--train-iters", steps), ("--grass-rank", rank),
                            ("--grass-method", method), ("--grass-update-interval", "200"),
                            ("--grass-scale", "0.25"), ("--grass-rewarmup-steps", "200"),
                            ("--transformer-impl", "local"), ("--lr-warmup-iters", "1000")]:  # fmt: skip
            assert grass[grass.index(flag) + 1] == value, (size, flag)
        assert ("--no-grass-reset-state" in grass) == (size == "1b")
        assert "--bf16" in grass and "--swiglu" in grass
    memory = run_file_args(str(REPO / "configs/megatron_lm/llama_13b_grass_1gpu.yaml"))
    for flag, value in [("--hidden-size", "5120"), ("--num-layers", "40"),
                        ("--micro-batch-size", "1"), ("--grass-rank", "128")]:  # fmt: skip
        assert memory[memory.index(flag) + 1] == value, flag
    # Protocol Models: one layer a stage for 2B (8) and 8B (32), k = 40 of 4096; 640M k = 15;
    # the whole last stage free (-1, the reference's rule).
    for size, layers, stages, rank in [("2b_protocol_8gpu", "8", "8", "40"),
                                       ("640m_protocol_8gpu", "16", "8", "15"),
                                       ("8b_protocol_64gpu", "32", "32", "40")]:  # fmt: skip
        proto = run_file_args(str(REPO / f"configs/megatron_lm/llama_{size}.yaml"))
        for flag, value in [("--num-layers", layers), ("--pipeline-model-parallel-size", stages),
                            ("--subspace-method", "protocol"), ("--subspace-rank", rank),
                            ("--subspace-update-interval", "500"), ("--hidden-dropout", "0"),
                            ("--subspace-uncompressed-last-layers", "-1")]:  # fmt: skip
            assert proto[proto.index(flag) + 1] == value, (size, flag)


@pytest.mark.parametrize(
    "script",
    [
        "scripts/pretrain_gpt_ext.sh",
        "scripts/slurm/pretrain_gpt_ext.sbatch",
        "scripts/reproduce/separate_gpt2_345m.sh",
        "scripts/reproduce/radius_gpt.sh",
        "scripts/reproduce/aqsgd_gpt2_1.5b.sh",
        "scripts/reproduce/grass_llama.sh",
        "scripts/reproduce/protocol_models.sh",
    ],
)
def test_launcher_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / script)], check=True)


def test_launcher_script_builds_the_command_from_a_run_file(tmp_path):
    env = {
        **os.environ,
        "MEGATRON_LM_DIR": str(_fake_checkout(tmp_path / "lm")),
        "CONFIG": str(REPO / "configs/megatron_lm/gpt_tiny_separate_cpu.yaml"),
        "CPU": "1",
        "GPUS_PER_NODE": "2",
        "PYTHON": os.sys.executable,
        "DRY_RUN": "1",
    }
    out = subprocess.run(
        ["bash", str(REPO / "scripts/pretrain_gpt_ext.sh"), "--pipeline-model-parallel-size", "2"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "--nproc-per-node 2" in out
    assert "-m megatron_ext pretrain --cpu" in out and "pretrain_gpt.py --num-layers 2" in out
    assert out.strip().endswith("--grad-compression separate --pipeline-model-parallel-size 2")


# -- with a Megatron-LM checkout ---------------------------------------------------------------


@pytest.fixture
def checkout_copy(tmp_path):
    """pretrain_gpt.py and package_info.py of MEGATRON_LM_DIR, copied (never edit the original)."""
    source = Path(os.environ["MEGATRON_LM_DIR"])
    copy = tmp_path / "Megatron-LM"
    (copy / "megatron" / "core").mkdir(parents=True)
    shutil.copy2(source / "pretrain_gpt.py", copy / "pretrain_gpt.py")
    shutil.copy2(source / "megatron/core/package_info.py", copy / "megatron/core/package_info.py")
    return copy


@pytest.mark.megatron_lm
def test_patch_real_pretrain_gpt(checkout_copy, capsys):
    script = checkout_copy / "pretrain_gpt.py"
    release = detect_checkout_release(str(checkout_copy))
    assert file_sha256(str(script)) == release.pretrain_gpt_sha256
    code, out, err = _run_patch(capsys, checkout_copy)
    assert code == 0, err
    assert f"Megatron-LM {release.tag}" in out and "patched pretrain_gpt.py" in out
    text = script.read_text()
    assert text.count("install_megatron_lm_hooks()") == 1
    compile(text, str(script), "exec")
    assert "already patched" in _run_patch(capsys, checkout_copy)[1]
    code, out, _ = _run_patch(capsys, checkout_copy, "--revert")
    assert code == 0 and f"byte-identical to the {release.tag} release file" in out
    assert file_sha256(str(script)) == release.pretrain_gpt_sha256


@pytest.mark.megatron_lm
def test_release_detected_by_fingerprint_without_package_info(checkout_copy):
    tag = detect_checkout_release(str(checkout_copy)).tag
    shutil.rmtree(checkout_copy / "megatron")
    assert detect_checkout_release(str(checkout_copy)).tag == tag
