"""DiLoCo (``--outer-method diloco``) in Megatron-LM's own pretrain_gpt.py, 2 sites of one rank.

The tiny GPT of the other Megatron-LM tests (``configs/megatron_lm/gpt_tiny_separate_cpu.yaml``
with ``--grad-compression none``), DP=2 as G = 2 sites, H = 3, 6 iterations, a ``torch_dist``
checkpoint every 2:

* zero-touch: the iteration line shows ``outer`` bytes at the outer steps (3 and 6) only and
  no data-parallel gradient bytes (a site of one rank reduces nothing);
* a run resumed from iteration 2, where the two sites' weights and AdamW states differ (the
  first outer step is at 3), continues exactly as the uninterrupted one: Megatron-LM's
  checkpoint keeps one mix of the data-parallel replicas, so this holds only because each
  rank's megatron-ext state carries its own weights and AdamW state (DiLoCo's ``site``
  entry) and puts them back at the first step. Measured: without that, iteration 3's loss
  differs.

With megatron's DDP and optimizer, with the distributed optimizer
(``--use-distributed-optimizer --num-distributed-optimizer-instances 2``: each site one
optimizer instance; Megatron-LM's checkpoint then holds site 0's instance and each rank its
own shards in its megatron-ext state), and with Grass (the outer step moves its frozen
projected weights, which each rank's megatron-ext state also carries).
"""

from pathlib import Path

import pytest

from tests.megatron_lm.lm_runs import iterations, pretrain, tiny_args

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]

FLAGS = dict(grad_compression="none", outer_method="diloco", outer_interval="3", train_iters="6")


@pytest.fixture(scope="module")
def lm_dir() -> Path:
    import os

    return Path(os.environ["MEGATRON_LM_DIR"])


VARIANTS = {
    "ddp": [],
    "dist-opt": ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
    # Grass (r=8 of 64, reselected every 2 steps): the outer step moves the frozen
    # projected weights; Megatron-LM's checkpoint holds site 0's, each rank its own in its
    # megatron-ext state (GrassOuterView.site_state).
    "grass": ["--grass-method", "norm2", "--grass-rank", "8", "--grass-update-interval", "2"]
    + ["--grass-rewarmup-steps", "1"],
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def two_sites(request, lm_dir, tmp_path_factory):
    """Uninterrupted 6 iterations, checkpoints (torch_dist) at 2, 4 and 6."""
    extra = VARIANTS[request.param]
    root = tmp_path_factory.mktemp("diloco_two_sites")
    run = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(save=str(root / "ckpt"), save_interval="2", **FLAGS) + extra,
        cwd=root,
    ).check()
    return root, run, extra


def test_zero_touch_diloco_sends_outer_bytes_at_outer_steps_only(two_sites):
    _, run, _ = two_sites
    assert "DiLoCo: site 0 of 2, H=3, 1 fragment(s), outer lr 0.7, momentum 0.9" in run.stdout
    iters = iterations(run.stdout)
    assert sorted(iters) == [1, 2, 3, 4, 5, 6]
    for it, record in iters.items():
        field = record.get("bytes", "")
        assert "dp-grad" not in field, (it, field)
        assert ("outer " in field) == (it in (3, 6)), (it, field)


def test_diloco_two_sites_resumes_exactly_between_outer_steps(two_sites, lm_dir, tmp_path):
    root, full, extra = two_sites
    resumed = pretrain(
        lm_dir / "pretrain_gpt.py",
        tiny_args(load=str(root / "ckpt"), ckpt_step="2", **FLAGS) + extra,
        cwd=tmp_path,
    ).check()
    objects = "grad_reducer, optimizer_hook.diloco"
    if "--grass-method" in extra:
        objects += ", optimizer_hook.grass"
    assert (
        f"> megatron-ext: loaded the state of 2 ranks from {root / 'ckpt' / 'iter_0000002'} "
        f"(ShardedObject 'megatron_ext/rank_state'; objects: {objects})" in resumed.stdout
    )
    a, b = iterations(full.stdout), iterations(resumed.stdout)
    assert sorted(b) == [3, 4, 5, 6]
    # Iteration 3 (the sites' own weights, then the outer step): exactly as uninterrupted.
    assert (b[3]["loss"], b[3]["grad_norm"]) == (a[3]["loss"], a[3]["grad_norm"])
    # Iteration 4: Megatron prints the mean of iterations 3 and 4 (test_pretrain_gpt.py).
    assert b[4]["grad_norm"] == a[4]["grad_norm"]
    mean = (float(a[3]["loss"]) + float(a[4]["loss"])) / 2
    assert abs(float(b[4]["loss"]) - mean) <= 1e-6 * mean
    for it in (5, 6):
        assert (b[it]["loss"], b[it]["grad_norm"]) == (a[it]["loss"], a[it]["grad_norm"])
