"""``examples/embed_megatron_core.py``: megatron-ext in a megatron-core loop of your own.

The embedding API of docs/architecture.md (``ExtRuntime.create``, ``transform_model``,
``install``, ``begin_step`` / ``end_step``, ``finish``, and the one-call
``runtime.install``) as a script of megatron-core's own style uses it, on CPU/gloo, on every
supported megatron-core release:

* the script's documented command (torchrun, two data-parallel ranks, SEPARATE): it trains
  (the loss falls), the replicas end with the same weights, and SEPARATE sends a fraction of
  the dense bytes;
* at PP=2 with Protocol Models (a model transform before DDP, and the pipeline codec through
  the schedule's ``p2p_communicator``): it trains, and the pipeline traffic is compressed;
* the one-call ``install`` on an already wrapped model: installs a method without a model
  transform, and refuses one that has a transform, naming its flag.
"""

import importlib.util
import json

from tests.helpers.dist import run_ranks
from tests.helpers.driver import run_command, torchrun_command
from tests.helpers.paths import REPO

EXAMPLE = REPO / "examples" / "embed_megatron_core.py"


def _example():
    spec = importlib.util.spec_from_file_location("embed_megatron_core", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_documented_command_trains_with_separate(tmp_path):
    # The docstring's first command, with --cpu.
    command = torchrun_command([str(EXAMPLE), "--cpu", "--grad-compression", "separate"])
    proc = run_command(command, tmp_path, timeout=600, merge_output=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summaries = _summaries(proc.stdout)
    assert [s["rank"] for s in summaries] == [0, 1], proc.stdout[-4000:]
    assert summaries[0]["weights_sum"] == summaries[1]["weights_sum"], "replicas differ"
    for s in summaries:
        _assert_trains(s["losses"])
        assert 0 < s["sent"] < s["dense_sent"] / 4, s


def _pipeline_rank(rank, world):
    return _example().main(
        ["--cpu", "--pipeline-model-parallel-size", "2", "--subspace-method", "protocol"]
    )


def test_pipeline_and_model_transform():
    summaries = sorted(run_ranks(_pipeline_rank, 2), key=lambda s: s["pp_rank"])
    first, last = summaries
    assert all(loss is None for loss in first["losses"])
    _assert_trains(last["losses"])
    for s in summaries:  # the stage's activations or gradients, compressed
        assert 0 < s["sent"] < s["dense_sent"] / 2, s


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
