"""DDP configurations the driver has no flag for still reduce through the seam like stock.

Megatron-LM users can switch them on, and each changes how megatron-core's
``start_grad_sync`` / ``finish_grad_sync`` work:

* ``reduce_scatter_with_fp32_accumulation`` (0.16 and 0.19): megatron's reduce-scatter
  accumulates in fp32 and returns a handle of its own, which the coalescing manager does
  not wait on; with overlapped reduction that handle must be the one waited on.
* ``param_name_patterns_for_fp32_local_accumulation`` (0.19+): ``param.main_grad`` is a
  separate fp32 tensor, copied into the communication buffer before the collective and
  back after it; the seam's 0.19 body must do the copy-in, or the reduced gradient is
  overwritten by a stale buffer (silently different training).

Each case trains the same tiny GPT stock and with every seam installed (methods 'none') and
requires bit-identical losses and parameters.
"""

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.mcore import build, first_difference, make_trainer, params, teardown, train

STEPS = 6
DISTOPT_OVERLAP = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--ddp-bucket-size",
    "20000",
]
CASES = {
    "fp32-reduce-scatter-overlap": (
        {"reduce_scatter_with_fp32_accumulation": True},
        DISTOPT_OVERLAP,
    ),
    "extra-main-grads-dp2": ({"param_name_patterns_for_fp32_local_accumulation": ("all",)}, []),
    "extra-main-grads-distopt-overlap": (
        {"param_name_patterns_for_fp32_local_accumulation": ("all",)},
        DISTOPT_OVERLAP,
    ),
}


def _case(rank, world, overrides, flags):
    import functools

    import megatron.core.distributed as md

    original = md.DistributedDataParallelConfig

    @functools.wraps(original)
    def with_overrides(*args, **kwargs):
        kwargs.update(overrides)
        return original(*args, **kwargs)

    md.DistributedDataParallelConfig = with_overrides
    try:
        trainer = make_trainer(flags)
        build(trainer, stock=True)
        extra = sum(
            len(getattr(b, "params_with_extra_main_grads", ()))
            for g in trainer.model[0].bucket_groups
            for b in g.buckets
        )
        stock_losses = train(trainer, STEPS)
        trainer.sync_params()
        stock_params = params(trainer)
        teardown(trainer)
        build(trainer, stock=False)
        ext_losses = train(trainer, STEPS)
        trainer.sync_params()
        ext_params = params(trainer)
        teardown(trainer)
    finally:
        md.DistributedDataParallelConfig = original
    return {
        "extra": extra,
        "loss_diff": None if stock_losses == ext_losses else (stock_losses, ext_losses),
        "param_diff": first_difference(stock_params, ext_params),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_config_variant_reduces_like_stock(case):
    from megatron.core.distributed import DistributedDataParallelConfig

    overrides, flags = CASES[case]
    missing = set(overrides) - set(DistributedDataParallelConfig.__dataclass_fields__)
    if missing:
        pytest.skip(f"this megatron-core has no {', '.join(sorted(missing))}")
    for rank, out in enumerate(run_ranks(_case, 2, overrides, flags)):
        if "param_name_patterns_for_fp32_local_accumulation" in overrides:
            assert out["extra"] > 0, f"rank {rank}: no param got an extra main_grad"
        assert out["loss_diff"] is None, f"rank {rank}: losses differ {out['loss_diff']}"
        assert out["param_diff"] is None, f"rank {rank}: {out['param_diff']}"
