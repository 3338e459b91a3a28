"""DiLoCo's exchange across sites: between which ranks, of which fragment when, and how.

What it does:
    :func:`site_groups` splits every data-parallel group into runs of consecutive ranks (the
    sites) and builds, for this rank, the group of its site (the gradient seam reduces over
    it every step) and the outer group of the ranks at its position in every site.
    :func:`split_fragments` splits the parameters (in FQN order) into contiguous fragments
    balanced by element count, every parameter in exactly one; :func:`fragment_due` says
    which fragments synchronize after a given count of inner steps (fragment ``i`` after the
    steps ``t`` with ``t % H == (i * H) // F``). :class:`DenseOuterExchange` averages a
    fragment's flat fp32 pseudo-gradient over the outer group (one rank per site) with one
    all-reduce, blocking (``average``) or asynchronous (``start``, for ``--outer-delay``).
    :func:`make_outer_exchange` builds the exchange ``--outer-compression`` names: this
    dense one for ``none``, else the compressed
    :class:`~megatron_ext.collectives.outer_exchange.OuterExchange` of that data-parallel
    method.

Why:
    Inside a site training is ordinary data parallelism; only the outer step crosses sites.
    Streaming DiLoCo (Douillard et al., 2025) spreads the outer exchange over the interval:
    one fragment at a time instead of every parameter at once. Every exchange has one
    interface (:class:`~megatron_ext.protocols.PseudoGradientExchange`), so the outer step
    (``hook.py``) does not know which one it holds.

Constraints:
    torch.distributed only; never imports Megatron. :func:`site_groups` is collective: every
    rank of the world calls it, in the same order (``new_group`` is collective). The
    fragment schedule is pure Python: the same answer on every rank and site (it is by
    iteration). The dense exchange sums then divides (gloo has no AVG) and holds no state.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed import ProcessGroup

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.optim.diloco.overlap import PendingAverage

# The names --outer-compression takes (each but "none" is an OuterExchange with that
# data-parallel method's compression); defined with the options, which need no torch.
from megatron_ext.options.outer import OUTER_EXCHANGES
from megatron_ext.protocols import PseudoGradientExchange

__all__ = [
    "site_groups",
    "split_fragments",
    "fragment_due",
    "DenseOuterExchange",
    "ExchangeFactory",
    "make_outer_exchange",
]

ExchangeFactory = Callable[..., PseudoGradientExchange]
"""What builds a fragment's exchange: :func:`make_outer_exchange`'s signature."""


def site_groups(
    dp_group: torch.distributed.ProcessGroup, num_sites: int
) -> Tuple[torch.distributed.ProcessGroup, torch.distributed.ProcessGroup, int]:
    """Process groups of the sites: ``(inner, outer, site)`` for this rank.

    The ranks of every data-parallel group (there is one per tensor/pipeline position) are
    split into ``num_sites`` runs of consecutive data-parallel ranks. ``inner`` is this
    rank's site (the gradient seam reduces over it), ``outer`` the ranks at this rank's
    position in every site (the outer exchange), ``site`` this rank's site index. Every
    rank of the world must call this, in the same order (``new_group`` is collective).

    Raises:
        ValueError: the data-parallel size is not a multiple of ``num_sites``.
    """
    dist = torch.distributed
    ranks = dist.get_process_group_ranks(dp_group)
    dp = len(ranks)
    if num_sites < 1 or dp % num_sites:
        raise ValueError(f"{num_sites} sites do not divide the data-parallel size {dp}")
    everyone: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    all_dp_groups = sorted({tuple(r) for r in everyone})
    per_site = dp // num_sites
    me = dist.get_rank()
    inner = outer = None
    site = -1
    for group_ranks in all_dp_groups:
        for s in range(num_sites):
            members = list(group_ranks[s * per_site : (s + 1) * per_site])
            pg = dist.new_group(members)
            if me in members:
                inner, site = pg, s
        for j in range(per_site):
            members = [group_ranks[s * per_site + j] for s in range(num_sites)]
            pg = dist.new_group(members)
            if me in members:
                outer = pg
    return inner, outer, site


def split_fragments(sizes: Sequence[Tuple[str, int]], num_fragments: int) -> List[List[str]]:
    """Split ``(fqn, numel)`` pairs, in the given order, into contiguous fragments balanced
    by element count; every parameter lands in exactly one fragment (some may be empty when
    one parameter outweighs a fragment's share)."""
    total = sum(n for _, n in sizes)
    out: List[List[str]] = [[] for _ in range(num_fragments)]
    start = 0
    for fqn, n in sizes:
        mid2 = 2 * start + n  # twice the midpoint, kept in integers
        k = min(num_fragments - 1, (mid2 * num_fragments) // (2 * max(total, 1)))
        out[k].append(fqn)
        start += n
    return out


def fragment_due(steps_taken: int, interval: int, num_fragments: int) -> List[int]:
    """The fragments synchronized once ``steps_taken`` (>= 1) inner steps are done."""
    phase = steps_taken % interval
    return [i for i in range(num_fragments) if (i * interval) // num_fragments == phase]


class DenseOuterExchange:
    """The dense pseudo-gradient exchange: an all-reduce mean over the outer group.

    A :class:`~megatron_ext.protocols.AsynchronousPseudoGradientExchange` (``start``); it
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
        self,
        method: str,
        options: Any,
        numel: int,
        group: Optional[ProcessGroup],
        device: torch.device,
        **layout: Any,
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
    method: str,
    options: Any,
    numel: int,
    group: Optional[ProcessGroup],
    device: torch.device,
    **layout: Any,
) -> PseudoGradientExchange:
    """The outer exchange called ``method`` (``--outer-compression``).

    ``options``: the compressed exchange's options (the options dataclass of its
    data-parallel method; None: its defaults); the dense exchange takes none.
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
