"""Small real megatron-core runs inside spawned ranks, through the production driver.

Each helper runs *inside* a rank started by :func:`tests.helpers.dist.run_ranks`. They use
``megatron_ext.train.Trainer`` (the code users run) with a tiny model on the embedded
corpus (vocab 512, cached under MEGATRON_EXT_CACHE), so "stock" and "ext" runs differ only
in whether megatron_ext's seams are installed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

TINY = [
    "--cpu",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--vocab-size",
    "512",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--lr-warmup-iters",
    "2",
    "--train-iters",
    "10",
    "--eval-iters",
    "0",
    "--log-interval",
    "1000",
    "--no-progress",
    "--split",
    "98,2,0",
]


def make_trainer(flags: Sequence[str]):
    """A Trainer with distributed setup and data built (collective)."""
    from megatron_ext.train import Trainer, parse_args

    cfg = parse_args(list(TINY) + list(flags))
    trainer = Trainer(cfg)
    trainer.setup_distributed()
    trainer.build_data()
    return trainer


def build(trainer, *, stock: bool) -> None:
    """(Re)seed and build model, optimizer and (unless ``stock``) megatron_ext's seams."""
    trainer.seed()
    trainer.build_model(stock=stock)
    trainer.build_optimizer()
    trainer.install_ext()


def train_with_traffic(
    trainer, steps: int, start: int = 0
) -> Tuple[List[Optional[float]], List[Dict[str, Any]]]:
    """Run ``steps`` iterations from iteration ``start``; returns the losses (last stage) and
    each iteration's traffic (what ``runtime.end_step()`` returned)."""
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, start * gbs)
    losses, traffic = [], []
    for it in range(start, start + steps):
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        assert ok
        traffic.append(trainer.runtime.end_step())
        losses.append(None if loss is None else float(loss))
    return losses, traffic


def train(trainer, steps: int, start: int = 0) -> List[Optional[float]]:
    """Run ``steps`` iterations from iteration ``start``; returns the losses (last stage)."""
    return train_with_traffic(trainer, steps, start)[0]


def params(trainer) -> Dict[str, Any]:
    """Detached copies of this rank's parameters keyed by global FQN."""
    from megatron_ext.megatron.naming import global_param_names

    out = {}
    for chunk in trainer.model:
        for p, name in global_param_names(chunk).items():
            out[name] = p.detach().clone()
    return out


def optimizer_state(trainer) -> Dict[str, Any]:
    """Optimizer state tensors of this rank keyed by FQN and state name."""
    from megatron_ext.megatron.optimizer import MegatronOptimizerView
    from megatron_ext.state import StepClock

    view = MegatronOptimizerView(trainer.optimizer, trainer.model, StepClock())
    out = {}
    for fqn in view.fqns():
        st = view.param_state(fqn)
        out[f"{fqn}/main"] = st.main_param.detach().clone()
        for k, v in st.state.items():
            if hasattr(v, "clone"):
                out[f"{fqn}/{k}"] = v.detach().clone()
    return out


def optimizer_pieces(trainer) -> Dict[str, Any]:
    """This rank's main parameters and Adam moments: (fqn/key) -> (start, end, flat values)
    of the flattened parameter (the whole parameter without the distributed optimizer)."""
    from megatron_ext.megatron.optimizer import MegatronOptimizerView
    from megatron_ext.state import StepClock

    view = MegatronOptimizerView(trainer.optimizer, trainer.model, StepClock())
    out = {}
    for fqn in view.fqns():
        st = view.param_state(fqn)
        lo, hi = st.param_range or (0, st.model_param.numel())
        tensors = {"main": st.main_param}
        tensors.update({k: v for k, v in st.state.items() if k in ("exp_avg", "exp_avg_sq")})
        for key, value in tensors.items():
            out[f"{fqn}/{key}"] = (lo, hi, value.detach().reshape(-1).clone())
    return out


def save_checkpoint(trainer, root: str, iteration: int) -> None:
    """Save model, optimizer, scheduler and megatron_ext state after ``iteration`` steps."""
    from megatron_ext.megatron import checkpoint as ckpt

    ckpt.save_checkpoint(
        root,
        iteration,
        **trainer.checkpoint_parts(),
        consumed_samples=iteration * trainer.sizes["gbs"],
    )


def load_checkpoint(
    trainer, root: str, *, model_only: bool = False, verify_checksums: bool = True
) -> Dict[str, Any]:
    """Load the latest checkpoint under ``root`` into the built trainer (``model_only``: its
    model weights only, as the driver's ``--finetune`` does, main copies refreshed;
    ``verify_checksums=False``: as ``--no-verify-checkpoint-checksums``)."""
    from megatron_ext.megatron import checkpoint as ckpt

    loaded = ckpt.load_checkpoint(
        root,
        **trainer.checkpoint_parts(),
        model_only=model_only,
        verify_checksums=verify_checksums,
    )
    if model_only:
        trainer.optimizer.reload_model_params()
    return loaded


def teardown(trainer) -> None:
    """Remove the seams and drop model and optimizer before the next build."""
    trainer.runtime.remove()
    del trainer.model, trainer.optimizer, trainer.scheduler


def first_difference(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[str]:
    """None if both dicts of tensors are bitwise equal, else a description."""
    import torch

    if set(a) != set(b):
        return f"keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in sorted(a):
        if not torch.equal(a[k], b[k]):
            diff = (a[k].float() - b[k].float()).abs().max().item()
            return f"{k} differs (max abs diff {diff:.3e})"
    return None


def resume_matches_uninterrupted(
    rank: int, world: int, flags: Sequence[str], root: str, steps: int = 6, save_at: int = 4
) -> Dict[str, Any]:
    """Train ``steps`` iterations uninterrupted, then again with a checkpoint after
    ``save_at`` and a rebuilt, reloaded trainer for the rest (a rank of ``run_ranks``).

    Returns the two loss lists (``losses``), the first parameter / optimizer-state difference
    at the end (None when bitwise equal) and the megatron_ext runtime's ``components`` of
    the resumed run (for method-specific checks).
    """
    trainer = make_trainer(flags)
    build(trainer, stock=False)
    full = train(trainer, steps)
    full_params, full_opt = params(trainer), optimizer_state(trainer)
    teardown(trainer)

    build(trainer, stock=False)
    first = train(trainer, save_at)
    save_checkpoint(trainer, root, save_at)
    teardown(trainer)
    build(trainer, stock=False)
    load_checkpoint(trainer, root)
    second = train(trainer, steps - save_at, start=save_at)
    out = {
        "losses": (full, first + second),
        "param_diff": first_difference(full_params, params(trainer)),
        "opt_diff": first_difference(full_opt, optimizer_state(trainer)),
        "components": trainer.runtime.components,
    }
    teardown(trainer)
    return out


def assert_resumed_exactly(out: Dict[str, Any]) -> None:
    """The losses, parameters and optimizer state of :func:`resume_matches_uninterrupted`
    agree bit for bit."""
    full, resumed = out["losses"]
    assert full == resumed, out["losses"]
    assert out["param_diff"] is None, out["param_diff"]
    assert out["opt_diff"] is None, out["opt_diff"]
