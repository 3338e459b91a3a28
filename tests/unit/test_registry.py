"""The method registry is the single source of truth: CLI, fingerprint, construction and
benchmarks all read it, and a new method needs its own module plus one registration."""

import argparse
import dataclasses

import pytest

from megatron_ext.config import (
    ExtConfig,
    add_args,
    ext_config_classes,
    ext_config_from_flags,
    flag_of,
)
from megatron_ext.methods import registry


def _parser():
    return add_args(argparse.ArgumentParser(allow_abbrev=False))


def test_registry_and_cli_agree():
    parser = _parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    for fam in registry.families():
        action = by_flag[fam.flag]
        assert tuple(action.choices) == registry.choices(fam.name)
        assert action.default == "none" and registry.choices(fam.name)[0] == "none"
        for name, method in registry.methods(fam.name).items():
            cfg = ext_config_from_flags([fam.flag, name])
            assert cfg.method(fam.name) == name
            if method.options is not None:
                assert method.options in ext_config_classes()
                for f in dataclasses.fields(method.options):
                    flag = flag_of(method.options, f.name)
                    # A boolean option that defaults to True is given as --no-<flag>.
                    assert flag in by_flag or "--no-" + flag[2:] in by_flag, flag
    # Every flag megatron-ext adds belongs to a family selector or a registered options class.
    known = {fam.flag for fam in registry.families()}
    for cls in ext_config_classes():
        known |= {flag_of(cls, f.name) for f in dataclasses.fields(cls)}
        known |= {"--no-" + flag_of(cls, f.name)[2:] for f in dataclasses.fields(cls)}
    added = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    assert added <= known


def test_registration_errors():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.get("grad", "separate"))
    with pytest.raises(ValueError, match="unknown method family"):
        registry.register(registry.Method("x", "nope", lambda ctx: registry.Components()))


@pytest.fixture
def toy():
    from tests.helpers import toy_method

    registry.register(toy_method.METHOD)
    try:
        yield toy_method
    finally:
        registry.unregister("grad", "halfprec")
    assert "halfprec" not in registry.choices("grad")


def test_a_new_method_is_one_module_and_one_registration(toy, tmp_path):
    import torch

    from megatron_ext.state import StepClock
    from megatron_ext.train import parse_args

    # Selectable from the driver's command line, its options as flags.
    cfg = parse_args(["--grad-compression", "halfprec", "--toy-halfprec-scale", "2"])
    assert cfg.ext.method("grad") == "halfprec"
    assert cfg.ext.options_for(toy.HalfPrecConfig).scale == 2.0
    assert "--toy-halfprec-scale" in _parser().format_help()
    # Fingerprinted: its options shape the checkpointed state's settings.
    settings = cfg.ext.state_settings()
    assert settings["grad_compression"] == "halfprec" and settings["toy_halfprec_scale"] == 2.0
    other = ext_config_from_flags(["--grad-compression", "halfprec"]).state_settings()
    assert other["toy_halfprec_scale"] == 1.0
    # Built through the same factory path the runtime uses.
    components = registry.build_components(cfg.ext, None, clock=StepClock())
    assert isinstance(components["grad"].reducer, toy.HalfPrecReducer)
    assert components["grad"].reducer.cfg.scale == 2.0
    # Benchmarkable: listed, its options flags accepted, its defaults and label used.
    from benchmarks import convergence, step_time

    args = convergence.build_parser().parse_args(["--methods", "none,halfprec"])
    from benchmarks.common import method_choices

    assert "halfprec" in method_choices("grad")  # what --methods defaults to and accepts
    assert "halfprec" in convergence.build_parser().format_help()
    assert convergence.method_flags("halfprec", args) == [
        "--grad-compression",
        "halfprec",
        "--toy-halfprec-scale",
        "0.5",
    ]
    assert convergence.label("halfprec", args) == "halfprec-x0.5"
    sargs = step_time.build_parser().parse_args(["--toy-halfprec-scale", "3"])
    cmd = " ".join(step_time.train_command(sargs, "halfprec", pp=1, iters=5, run_dir=str(tmp_path)))
    assert "--grad-compression halfprec --toy-halfprec-scale 3.0" in cmd
    del torch


def test_ext_config_selects_and_validates():
    from megatron_ext.methods.separate import SeparateConfig

    cfg = ExtConfig.of(grad="separate", options=[SeparateConfig(ratio=8)])
    assert cfg.method("grad") == "separate" and cfg.enabled("grad")
    assert not cfg.enabled("p2p")
    assert cfg.options_for(SeparateConfig).ratio == 8
    assert cfg.state_settings()["separate_ratio"] == 8
    # Settings of methods that are not selected do not enter the fingerprint.
    assert "separate_ratio" not in ExtConfig().state_settings()


def test_method_order_does_not_depend_on_which_module_is_imported_first():
    """``--help``, docs/flags.md and the choices list the built-in methods in BUILTIN's order
    even when a method module is imported before the registry (it used to move that method
    last: Radius after QuantizedAdam)."""
    import subprocess
    import sys

    code = (
        "import megatron_ext.methods.radius, megatron_ext.methods.grass\n"
        "from megatron_ext.methods import registry\n"
        "print(registry.choices('grad'), registry.choices('linear'))"
    )
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    from megatron_ext.methods import registry

    assert first.stdout.strip() == f"{registry.choices('grad')} {registry.choices('linear')}"
    assert registry.choices("grad")[:3] == ("none", "separate", "radius")
