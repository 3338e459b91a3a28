"""No non-finite value reaches the weights or a checkpoint through DiLoCo (real megatron-core).

Before, ``--outer-lr nan`` (or a NaN pseudo-gradient from one site) wrote NaN into every
weight at the outer step and the next checkpoint was saved with every floating tensor
non-finite. Here, in the driver's trainer on 2 CPU ranks (each rank a site, fp32: no loss
scaling), once with the dense blocking exchange and once with the distributed optimizer
inside each site (``--num-distributed-optimizer-instances 2``) and the 4-bit exchange
overlapped on the exchange thread:

1. after a good checkpoint, a NaN is put into site 1's snapshot (its pseudo-gradient turns
   NaN); the outer step stops both ranks with a message naming site 1, and writes nothing
   (the fp32 main and model parameters are those the inner step left, snapshot and
   momentum as before);
2. a save now (site 1's state holds the NaN) is refused on both ranks naming the tensor:
   no ``iter_`` directory appears and the latest marker still names the good checkpoint,
   which loads (every loaded tensor is checked finite);
3. with the snapshot repaired and a NaN outer learning rate (as a run file could once pass
   it), the next outer step stops naming ``--outer-lr`` and writes nothing.

The loss-scaling (skip) side, the other exchanges and the threaded site-flag gather are in
tests/distributed/test_outer_nonfinite.py (fp16 is Megatron-LM's; the driver has none).
"""

from __future__ import annotations

import math
import os

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import build, load_checkpoint, make_trainer, save_checkpoint, teardown

DILOCO = ["--outer-method", "diloco", "--outer-interval", "2"]
DIST_OPT = [
    "--outer-method",
    "diloco",
    "--outer-interval",
    "4",
    "--outer-delay",
    "1",
    "--outer-compression",
    "quantized",
    "--use-distributed-optimizer",
    "--num-distributed-optimizer-instances",
    "2",
]


def _hook(trainer):
    from megatron_ext.optim.diloco import DiLoCoHook

    (hook,) = [h for h in trainer.runtime._optimizer_hooks() if isinstance(h, DiLoCoHook)]
    return hook


def _state(trainer, hook):
    """fp32 main parameters (this rank's shards), model parameters, snapshot, momentum."""
    from megatron_ext.megatron.optimizer import MegatronOptimizerView
    from megatron_ext.state import StepClock

    view = MegatronOptimizerView(trainer.optimizer, trainer.model, StepClock())
    main = {f: view.param_state(f).main_param.detach().clone() for f in view.fqns()}
    model = {f: view.param_state(f).model_param.detach().clone() for f in view.fqns()}
    return [
        main,
        model,
        {k: v.clone() for k, v in hook.snapshot.items()},
        {k: v.clone() for k, v in hook.momentum.items()},
    ]


def _same(a, b):

    def equal(x, y):
        return bool(((x == y) | (x.isnan() & y.isnan())).all())

    return all(set(x) == set(y) and all(equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _steps(trainer, start, steps):
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, start * gbs)
    for it in range(start, start + steps):
        trainer.train_step(it, it * gbs, iterator)
        trainer.runtime.end_step()


def _stopped(trainer, hook, start, steps):
    """Run ``steps`` steps from ``start``, expecting the last one's outer step to stop;
    returns the message and whether the outer step wrote nothing."""
    from megatron_ext.protocols import NonFiniteError

    if steps > 1:
        _steps(trainer, start, steps - 1)
    before = {}
    original = hook.finish_fragment

    def finish(view, index):
        before["state"] = _state(trainer, hook)  # after the inner update of this step
        return original(view, index)

    hook.finish_fragment = finish
    try:
        _steps(trainer, start + steps - 1, 1)
        message = None
    except NonFiniteError as exc:
        message = str(exc)
    finally:
        hook.finish_fragment = original
    return message, "state" in before and _same(before["state"], _state(trainer, hook))


def _case(trainer, rank, root, *, good, sync, nan_lr_steps):
    """``good``: steps before the good checkpoint; ``sync``: the step after which the broken
    outer step is applied; ``nan_lr_steps``: steps to the next applied outer step."""
    import dataclasses

    import torch

    from megatron_ext.megatron.checkpoint import CheckpointSaveError, latest_iteration

    out = {}
    build(trainer, stock=False)
    hook = _hook(trainer)
    _steps(trainer, 0, good)
    out["synced"] = hook.syncs
    save_checkpoint(trainer, root, good)
    first = sorted(hook.snapshot)[0]
    kept = hook.snapshot[first].clone()
    if rank == 1:
        hook.snapshot[first].view(-1)[0] = float("nan")
    out["site"] = _stopped(trainer, hook, good, sync - good)
    try:
        save_checkpoint(trainer, root, sync)
        out["save"] = None
    except CheckpointSaveError as exc:
        out["save"] = str(exc)
    out["latest"] = latest_iteration(root)
    out["dirs"] = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
    hook.snapshot[first].copy_(kept)
    # A NaN outer lr (the options dataclass refuses it: replaced on a copy).
    opts = dataclasses.replace(hook.options)
    object.__setattr__(opts, "lr", math.nan)
    hook.options = opts
    out["lr"] = _stopped(trainer, hook, sync, nan_lr_steps)
    teardown(trainer)
    build(trainer, stock=False)
    loaded = load_checkpoint(trainer, root)
    out["loaded"] = loaded["iteration"]
    out["loaded_finite"] = all(
        bool(torch.isfinite(p).all()) for c in trainer.model for p in c.parameters()
    )
    teardown(trainer)
    return out


def _run(rank, world, root):
    from megatron.core import parallel_state as ps

    from megatron_ext.train import parse_args
    from tests.helpers.mcore import TINY

    trainer = make_trainer(DILOCO)
    out = {"dense": _case(trainer, rank, root + "-dense", good=3, sync=4, nan_lr_steps=2)}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    trainer.cfg = parse_args(list(TINY) + DIST_OPT)
    # H = 4, delay 1: sent after 4, applied after 5 (good); sent after 8, applied after 9.
    out["dist-opt"] = _case(trainer, rank, root + "-do", good=5, sync=9, nan_lr_steps=4)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_run, 2, str(tmp_path_factory.mktemp("diloco_nonfinite") / "ckpt"))


@pytest.mark.parametrize("case", ["dense", "dist-opt"])
def test_a_non_finite_outer_step_writes_and_saves_nothing(results, case):
    good, sync = {"dense": (3, 4), "dist-opt": (5, 9)}[case]
    for rank, out in enumerate(results):
        r = out[case]
        assert r["synced"] == 1
        message, unchanged = r["site"]
        assert message is not None, f"rank {rank}: the run went on"
        assert "the pseudo-gradient of site 1 (of 2) is not finite" in message, message
        assert unchanged, f"rank {rank}: the outer step wrote something"
        assert r["save"] is not None, f"rank {rank}: a NaN state was saved"
        assert r["save"].startswith(f"--save: the checkpoint of iteration {sync} was not written")
        assert "'megatron_ext/rank_state/" in r["save"] and "snapshot" in r["save"], r["save"]
        assert "of rank 1 holds 1 non-finite values" in r["save"], r["save"]
        assert f"the latest checkpoint stays iteration {good}" in r["save"]
        assert r["latest"] == good and r["dirs"] == [f"iter_{good:07d}"]
        message, unchanged = r["lr"]
        assert message is not None and unchanged, (rank, message)
        assert "although the averaged pseudo-gradient is (--outer-lr nan" in message, message
        assert r["loaded"] == good and r["loaded_finite"]
