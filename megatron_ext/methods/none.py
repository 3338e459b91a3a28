"""The pass-through of every family (``none``): megatron-core's own communication.

Each family's ``none`` still goes through the seams (a dense reducer issuing megatron's
collectives, an identity codec, megatron's own linear forward/backward), so that byte
accounting works and the seams are exercised by the bit-exactness tests against stock
megatron-core.
"""

from __future__ import annotations

from megatron_ext.methods.registry import Components, Method, MethodContext, register

__all__ = []


def _dense_reducer(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.grad_reducer import DenseGradReducer

    return Components(reducer=DenseGradReducer())


def _identity_codec(ctx: MethodContext) -> Components:
    from megatron_ext.collectives.p2p import IdentityCodec

    return Components(codec=IdentityCodec())


def _pass_through_linear(ctx: MethodContext) -> Components:
    from megatron_ext.autograd.linear import PassThroughLinearHook

    return Components(linear_hook=PassThroughLinearHook(), linear_layers=ctx.family_options.layers)


def _nothing(ctx: MethodContext) -> Components:
    return Components()


register(Method("none", "grad", _dense_reducer, summary="dense megatron-core reduction"))
register(Method("none", "p2p", _identity_codec, summary="uncompressed pipeline transfers"))
register(Method("none", "linear", _pass_through_linear, summary="megatron-core's linear backward"))
register(Method("none", "subspace", _nothing, summary="unconstrained residual stream"))
register(Method("none", "outer", _nothing, summary="data parallelism synchronized every step"))
