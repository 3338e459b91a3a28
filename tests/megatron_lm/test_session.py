"""Pieces of the Megatron-LM session and hooks, checked without training.

Without a checkout: the log-line decoration, the checkpoint-metadata decision, the
Megatron-LM options megatron-ext refuses. With ``MEGATRON_LM_DIR`` (in a subprocess, so
this test process keeps its own imports): the sample ids megatron-ext computes equal what
Megatron-LM's ``MegatronPretrainingSampler`` yields, and every hook target exists in the
checkout with the parameters the hooks read (and a changed signature is refused).
"""

import argparse
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.megatron.lm import checkpoint as lm_ckpt
from megatron_ext.megatron.lm.arguments import check_megatron_lm_args
from megatron_ext.megatron.lm.releases import RELEASES
from megatron_ext.megatron.lm.session import MegatronLMSession
from megatron_ext.state import ExtState, StateMismatch
from tests.helpers.paths import REPO
from tests.megatron_lm.lm_runs import hook_module, tiny_args


def _session() -> MegatronLMSession:
    return MegatronLMSession(RELEASES["0.16.1"], cpu=True)


def test_bytes_field_is_appended_to_the_iteration_line_only_once():
    session = _session()
    field = " bytes sent/step (all ranks): dp-grad 1.00 KB |"
    session.pending_log_field = field
    # Other prints on the last rank during training_log pass through unchanged.
    assert session.decorate_log_line("Number of parameters: 0.00") == "Number of parameters: 0.00"
    line = " [2026-01-01 00:00:00.0] iteration        2/       4 | consumed samples:   16 |"
    assert session.decorate_log_line(line) == line + field
    assert session.decorate_log_line(line) == line


def _runtime(settings, layout):
    return SimpleNamespace(state=ExtState(settings=settings, layout={**layout, "rank": 0}))


def test_checkpoint_metadata_decides_whether_state_loads(capsys):
    layout = {"tp": 1, "pp": 1, "dp": 2, "world": 2}
    runtime = _runtime({"grad_compression": "separate", "separate_ratio": 16}, layout)
    meta = lm_ckpt.ext_meta(runtime)
    assert meta["layout"] == layout  # the rank is not part of the shared metadata
    assert lm_ckpt.decide_load(meta, runtime, "error", "ckpt/iter_0000002") is True

    other = lm_ckpt.ext_meta(
        _runtime({"grad_compression": "separate", "separate_ratio": 8}, layout)
    )
    with pytest.raises(StateMismatch, match="--ext-state-on-mismatch reset"):
        lm_ckpt.decide_load(other, runtime, "error", "ckpt/iter_0000002")
    with pytest.raises(StateMismatch, match="holds no megatron-ext state"):
        lm_ckpt.decide_load(None, runtime, "error", "ckpt/iter_0000002")
    assert lm_ckpt.decide_load(other, runtime, "reset", "ckpt/iter_0000002") is False
    assert "megatron-ext: WARNING:" in capsys.readouterr().out


def test_rank_files_and_iteration_dirs(tmp_path):
    assert lm_ckpt.rank_file("ck/iter_0000004", 3) == "ck/iter_0000004/megatron_ext/rank_00003.pt"
    (tmp_path / "iter_0000004").mkdir()
    assert lm_ckpt.iteration_dir_of(str(tmp_path / "iter_0000004")) == str(
        tmp_path / "iter_0000004"
    )
    legacy = tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    assert lm_ckpt.iteration_dir_of(str(legacy)) == str(tmp_path / "iter_0000004")


def _megatron_args(**overrides):
    base = dict(
        save="ckpt",
        load=None,
        ckpt_format="torch_dist",
        non_persistent_save_interval=None,
        cuda_graph_impl="none",
        cuda_graph_scope=[],
        use_torch_fsdp2=False,
        use_megatron_fsdp=False,
        dataloader_type="single",
        # Megatron-LM's defaults, on the local spec in fp32 (no fused softmax then).
        transformer_impl="local",
        fp16=False,
        bf16=False,
        masked_softmax_fusion=True,
        gradient_accumulation_fusion=False,
    )
    return argparse.Namespace(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"ckpt_format": "torch_dcp"}, "--ckpt-format"),
        ({"non_persistent_save_interval": 100}, "--non-persistent-save-interval"),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["CudaGraphScope.full_iteration"]},
            "--cuda-graph-impl",
        ),
        ({"use_megatron_fsdp": True}, "--use-megatron-fsdp"),
    ],
)
def test_megatron_lm_options_the_hooks_cannot_serve_are_refused(overrides, flag):
    check_megatron_lm_args(_megatron_args(), ExtConfig())
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**overrides), ExtConfig())
    assert info.value.flags[0] == flag


def _apex_missing(*modules):
    import importlib.util

    return all(importlib.util.find_spec(m) is None for m in modules)


@pytest.mark.skipif(
    not _apex_missing("scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda"),
    reason="Apex's CUDA extensions are installed here",
)
@pytest.mark.parametrize(
    "overrides, flags",
    [
        ({"bf16": True}, ("--no-masked-softmax-fusion", "--transformer-impl")),
        ({"fp16": True}, ("--no-masked-softmax-fusion", "--transformer-impl")),
        (
            {"gradient_accumulation_fusion": True},
            ("--no-gradient-accumulation-fusion", "--transformer-impl"),
        ),
        (
            {"bf16": True, "gradient_accumulation_fusion": True},
            (
                "--no-masked-softmax-fusion",
                "--no-gradient-accumulation-fusion",
                "--transformer-impl",
            ),
        ),
    ],
)
def test_local_spec_without_apex_is_refused_naming_the_flags(overrides, flags):
    """The local spec's fused softmax (fp16/bf16) and fused wgrad accumulation import
    Apex's extensions after start-up; without them the run is refused up front."""
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**overrides), ExtConfig())
    assert info.value.flags == flags
    assert "not importable" in str(info.value)
    # The flags named, or Transformer Engine's layers, avoid the extensions.
    off = {"masked_softmax_fusion": False, "gradient_accumulation_fusion": False}
    check_megatron_lm_args(_megatron_args(**{**overrides, **off}), ExtConfig())
    te = {**overrides, "transformer_impl": "transformer_engine"}
    check_megatron_lm_args(_megatron_args(**te), ExtConfig())


def test_huggingface_tokenizer_without_transformers_is_refused_naming_the_extra(monkeypatch):
    # Megatron-LM imports transformers only when it builds the tokenizer, after start-up
    # (configs/megatron_lm/llama_8b_protocol_64gpu.yaml uses it).
    from megatron_ext.megatron.lm import requirements

    args = _megatron_args(tokenizer_type="HuggingFaceTokenizer")
    real = requirements.importlib.util.find_spec
    monkeypatch.setattr(
        requirements.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(args, ExtConfig())
    assert info.value.flags == ("--tokenizer-type",)
    assert "pip install 'megatron-ext[hf]'" in str(info.value)
    monkeypatch.setattr(requirements.importlib.util, "find_spec", real)
    check_megatron_lm_args(_megatron_args(tokenizer_type="GPT2BPETokenizer"), ExtConfig())


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_grass_refuses_cuda_graphs(impl):
    from megatron_ext.config import ext_config_from_flags

    cfg = ext_config_from_flags(["--grass-method", "topr"])
    check_megatron_lm_args(_megatron_args(), cfg)
    graphs = {"cuda_graph_impl": impl, "cuda_graph_scope": ["CudaGraphScope.attn"]}
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**graphs), cfg)
    assert info.value.flags == ("--cuda-graph-impl", "--grass-method")
    check_megatron_lm_args(_megatron_args(**graphs), ExtConfig())  # without Grass: fine


def test_tp_comm_overlap_needs_accounting_off():
    """TE userbuffer traffic bypasses torch.distributed: the byte report cannot include it."""
    from megatron_ext.config import ext_config_from_flags

    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(tp_comm_overlap=True), ExtConfig())
    assert info.value.flags == ("--tp-comm-overlap", "--no-comm-accounting")
    quiet = ext_config_from_flags(["--no-comm-accounting"])
    check_megatron_lm_args(_megatron_args(tp_comm_overlap=True), quiet)


@pytest.mark.parametrize(
    "attr, flag",
    [
        ("use_precision_aware_optimizer", "--use-precision-aware-optimizer"),
        ("optimizer_cpu_offload", "--optimizer-cpu-offload"),
    ],
)
def test_radius_refuses_optimizers_that_hide_its_moments(attr, flag):
    """Radius selects from the fp32 Adam moments and master weights; TE's precision-aware
    FusedAdam keeps scaled low-precision moments, and the CPU offload wrapper hides the
    AdamW mode (weight decay was dropped from the selection)."""
    from megatron_ext.config import ext_config_from_flags

    cfg = ext_config_from_flags(["--grad-compression", "radius"])
    check_megatron_lm_args(_megatron_args(), cfg)
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**{attr: True}), cfg)
    assert info.value.flags == ("--grad-compression", flag)
    check_megatron_lm_args(_megatron_args(**{attr: True}), ExtConfig())  # other methods: fine


def test_aqsgd_needs_fixed_samples_in_megatron_lm_naming_the_flag():
    from megatron_ext.config import ext_config_from_flags

    cfg = ext_config_from_flags(["--p2p-compression", "aqsgd"])
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(), cfg)
    assert info.value.flags == ("--p2p-compression", "--fixed-samples")
    fixed = dict(
        fixed_samples=64, data_parallel_size=2, micro_batch_size=2, global_batch_size=16, seed=1
    )
    check_megatron_lm_args(_megatron_args(**fixed), cfg)


@pytest.mark.parametrize(
    "overrides, flag, named",
    [
        ({"optimizer": "sgd"}, "--optimizer", "--optimizer sgd"),
        ({"optimizer": "muon"}, "--optimizer", "--optimizer muon"),
        ({"optimizer": "dist_muon"}, "--optimizer", "--optimizer dist_muon"),
        ({"optimizer": "lion"}, "--optimizer", "--optimizer lion"),  # 0.19
        ({"optimizer": "soap"}, "--optimizer", "--optimizer soap"),  # 0.19
        ({"decoupled_weight_decay": False}, "decoupled_weight_decay", "=False"),
        (
            {"decoupled_weight_decay": False, "yaml_cfg": "run.yaml"},
            "--yaml-cfg",
            "decoupled_weight_decay=False",
        ),
        ({"use_precision_aware_optimizer": True}, "--use-precision-aware-optimizer", "fp32"),
        ({"optimizer_cpu_offload": True}, "--optimizer-cpu-offload", "host"),
    ],
)
def test_grass_refuses_every_optimizer_but_decoupled_adamw(overrides, flag, named):
    """Grass's update, decay, bias correction and moment carrying are AdamW's."""
    from megatron_ext.config import ext_config_from_flags

    cfg = ext_config_from_flags(["--grass-method", "topr", "--no-grass-reset-state"])
    check_megatron_lm_args(_megatron_args(optimizer="adam"), cfg)
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**overrides), cfg)
    assert info.value.flags == ("--grass-method", flag)
    assert named in str(info.value)
    if "optimizer" in overrides:  # without Grass: not ours to refuse
        check_megatron_lm_args(_megatron_args(**overrides), ExtConfig())


@pytest.mark.parametrize("flag", ["use_cpu_initialization", "init_model_with_meta_device"])
def test_grass_refuses_weights_off_the_gpu_while_the_model_is_built(monkeypatch, flag):
    # Grass adds its parameters and rows inside the model provider, on the weights' device;
    # on a GPU machine these flags leave the weights elsewhere until later.
    from megatron_ext.config import ext_config_from_flags

    cfg = ext_config_from_flags(["--grass-method", "topr"])
    check_megatron_lm_args(_megatron_args(**{flag: True}), cfg)  # CPU execution: fine
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    check_megatron_lm_args(_megatron_args(), cfg)
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**{flag: True}), cfg)
    assert info.value.flags == ("--grass-method", "--" + flag.replace("_", "-"))


@pytest.mark.parametrize(
    "overrides, flags",
    [
        ({"fixed_samples": 0}, ("--fixed-samples",)),
        ({"fixed_samples": 1}, ("--fixed-samples",)),  # fewer than the DP ranks
        ({"fixed_samples": 14}, ("--fixed-samples", "--global-batch-size")),  # < one step
        ({"dataloader_type": "cyclic"}, ("--fixed-samples", "--dataloader-type")),
    ],
)
def test_bad_fixed_samples_are_refused_naming_the_flag(overrides, flags):
    base = dict(
        fixed_samples=64, data_parallel_size=2, micro_batch_size=2, global_batch_size=16, seed=1
    )
    with pytest.raises(ConfigError) as info:
        check_megatron_lm_args(_megatron_args(**{**base, **overrides}), ExtConfig())
    assert info.value.flags == flags


def test_codecs_without_sample_state_take_any_sampler():
    from megatron_ext.config import ext_config_from_flags

    cfg = ext_config_from_flags(["--p2p-compression", "directq"])
    check_megatron_lm_args(_megatron_args(dataloader_type="cyclic"), cfg)
    # Only the single sampler determines sample ids (what a sample-keyed codec would need).
    assert _session()._sample_ids(SimpleNamespace(dataloader_type="cyclic")) is None


def _run_with_checkout(code: str) -> str:
    """Run ``code`` with the checkout's megatron.training importable (the Python shims of its
    release, the triton stand-ins). ``hooks`` is the release's hook module."""
    prelude = textwrap.dedent(f"""
        import sys
        sys.path.append({os.environ["MEGATRON_LM_DIR"]!r})
        sys.path.insert(0, {str(REPO)!r})
        import importlib
        from megatron_ext.megatron.lm.compat import apply_python_shims
        from megatron_ext.megatron.lm.cpu import register_triton_stand_ins
        from megatron_ext.megatron.lm.releases import detect_checkout_release

        release = detect_checkout_release({os.environ["MEGATRON_LM_DIR"]!r})
        apply_python_shims(release.requires_python)
        register_triton_stand_ins()
        hooks = importlib.import_module(release.hooks.split(":")[0])
        """)
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.megatron_lm
def test_sample_ids_equal_megatron_pretraining_sampler():
    out = _run_with_checkout("""
        from megatron.training.datasets.data_samplers import MegatronPretrainingSampler
        from megatron_ext.megatron.data import sample_indices

        checked = 0
        for mbs, dp, consumed in [(2, 2, 0), (2, 2, 8), (3, 4, 24), (1, 8, 40), (4, 1, 12)]:
            for dp_rank in range(dp):
                sampler = MegatronPretrainingSampler(1000, consumed, mbs, dp_rank, dp)
                for microbatch, batch in zip(range(6), iter(sampler)):
                    ours = sample_indices(consumed, microbatch, mbs, dp_rank, dp).tolist()
                    assert ours == list(batch), (mbs, dp, consumed, dp_rank, microbatch)
                    checked += 1
        print("checked", checked)
        """)
    assert "checked 102" in out  # 6 microbatches x 17 (layout, DP rank) pairs


@pytest.mark.megatron_lm
def test_fixed_sample_loader_yields_the_ids_the_stages_compute():
    """Megatron-LM's data iterator (our batch sampler in its DataLoader) and the ids the
    pipeline stages compute from consumed samples agree, across epochs and resumes."""
    out = _run_with_checkout("""
        import torch
        from megatron_ext.megatron.data import FixedSampleBatchSampler, fixed_sample_sampler

        checked = 0
        for mbs, dp, nmb, n, consumed in [(2, 2, 2, 16, 0), (2, 2, 2, 16, 24), (3, 1, 2, 12, 6)]:
            for rank in range(dp):
                sampler = fixed_sample_sampler(n, mbs, nmb, rank, dp, seed=5)
                loader = torch.utils.data.DataLoader(
                    list(range(100)), batch_sampler=FixedSampleBatchSampler(sampler, consumed)
                )
                seen = []
                for microbatch, batch in zip(range(3 * n // (mbs * dp)), loader):
                    expect = sampler.indices(consumed, microbatch).tolist()
                    assert batch.tolist() == expect, (mbs, dp, rank, microbatch)
                    seen += expect
                    checked += 1
                if consumed % n == 0:
                    # Three epochs over this rank's fixed samples, each sample once per epoch.
                    assert sorted(seen) == sorted(sampler.local_ids().tolist() * 3)
        print("checked", checked)
        """)
    assert "checked 60" in out


@pytest.mark.megatron_lm
def test_hook_targets_exist_and_a_changed_signature_is_refused():
    out = _run_with_checkout("""
        from megatron_ext.megatron.lm.releases import UnsupportedReleaseError

        checked = hooks._check_targets()
        print("targets", len(checked), "of", len(hooks.HOOK_TARGETS))
        import megatron.training.training as training

        training.train_step = lambda forward_step_func, data_iterator: None
        try:
            hooks._check_targets()
        except UnsupportedReleaseError as exc:
            print("refused:", exc)
        """)
    n = len(hook_module().HOOK_TARGETS)
    assert f"targets {n} of {n}" in out
    assert "refused: megatron.training.training.train_step" in out and "lacks ['iteration'" in out


def test_dataset_helpers_build_is_skipped_when_built_and_explained_when_impossible(monkeypatch):
    import importlib

    from megatron_ext.megatron.lm import cpu as lm_cpu

    # The installed megatron-core wheel ships helpers_cpp: nothing to build, no make run.
    monkeypatch.setattr(lm_cpu.subprocess, "run", lambda *a, **k: pytest.fail("ran make"))
    lm_cpu._compile_helpers()

    real_import = importlib.import_module

    def no_helpers(name, *args, **kwargs):
        if name.endswith("helpers_cpp"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(lm_cpu.importlib, "import_module", no_helpers)
    monkeypatch.setitem(sys.modules, "pybind11", None)  # "not installed"
    with pytest.raises(RuntimeError, match="pip install pybind11"):
        lm_cpu._compile_helpers()


@pytest.mark.megatron_lm
def test_install_then_remove_restores_megatron_lm():
    out = _run_with_checkout("""
        import megatron.training.training as training
        import megatron.training.checkpointing as checkpointing
        from megatron_ext.megatron.lm import install_megatron_lm_hooks, installed_hooks

        before = (training.train_step, training.initialize_megatron, checkpointing.generate_state_dict)
        hooks = install_megatron_lm_hooks(cpu=True)
        assert install_megatron_lm_hooks(cpu=True) is hooks  # idempotent
        assert training.train_step.__megatron_ext_hook__
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
        hooks.remove()
        after = (training.train_step, training.initialize_megatron, checkpointing.generate_state_dict)
        assert after == before and installed_hooks() is None
        print("restored", len(hooks.session.hook_names))
        """)
    assert f"restored {len(hook_module().HOOK_TARGETS)}" in out


def _without(args, flag):
    """``args`` without ``flag`` and its value."""
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


# name: (world size, pretrain_gpt.py arguments, what the refusal line holds)
_REFUSALS = {
    "separate-ratio": (
        1,
        tiny_args(separate_ratio="7"),
        ["--separate-ratio, --separate-block-size: ratio 7 must divide the block size 256"],
    ),
    # Grass's update is decoupled AdamW's: SGD's momentum would survive reselections and
    # its weight decay would act on V, the change since the selection.
    "grass-sgd": (
        1,
        tiny_args(grad_compression="none", grass_method="norm2", grass_rank="8", optimizer="sgd"),
        ["--grass-method, --optimizer:", "got --optimizer sgd"],
    ),
    "aqsgd-without-fixed-samples": (
        2,
        tiny_args(p2p_compression="aqsgd", pipeline_model_parallel_size="2"),
        ["--p2p-compression, --fixed-samples:"],
    ),
    # A patched pretrain_gpt.py has no launcher to check it before Megatron-LM parses.
    "no-eval-interval": (2, _without(tiny_args(), "--eval-interval"), ["--eval-interval: "]),
    # Megatron-LM's validate_args would stop it with a bare AssertionError.
    "save-without-interval": (1, tiny_args(save="TMP/ckpt"), ["--save-interval: "]),
    # Megatron-LM's own flags through megatron-ext's range table (the driver's), before
    # Megatron-LM's validate_args: an Adam beta of 2 reached torch's optimizer as a worker
    # traceback, a NaN learning rate Megatron-LM's assertion min_lr <= lr.
    "adam-beta1": (
        1,
        tiny_args(adam_beta1="2"),
        ["--adam-beta1: must be a finite number in [0, 1)"],
    ),
    "lr-nan": (1, tiny_args(lr="nan"), ["--lr: must be a finite number > 0, got nan"]),
    # Megatron-LM's own parser: one line, without its ~700-line usage.
    "lr-typo": (1, tiny_args(lr="1e-3x"), ["argument --lr: invalid float value: '1e-3x'"]),
    # Schedules against --train-iters: no outer step at all; megatron-core's assertion in its
    # learning-rate scheduler at the first step.
    "diloco-interval": (
        2,
        tiny_args(outer_method="diloco", outer_interval="50", train_iters="20"),
        ["--outer-interval, --train-iters: DiLoCo's first outer step comes after 50"],
    ),
    "warm-up": (
        1,
        tiny_args(lr_warmup_iters="20", train_iters="20"),
        ["--lr-warmup-iters, --train-iters:"],
    ),
    # TMP/finished: a --save directory whose tracker says iteration 4 (made by the test).
    "finished-load": (
        1,
        tiny_args(load="TMP/finished", train_iters="4"),
        ["--load, --train-iters: TMP/finished holds a finished run (iteration 4"],
    ),
}


@pytest.mark.megatron_lm
def test_refusals_through_megatron_lm_parser_and_hooked_validate_args(tmp_path):
    """Each refusal as a launch of a patched pretrain_gpt.py meets it: Megatron-LM's own
    parser (with megatron-ext's flags added by the hooked ``parse_args``) and its
    ``validate_args``, whose hook checks megatron-ext's configuration and exits with code 2
    and one ``megatron-ext: error:`` line. One process for every case (a launch each would
    cost a Megatron-LM start-up each), as a torchrun worker: the line goes to the worker's
    error file, not to stderr (where torchrun's summary would bury it), and is in the last
    lines of torchrun's summary (rendered by torch's own formatter). Launches under torchrun
    are in test_pretrain_gpt.py and test_patch_and_launcher.py."""
    from tests.helpers.refusal import assert_cause_last, torchrun_summary

    (tmp_path / "finished").mkdir()
    (tmp_path / "finished" / "latest_checkpointed_iteration.txt").write_text("4")
    here = {"TMP": str(tmp_path)}
    cases = {
        name: (world, [a.replace("TMP", here["TMP"]) for a in argv])
        for name, (world, argv, _) in _REFUSALS.items()
    }
    out = _run_with_checkout(f"""
        import contextlib, io, json, os
        from megatron_ext.megatron.lm import install_megatron_lm_hooks

        installed = install_megatron_lm_hooks(cpu=True)
        call = {{
            t.role: getattr(importlib.import_module(t.module), t.name)
            for t in hooks.HOOK_TARGETS
            if t.role in ("parse_args", "validate_args")
        }}
        for name, (world, argv) in {cases!r}.items():
            os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
            os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join({str(tmp_path)!r}, name)
            sys.argv = ["pretrain_gpt.py", *argv]
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    args = call["parse_args"](None, False)
                    # pretrain_gpt.py's defaults
                    call["validate_args"](args, {{"tokenizer_type": "GPT2BPETokenizer"}})
                result = "passed"
            except SystemExit as exc:
                result = f"exit {{exc.code}}"
            errors = [l for l in err.getvalue().splitlines() if "error:" in l]
            print("@@ " + json.dumps([name, result, errors]))
        installed.remove()
        """)
    results = {}
    for line in out.splitlines():
        if line.startswith("@@ "):
            name, result, errors = json.loads(line[3:])
            results[name] = (result, errors)
    assert sorted(results) == sorted(_REFUSALS), out[-3000:]
    for name, (_, _, expected) in _REFUSALS.items():
        result, errors = results[name]
        error_file = tmp_path / name
        assert result == "exit 2", (name, result, errors)
        assert not errors, (name, errors)
        last = json.loads(error_file.read_text())["message"]["message"]
        assert last.startswith(("megatron-ext: error: ", "pretrain_gpt.py: error: ")), (name, last)
        expected = [text.replace("TMP", here["TMP"]) for text in expected]
        for text in expected:
            assert text in last, (name, last)
        assert_cause_last(torchrun_summary(str(error_file)), expected[-1])
