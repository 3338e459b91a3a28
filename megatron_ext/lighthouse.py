"""``megatron-ext lighthouse``: torchft's lighthouse for DiLoCo sites that fail alone.

What it does:
    Starts torchft's ``LighthouseServer`` (the same server as torchft's ``torchft_lighthouse``
    binary) in this process, prints one line with its address (``lighthouse: http://...``),
    and serves until SIGINT or SIGTERM. Every site's job then passes
    ``--outer-transport torchft --outer-lighthouse <address> --outer-site-id <i>``.

    The lighthouse forms a quorum of the sites at each outer step: at once when every site
    that heartbeats has asked; otherwise, with at least ``--min-replicas`` asking, after
    ``--join-timeout-ms`` (a site that heartbeats but is slow to reach the outer step, e.g.
    one that is starting up). A site whose heartbeat is older than
    ``--heartbeat-timeout-ms`` is dead and no longer waited for: this bounds the time from a
    site's death to the survivors' next outer step (plus ``--outer-timeout`` when it died
    during the exchange). Choose ``--join-timeout-ms`` above the time of H inner steps, so
    a site that starts or restarts waits for the others' next outer step instead of forming
    a quorum of its own.

Constraints:
    Needs torchft (its native extension). Binds the address given (default loopback).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import List, Optional

__all__ = ["main", "start_lighthouse"]


def start_lighthouse(
    *,
    min_replicas: int,
    bind: str = "127.0.0.1:29510",
    join_timeout_ms: int = 60000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
):
    """torchft's ``LighthouseServer`` (``address()``, ``shutdown()``) on ``bind``."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ext lighthouse",
        description="Serve torchft's lighthouse for DiLoCo sites (--outer-transport torchft).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        required=True,
        help="Fewest sites that form a quorum (below it the outer step waits).",
    )
    parser.add_argument(
        "--bind", default="127.0.0.1:29510", help="host:port to serve on (port 0: any free)."
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="How long a quorum waits for sites that heartbeat but have not asked yet.",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="A site whose last heartbeat is older is dead (dropped from the next quorum).",
    )
    parser.add_argument(
        "--quorum-tick-ms", type=int, default=100, help="How often a pending quorum is checked."
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("min_replicas", "join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    from megatron_ext.optim.diloco_ft import torchft_missing

    missing = torchft_missing()
    if missing:
        print(f"megatron-ext lighthouse: {missing}", file=sys.stderr)
        return 2
    server = start_lighthouse(
        min_replicas=args.min_replicas,
        bind=args.bind,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    # The server reports the machine's host name; a loopback bind is reached on 127.0.0.1.
    address = server.address()
    host, _, port = args.bind.rpartition(":")
    if host in ("127.0.0.1", "localhost"):
        address = f"http://{host}:{address.rsplit(':', 1)[1]}"
    print(f"lighthouse: {address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
