"""Traffic-shaping settings and the ``tc`` command lines that install them.

What it does:
    :func:`parse_rate`, :func:`parse_time` and :func:`parse_loss` validate the user's
    ``--bandwidth`` / ``--latency`` / ``--loss`` strings (tc syntax) and normalise them into
    :class:`LinkShape`. :func:`tc_commands` returns the ``tc`` argument lists that shape the
    egress of one rank's interface:

    * all traffic (``destinations=None``): a ``tbf`` root qdisc at the rate, with a
      ``netem`` child for delay and loss when asked for;
    * traffic to some destinations only: an ``htb`` root whose default class is effectively
      unlimited (:data:`UNSHAPED_RATE_BPS`), one class at the rate per shaped destination
      selected by a ``u32`` filter on the destination IP, and a ``netem`` leaf for delay and
      loss.

Why:
    Shaping is installed at each sender, so each direction of a link is shaped once and a
    link's one-way rate is the given bandwidth. Generating the commands in pure functions
    lets the unit tests check them without root.

Constraints:
    Pure Python, no subprocesses. ``--latency`` and ``--loss`` need the kernel's ``netem``
    qdisc (``CONFIG_NET_SCH_NETEM``); ``tbf``, ``htb`` and ``u32`` are needed in any case.
    The added delay is one way per direction, so a round trip gains twice ``--latency``.
    Rates are decimal (``100mbit`` = 100e6 bit/s = 12.5 MB/s), as in tc.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import List, Mapping, Optional

__all__ = [
    "UNSHAPED_RATE_BPS",
    "LinkShape",
    "format_rate",
    "parse_loss",
    "parse_rate",
    "parse_time",
    "tbf_burst_bytes",
    "tc_commands",
]

# Multipliers of tc's rate units (tc(8), "RATES"): SI prefixes are powers of 1000, IEC
# prefixes powers of 1024; "bit" units count bits, "bps" units count bytes.
_RATE_UNITS = {}
for _prefix, _factor in (
    ("", 1),
    ("k", 1000),
    ("m", 1000**2),
    ("g", 1000**3),
    ("t", 1000**4),
    ("ki", 1024),
    ("mi", 1024**2),
    ("gi", 1024**3),
    ("ti", 1024**4),
):
    _RATE_UNITS[_prefix + "bit"] = _factor
    _RATE_UNITS[_prefix + "bps"] = 8 * _factor

_TIME_UNITS = {
    "s": 1_000_000,
    "sec": 1_000_000,
    "secs": 1_000_000,
    "ms": 1000,
    "msec": 1000,
    "msecs": 1000,
    "us": 1,
    "usec": 1,
    "usecs": 1,
}

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")

MIN_RATE_BPS = 8_000
"""Lowest accepted rate (8kbit = 1 kB/s); slower links make a training run pointless."""

UNSHAPED_RATE_BPS = 100 * 1000**3
"""Rate of the htb default class that carries unshaped traffic: 100gbit, far above what a
veth pair moves (1-2 GB/s of TCP measured on the development machine), so it never limits."""

MAX_RATE_BPS = UNSHAPED_RATE_BPS
"""Highest accepted rate; a shaped class must stay below the unshaped default class."""

_TBF_QUEUE_LATENCY = "50ms"
"""Longest time a packet may wait in tbf's queue; tc sizes the queue from it (bytes =
rate * latency + burst). 50 ms absorbs TCP bursts without building a large standing queue."""

_HTB_MAX_QUANTUM = 200_000
"""htb warns about quantums above 200000 bytes; per-class quantums are clamped to it."""


def _split(text: str, what: str) -> tuple:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {text!r}")
    match = _NUMBER_UNIT.match(text)
    if not match:
        raise ValueError(f"cannot parse {what} {text!r}")
    return float(match.group(1)), match.group(2).lower()


def parse_rate(text: str) -> int:
    """Parse a tc rate such as ``100mbit``, ``1gbit``, ``12.5mbps`` or ``512kibit``.

    A unit is required: tc reads a bare number as bit/s, which is rarely what a user
    typing ``--bandwidth 100`` means.

    Args:
        text: Rate in tc syntax (units are case-insensitive).

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: The string does not parse, has no or an unknown unit, or the rate is
            outside ``[MIN_RATE_BPS, MAX_RATE_BPS]``.
    """
    value, unit = _split(text, "rate")
    if not unit:
        raise ValueError(f"rate {text!r} has no unit; write e.g. '{text.strip()}mbit'")
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"unknown rate unit {unit!r} in {text!r}; use tc units such as kbit, mbit, gbit, "
            "mbps (bytes/s) or mibit"
        )
    rate = int(round(value * _RATE_UNITS[unit]))
    if not MIN_RATE_BPS <= rate <= MAX_RATE_BPS:
        raise ValueError(
            f"rate {text!r} = {rate} bit/s is outside [{format_rate(MIN_RATE_BPS)}, "
            f"{format_rate(MAX_RATE_BPS)}]"
        )
    return rate


def format_rate(rate_bps: int) -> str:
    """Short human form of a rate in bit/s, e.g. ``100mbit`` (decimal prefixes)."""
    for factor, unit in ((1000**3, "gbit"), (1000**2, "mbit"), (1000, "kbit")):
        if rate_bps >= factor:
            return f"{rate_bps / factor:g}{unit}"
    return f"{rate_bps}bit"


def parse_time(text: str) -> int:
    """Parse a tc time such as ``10ms``, ``0.5ms``, ``250us`` or ``1s``.

    Args:
        text: Time in tc syntax; a unit is required.

    Returns:
        The time in whole microseconds (at least 1).

    Raises:
        ValueError: The string does not parse, has no or an unknown unit, or the time is
            not in ``(0, 10s]``.
    """
    value, unit = _split(text, "time")
    if unit not in _TIME_UNITS:
        raise ValueError(f"time {text!r} needs a unit: s, ms or us (e.g. '10ms')")
    micros = value * _TIME_UNITS[unit]
    if not 0 < micros <= 10_000_000:
        raise ValueError(f"time {text!r} must be greater than 0 and at most 10s")
    return max(1, int(round(micros)))


def parse_loss(text: str) -> float:
    """Parse a packet-loss probability such as ``0.1%`` (the ``%`` is optional).

    Returns:
        The loss in percent, in ``(0, 100)``.

    Raises:
        ValueError: The string does not parse or the percentage is out of range.
    """
    value, unit = _split(text, "loss")
    if unit not in ("", "%"):
        raise ValueError(f"loss {text!r} must be a percentage such as '0.1%'")
    if not 0 < value < 100:
        raise ValueError(f"loss {text!r} must be greater than 0% and below 100%")
    return value


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """Validated shaping of one direction of a link."""

    rate_bps: int
    """One-way rate in bits per second."""

    delay_us: Optional[int] = None
    """Added one-way delay in microseconds (netem), or ``None`` for none."""

    loss_percent: Optional[float] = None
    """Random packet loss in percent (netem), or ``None`` for none."""

    @classmethod
    def from_strings(
        cls, bandwidth: str, latency: Optional[str] = None, loss: Optional[str] = None
    ) -> "LinkShape":
        """Build from tc-syntax strings, validating each (``ValueError`` on bad input)."""
        return cls(
            rate_bps=parse_rate(bandwidth),
            delay_us=parse_time(latency) if latency else None,
            loss_percent=parse_loss(loss) if loss else None,
        )

    @property
    def needs_netem(self) -> bool:
        """Whether delay or loss is asked for (both need the netem qdisc)."""
        return self.delay_us is not None or self.loss_percent is not None

    def describe(self) -> str:
        """One-line summary, e.g. ``100mbit, +10ms delay, 0.1% loss``."""
        parts = [format_rate(self.rate_bps)]
        if self.delay_us is not None:
            parts.append(f"+{self.delay_us / 1000:g}ms delay")
        if self.loss_percent is not None:
            parts.append(f"{self.loss_percent:g}% loss")
        return ", ".join(parts)


def tbf_burst_bytes(rate_bps: int) -> int:
    """Token-bucket size for a rate: 4 ms worth of traffic, at least 16 KiB.

    The bucket must hold more than one timer tick of traffic or the qdisc cannot reach its
    rate, and at least a few full-size packets; larger buckets let short bursts exceed the
    rate. At 100mbit this gives 50000 bytes, which measured 12.0 MB/s of TCP payload, at
    the ceiling of about 11.96 MB/s left after Ethernet/IP/TCP headers (1448 of 1514 bytes).
    """
    return max(16 * 1024, int(rate_bps / 8 * 0.004))


def _htb_quantum(rate_bps: int) -> int:
    return min(_HTB_MAX_QUANTUM, max(1600, rate_bps // 8 // 10))


def _netem_args(shape: LinkShape) -> List[str]:
    args = ["netem"]
    if shape.delay_us is not None:
        args += ["delay", f"{shape.delay_us}us"]
    if shape.loss_percent is not None:
        args += ["loss", f"{shape.loss_percent:g}%"]
    # netem queues every packet that is being delayed; its default limit of 1000 packets
    # drops traffic once the bandwidth-delay product exceeds it. Allow twice the product in
    # 1000-byte packets.
    delay_s = (shape.delay_us or 0) / 1e6
    limit = max(1000, math.ceil(2 * shape.rate_bps / 8 * delay_s / 1000))
    return args + ["limit", str(limit)]


def tc_commands(
    shape: Optional[LinkShape], dev: str, destinations: Optional[Mapping[int, str]] = None
) -> List[List[str]]:
    """``tc`` command lines that shape the egress of one interface.

    The lists start with ``"tc"``; the caller runs them inside the interface's network
    namespace (``ip netns exec NS tc ...``).

    Args:
        shape: Rate, delay and loss; ``None`` means no shaping (no commands).
        dev: Interface name inside the namespace.
        destinations: ``None`` shapes all traffic leaving ``dev`` (tbf). Otherwise a map
            from destination rank to its IPv4 address: only traffic to these addresses is
            shaped (htb), and an empty map yields no commands.

    Returns:
        The command lines, to be run in order.
    """
    if shape is None:
        return []
    burst = str(tbf_burst_bytes(shape.rate_bps))
    rate = f"{shape.rate_bps}bit"
    if destinations is None:
        commands = [
            ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf"]
            + ["rate", rate, "burst", burst, "latency", _TBF_QUEUE_LATENCY]
        ]
        if shape.needs_netem:
            commands.append(
                ["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
                + _netem_args(shape)
            )
        return commands
    if not destinations:
        return []
    unshaped_rate = f"{UNSHAPED_RATE_BPS}bit"
    unshaped_burst = str(tbf_burst_bytes(UNSHAPED_RATE_BPS))
    commands = [
        ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
        ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb"]
        + ["rate", unshaped_rate, "quantum", str(_HTB_MAX_QUANTUM)]
        + ["burst", unshaped_burst, "cburst", unshaped_burst],
    ]
    for dst_rank in sorted(destinations):
        # Class and netem handle ids are hexadecimal in tc; 0x100 + rank keeps them
        # readable (rank 0 -> 1:100, rank 10 -> 1:10a) and clear of the default class 1:1.
        minor = f"{0x100 + dst_rank:x}"
        classid = f"1:{minor}"
        commands.append(
            ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb"]
            + ["rate", rate, "ceil", rate, "quantum", str(_htb_quantum(shape.rate_bps))]
            + ["burst", burst, "cburst", burst]
        )
        if shape.needs_netem:
            commands.append(
                ["tc", "qdisc", "add", "dev", dev, "parent", classid, "handle", f"{minor}:"]
                + _netem_args(shape)
            )
        commands.append(
            ["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1"]
            + ["u32", "match", "ip", "dst", f"{destinations[dst_rank]}/32", "flowid", classid]
        )
    return commands
