"""AQ-SGD and DirectQ (``--p2p-compression aqsgd|directq``): factory and registration.

The codecs are ``megatron_ext.collectives.aqsgd`` (quantized per-sample activation deltas
with their buffers; direct quantization) on ``megatron_ext.compressors.quantize`` (the
quantizer and the bit packing). Both methods take the ``--aqsgd-*`` options; DirectQ uses
the bit widths, scales, rounding and warm-up only.

Its options: :class:`~megatron_ext.options.aqsgd.AQSGDConfig` (the codecs read them too).

Warm-up (``--aqsgd-warmup-epochs``, the authors' ``--warmup-epochs``, default 1): the first
epochs train without compression, as the AQ-SGD authors do (their runner sets
``FLAG_DISABLE_COMPRESSION`` for epochs ``< warmup_epochs``): forward activations, backward
gradients and the data-parallel exchange (whatever ``--grad-compression`` is) travel in full
precision, and AQ-SGD's buffers are filled with the exact activations. An epoch is
``--fixed-samples`` (rounded down to a multiple of the data-parallel size) over the global
batch; the warm-up lasts ``ceil(epochs x fixed samples / global batch)`` steps, so that
every sample has had a full-precision visit. The phase is a function of the iteration, so
a resumed run is in the phase an uninterrupted one would be.
"""

from __future__ import annotations

from megatron_ext.methods.registry import Components, Method, MethodContext, register
from megatron_ext.options.aqsgd import AQSGDConfig

__all__ = ["AQSGDConfig", "METHOD", "DIRECTQ"]


def _build_aqsgd(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.aqsgd import AQSGDCodec

    codec = AQSGDCodec(ctx.options, ctx)

    def setup():
        from megatron_ext.optim.memory import pending_optimizer_state_nbytes

        # Adam's moments (and a precision-aware optimizer's fp32 master weights) appear at
        # the first step, after the buffers: the fit check keeps room for them.
        codec.setup(reserve_nbytes=pending_optimizer_state_nbytes(ctx.handles.optimizer))

    return Components(codec=codec, on_install=setup)


def _build_directq(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.aqsgd import DirectQCodec

    codec = DirectQCodec(ctx.options, ctx)

    def setup():
        import torch

        from megatron_ext.logging import print_rank_0

        codec.stage = torch.distributed.get_rank(ctx.groups.pp)
        codec.set_warmup(ctx.handles.samples)
        print_rank_0(
            f"> directq: forward {ctx.options.fw_bits} bits, backward {ctx.options.bw_bits} "
            f"bits, scales per {ctx.options.granularity}, {codec.describe_warmup()}"
        )

    return Components(codec=codec, on_install=setup)


METHOD = register(
    Method(
        name="aqsgd",
        family="p2p",
        build=_build_aqsgd,
        options=AQSGDConfig,
        summary="quantized change of each sample's activation since its last visit, "
        "quantized activation gradients",
        bench_label=lambda o: f"aqsgd-fw{o.fw_bits}bw{o.bw_bits}",
    )
)

DIRECTQ = register(
    Method(
        name="directq",
        family="p2p",
        build=_build_directq,
        options=AQSGDConfig,
        summary="quantized activations and activation gradients (the AQ-SGD paper's baseline)",
        bench_label=lambda o: f"directq-fw{o.fw_bits}bw{o.bw_bits}",
    )
)
