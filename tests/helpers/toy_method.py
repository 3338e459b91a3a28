"""A toy gradient method, written the way a new method is added: one module, one registration.

``halfprec`` reduces every bucket in bfloat16 (half the bytes) and scales the result by
``--toy-halfprec-scale``. The test registers :data:`METHOD` and checks that, with no other
edit anywhere, it is selectable from the CLI, fingerprinted in checkpointed state, built by
the runtime's factory path, and benchmarkable.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional

import torch

from megatron_ext.collectives.grad_reducer import CompressedReduction, GradReducer
from megatron_ext.methods.registry import BenchContext, Components, Method, MethodContext
from megatron_ext.options.base import options_dataclass


@options_dataclass(group="toy: halfprec", prefix="toy-halfprec")
class HalfPrecConfig:
    """Toy: bfloat16 gradient reduction."""

    scale: float = 1.0
    """Factor applied to the reduced gradient."""


class _HalfPrecReduction(CompressedReduction):
    def compresses(self, s) -> bool:
        return True

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        works, payloads = [], []
        for split in self.splits:
            payload = split.view.grad.to(torch.bfloat16)
            works.append(
                self.all_reduce(payload, dense=self.dense_wire_bytes(split.view, force_all_reduce))
            )
            payloads.append((split, payload))

        def then():
            for split, payload in payloads:
                split.view.grad.copy_(payload.float() * self.reducer_scale)

        return self.finish(works, then)


class HalfPrecReducer(GradReducer):
    name = "halfprec"
    elastic_rules: ClassVar[Dict[str, str]] = {}  # no state

    def __init__(self, cfg: HalfPrecConfig):
        super().__init__()
        self.cfg = cfg

    def _bind(self, spec):
        bound = _HalfPrecReduction(spec)
        bound.reducer_scale = self.cfg.scale
        return bound


def _build(ctx: MethodContext) -> Components:
    return Components(reducer=HalfPrecReducer(ctx.options))


def _bench_defaults(bench: BenchContext) -> Dict[str, Any]:
    return {"scale": 0.5}


METHOD = Method(
    name="halfprec",
    family="grad",
    build=_build,
    options=HalfPrecConfig,
    summary="toy: bfloat16 all-reduce",
    bench_defaults=_bench_defaults,
    bench_label=lambda o: f"halfprec-x{o.scale:g}",
)
