"""SEPARATE (``--grad-compression separate``): options, factory and registration.

The algorithm is ``megatron_ext.collectives.separate`` (the collective choreography) on
``megatron_ext.compressors.separate`` (the projection math); this module declares the method:
its options (``--separate-*``), what it builds (a gradient reducer) and its benchmark label.

Its options: :class:`~megatron_ext.options.separate.SeparateConfig`.
"""

from __future__ import annotations

from megatron_ext.methods.registry import Components, Method, MethodContext, register
from megatron_ext.options.separate import SeparateConfig

__all__ = ["SeparateConfig", "METHOD"]


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.separate import SeparateReducer

    return Components(reducer=SeparateReducer(ctx.options))


def _label(options: SeparateConfig) -> str:
    label = f"{'g-' if options.adaptive else ''}separate-{options.ratio}"
    if options.blocks != "bucket":
        label += f"-{options.blocks}"
    if options.refresh_interval != 1:
        label += f"-refresh{options.refresh_interval or 'reset'}"
    return label


METHOD = register(
    Method(
        name="separate",
        family="grad",
        build=_build,
        options=SeparateConfig,
        summary="common random projection of each bucket, moving-average error feedback",
        bench_label=_label,
    )
)
