"""DiLoCo's dense outer exchange and the factory that builds an exchange by name.

What it does:
    :class:`DenseOuterExchange` averages a fragment's flat fp32 pseudo-gradient over the
    outer group (one rank per site) with one all-reduce, blocking (``average``) or
    asynchronous (``start``, for ``--outer-delay``). :func:`make_outer_exchange` builds the
    exchange ``--outer-compression`` names: this dense one for ``none``, else the compressed
    :class:`~megatron_ext.collectives.outer_exchange.OuterExchange` of that data-parallel
    method.

Why:
    Every exchange has one interface (``average``, ``wire_bytes``, ``state_dict``,
    ``load_state_dict``), so the outer step (``hook.py``) does not know which one it holds.

Constraints:
    torch.distributed only; never imports Megatron. The dense exchange sums then divides
    (gloo has no AVG) and holds no state.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.optim.diloco.overlap import PendingAverage

# The names --outer-compression takes (each but "none" is an OuterExchange with that
# data-parallel method's compression); defined with the options, which need no torch.
from megatron_ext.options.outer import OUTER_EXCHANGES

__all__ = ["DenseOuterExchange", "make_outer_exchange"]


class DenseOuterExchange:
    """The dense pseudo-gradient exchange: an all-reduce mean over the outer group.

    A :class:`~megatron_ext.protocols.PseudoGradientExchange`, asynchronous (``start``); it
    holds no state.

    Args:
        method: ``"none"``.
        options: unused (the compressed exchanges' options).
        numel: elements of the flat pseudo-gradient.
        group: the outer process group (one rank per site).
        device: where the flat tensor lives when exchanged.
        layout: ``name`` (the buffer's stable name) and ``shapes`` (the parameters laid out
            in it), which compressed exchanges use; the dense one ignores them.
    """

    asynchronous: ClassVar[bool] = True

    def __init__(
        self, method: str, options: Any, numel: int, group: Any, device: Any, **layout: Any
    ):
        if method != "none":
            raise ValueError(f"DenseOuterExchange is the 'none' exchange, got {method!r}")
        self.numel = int(numel)
        self.group = group
        self.device = torch.device(device)
        self.size = torch.distributed.get_world_size(group) if group is not None else 1

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` (fp32, ``numel`` elements) over the outer group."""
        self._check(flat)
        if self.size == 1:
            return flat
        out = flat.clone()
        # SUM then divide: gloo has no AVG.
        with ProcessGroupTrafficMeter.tagged("outer"):
            torch.distributed.all_reduce(out, group=self.group)
        out.div_(self.size)
        return out

    def start(self, flat: torch.Tensor) -> "PendingAverage":
        """Start :meth:`average` without waiting (an asynchronous all-reduce): the returned
        handle's ``wait()`` gives the mean. ``flat`` is consumed (reduced in place)."""
        self._check(flat)
        if self.size == 1:
            return PendingAverage(flat)
        with ProcessGroupTrafficMeter.tagged("outer"):
            work = torch.distributed.all_reduce(flat, group=self.group, async_op=True)
        return PendingAverage(flat, work=work, divide_by=self.size)

    def _check(self, flat: torch.Tensor) -> None:
        if flat.dtype != torch.float32 or flat.numel() != self.numel:
            raise ValueError(
                f"outer exchange expects {self.numel} fp32 elements, got {flat.numel()} "
                f"{flat.dtype}"
            )

    def wire_bytes(self) -> int:
        """Bytes this rank sends per :meth:`average` (ring all-reduce convention)."""
        return collective_wire_bytes("all_reduce", 4 * self.numel, self.size)

    def state_dict(self) -> Dict[str, Any]:
        """No state."""
        return {}

    def shared_state_dict(self) -> Dict[str, Any]:
        """What a joining site takes from a peer (as ``OuterExchange.shared_state_dict``):
        nothing."""
        return {}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Accepts only the empty state."""
        if sd:
            raise ValueError(f"the dense outer exchange has no state, got {sorted(sd)}")


def make_outer_exchange(
    method: str, options: Any, numel: int, group: Any, device: Any, **layout: Any
) -> Any:
    """The outer exchange called ``method`` (``--outer-compression``).

    ``layout``: ``name=`` the flat buffer's stable name (``outer/<fragment>``) and
    ``shapes=`` the ``(fqn, shape)`` of its parameters, for exchanges that compress per
    matrix or key their state by name.

    Raises:
        ValueError: a method this build does not know.
    """
    if method == "none":
        return DenseOuterExchange(method, options, numel, group, device, **layout)
    if method in OUTER_EXCHANGES:
        from megatron_ext.collectives.outer_exchange import OuterExchange

        return OuterExchange(method, options, numel, group, device, **layout)
    raise ValueError(f"unknown outer exchange {method!r} (known: {', '.join(OUTER_EXCHANGES)})")
