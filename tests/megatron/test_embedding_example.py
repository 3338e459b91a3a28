"""``examples/embed_megatron_core.py``: megatron-ext in a megatron-core loop of your own.

The embedding API of docs/architecture.md (``ExtRuntime.create``, ``transform_model``,
``install``, ``begin_step`` / ``end_step``, ``finish``, and the one-call
``runtime.install``) as a script of megatron-core's own style uses it, on CPU/gloo, on every
supported megatron-core release:

* every command of the script's docstring, as written (``--cpu`` added where it is not):
  the first under torchrun (two data-parallel ranks, SEPARATE: the replicas end with the same
  weights, SEPARATE sends a fraction of the dense bytes), the others on two ranks of the
  tests' launcher (Grass: a model transform before DDP; Protocol Models at PP=2: a model
  transform and the pipeline codec through the schedule's ``p2p_communicator``, the pipeline
  traffic compressed); each trains (the loss falls on the last stage);
* the one-call ``install`` on an already wrapped model: installs a method without a model
  transform, and refuses one that has a transform, naming its flag.
"""

import ast
import importlib.util
import json
import shlex

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.driver import run_command, torchrun_command
from tests.helpers.paths import REPO

EXAMPLE = REPO / "examples" / "embed_megatron_core.py"


def _example():
    spec = importlib.util.spec_from_file_location("embed_megatron_core", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented_commands():
    """The argument lists of the docstring's ``torchrun ... embed_megatron_core.py ARGS``."""
    text = ast.get_docstring(ast.parse(EXAMPLE.read_text())).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.strip().startswith("torchrun "):
            words = shlex.split(line)
            args = words[words.index("examples/embed_megatron_core.py") + 1 :]
            commands.append(args if "--cpu" in args else ["--cpu", *args])
    return commands


COMMANDS = _documented_commands()


def _summaries(output):
    return sorted(
        (
            json.loads(line.split("SUMMARY ", 1)[1])
            for line in output.splitlines()
            if "SUMMARY" in line
        ),
        key=lambda s: s["rank"],
    )


def _assert_trains(losses):
    assert losses[0] - sum(losses[-2:]) / 2 > 0.05, f"the loss did not fall: {losses}"


def test_the_documented_commands_are_the_tested_ones():
    assert COMMANDS[0] == ["--cpu", "--grad-compression", "separate"], COMMANDS
    assert [c[1:3] for c in COMMANDS[1:]] == [
        ["--grass-method", "topr"],
        ["--pipeline-model-parallel-size", "2"],
    ], COMMANDS


# release_covered: torchrun's launch and SEPARATE through megatron-core's DDP are
# megatron-ext's own and run on every release elsewhere (tests/megatron/
# test_grad_compression.py); the example's use of the API runs on every release in the
# tests below, so this launch runs once, in the main pass.
@pytest.mark.release_covered
def test_documented_command_trains_with_separate(tmp_path):
    command = torchrun_command([str(EXAMPLE), *COMMANDS[0]])
    proc = run_command(command, tmp_path, timeout=600, merge_output=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summaries = _summaries(proc.stdout)
    assert [s["rank"] for s in summaries] == [0, 1], proc.stdout[-4000:]
    assert summaries[0]["weights_sum"] == summaries[1]["weights_sum"], "replicas differ"
    for s in summaries:
        _assert_trains(s["losses"])
        assert 0 < s["sent"] < s["dense_sent"] / 4, s


def _main_rank(rank, world, args):
    return _example().main(args)


@pytest.mark.parametrize("args", COMMANDS[1:], ids=lambda args: args[1].lstrip("-"))
def test_documented_command_with_a_model_transform(args):
    summaries = sorted(run_ranks(_main_rank, 2, args), key=lambda s: s["rank"])
    if "--pipeline-model-parallel-size" in args:
        first, last = sorted(summaries, key=lambda s: s["pp_rank"])
        assert all(loss is None for loss in first["losses"])
        _assert_trains(last["losses"])
        for s in summaries:  # the stage's activations or gradients, compressed
            assert 0 < s["sent"] < s["dense_sent"] / 2, s
    else:  # Grass at DP=2: the replicas agree
        assert summaries[0]["weights_sum"] == summaries[1]["weights_sum"], summaries
        for s in summaries:
            _assert_trains(s["losses"])


def _one_call_rank(rank, world):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.config import ConfigError, ext_config_from_flags
    from megatron_ext.megatron.runtime import ExtRuntime, install

    example = _example()
    args = example.parse_args(["--cpu"])
    example.initialize(args)
    model = example.build_model(args)
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    try:
        install(
            ext_config_from_flags(["--grass-method", "topr", "--grass-rank", "16"]),
            model_chunks=[model],
            optimizer=optimizer,
            model_config=model.config,
        )
    except ConfigError as e:
        refusal = str(e)
    else:
        refusal = None
    runtime = install(
        ext_config_from_flags(["--grad-compression", "separate"]),
        model_chunks=[model],
        optimizer=optimizer,
        model_config=model.config,
    )
    assert isinstance(runtime, ExtRuntime) and runtime.reducer is not None
    runtime.remove()
    torch.distributed.destroy_process_group()
    return refusal


def test_one_call_install_refuses_a_model_transform():
    refusals = run_ranks(_one_call_rank, 2)
    for refusal in refusals:
        assert refusal is not None and refusal.startswith("--grass-method"), refusal
        assert "already wrapped" in refusal
