"""Checkpoint save -> fresh objects -> load -> continue equals an uninterrupted run, bitwise.

Real megatron-core dist_checkpointing (torch_dist) on CPU/gloo with 2 ranks, through the
driver's checkpoint functions. Dropout is off (with dropout the CPU emulation of the CUDA
generator makes masks depend on the CPU generator, which is restored too, but the
comparison is only meaningful without it). Compared bit for bit: losses of the continued
iterations, every parameter, every optimizer state tensor (main params and Adam moments),
and megatron_ext's per-rank state (a probe object registered in the ExtState whose value
differs on every rank, so a rank-mixing or deduplicating save would be caught).
"""

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import (
    build,
    first_difference,
    load_checkpoint,
    make_trainer,
    optimizer_state,
    params,
    save_checkpoint,
    teardown,
    train,
)


class _RankProbe:
    """A stateful object whose state differs per rank and per step."""

    def __init__(self):
        import torch

        self.value = torch.zeros(3)
        self.count = 0

    def bump(self, rank):
        import torch

        self.value += torch.tensor([rank + 1.0, 0.5, -1.0])
        self.count += 1

    def state_dict(self):
        return {"value": self.value.clone(), "count": self.count}

    def load_state_dict(self, state):
        if set(state) != {"value", "count"}:
            raise ValueError(f"unexpected keys {sorted(state)}")
        self.value = state["value"].clone()
        self.count = state["count"]


def _resume(rank, world, flags, root):
    trainer = make_trainer(flags)
    gbs = trainer.sizes["gbs"]

    def fresh():
        build(trainer, stock=False)
        probe = _RankProbe()
        trainer.runtime.state.register("test_probe", probe)
        return probe

    probe = fresh()
    full_losses = []
    for it in range(6):
        full_losses += train(trainer, 1, start=it)
        probe.bump(rank)
    trainer.sync_params()
    full_params, full_opt = params(trainer), optimizer_state(trainer)
    full_probe = probe.state_dict()
    teardown(trainer)

    probe = fresh()
    first = []
    for it in range(3):
        first += train(trainer, 1, start=it)
        probe.bump(rank)
    trainer.sync_params()
    save_checkpoint(trainer, root, 3)
    teardown(trainer)

    probe = fresh()
    loaded = load_checkpoint(trainer, root)
    assert loaded["iteration"] == 3 and loaded["consumed_samples"] == 3 * gbs
    second = []
    for it in range(3, 6):
        second += train(trainer, 1, start=it)
        probe.bump(rank)
    trainer.sync_params()
    out = {
        "losses_equal": first + second == full_losses,
        "losses": (full_losses, first + second),
        "param_diff": first_difference(full_params, params(trainer)),
        "opt_diff": first_difference(full_opt, optimizer_state(trainer)),
        "probe_equal": probe.count == full_probe["count"]
        and bool((probe.value == full_probe["value"]).all()),
        "lr": trainer.optimizer.param_groups[0]["lr"],
    }
    teardown(trainer)
    return out


CASES = {
    "dp2": [],
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
    "dp2-distopt-overlap": [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "20000",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bit_exact(case, tmp_path):
    results = run_ranks(_resume, 2, CASES[case], str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        assert out["losses_equal"], f"rank {rank}: {out['losses']}"
        assert out["param_diff"] is None, f"rank {rank}: {out['param_diff']}"
        assert out["opt_diff"] is None, f"rank {rank}: {out['opt_diff']}"
        assert out["probe_equal"], f"rank {rank}: per-rank megatron_ext state not restored"
