"""Resume on another data-parallel size: DP=2 checkpoints loaded with DP=1 and DP=4.

Cases: ``none`` DP 2 -> 1; G-SEPARATE with two pipeline stages, DP 2 -> 1 (4 ranks -> 2:
each stage's state comes from the old ranks of that stage); G-SEPARATE DP 2 -> 4.

Real megatron-core dist_checkpointing (torch_dist) on CPU/gloo through the driver's save
and resume (``Trainer._save`` / ``Trainer._resume``), with the distributed optimizer
(``dp_reshardable``, resharded along DP by megatron-core). The global batch (8) is the
same at every DP size, so every iteration reads the same samples. Checked on each new
rank, against the DP=2 run:

* model weights equal the saved ones, bit for bit;
* the optimizer state (fp32 main parameters, Adam moments, assembled from the DP shards
  of every rank) equals the saved one, bit for bit, and the moments are not zero (a
  reinitialized optimizer would fail both);
* the RNG states equal those the saved ranks had (the driver seeds all DP ranks alike);
  in the ``none`` case the test makes one saved rank's Python RNG differ, and then no RNG
  state is restored (Megatron-LM's ``--no-load-rng``) and the log says so;
* G-SEPARATE's adapted ratios and beta scales (replicated across DP) carry over;
* SEPARATE's error-feedback mass is preserved: the sum of the residuals over the new
  ranks equals the sum over the old ranks (tolerance: the remap adds in float64 and
  rounds once to float32, so one float32 rounding of the sum, relative 2**-23);
* continuing one step gives the parameters of the uninterrupted DP=2 run up to the
  reduction order: SEPARATE's reduction is linear in ``g + e``, so with the residual mass
  preserved only the summation order differs (measured: at most 7.5e-9 apart for PP=2,
  DP 2 -> 1 and 6.0e-8 for DP 2 -> 4; with half of the residual mass lost, 1.0e-3 and
  8.9e-4 apart, so the tolerance 1e-6 separates the two);
* a state object whose rule is reset (a probe registered by the test) is reset to its
  fresh value and named in exactly one log line.
"""

import contextlib
import io
import random

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.flag_sets import SEPARATE as _SEPARATE
from tests.helpers.mcore import build, make_trainer, optimizer_pieces, params, teardown, train

COMMON = ["--global-batch-size", "8", "--use-distributed-optimizer"]
# G-SEPARATE: SEPARATE, adaptive.
SEPARATE = _SEPARATE + ["--separate-adaptive", "--separate-adapt-interval", "2"]
SAVE_AT = 3


class _Probe:
    """State that cannot be remapped (its rule: reset)."""

    elastic_rules = {"value": "reset"}

    def __init__(self, value):
        import torch

        self.value = torch.full((2,), float(value))

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


def _rank_report(trainer):
    import torch

    return {
        "params": params(trainer),
        "optimizer": optimizer_pieces(trainer),
        "objects": trainer.runtime.state.state_dict()["objects"],
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "pp_rank": trainer.ps.get_pipeline_model_parallel_rank(),
    }


def _save_run(rank, world, flags, root):
    trainer = make_trainer(flags + ["--save", root])
    build(trainer, stock=False)
    trainer.runtime.state.register("test_probe", _Probe(rank + 1))
    train(trainer, SAVE_AT)
    if flags == COMMON:
        # The none case: DP replicas whose (Python) RNG states differ (from each other and
        # from the seeded state) are not restored.
        for _ in range(rank + 1):
            random.random()
    trainer._save(SAVE_AT, SAVE_AT * trainer.sizes["gbs"])  # the driver's own save
    out = _rank_report(trainer)
    train(trainer, 1, start=SAVE_AT)
    trainer.sync_params()
    out["continued"] = params(trainer)
    teardown(trainer)
    return out


def _load_run(rank, world, flags, root):
    trainer = make_trainer(flags + ["--load", root])
    build(trainer, stock=False)
    trainer.runtime.state.register("test_probe", _Probe(-7))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        iteration, _ = trainer._resume()  # the driver's own load
    assert iteration == SAVE_AT
    out = _rank_report(trainer)
    out["log"] = log.getvalue()
    train(trainer, 1, start=SAVE_AT)
    trainer.sync_params()
    out["continued"] = params(trainer)
    teardown(trainer)
    return out


_SAVED = {}

PP2 = ["--pipeline-model-parallel-size", "2"]


def _saved(method, pp, tmp_path_factory):
    """The DP=2 run of ``method`` with ``pp`` pipeline stages (once per module)."""
    if (method, pp) not in _SAVED:
        root = str(tmp_path_factory.mktemp(f"elastic-{method}-pp{pp}") / "ckpt")
        flags = COMMON + (SEPARATE if method == "separate" else []) + (PP2 if pp == 2 else [])
        _SAVED[method, pp] = (root, flags, run_ranks(_save_run, 2 * pp, flags, root))
    return _SAVED[method, pp]


def _merged(reports, field):
    """``field`` (a dict keyed by global FQN) of every rank in one dict; ranks holding the
    same parameter (DP replicas) must agree."""
    import torch

    out = {}
    for report in reports:
        for name, value in report[field].items():
            if name in out:
                assert torch.equal(out[name], value), f"{field} {name} differs across replicas"
            out[name] = value
    return out


def _assemble(reports):
    """Full flattened optimizer tensors from every rank's pieces."""
    import torch

    full = {}
    for report in reports:
        for key, (lo, hi, values) in report["optimizer"].items():
            numel = report["params"][key.rsplit("/", 1)[0]].numel()
            target = full.setdefault(key, torch.full((numel,), float("nan")))
            target[lo:hi] = values
    return full


def _residual_sum(reports):
    import torch

    total = {}
    for report in reports:
        for key, value in report["objects"]["grad_reducer"].items():
            if not key.startswith("residual/"):
                continue
            total[key] = total.get(key, torch.zeros_like(value, dtype=torch.float64)) + value
    return total


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,pp,new_dp",
    [("none", 1, 1), ("separate", 2, 1), ("separate", 1, 4)],
    ids=["none-dp2-to-dp1", "separate-pp2-dp2-to-dp1", "separate-dp2-to-dp4"],
)
def test_resume_on_another_dp_size(method, pp, new_dp, tmp_path_factory):
    import torch

    root, flags, old = _saved(method, pp, tmp_path_factory)
    new = run_ranks(_load_run, new_dp * pp, flags, root)

    saved_params, saved_continued = _merged(old, "params"), _merged(old, "continued")
    for report in new:
        assert report["params"] and report["params"].keys() <= saved_params.keys()
        for name, value in report["params"].items():
            assert torch.equal(value, saved_params[name]), name
        # RNG states of the saved ranks of the same pipeline stage, when those agree.
        same_stage = [r for r in old if r["pp_rank"] == report["pp_rank"]]
        if method == "separate":
            assert torch.equal(report["rng"], same_stage[0]["rng"])
            assert report["py_rng"] == same_stage[0]["py_rng"]
            assert "RNG states restored" in new[0]["log"]
        else:
            assert all(report["py_rng"] != r["py_rng"] for r in same_stage)
            assert "RNG states not restored" in new[0]["log"]
    assert _merged(new, "params").keys() == saved_params.keys()
    saved_opt, loaded_opt = _assemble(old), _assemble(new)
    assert set(saved_opt) == set(loaded_opt)
    for key, value in saved_opt.items():
        assert not value.isnan().any(), f"{key}: not covered by the saved shards"
        assert torch.equal(loaded_opt[key], value), key
    moments = [v for k, v in saved_opt.items() if k.endswith("exp_avg_sq")]
    assert moments and all(bool((v > 0).any()) for v in moments)

    # The probe: reset to its fresh value, named in one line.
    for report in new:
        assert torch.equal(report["objects"]["test_probe"]["value"], torch.full((2,), -7.0))
    reset_lines = [line for line in new[0]["log"].splitlines() if "reset" in line]
    assert len(reset_lines) == 1, new[0]["log"]
    assert "test_probe: value" in reset_lines[0]
    assert "grad_reducer" not in reset_lines[0]
    assert "global batch" not in new[0]["log"]  # saved with the checkpoint, and the same

    if method == "separate":
        # G-SEPARATE's ratios and beta scales (replicated): the saved replicas', which the
        # adaptation at step 2 moved away from the fresh values (ratio 16, scale 1).
        saved = {}
        for report in old:
            saved.update(
                {
                    k: v
                    for k, v in report["objects"]["grad_reducer"].items()
                    if k.split("/")[0] in ("ratio", "beta_scale")
                }
            )
        assert any(v not in (16, 1.0) for v in saved.values()), saved
        for report in new:
            mine = report["objects"]["grad_reducer"]
            assert {k: saved[k] for k in mine if k in saved} == {
                k: mine[k] for k in mine if k in saved
            }
        saved_sum, loaded_sum = _residual_sum(old), _residual_sum(new)
        assert set(saved_sum) == set(loaded_sum) and saved_sum
        for key, value in saved_sum.items():
            assert value.abs().max() > 0, key
            # One float32 rounding of the float64 sum (see module docstring).
            torch.testing.assert_close(loaded_sum[key], value, rtol=2.0**-23, atol=1e-12)

    # One more step: the uninterrupted DP=2 run's parameters up to the reduction order.
    for report in new:
        for name, value in report["continued"].items():
            torch.testing.assert_close(value, saved_continued[name], rtol=1e-5, atol=1e-6)
