"""A NaN or Inf in a compressor's residual is never applied to the weights (real megatron-core).

Before the step transaction, a NaN that entered an error-feedback residual was applied to the
weights and saved with the next checkpoint (``grad norm: nan``, the optimizer step taken),
and an Inf in a Radius residual trained on with ``grad norm: inf``: megatron's NaN check runs
on each rank's gradient *before* compression; the gradient rebuilt after the exchange, which
carries the residual, was never checked.

Here, in the driver's training step on 2 ranks without loss scaling (fp32): after 3 steps a
NaN is written into rank 0's SEPARATE residual, or an Inf into a Radius residual entry that
sparse steps do not send; the next step must stop on *every* rank with megatron-ext's message
before the optimizer applies anything (the weights equal those before the step). With loss
scaling (fp16, Megatron-LM only) the same flag makes megatron skip the step instead:
tests/distributed/test_nonfinite.py and tests/megatron_lm/test_fp16.py.
"""

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import build, make_trainer, params, train

CASES = {
    "separate": ["--grad-compression", "separate", "--separate-ratio", "4"],
    "radius": ["--grad-compression", "radius", "--radius-interval", "100"],
}


def _inject(method, reducer):
    import torch

    if method == "separate":
        reducer.bound[0].segments[0][0].error.view(-1)[0] = float("nan")
        return
    # Radius: an entry this step does not send (not selected), so only the residual has it.
    bound = reducer.bound[0]
    split = next(sp for sp in bound.splits if sp.matrices)
    s = split.matrices[0]
    unsent = int(torch.nonzero(~reducer.masks[s.fqn])[0])
    index = bound.splits.index(split)
    bound.residuals[index][s.start + unsent] = float("inf")


def _run(rank, world, method):
    import torch

    trainer = make_trainer(CASES[method])
    build(trainer, stock=False)
    train(trainer, 3)
    before = params(trainer)
    if rank == 0:
        _inject(method, trainer.runtime.reducer)
    message = None
    try:
        train(trainer, 1, start=3)
    except RuntimeError as exc:
        message = str(exc)
    after = params(trainer)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(bool(torch.isfinite(v).all()) for v in after.values())
    return message, unchanged, finite


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CASES))
def test_a_non_finite_residual_stops_training_before_it_is_applied(method):
    for rank, (message, unchanged, finite) in enumerate(run_ranks(_run, 2, method)):
        assert message is not None, f"rank {rank}: the step ran on"
        assert "found NaN or Inf in the gradient rebuilt" in message, message
        assert f"'{method}' reduction" in message, message
        assert unchanged and finite, f"rank {rank}: the weights changed"
