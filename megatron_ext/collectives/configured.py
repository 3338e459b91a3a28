"""A gradient reducer whose bound reductions are built from its config alone.

What it does:
    :class:`ConfiguredReducer` keeps the method's config and binds each bucket group to
    ``reduction(cfg, spec)``, the subclass's :class:`~megatron_ext.collectives.grad_reducer.
    BoundReduction` class. A method whose reducer holds no state beyond the bound reductions
    (PowerSGD, SEPARATE, quantized) then only names itself, its elastic rules, what it
    supports and that class.

Why:
    The constructor and ``_bind`` were the same few lines in every such reducer.

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Generic, TypeVar

from megatron_ext.collectives.grad_reducer import BoundReduction, BucketGroupSpec, GradReducer

__all__ = ["ConfiguredReducer"]

C = TypeVar("C")


class ConfiguredReducer(GradReducer[BoundReduction], Generic[C]):
    """A reducer that binds each bucket group to ``reduction(cfg, spec)``.

    Subclasses name their options dataclass (``ConfiguredReducer[SeparateConfig]``) and set
    ``name``, ``elastic_rules``, ``supports`` and ``reduction``.

    Args:
        cfg: the method's options dataclass (kept as ``self.cfg``).
    """

    reduction: ClassVar[Callable[..., BoundReduction]]
    """The bound reduction's class, built as ``reduction(cfg, spec)``."""

    def __init__(self, cfg: C):
        super().__init__()
        self.cfg = cfg

    def _bind(self, spec: BucketGroupSpec) -> BoundReduction:
        return self.reduction(self.cfg, spec)
