"""Fingerprints of a short run of every method: for a bitwise before/after check of a refactor.

What it does:
    Trains each registered method (every family's methods but ``none``, plus the all-``none``
    baseline) a few steps on the driver's ``Trainer`` (CPU, gloo, the tiny model of the
    tests, two ranks: DP=2 for the gradient, linear and outer families, PP=2 for the
    pipeline and subspace families), then prints one JSON line per run: a SHA-256 of the
    final weights (every rank, by global FQN), of megatron-ext's checkpointed state (per
    rank, by object name; keys hashed after stripping the positional index of the
    ``optimizer_hook`` names so that a renaming of the keys alone does not count), the
    losses and the bytes by category.

Why:
    A refactor that must not change behaviour (moving code, renaming state keys) is checked
    by running this before (on the base commit) and after, and comparing the lines
    (``diff``; the loss and byte lists are printed whole, so a difference shows where it
    starts). Warm-ups are shortened so that every method compresses within the run. The
    hashes depend on the machine and the library versions, so they are not
    stored: run both sides in the same environment.

Usage:
    PYTHONPATH=$PWD python scripts/dev/bitwise_fingerprint.py > after.jsonl
    PYTHONPATH=$PWD python scripts/dev/bitwise_fingerprint.py separate aqsgd  # a subset
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from typing import Any, Dict, List, Sequence, Tuple

STEPS = 4

FLAGS: Dict[str, List[str]] = {
    "grad": ["--global-batch-size", "8"],
    "p2p": ["--pipeline-model-parallel-size", "2", "--fixed-samples", "32"]
    + ["--global-batch-size", "8"],
    "linear": ["--global-batch-size", "8", "--grass-rank", "8", "--grass-update-interval", "2"],
    "subspace": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    + ["--subspace-rank", "8", "--position-embedding-type", "rope"]
    + ["--untie-embeddings-and-output-weights"],
    "outer": ["--global-batch-size", "8", "--outer-interval", "2"],
}
"""Flags of a family's runs (beyond the selector): the layout and what its methods need."""

METHOD_FLAGS: Dict[str, List[str]] = {
    "powersgd": ["--powersgd-start-step", "1"],
    "quantized-adam": ["--quantized-adam-warmup-steps", "2"],
    "aqsgd": ["--aqsgd-warmup-epochs", "0", "--aqsgd-checkpoint-buffers"],
    "directq": ["--aqsgd-warmup-epochs", "0"],
}
"""Flags that make a method compress within the run's few steps (warm-ups shortened)."""


def _digest(tensors: Dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for key in sorted(tensors):
        value = tensors[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _flatten(prefix: str, value: Any, out: Dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}/{i}", v, out)
    else:
        out[prefix] = value


def _stable_name(name: str) -> str:
    return re.sub(r"^optimizer_hook\.\d+\.", "optimizer_hook.", name)


def _rank(rank: int, world: int, flags: Sequence[str]) -> Dict[str, Any]:
    from tests.helpers.mcore import build, make_trainer, params, teardown

    trainer = make_trainer(list(flags))
    build(trainer, stock=False)
    gbs = trainer.sizes["gbs"]
    iterator = trainer._iterator(trainer.train_ds, 0)
    losses, traffic = [], []
    for it in range(STEPS):
        loss, _, ok = trainer.train_step(it, it * gbs, iterator)
        assert ok
        step = trainer.runtime.end_step()
        traffic.append({k: repr(v) for k, v in sorted(step.items())})
        losses.append(None if loss is None else float(loss).hex())
    trainer.sync_params()
    state: Dict[str, Any] = {}
    for name, obj in trainer.runtime.state.state_dict()["objects"].items():
        _flatten(_stable_name(name), obj, state)
    out = {
        "params": params(trainer),
        "state": _digest(state),
        "losses": losses,
        "traffic": traffic,
    }
    teardown(trainer)
    return out


def runs(selected: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """(label, flags) of every run (``selected``: only these method names)."""
    from megatron_ext.methods import registry

    out = [("none", FLAGS["grad"])]
    for fam in registry.families():
        for name in registry.methods(fam.name):
            if name != "none":
                flags = FLAGS[fam.name] + [fam.flag, name] + METHOD_FLAGS.get(name, [])
                out.append((f"{fam.name}:{name}", flags))
    return [r for r in out if not selected or r[0].split(":")[-1] in selected]


def main(argv: Sequence[str]) -> int:
    from tests.helpers.dist import run_ranks

    for label, flags in runs(argv):
        try:
            reports = run_ranks(_rank, 2, flags)
        except Exception as exc:  # noqa: BLE001 - one failing run is reported, others go on
            print(json.dumps({"run": label, "error": str(exc).splitlines()[-1][:300]}))
            continue
        weights: Dict[str, Any] = {}
        for report in reports:
            for name, value in report["params"].items():
                weights.setdefault(name, value)
        print(
            json.dumps(
                {
                    "run": label,
                    "weights": _digest(weights),
                    "state": [r["state"] for r in reports],
                    "losses": [r["losses"] for r in reports],
                    "traffic": hashlib.sha256(
                        json.dumps([r["traffic"] for r in reports]).encode()
                    ).hexdigest()[:16],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
