"""Every DP compressor, and DiLoCo, trains under Megatron-LM's ``--fp16`` (loss scaling).

Megatron's loss scaler starts at 2^32, so the first iterations overflow by design and are
skipped while the scale comes down. Before the step transaction (collectives/grad_reducer.py)
the overflowing gradient entered each compressor's state and every later iteration
overflowed too (measured on core_v0.16.1, 40 iterations: SEPARATE, PowerSGD and the
quantized exchange skipped 40 of 40 and drove the scale to 1.0; Radius stopped with
"optimizer state missing"). Here each method must come out of the overflow phase like
uncompressed training does: at most two skipped iterations in the last 20 (the scale probing
too high), a loss scale far above 1, a falling loss. (Measured: ``none`` skips 17 of 40
iterations, 16 in the first 16 and one later when the scale probes too high, at iteration 27;
every compressed method now does the same, 16-17; Radius's late one fell at iteration 37.)

Each launch also runs Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval`` (its
replicas bit-identical before training and every 20 iterations, asserted by Megatron-LM
itself): the DP compressors keep the two replicas equal through the overflowing start too.
Not for DiLoCo, whose sites differ between outer steps by design (tests/megatron_lm/
test_replica_check.py has the other methods).

QuantizedAdam runs with ``--use-distributed-optimizer`` (its sharded path: the replicas'
hashes then check megatron-core's parameter all-gather too; exact and elastic resume of that
path are driver tests, tests/megatron/test_quantized_adam_distopt.py).

Needs ``MEGATRON_LM_DIR`` (skipped otherwise); ~10 s per method.
"""

import os
import re
from pathlib import Path

import pytest

from tests.megatron_lm.lm_runs import iterations, pretrain, tiny_args

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]


METHODS = {
    "none": {},
    "separate": {},
    "powersgd": {"powersgd_start_step": "2"},
    "quantized": {},
    # Warm-up counted in applied steps: the overflowing start (skipped) does not count, the
    # frozen variance is Adam's; afterwards a rank's overflow skips the step on every rank.
    # With the distributed optimizer (sharded Adam state; its clipping would take one norm
    # over shards of different ranks' local gradients, so --clip-grad 0): the weight-hash
    # check below shows megatron-core's parameter all-gather keeps the replicas equal.
    "quantized-adam": {"quantized_adam_warmup_steps": "3", "clip_grad": "0"},
    # Both Radius paper run files use fp16; reselect inside the run.
    "radius": {"radius_interval": "10"},
    # DiLoCo, 2 sites, 4-bit exchange: outer steps fall inside the overflowing start too
    # (scheduled by iteration; a skipped inner step moves nothing), and its first step takes
    # the snapshots from the weights.
    "diloco": {
        "grad_compression": "none",
        "outer_method": "diloco",
        "outer_interval": "5",
        "outer_compression": "quantized",
    },
}


# One launch per seam runs on every release: SEPARATE for the gradient reducer's step
# transaction (PowerSGD and the quantized exchange go through the same seam and the same
# transaction: run once, in the main pass), Radius and QuantizedAdam for their optimizer hooks
# (QuantizedAdam with the distributed optimizer), DiLoCo for the outer step. ``none`` is
# Megatron-LM's own loss scaling with nothing of ours in the step.
_ONCE = {"none", "powersgd", "quantized"}


@pytest.mark.parametrize(
    "method",
    [
        pytest.param(m, marks=pytest.mark.release_covered) if m in _ONCE else m
        for m in sorted(METHODS)
    ],
)
def test_fp16_trains_through_the_overflowing_start(method, tmp_path):
    lm_dir = Path(os.environ["MEGATRON_LM_DIR"])
    args = tiny_args(train_iters="40", **{"grad_compression": method, **METHODS[method]})
    # No --no-masked-softmax-fusion: CPU execution turns the CUDA-only fused softmax off.
    args += ["--fp16"] + (["--use-distributed-optimizer"] if method == "quantized-adam" else [])
    replicas = method != "diloco"  # DiLoCo's sites differ between outer steps
    if replicas:
        args += ["--check-weight-hash-across-dp-replicas-interval", "20"]
    run = pretrain(lm_dir / "pretrain_gpt.py", args, cwd=tmp_path).check()
    if replicas:
        lines = [l for l in run.stdout.splitlines() if l.startswith(">>> Weight hashes match")]
        assert lines == [f">>> Weight hashes match after {i} iterations..." for i in (0, 20, 40)]
    iters = iterations(run.output)
    assert sorted(iters) == list(range(1, 41)), sorted(iters)
    skipped = {it: int(iters[it]["skipped"]) for it in iters}
    scale = {it: float(iters[it]["loss_scale"]) for it in iters}
    # The start overflows by design (scale 2^32) ...
    assert skipped[1] == 1, iters[1]["line"]
    # ... and training then takes its steps as uncompressed training does: an occasional
    # overflow when the scale probes too high, not an overflow that never ends.
    late = [it for it in range(21, 41) if skipped[it]]
    assert len(late) <= 2, late
    assert sum(skipped.values()) <= 20, skipped
    assert scale[40] >= 2.0**14, scale
    # A skipped iteration logs no loss.
    losses = [float(iters[it]["loss"]) for it in range(31, 41) if not skipped[it]]
    assert len(losses) >= 8, losses
    first = next(float(iters[it]["loss"]) for it in sorted(iters) if "loss" in iters[it])
    assert all(loss == loss for loss in losses) and max(losses) < first, (first, losses)
    if method == "quantized-adam":  # the sharded optimizer was on
        assert re.search(r"use_distributed_optimizer \.+ True", run.stdout), run.stdout[:3000]
