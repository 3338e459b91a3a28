"""``--check-weight-hash-across-dp-replicas-interval`` on the driver, with every method.

Megatron-LM's check (megatron-core's ``check_param_hashes_across_dp_replicas``, cross-check
over the data-parallel group) runs before the first iteration and every N iterations of
``Trainer.run``. Each method trains 4 iterations on 2 data-parallel replicas (PP=2 methods:
4 ranks) with the check every 2 iterations: the compressed reductions and the subspace /
pipeline codecs must leave the replicas bit-identical. Then, as a negative control, one
replica's weight is perturbed in-process and the same check must stop, naming the
parameter on that replica.
"""

import contextlib
import io

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import teardown

PP2 = ["--pipeline-model-parallel-size", "2"]

METHODS = {
    "separate": (2, ["--grad-compression", "separate"]),
    "separate-distopt-overlap": (
        2,
        ["--grad-compression", "separate", "--use-distributed-optimizer"]
        + ["--overlap-grad-reduce", "--overlap-param-gather"],
    ),
    "radius": (2, ["--grad-compression", "radius"]),
    "powersgd": (2, ["--grad-compression", "powersgd", "--powersgd-start-step", "0"]),
    "quantized": (2, ["--grad-compression", "quantized"]),
    "grass-topr": (2, ["--grass-method", "topr", "--grass-rank", "8"]),
    "aqsgd-pp2": (
        4,
        PP2 + ["--p2p-compression", "aqsgd", "--fixed-samples", "16", "--global-batch-size", "8"],
    ),
    "protocol-pp2": (
        4,
        PP2 + ["--subspace-method", "protocol", "--subspace-rank", "8"]
        + ["--subspace-update-interval", "2", "--subspace-lr", "0.5"],
    ),
}  # fmt: skip

CHECK = ["--check-weight-hash-across-dp-replicas-interval", "2", "--train-iters", "4"]


def _train_then_perturb(rank, world_size, flags, cwd):
    import os

    import torch
    from megatron.core import parallel_state as ps

    from megatron_ext.train import Trainer, parse_args
    from tests.helpers.mcore import TINY

    os.chdir(cwd)  # the driver writes its report into the working directory
    trainer = Trainer(parse_args(list(TINY) + flags))
    trainer.setup_distributed()
    trainer.build_data()
    trainer.build_model()
    trainer.build_optimizer()
    trainer.install_ext()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.run()
    matches = [l for l in out.getvalue().splitlines() if l.startswith(">>> Weight hashes match")]
    # Negative control: data-parallel rank 1 changes one element of its first parameter.
    name, param = next(iter(trainer.model[0].named_parameters()))
    if ps.get_data_parallel_rank() == 1:
        with torch.no_grad():
            param.view(-1)[0] += 1.0
    try:
        trainer._check_weight_hashes(4)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    teardown(trainer)
    return {
        "global_rank": torch.distributed.get_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "matches": matches,
        "perturbed": name,
        "error": error,
    }


@pytest.mark.parametrize("method", list(METHODS))
def test_replicas_stay_identical_and_a_perturbed_replica_is_caught(method, tmp_path):
    world, flags = METHODS[method]
    results = run_ranks(_train_then_perturb, world, flags + CHECK, str(tmp_path))
    assert all(r["dp_size"] == 2 for r in results)
    # Rank 0 prints Megatron-LM's line before the first iteration and after 2 and 4.
    assert results[0]["matches"] == [
        f">>> Weight hashes match after {i} iterations..." for i in (0, 2, 4)
    ], results[0]["matches"]
    for r in results:
        assert r["error"] is not None, f"rank {r['global_rank']}: the perturbation went unseen"
        assert r["error"].startswith("Parameter hashes not matching across DP replicas")
        if r["dp_rank"] == 1:
            assert f"Hash not matching for {r['perturbed']}" in r["error"], r["error"]
