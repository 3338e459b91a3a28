"""megatron-core 0.19.x: the method bodies megatron-ext re-implements around its seams.

What it does:
    :func:`start_grad_sync` is ``_ParamAndGradBucketGroup.start_grad_sync`` of megatron-core
    0.19.2 (``distributed/param_and_grad_buffer.py`` L594-779) up to the collective, which a
    bound reduction (:class:`~megatron_ext.collectives.grad_reducer.BoundReduction`) issues.
    Every step 0.19 added over 0.16 is kept:

    * drain the predecessor bucket group (``previous_grad_reduce_bucket_group``, linked only
      with ``reduce_scatter_with_fp32_accumulation`` and overlapped reduction);
    * wait on CUDA-graph wgrad events (``param._cudagraph_wgrad_ready_event``);
    * copy ``main_grad`` into the communication buffer for
      ``bucket.params_with_extra_main_grads`` (DDP config
      ``param_name_patterns_for_fp32_local_accumulation``: ``main_grad`` is then a separate
      fp32 tensor and ``main_grad_copy_in_grad_buffer`` its view in ``grad_data``);
    * scale under ``torch.no_grad()``.

    megatron's own ``finish_grad_sync`` (idempotent within an iteration through
    ``grad_reduce_finished``; copies the reduced gradient back to ``main_grad`` for the
    params above), ``register_grad_ready`` and ``reset`` run unchanged.

    :func:`bucket_grad` is where a parameter's gradient lives in ``bucket.grad_data``.

    ``P2PCommunicator._communicate`` of 0.19.2 is byte-identical to 0.16.1's (the class only
    gained read-only stage properties), so the P2P seam needs nothing here.

Constraints:
    Verified against megatron-core 0.19.2 (and Megatron-LM core_v0.19.0, whose megatron/core
    differs from the 0.19.2 wheel in four files away from these seams).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_ext.collectives.grad_reducer import BoundReduction, DeferredHandle

__all__ = ["VERSION", "start_grad_sync", "bucket_grad"]

VERSION = "0.19"


def bucket_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The view of ``bucket.grad_data`` holding ``param``'s gradient for communication:
    ``main_grad_copy_in_grad_buffer`` for params with an extra (fp32) ``main_grad``,
    ``main_grad`` otherwise."""
    copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
    return copy if copy is not None else param.main_grad


def _noop() -> None:
    return None


def start_grad_sync(
    bucket_group: Any, bound: BoundReduction, step: int, force_all_reduce: Optional[bool]
) -> None:
    """megatron-core 0.19 ``start_grad_sync`` of ``bucket_group`` through ``bound``."""
    self = bucket_group
    if self.is_first_batch and self.grad_reduce_handle is not None:
        # First batch with overlap: already launched by register_grad_ready.
        return
    previous = self.previous_grad_reduce_bucket_group
    if previous is not None and previous.grad_reduce_handle is not None:
        previous.finish_grad_sync(force_all_reduce=force_all_reduce)
    assert (
        self.grad_reduce_handle is None
    ), "Should not have multiple communication calls outstanding at once"

    current_stream = torch.cuda.current_stream()
    waited_event_ids = set()
    for bucket in self.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None and id(event) not in waited_event_ids:
                current_stream.wait_event(event)
                waited_event_ids.add(id(event))

    for bucket in self.buckets:
        for param in bucket.params_with_extra_main_grads:
            if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)

    ddp_config = self.ddp_config
    if ddp_config.check_for_nan_in_grad or ddp_config.check_for_large_grads:
        self.check_grads(
            check_for_nan_or_inf=ddp_config.check_for_nan_in_grad,
            check_for_large=ddp_config.check_for_large_grads,
        )
    with torch.no_grad():
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        handle = bound.launch(step, bool(force_all_reduce))
    if ddp_config.overlap_grad_reduce:
        # finish_grad_sync waits on it; a reduction may also have finished synchronously.
        self.grad_reduce_handle = DeferredHandle(handle.wait if handle is not None else _noop)
    else:
        if handle is not None:
            handle.wait()
        self.grad_reduce_handle = None
