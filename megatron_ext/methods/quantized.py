"""Quantized DP exchange (``--grad-compression quantized``): options, factory, registration.

The collective is ``megatron_ext.collectives.quantized`` (all-to-all of k-bit partitions,
server reduction, all-gather, with worker and server error compensation) on
``megatron_ext.compressors.quantize``. It quantizes the raw gradient and leaves megatron's
Adam as it is; the AQ-SGD authors' end-to-end runs use QuantizedAdam instead (frozen Adam
variance, the momentum exchanged: ``--grad-compression quantized-adam``,
``megatron_ext.methods.quantized_adam``), since error compensation on the gradient does not
carry through Adam's variance.

Its options: :class:`~megatron_ext.options.quantized.QuantizedConfig`.
"""

from __future__ import annotations

from megatron_ext.methods.registry import Components, Method, MethodContext, register
from megatron_ext.options.quantized import QuantizedConfig

__all__ = ["QuantizedConfig", "METHOD"]


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.quantized import QuantizedReducer

    return Components(reducer=QuantizedReducer(ctx.options))


METHOD = register(
    Method(
        name="quantized",
        family="grad",
        build=_build,
        options=QuantizedConfig,
        summary="k-bit gradients with worker and server error compensation (all-to-all, "
        "all-gather)",
        bench_label=lambda o: f"quantized-{o.bits}bit",
    )
)
