"""megatron-core 0.16.x: the method bodies megatron-ext re-implements around its seams.

What it does:
    :func:`start_grad_sync` is ``_ParamAndGradBucketGroup.start_grad_sync`` of megatron-core
    0.16 (first-batch handling, NaN / large-gradient checks, ``gradient_scaling_factor``,
    async only with ``overlap_grad_reduce``) with the collective delegated to a bound
    reduction (:class:`~megatron_ext.collectives.grad_reducer.BoundReduction`). Megatron's
    own ``finish_grad_sync`` is kept: it calls ``start_grad_sync`` when reduction is
    synchronous and waits on our handle when it is overlapped.

Constraints:
    Verified against megatron-core 0.16.1 (``param_and_grad_buffer.py`` L364-537).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_ext.collectives.grad_reducer import BoundReduction, DeferredHandle

__all__ = ["VERSION", "start_grad_sync", "bucket_grad"]

VERSION = "0.16"


def bucket_grad(param: Any) -> Any:
    """The view of ``bucket.grad_data`` holding ``param``'s gradient (``main_grad``)."""
    return param.main_grad


def _noop() -> None:
    return None


def start_grad_sync(
    bucket_group: Any, bound: BoundReduction, step: int, force_all_reduce: Optional[bool]
) -> None:
    """megatron-core 0.16 ``start_grad_sync`` of ``bucket_group`` through ``bound``."""
    if bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None:
        # First batch with overlap: already launched by register_grad_ready.
        return
    assert (
        bucket_group.grad_reduce_handle is None
    ), "Should not have multiple communication calls outstanding at once"
    ddp_config = bucket_group.ddp_config
    if ddp_config.check_for_nan_in_grad or ddp_config.check_for_large_grads:
        bucket_group.check_grads(
            check_for_nan_or_inf=ddp_config.check_for_nan_in_grad,
            check_for_large=ddp_config.check_for_large_grads,
        )
    for bucket in bucket_group.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    handle = bound.launch(step, bool(force_all_reduce))
    if ddp_config.overlap_grad_reduce:
        # finish_grad_sync waits on it; a reduction may also have finished synchronously.
        bucket_group.grad_reduce_handle = DeferredHandle(
            handle.wait if handle is not None else _noop
        )
    else:
        if handle is not None:
            handle.wait()
        bucket_group.grad_reduce_handle = None
