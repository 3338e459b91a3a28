"""``megatron-ext train`` argument handling: presets, run files, validation, exit codes.

Everything here fails before any process group exists (pure parsing and layout checks).
"""

import pytest
import torch

from megatron_ext.config import ConfigError
from megatron_ext.train import main, parse_args
from megatron_ext.train_config import layout_sizes


def test_model_preset_sets_defaults_and_flags_override():
    cfg = parse_args(["--cpu", "--model", "gpt-tiny"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (4, 256, 128)
    assert cfg.data.vocab_size == 8192
    cfg = parse_args(["--cpu", "--model", "gpt-tiny", "--num-layers", "2"])
    assert cfg.model.num_layers == 2


def test_llama_preset():
    cfg = parse_args(["--cpu", "--model", "llama-tiny"])
    m = cfg.model
    assert m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"
    assert m.group_query_attention and m.num_query_groups == 2
    assert m.untie_embeddings_and_output_weights and m.disable_bias_linear


@pytest.mark.parametrize(
    "name", ["gpt2-345m", "gpt-2.0b", "llama-60m", "llama-350m", "llama-1b", "llama-7b"]
)
def test_paper_presets_parse(name):
    cfg = parse_args(["--model", name])
    assert cfg.model.hidden_size % cfg.model.num_attention_heads == 0


def test_run_file_names_a_model_and_cli_wins(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("model: gpt-tiny\ntrain-iters: 17\nlr: 0.002\n")
    cfg = parse_args(["--config", str(run), "--lr", "0.003"])
    assert cfg.model.num_layers == 4
    assert cfg.training.train_iters == 17
    assert cfg.training.lr == 0.003


def test_run_file_with_unknown_key_names_the_flag(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("num_layerz: 3\n")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", str(run)])
    assert str(exc.value).startswith("--config:") and "num_layerz" in str(exc.value)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError) as exc:
        parse_args(["--model", "gpt-huge"])
    assert str(exc.value).startswith("--model:") and "gpt-tiny" in str(exc.value)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--hidden-size", "100", "--num-attention-heads", "3"], "--hidden-size"),
        (["--train-iters", "5", "--lr-warmup-iters", "5"], "--lr-warmup-iters"),
        (["--overlap-param-gather"], "--overlap-param-gather"),
        (["--save-interval", "10"], "--save-interval"),
        (["--micro-batch-size", "0"], "--micro-batch-size"),
        (["--group-query-attention"], "--num-query-groups"),
        (["--hidden-dropout", "1.5"], "--hidden-dropout"),
        (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
        (["--grass-method", "topr", "--grass-rank", "0"], "--grass-rank"),
        (["--grass-method", "norm2", "--grass-scale", "0"], "--grass-scale"),
        (["--grass-method", "topr", "--grass-sketch-size", "-1"], "--grass-sketch-size"),
        (
            ["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"],
            "--override-opt-param-scheduler, --use-checkpoint-opt-param-scheduler",
        ),
    ],
)
def test_invalid_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as exc:
        parse_args(["--cpu"] + argv)
    assert str(exc.value).startswith(flag), str(exc.value)


@pytest.mark.parametrize(
    "argv, world, flag",
    [
        (["--tensor-model-parallel-size", "3"], 2, "--tensor-model-parallel-size"),
        (["--global-batch-size", "6", "--micro-batch-size", "4"], 2, "--global-batch-size"),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2, "--num-layers"),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--num-attention-heads",
                "3",
                "--hidden-size",
                "96",
            ],
            2,
            "--num-attention-heads",
        ),
    ],
)
def test_layout_errors_name_the_flags(argv, world, flag):
    cfg = parse_args(["--cpu"] + argv)
    with pytest.raises(ConfigError) as exc:
        layout_sizes(cfg, world)
    assert str(exc.value).startswith(flag), str(exc.value)


def test_layout_sizes():
    cfg = parse_args(
        [
            "--cpu",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "16",
            "--pipeline-model-parallel-size",
            "2",
        ]
    )
    sizes = layout_sizes(cfg, 4)
    assert sizes == {"tp": 1, "pp": 2, "dp": 2, "gbs": 16, "num_microbatches": 4}


def test_main_exits_2_with_a_message_naming_the_flag(capsys):
    assert main(["--cpu", "--lr-warmup-iters", "500", "--train-iters", "10"]) == 2
    err = capsys.readouterr().err
    assert "--lr-warmup-iters" in err and "error" in err
    with pytest.raises(SystemExit) as exc:
        main(["--grad-compression", "nope"])
    assert exc.value.code == 2
    assert "--grad-compression" in capsys.readouterr().err


def test_main_without_cuda_and_without_cpu_flag_explains(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--train-iters", "20"]) == 2
    assert "--cpu" in capsys.readouterr().err


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("scaled_masked_softmax_cuda") is not None,
    reason="Apex's fused softmax extension is installed here",
)
def test_local_spec_bf16_without_apex_softmax_is_refused_before_start_up(monkeypatch):
    """The local spec fuses the masked softmax of bf16 attention through Apex's extension,
    imported at the first forward; without it the driver refuses at parse time."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as exc:
        parse_args(["--bf16", "--no-persist-layer-norm"])
    assert exc.value.flags == ("--no-masked-softmax-fusion", "--transformer-impl")
    assert "scaled_masked_softmax_cuda" in str(exc.value)
    cfg = parse_args(["--bf16", "--no-masked-softmax-fusion", "--no-persist-layer-norm"])
    assert cfg.model.masked_softmax_fusion is False
    parse_args(["--bf16", "--cpu"])  # CPU runs never fuse
    te = ["--bf16", "--transformer-impl", "transformer_engine"]
    if __import__("importlib").util.find_spec("transformer_engine") is not None:
        parse_args(te)  # the TE spec needs no Apex kernel
    else:  # ... but Transformer Engine itself
        with pytest.raises(ConfigError, match="^--transformer-impl: transformer_engine needs"):
            parse_args(te)
    parse_args(["--no-persist-layer-norm"])  # fp32 attention takes the unfused softmax


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("apex") is not None, reason="Apex is installed here"
)
def test_persist_layer_norm_without_apex_is_refused_naming_the_flag(monkeypatch):
    """Without Apex the local spec builds torch's norm, which asserts persist_layer_norm off
    at model build (seen on an H100); the driver refuses at parse time instead, with every
    missing kernel's flag in one message (on a machine with CUDA: without, the refusal names
    --cpu)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as exc:
        parse_args([])
    assert exc.value.flags == ("--no-persist-layer-norm", "--transformer-impl")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--bf16"])
    assert exc.value.flags == (
        "--no-masked-softmax-fusion",
        "--no-persist-layer-norm",
        "--transformer-impl",
    )
    assert parse_args(["--no-persist-layer-norm"]).model.persist_layer_norm is False
    parse_args(["--cpu"])  # CPU runs never persist


@pytest.mark.parametrize(
    "spelling", ["--override-opt-param-scheduler", "--override-opt_param-scheduler"]
)
def test_scheduler_flags_take_megatron_lm_spellings(spelling):
    cfg = parse_args(["--cpu", spelling])
    assert cfg.training.override_opt_param_scheduler
    assert not cfg.training.use_checkpoint_opt_param_scheduler
    cfg = parse_args(["--cpu", "--use-checkpoint-opt_param-scheduler"])
    assert cfg.training.use_checkpoint_opt_param_scheduler
