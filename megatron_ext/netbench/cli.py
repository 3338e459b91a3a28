"""``megatron-ext netbench``: run a training command over shaped links and report the timing.

What it does:
    ``megatron-ext netbench [options] -- COMMAND...`` builds a :class:`ShapedNetwork` with
    ``--nproc`` rank namespaces, shapes the links selected by ``--shape`` (``all``, ``pp``,
    ``dp``, or ``sites`` with ``--sites S``: only links between S sites of consecutive
    data-parallel ranks) to ``--bandwidth`` (with optional ``--latency`` / ``--loss``),
    measures a few links, starts COMMAND once per rank inside its namespace with the torchrun environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and ``GLOO_SOCKET_IFNAME``, and prints
    a summary (measured MB/s per link, exit codes, wall time). ``--unshaped`` runs the same
    namespaces without tc, which is the baseline to compare against. ``--report`` writes
    the same facts as JSON.

Why:
    Users ask how much faster training runs with compression at their bandwidth; running
    the unmodified command twice (shaped and ``--unshaped``, or shaped with and without
    compression flags) answers it with real TCP.

Constraints:
    Root and iproute2 are required; bad flags, missing root or tools exit with code 2 and
    a one-line message. COMMAND must use the gloo backend (NCCL on one machine would use
    shared memory or NVLink and bypass the shaped interfaces). The exit code is 0 when all
    ranks succeed, 124 on ``--timeout``, otherwise the failing rank's code (128 + signal
    number for a rank killed by a signal). Never imports torch or Megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import List, Optional, Sequence, Tuple

from megatron_ext.netbench.netns import (
    DEFAULT_MASTER_PORT,
    LinkMeasurement,
    NetbenchError,
    NetbenchUnavailableError,
    RankRunResult,
    ShapedNetwork,
    cleanup_stale,
)
from megatron_ext.netbench.shaping import parse_loss, parse_rate, parse_time
from megatron_ext.netbench.topology import SCOPES, ParallelLayout

__all__ = ["build_parser", "main"]

_PROG = "megatron-ext netbench"
_USAGE_EXIT = 2
_TIMEOUT_EXIT = 124


class _UsageError(Exception):
    """A bad flag or combination; reported as one line with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # noqa: D102 - argparse hook
        raise _UsageError(message)


def _validated(parse):
    def convert(text: str):
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        return text

    convert.__name__ = parse.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``megatron-ext netbench`` (options before ``--``)."""
    parser = _Parser(
        prog=_PROG,
        usage=f"{_PROG} [options] -- COMMAND...",
        description=(
            "Run COMMAND once per rank, each rank in its own network namespace, with the "
            "links between ranks shaped by tc. Needs root and iproute2."
        ),
    )
    parser.add_argument("--nproc", type=int, default=2, help="Number of ranks (default 2).")
    parser.add_argument(
        "--bandwidth",
        type=_validated(parse_rate),
        default="100mbit",
        help="One-way rate of each shaped link, tc syntax (default 100mbit = 12.5 MB/s).",
    )
    parser.add_argument(
        "--latency",
        type=_validated(parse_time),
        default=None,
        help="Added one-way delay per shaped link, e.g. 10ms (needs the netem qdisc).",
    )
    parser.add_argument(
        "--loss",
        type=_validated(parse_loss),
        default=None,
        help="Random packet loss per shaped link, e.g. 0.1%% (needs the netem qdisc).",
    )
    parser.add_argument(
        "--shape",
        choices=SCOPES,
        default="all",
        help="Which links to shape: all, pp (between pipeline stages), dp (between "
        "data-parallel peers) or sites (between the --sites groups of consecutive "
        "data-parallel ranks); uses --tp/--pp for the rank layout.",
    )
    parser.add_argument(
        "--sites",
        type=int,
        default=None,
        help="With --shape sites: number of sites S >= 2; the data-parallel ranks are split "
        "into S blocks of consecutive DP ranks (each across every tp/pp coordinate) and only "
        "links between different sites are shaped. The DP size must be divisible by S.",
    )
    parser.add_argument("--tp", type=int, default=1, help="Tensor-parallel size (default 1).")
    parser.add_argument("--pp", type=int, default=1, help="Pipeline-parallel size (default 1).")
    parser.add_argument(
        "--check-seconds",
        type=float,
        default=1.5,
        help="Seconds of traffic per measured link before the run (default 1.5).",
    )
    parser.add_argument(
        "--check-links",
        type=int,
        default=4,
        help="Most shaped links to measure; one unshaped link is added (default 4).",
    )
    parser.add_argument("--no-check", action="store_true", help="Skip the link measurement.")
    parser.add_argument(
        "--unshaped",
        action="store_true",
        help="Same namespaces without any tc shaping: the baseline.",
    )
    parser.add_argument("--report", metavar="PATH", help="Write a JSON report to PATH.")
    parser.add_argument(
        "--show-all-ranks",
        action="store_true",
        help="Print every rank's output (default: rank 0 and the last rank).",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="Stop all ranks after this many seconds."
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"MASTER_PORT of the ranks (default {DEFAULT_MASTER_PORT}).",
    )
    return parser


def _split_command(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise _UsageError("missing '-- COMMAND...' (the training command to run per rank)")
    cut = argv.index("--")
    command = argv[cut + 1 :]
    if not command:
        raise _UsageError("empty COMMAND after '--'")
    return argv[:cut], command


def _parse(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str], ParallelLayout]:
    options, command = _split_command(argv)
    args = build_parser().parse_args(options)
    if args.nproc < 2:
        raise _UsageError(f"--nproc must be at least 2, got {args.nproc}")
    if args.check_seconds <= 0:
        raise _UsageError("--check-seconds must be positive")
    if args.check_links < 0:
        raise _UsageError("--check-links must be >= 0")
    if args.unshaped and (args.latency or args.loss or args.shape != "all"):
        raise _UsageError("--unshaped cannot be combined with --latency, --loss or --shape")
    if args.shape == "sites" and args.sites is None:
        raise _UsageError("--shape sites needs --sites S (the number of sites, at least 2)")
    if args.sites is not None and args.shape != "sites":
        raise _UsageError(f"--sites applies only to --shape sites, not --shape {args.shape}")
    if args.sites is not None and args.sites < 2:
        raise _UsageError(f"--sites must be at least 2, got {args.sites}")
    try:
        layout = ParallelLayout(args.nproc, tp_size=args.tp, pp_size=args.pp)
    except ValueError as exc:
        raise _UsageError(f"--nproc/--tp/--pp: {exc}") from exc
    if args.sites is not None:
        if layout.dp_size % args.sites:
            raise _UsageError(
                f"--sites {args.sites} does not divide the data-parallel size {layout.dp_size} "
                f"(--nproc {args.nproc} / (--tp {args.tp} * --pp {args.pp})); every site "
                "needs the same number of data-parallel ranks"
            )
        layout = ParallelLayout(args.nproc, tp_size=args.tp, pp_size=args.pp, sites=args.sites)
    if not args.unshaped and args.shape != "all" and not layout.pairs(args.shape):
        raise _UsageError(
            f"--shape {args.shape} selects no links with --nproc {args.nproc} --tp {args.tp} "
            f"--pp {args.pp} (the {args.shape} size is 1)"
        )
    return args, command, layout


def _print_summary(
    network: ShapedNetwork,
    layout: ParallelLayout,
    links: List[LinkMeasurement],
    result: RankRunResult,
) -> None:
    print(f"\nnetbench summary: {network.num_ranks} ranks, {network.describe_shaping()}")
    if links:
        num_shaped = len(network.shaped_pairs)
        measured = sum(1 for m in links if m.shaped)
        print(f"{'link':<10} {'kind':<16} {'shaped':<7} {'MB/s':>10}")
        for m in links:
            link = f"{m.src} -> {m.dst}"
            kind = _link_kind(layout, m.src, m.dst)
            print(f"{link:<10} {kind:<16} {'yes' if m.shaped else 'no':<7} {m.mb_per_s:>10.2f}")
        if num_shaped:
            print(f"(measured {measured} of {num_shaped} shaped directed links)")
    codes = " ".join("?" if c is None else str(c) for c in result.exit_codes)
    print(f"rank exit codes: {codes}{'  (timed out)' if result.timed_out else ''}")
    print(f"wall time: {result.wall_time_s:.2f} s")
    if result.interface_bytes:
        sent = " ".join(f"{c['tx_bytes'] / 1e6:.2f}" for c in result.interface_bytes)
        print(f"MB sent per rank (interface counters, headers included): {sent}")


def _link_kind(layout: ParallelLayout, src: int, dst: int) -> str:
    kind = layout.classify(src, dst)
    if layout.sites > 1:
        same = layout.site(src) == layout.site(dst)
        kind += f" (site {layout.site(src)}{'' if same else f'->{layout.site(dst)}'})"
    return kind


def _exit_code(result: RankRunResult) -> int:
    if result.timed_out:
        return _TIMEOUT_EXIT
    if result.failed_rank is None:
        return 0
    code = result.exit_codes[result.failed_rank]
    if code is None:
        return 1
    return 128 - code if code < 0 else code


def _report(
    args: argparse.Namespace,
    command: List[str],
    layout: ParallelLayout,
    network: ShapedNetwork,
    links: List[LinkMeasurement],
    result: RankRunResult,
) -> dict:
    return {
        "settings": {
            "nproc": args.nproc,
            "bandwidth": None if args.unshaped else args.bandwidth,
            "latency": args.latency,
            "loss": args.loss,
            "shape": None if args.unshaped else args.shape,
            "unshaped": args.unshaped,
            "tp": layout.tp_size,
            "pp": layout.pp_size,
            "dp": layout.dp_size,
            "sites": layout.sites if layout.sites > 1 else None,
            "check_seconds": None if args.no_check else args.check_seconds,
            "shaping": network.describe_shaping(),
            "num_shaped_links": len(network.shaped_pairs),
        },
        "command": command,
        "link_check": [
            dict(
                dataclasses.asdict(m),
                kind=layout.classify(m.src, m.dst),
                **(
                    {"src_site": layout.site(m.src), "dst_site": layout.site(m.dst)}
                    if layout.sites > 1
                    else {}
                ),
            )
            for m in links
        ],
        "exit_codes": result.exit_codes,
        "interface_bytes": result.interface_bytes,
        "timed_out": result.timed_out,
        "wall_time_s": result.wall_time_s,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``megatron-ext netbench``.

    Args:
        argv: Arguments after ``netbench`` (default ``sys.argv[1:]``).

    Returns:
        The process exit code (see the module docstring).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv[: argv.index("--") if "--" in argv else None]):
        build_parser().print_help()
        return 0
    try:
        args, command, layout = _parse(argv)
    except _UsageError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _USAGE_EXIT
    try:
        removed = cleanup_stale()
        if removed:
            print(f"netbench: removed {len(removed)} namespaces left by killed runs")
        network = ShapedNetwork(
            args.nproc,
            bandwidth=None if args.unshaped else args.bandwidth,
            latency=args.latency,
            loss=args.loss,
            shaped_pairs=None if args.shape == "all" else layout.pairs(args.shape),
            master_port=args.master_port,
        )
        with network:
            print(f"netbench: {args.nproc} ranks, {network.describe_shaping()}", flush=True)
            links: List[LinkMeasurement] = []
            if not args.no_check:
                links = network.check_links(args.check_seconds, max_links=args.check_links)
                for m in links:
                    print(
                        f"netbench: link {m.src} -> {m.dst} "
                        f"({'shaped' if m.shaped else 'unshaped'}): {m.mb_per_s:.2f} MB/s",
                        flush=True,
                    )
            result = network.run_ranks(
                command, timeout=args.timeout, show_all_ranks=args.show_all_ranks
            )
    except NetbenchUnavailableError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _USAGE_EXIT
    except NetbenchError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # The network was already torn down by the signal handler / the with block.
        print(f"{_PROG}: interrupted; ranks stopped and namespaces removed", file=sys.stderr)
        return 130
    _print_summary(network, layout, links, result)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump(_report(args, command, layout, network, links, result), handle, indent=2)
            handle.write("\n")
        print(f"report: {args.report}")
    return _exit_code(result)


if __name__ == "__main__":
    sys.exit(main())
