"""Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval`` passes with every method.

Megatron-LM checks that the data-parallel replicas hold bit-identical weights (megatron-core's
``check_param_hashes_across_dp_replicas`` with cross-check) before training and every N
iterations, and asserts otherwise. One zero-touch ``pretrain_gpt.py`` launch per method on the
tiny run file (``configs/megatron_lm/gpt_tiny_separate_cpu.yaml``), always with 2
data-parallel replicas (the PP=2 methods on 4 processes), checking every 2 of 4 iterations.
The DP compressors (SEPARATE, Radius, PowerSGD, the quantized exchange, QuantizedAdam) are
checked in their ``--fp16`` launches (tests/megatron_lm/test_fp16.py), Grass (top-r) in its
``--fp16`` launch (tests/megatron_lm/test_pretrain_gpt.py): one launch each checks both.
The driver's test of the same flag (tests/megatron/test_replica_check.py) holds the negative
control.
"""

import os
from pathlib import Path

import pytest

from tests.megatron_lm.lm_runs import iterations, pretrain, tiny_args

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]

PP2 = ["--pipeline-model-parallel-size", "2"]

METHODS = {
    "aqsgd-pp2": (4, dict(grad_compression="none", p2p_compression="aqsgd", fixed_samples="16"),
                  PP2),
    "protocol-pp2": (4, dict(grad_compression="none", subspace_method="protocol",
                             subspace_rank="8", subspace_update_interval="2", subspace_lr="0.5"),
                     PP2),
}  # fmt: skip


@pytest.mark.parametrize("method", list(METHODS))
def test_weight_hashes_match_across_dp_replicas(method, tmp_path):
    nproc, overrides, extra = METHODS[method]
    run = pretrain(
        Path(os.environ["MEGATRON_LM_DIR"]) / "pretrain_gpt.py",
        tiny_args(check_weight_hash_across_dp_replicas_interval="2", **overrides) + extra,
        cwd=tmp_path,
        nproc=nproc,
    ).check()
    assert f"using world size: {nproc}, data-parallel size: 2," in run.stdout
    assert sorted(iterations(run.stdout)) == [1, 2, 3, 4]
    lines = [l for l in run.stdout.splitlines() if l.startswith(">>> Weight hashes match")]
    assert lines == [f">>> Weight hashes match after {i} iterations..." for i in (0, 2, 4)]
