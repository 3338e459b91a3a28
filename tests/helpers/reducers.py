"""Gradient reducers on plain process groups, built the way the runtime builds them.

``make_reducer(method, **options)`` goes through the method registry (the method's options
dataclass and factory), so tests exercise the same construction path as training;
``bind(...)`` describes one flat bucket as megatron's adapter would.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = [
    "make_reducer",
    "method_options",
    "bind",
    "reduce",
    "compressed_grad_methods",
    "param_slices",
]


def param_slices(shapes):
    """``ParamSlice`` objects of ``(fqn, shape)`` laid out back to back; returns them and the
    number of elements they cover."""
    import math

    from megatron_ext.collectives.grad_reducer import ParamSlice

    slices, pos = [], 0
    for fqn, shape in shapes:
        n = math.prod(shape)
        slices.append(ParamSlice(fqn, pos, pos + n, tuple(shape)))
        pos += n
    return slices, pos


def method_options(method: str, **options: Any) -> Any:
    """The options instance of gradient method ``method``."""
    from megatron_ext.methods import registry

    cls = registry.get("grad", method).options
    return None if cls is None else cls(**options)


def make_reducer(method: str, **options: Any):
    """The reducer (and its components) of gradient method ``method`` with ``options``."""
    from megatron_ext.methods import registry
    from megatron_ext.state import StepClock

    spec = registry.get("grad", method)
    ctx = registry.MethodContext(
        name=method,
        options=method_options(method, **options),
        family_options=None,
        config=None,
        layout=None,
        clock=StepClock(),
    )
    return spec.build(ctx).reducer


def compressed_grad_methods() -> Sequence[str]:
    """Every registered gradient method that compresses the gradient itself: all but the
    pass-through and reducers with ``reduces_gradient = False`` (quantized-adam leaves
    gradients local and exchanges the momentum; tests/distributed/test_quantized_adam.py)."""
    from megatron_ext.methods import registry

    return [m for m in registry.choices("grad") if m != "none" and make_reducer(m).reduces_gradient]


def bind(
    reducer,
    grad,
    slices,
    *,
    key: str = "bucket",
    distributed_optimizer: bool = False,
    op: Any = None,
    async_op: bool = False,
    meter: Optional[Any] = None,
    group: Any = None,
):
    """Bind ``reducer`` to one bucket (``grad`` with ``slices``) on ``group`` (WORLD)."""
    import torch.distributed as dist

    from megatron_ext.collectives.grad_reducer import BucketGroupSpec

    spec = BucketGroupSpec.create(
        [(grad, slices, key)],
        group if group is not None else dist.group.WORLD,
        op=op if op is not None else dist.ReduceOp.SUM,
        distributed_optimizer=distributed_optimizer,
        async_op=async_op,
        meter=meter,
    )
    return reducer.bind(spec)


def reduce(bound, step: int, force_all_reduce: bool = False, applied: bool = True) -> None:
    """Launch and finish one reduction, then close the step as the optimizer hook does
    (``applied``: the optimizer took the step; False: it skipped it, an fp16 overflow)."""
    handle = bound.launch(step, force_all_reduce)
    if handle is not None:
        handle.wait()
    bound.end_step(applied)
