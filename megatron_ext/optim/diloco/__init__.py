"""DiLoCo: infrequent outer synchronization of data-parallel sites (pure torch).

What it does:
    The data-parallel ranks form sites; every H steps an outer Nesterov-SGD step on the
    pseudo-gradient averaged over the sites synchronizes them (``docs/methods/diloco.md``).
    One idea a module:

    * ``hook.py``: :class:`DiLoCoHook`, the outer step after the inner optimizer's step
      (schedule, non-finite rule, state and checkpoints; the algorithm in full).
    * ``exchange.py``: the exchange across sites: the sites as process groups
      (:func:`site_groups`), Streaming DiLoCo's fragments (:func:`split_fragments`,
      :func:`fragment_due`), :class:`DenseOuterExchange` and :func:`make_outer_exchange`,
      the exchange ``--outer-compression`` names.
    * ``overlap.py``: exchanges in flight (``--outer-delay``): :class:`PendingAverage`,
      :class:`ThreadedAverage`, :class:`ExchangeWorker`.
    * ``outer_step.py``: :func:`outer_sgd_step`, the eager outer SGD step.

Why a package:
    Each part is read and tested on its own; the public names are re-exported here, so
    ``from megatron_ext.optim.diloco import X`` stays the one import path (the method, the
    torchft variant ``megatron_ext/optim/diloco_ft.py``, benchmarks and tests use it).

Constraints:
    Pure torch; never imports Megatron or ``megatron_ext.methods``.
"""

from megatron_ext.optim.diloco.exchange import (
    DenseOuterExchange,
    fragment_due,
    make_outer_exchange,
    site_groups,
    split_fragments,
)
from megatron_ext.optim.diloco.hook import DiLoCoHook
from megatron_ext.optim.diloco.outer_step import outer_sgd_step
from megatron_ext.optim.diloco.overlap import ExchangeWorker, PendingAverage, ThreadedAverage

# The names --outer-compression takes (each but "none" is an OuterExchange with that
# data-parallel method's compression); defined with the options, which need no torch.
from megatron_ext.options.outer import OUTER_EXCHANGES

__all__ = [
    "DenseOuterExchange",
    "PendingAverage",
    "ThreadedAverage",
    "ExchangeWorker",
    "make_outer_exchange",
    "OUTER_EXCHANGES",
    "site_groups",
    "split_fragments",
    "fragment_due",
    "outer_sgd_step",
    "DiLoCoHook",
]
