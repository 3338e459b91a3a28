"""Options of DiLoCo (``--outer-*``) and of its outer exchanges (``--outer-compression``).

What: :class:`OuterConfig` is DiLoCo's options dataclass (the method,
``megatron_ext.methods.diloco``, registers it); :data:`OUTER_EXCHANGES` names the exchanges
``megatron_ext.optim.diloco`` builds; every one but ``none`` compresses the pseudo-gradient the
way that data-parallel method compresses a gradient, with that method's options dataclass
(:data:`OUTER_EXCHANGE_OPTIONS`).

Why a leaf module: the option checks run while flags are parsed, before torch is imported, and
the outer step (``megatron_ext.optim.diloco``, ``megatron_ext.optim.diloco_ft``) and the exchange
(``megatron_ext.collectives.outer_exchange``) read these options without importing the method
registry.
"""

from __future__ import annotations

from dataclasses import field
from typing import Dict, Optional, Tuple

from megatron_ext.options.base import (
    RUN_ONLY,
    ConfigError,
    arg,
    check_choice,
    check_positive,
    flag_of,
    options_dataclass,
)
from megatron_ext.options.powersgd import PowerSGDConfig
from megatron_ext.options.quantized import QuantizedConfig
from megatron_ext.options.radius import RadiusConfig
from megatron_ext.options.separate import SeparateConfig

__all__ = ["OuterConfig", "OUTER_EXCHANGES", "OUTER_EXCHANGE_OPTIONS"]

OUTER_EXCHANGES: Tuple[str, ...] = ("none", "quantized", "radius", "separate", "powersgd")
"""Names ``megatron_ext.optim.diloco.make_outer_exchange`` builds (``--outer-compression``):
``none`` is the dense all-reduce; the others are
``megatron_ext.collectives.outer_exchange.OuterExchange`` with that data-parallel method's
compression."""

OUTER_EXCHANGE_OPTIONS: Dict[str, type] = {
    "quantized": QuantizedConfig,
    "radius": RadiusConfig,
    "separate": SeparateConfig,
    "powersgd": PowerSGDConfig,
}
"""The options dataclass of each compressed outer exchange (its data-parallel method's)."""


_STATE_DEVICES = ("device", "cpu")
_TRANSPORTS = ("world", "torchft")


@options_dataclass(group="megatron-ext: outer synchronization (DiLoCo)", prefix="outer")
class OuterConfig:
    """DiLoCo: sites train apart for H steps, then average their pseudo-gradients."""

    interval: int = 100
    """H: inner steps between two outer synchronizations of a fragment (DiLoCo paper: 500;
    torchft's sync_every)."""

    lr: float = 0.7
    """Outer learning rate (DiLoCo paper: 0.7)."""

    momentum: float = 0.9
    """Outer momentum (DiLoCo paper: 0.9)."""

    nesterov: bool = True
    """Nesterov momentum in the outer SGD step (DiLoCo paper: on)."""

    groups: Optional[int] = None
    """G: the data-parallel ranks form G sites of consecutive ranks; inside a site ordinary
    data parallelism every step, across sites only the outer synchronization. Default: the
    data-parallel size (each rank its own site: pure DiLoCo)."""

    fragments: int = 1
    """F: streaming DiLoCo; the parameters are split into F fragments (contiguous in FQN
    order, balanced by size) and fragment i is synchronized at offset i*H/F of each cycle of
    H steps."""

    delay: int = 0
    """tau: inner steps a fragment's exchange overlaps (Streaming DiLoCo's tau, torchft's
    fragment_sync_delay): its pseudo-gradient is sent after step t and applied after step
    t + tau; 0: blocking, applied at once. tau < H. A compressed exchange
    (--outer-compression) then runs on a worker thread."""

    merge_alpha: float = 0.0
    """alpha: after the outer step the fragment's weights become alpha * local + (1 - alpha)
    * global (Streaming DiLoCo's alpha, torchft's fragment_update_alpha); 0: the global
    weights (the sites agree after every sync)."""

    state_device: str = field(default="device", metadata=arg(choices=_STATE_DEVICES))
    """Where the fp32 outer state (last synchronized parameters, outer momentum) lives:
    'device' (the parameters' device) or 'cpu' (host memory)."""

    compression: str = "none"
    """Compression of the pseudo-gradient exchange, error feedback kept across outer syncs:
    'none' (dense fp32 all-reduce), 'quantized' (4-bit rows of 256, as Streaming DiLoCo),
    'radius' (top-k of 1/64 per chunk of 4096, as SparseLoCo), 'separate' (ratio 16),
    'powersgd' (rank 4). The exchange's own settings are these defaults, not the
    --quantized-* / --radius-* / --separate-* / --powersgd-* flags (those configure
    --grad-compression inside a site)."""

    transport: str = field(default="world", metadata=arg(choices=_TRANSPORTS))
    """How the sites talk at an outer step: 'world' (every site is a run of data-parallel
    ranks of one torch.distributed world, --outer-groups; a failure anywhere stops every
    site) or 'torchft' (each site is its own job, this one; the outer step goes through
    torchft's Manager and lighthouse: a dead site is dropped at the next quorum, a started or
    restarted one recovers the global state from a live peer; megatron_ext/optim/diloco_ft.py)."""

    site_id: Optional[int] = None
    """With --outer-transport torchft: this job's site (torchft replica id), unique among the
    sites; a restarted site keeps its id."""

    sites: Optional[int] = None
    """With --outer-transport torchft: N, the site ids are 0..N-1; each site trains on its
    own 1/N of the training samples (disjoint shards: megatron_ext/train.py; in
    pretrain_gpt.py megatron_ext/megatron/lm/session.py)."""

    lighthouse: Optional[str] = field(default=None, metadata=RUN_ONLY)
    """With --outer-transport torchft: the lighthouse address, e.g. http://host:29510
    (megatron-ext lighthouse starts one). Default: the TORCHFT_LIGHTHOUSE environment variable."""

    min_sites: int = field(default=1, metadata=RUN_ONLY)
    """With --outer-transport torchft: an outer step commits only with at least this many
    sites present (torchft's min_replica_size); with fewer, the sites wait (up to
    --outer-quorum-timeout) for others."""

    quorum_timeout: float = field(default=600.0, metadata=RUN_ONLY)
    """With --outer-transport torchft: seconds an outer step may wait for its quorum (the
    other sites reaching the same step, a dead one being dropped); training stops with an
    error past it."""

    timeout: float = field(default=60.0, metadata=RUN_ONLY)
    """With --outer-transport torchft: seconds for the exchange's collectives and a live
    recovery's transfer; a failed attempt is retried over the sites still alive."""

    def __post_init__(self):
        cls = type(self)
        check_positive(cls, "interval", self.interval)
        check_positive(cls, "lr", self.lr)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(flag_of(cls, "momentum"), f"must be in [0, 1), got {self.momentum}")
        if self.groups is not None:
            check_positive(cls, "groups", self.groups)
        check_positive(cls, "fragments", self.fragments)
        if self.fragments > self.interval:
            raise ConfigError(
                [flag_of(cls, "fragments"), flag_of(cls, "interval")],
                f"{self.fragments} fragments need an interval of at least as many steps, got "
                f"{self.interval}",
            )
        check_positive(cls, "delay", self.delay, allow_zero=True)
        if self.delay >= self.interval:
            raise ConfigError(
                [flag_of(cls, "delay"), flag_of(cls, "interval")],
                f"a fragment's exchange must land before its next one: delay {self.delay} "
                f"needs an interval above it, got {self.interval}",
            )
        if not 0.0 <= self.merge_alpha <= 1.0:
            raise ConfigError(
                flag_of(cls, "merge_alpha"), f"must be in [0, 1], got {self.merge_alpha}"
            )
        check_choice(cls, "state_device", self.state_device)
        if self.compression not in OUTER_EXCHANGES:
            raise ConfigError(
                flag_of(cls, "compression"),
                f"unknown exchange {self.compression!r} (choose from "
                f"{', '.join(OUTER_EXCHANGES)})",
            )
        check_choice(cls, "transport", self.transport)
        check_positive(cls, "min_sites", self.min_sites)
        check_positive(cls, "quorum_timeout", self.quorum_timeout)
        check_positive(cls, "timeout", self.timeout)
        if self.transport == "torchft":
            _check_torchft(self)

    def num_sites(self, dp: int) -> int:
        """G for a data-parallel size ``dp`` (sites inside this world: 1 with torchft, where
        the whole job is one site)."""
        if self.transport == "torchft":
            return 1
        return dp if self.groups is None else self.groups


def _check_torchft(o: OuterConfig) -> None:
    """What --outer-transport torchft cannot serve (yet), refused naming the flags."""
    cls = type(o)
    t = flag_of(cls, "transport")
    if o.site_id is None or o.site_id < 0:
        raise ConfigError([t, flag_of(cls, "site_id")], "each site needs its id (0, 1, ...)")
    if o.sites is None or not 0 <= o.site_id < o.sites:
        raise ConfigError(
            [flag_of(cls, "sites"), flag_of(cls, "site_id")],
            f"the site ids are 0 .. N-1 for N sites (each reads its own 1/N of the data): "
            f"got site {o.site_id} of {o.sites}",
        )
    if o.min_sites > o.sites:
        raise ConfigError(
            [flag_of(cls, "min_sites"), flag_of(cls, "sites")],
            f"{o.min_sites} sites per outer step cannot be reached with {o.sites} sites",
        )
    if o.groups not in (None, 1):
        raise ConfigError(
            [t, flag_of(cls, "groups")],
            "with torchft each job is one site (its data-parallel ranks reduce every step); "
            "start one job per site instead of --outer-groups",
        )
    # torchft's Manager takes one step at a time (quorum, collectives, commit vote): a
    # fragment's overlapped outer step must be voted on before the next fragment's quorum.
    gap = min(
        ((i + 1) * o.interval) // o.fragments - (i * o.interval) // o.fragments
        for i in range(o.fragments)
    )
    if o.delay >= gap:
        raise ConfigError(
            [t, flag_of(cls, "delay"), flag_of(cls, "fragments")],
            f"over torchft a fragment's exchange must land before the next fragment's outer "
            f"step starts (one torchft step at a time): delay {o.delay} must be below "
            f"{gap}, the fewest steps between two fragments' outer steps",
        )
