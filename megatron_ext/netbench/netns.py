"""Network namespaces joined by a shaped virtual switch, for measuring training over slow links.

What it does:
    :class:`ShapedNetwork` builds, on one machine, one Linux network namespace per rank and
    one "switch" namespace holding a bridge. Each rank namespace gets a veth pair: ``eth0``
    (address ``10.213.<n>.<rank + 1>/24``) inside the rank namespace, its peer ``p<rank>``
    inside the switch namespace on the bridge. The egress of every rank's ``eth0`` is shaped
    with tc (:mod:`megatron_ext.netbench.shaping`), so each direction of a link is shaped at
    its sender. :meth:`ShapedNetwork.check_links` measures the achieved throughput of a few
    links with a small TCP probe, and :meth:`ShapedNetwork.run_ranks` starts one process per
    rank inside its namespace with the environment ``torchrun`` would give it, plus
    ``GLOO_SOCKET_IFNAME=eth0``.

Why:
    "How much faster does training run with compression at my bandwidth?" needs real TCP
    over a real bottleneck, not a model of one. Namespaces and tc give that on one machine
    with the unmodified training command and torch.distributed's gloo backend.

Constraints:
    * Linux, root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``), ``ip`` and ``tc`` from
      iproute2, and a kernel with veth, bridge, tbf, htb and u32 (plus netem for delay and
      loss). Missing pieces raise :class:`NetbenchUnavailableError` saying what to do.
    * Nothing is created in the host's root namespace: the veth pairs are created directly
      inside our namespaces, and the addresses only exist there. So concurrent instances
      can never clash on addresses or ports; ``<n>`` is still derived from the pid so that
      addresses in logs tell instances apart.
    * Cleanup deletes only what this instance created (tracked names), on normal exit,
      exceptions, SIGINT, SIGTERM and SIGHUP (handlers clean up, then re-raise), and at
      interpreter exit. A SIGKILLed run leaves namespaces behind; :func:`cleanup_stale`
      removes those whose owning pid is gone. Signal handlers are installed only when the
      network is created from the main thread.
    * Rank processes have no route out of their namespace: the training command must not
      need the internet (set ``HF_HUB_OFFLINE=1`` and friends).
    * The ranks share the machine's CPUs; on a small machine CPU contention, not only the
      network, shapes the timings of both the shaped and the unshaped run.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import (
    Deque,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    TextIO,
)

from megatron_ext.netbench.shaping import LinkShape, tc_commands
from megatron_ext.netbench.topology import select_check_links

__all__ = [
    "DEFAULT_PREFIX",
    "LinkMeasurement",
    "NetbenchError",
    "NetbenchUnavailableError",
    "RankRunResult",
    "ShapedNetwork",
    "cleanup_stale",
    "netns_unavailable_reason",
    "rank_command",
    "torchrun_env",
]

DEFAULT_PREFIX = "mxnb"
"""Namespace name prefix; names are ``<prefix><pid>-<instance>-{sw,r<rank>}``."""

RANK_IFNAME = "eth0"
"""Interface name of every rank inside its namespace (also ``GLOO_SOCKET_IFNAME``)."""

DEFAULT_MASTER_PORT = 29500
"""``MASTER_PORT`` of the ranks; rank 0's namespace is private, so it cannot be taken."""

CHECK_PORT = 29400
"""Port of the link-check receiver inside the destination namespace."""

_BRIDGE = "br0"
_MAX_RANKS = 250
_LINKCHECK = Path(__file__).with_name("linkcheck.py")
_KILL_GRACE_S = 5.0


class NetbenchError(RuntimeError):
    """A netbench operation failed (a command returned an error, a probe timed out, ...)."""


class NetbenchUnavailableError(NetbenchError):
    """This machine or user cannot build shaped networks; the message says how to fix it."""


@dataclasses.dataclass
class LinkMeasurement:
    """Throughput of one directed link measured by :meth:`ShapedNetwork.check_links`."""

    src: int
    """Sending rank."""

    dst: int
    """Receiving rank."""

    shaped: bool
    """Whether traffic from ``src`` to ``dst`` is shaped."""

    mb_per_s: float
    """TCP payload throughput in MB/s (10**6 bytes per second) seen by the receiver."""

    num_bytes: int
    """Bytes received."""

    seconds: float
    """Time from the first to the last received byte."""


@dataclasses.dataclass
class RankRunResult:
    """Outcome of :meth:`ShapedNetwork.run_ranks`."""

    exit_codes: List[Optional[int]]
    """Exit code per rank; negative for a signal, ``None`` if it could not be collected."""

    wall_time_s: float
    """Seconds from starting the first rank until the last one exited."""

    timed_out: bool = False
    """Whether the run was stopped because it exceeded its timeout."""

    failed_rank: Optional[int] = None
    """First rank seen exiting with a non-zero code (the others were then stopped)."""

    output_tails: List[List[str]] = dataclasses.field(default_factory=list)
    """Last lines of each rank's combined stdout/stderr, without the ``[rank N]`` prefix."""

    interface_bytes: List[Dict[str, int]] = dataclasses.field(default_factory=list)
    """Per rank, bytes its ``eth0`` transmitted and received during the run (the kernel's
    interface counters: every frame, so payload plus Ethernet/IP/TCP headers and ACKs)."""

    @property
    def ok(self) -> bool:
        """All ranks exited with code 0 within the timeout."""
        return not self.timed_out and all(code == 0 for code in self.exit_codes)


# ---------------------------------------------------------------------------------------
# Preflight checks and command helpers
# ---------------------------------------------------------------------------------------


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    proc = subprocess.run(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise NetbenchError(
            f"command failed ({proc.returncode}): {' '.join(argv)}: {proc.stderr.strip()}"
        )
    return proc.stdout


def _check_tools() -> None:
    if not sys.platform.startswith("linux"):
        raise NetbenchUnavailableError("netbench needs Linux network namespaces")
    if os.geteuid() != 0:
        raise NetbenchUnavailableError(
            "netbench must run as root: creating network namespaces and tc qdiscs needs "
            "CAP_NET_ADMIN and CAP_SYS_ADMIN (rerun with sudo)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetbenchUnavailableError(
                f"'{tool}' not found on PATH; install iproute2 "
                "(apt-get install -y iproute2, or dnf install -y iproute-tc)"
            )


def netns_unavailable_reason(prefix: str = DEFAULT_PREFIX) -> Optional[str]:
    """Why shaped networks cannot be built here, or ``None`` if they can.

    Beyond checking for root and the tools, this creates and deletes a throwaway namespace,
    which is what fails in an unprivileged container.

    Args:
        prefix: Prefix of the probe namespace's name.

    Returns:
        A one-line reason, or ``None``.
    """
    try:
        _check_tools()
    except NetbenchUnavailableError as exc:
        return str(exc)
    name = f"{prefix}{os.getpid()}-probe"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return (
            f"cannot create a network namespace ('ip netns add' said: {proc.stderr.strip()}); "
            "in a container, run it with --privileged or --cap-add NET_ADMIN --cap-add "
            "SYS_ADMIN"
        )
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def rank_command(namespace: str, env: Mapping[str, str], command: Sequence[str]) -> List[str]:
    """Command line that runs ``command`` inside ``namespace`` with extra variables.

    ``ip netns exec`` keeps the caller's environment; ``env K=V`` adds the rank's variables
    on top, so the printed line can be pasted into a root shell to rerun one rank.
    """
    return (
        ["ip", "netns", "exec", namespace, "env"]
        + [f"{k}={v}" for k, v in env.items()]
        + [str(part) for part in command]
    )


def torchrun_env(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    env_extra: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """torchrun's variables for ``rank`` of a one-node world of ``world_size`` (``LOCAL_RANK``
    the rank, ``LOCAL_WORLD_SIZE`` the world size), gloo on :data:`RANK_IFNAME`, unbuffered
    output; ``env_extra`` on top (values as strings)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": RANK_IFNAME,
        "PYTHONUNBUFFERED": "1",
    }
    env.update({k: str(v) for k, v in (env_extra or {}).items()})
    return env


def _list_namespaces() -> List[str]:
    # "ip netns list" prints "name" or "name (id: N)" per line.
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    # Processes that escaped our process-group kill (or of a killed run) would keep the
    # namespace and its interfaces alive after "ip netns del".
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for token in proc.stdout.split():
        try:
            os.kill(int(token), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def _delete_namespace(namespace: str) -> Optional[str]:
    _kill_namespace_processes(namespace)
    proc = subprocess.run(["ip", "netns", "del", namespace], capture_output=True, text=True)
    if proc.returncode != 0 and "No such file" not in proc.stderr:
        return f"{namespace}: {proc.stderr.strip()}"
    return None


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> List[str]:
    """Delete namespaces left behind by netbench runs that were killed.

    A namespace is stale when its name is ``<prefix><pid>-...`` and no process with that
    pid exists. Processes still running inside it (orphaned ranks) are killed first. A
    namespace whose pid is alive is kept, even if that pid was reused by another program.

    Args:
        prefix: Name prefix to look for (``DEFAULT_PREFIX`` unless a custom one was used).

    Returns:
        The names of the deleted namespaces.
    """
    _check_tools()
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    for name in _list_namespaces():
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            if _delete_namespace(name) is None:
                removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------
# Cleanup on signals and at exit
# ---------------------------------------------------------------------------------------

_LIVE: "set[ShapedNetwork]" = set()
_LIVE_LOCK = threading.RLock()
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PREVIOUS_HANDLERS: Dict[int, object] = {}
_ATEXIT_REGISTERED = False
_CLEANING = False


def _close_all_live() -> None:
    with _LIVE_LOCK:
        networks = list(_LIVE)
    for network in networks:
        network.close()


def _signal_handler(signum, frame) -> None:
    global _CLEANING
    if _CLEANING:
        # A second Ctrl-C while cleaning up: let the cleanup finish (it takes < 1 s).
        return
    # Read before cleaning up: closing the last network restores the previous handlers.
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    _CLEANING = True
    try:
        _close_all_live()
    finally:
        _CLEANING = False
    if callable(previous):
        # Typically signal.default_int_handler, which raises KeyboardInterrupt.
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_cleanup_hooks() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all_live)
        _ATEXIT_REGISTERED = True
    if threading.current_thread() is not threading.main_thread() or _PREVIOUS_HANDLERS:
        return
    for signum in _HANDLED_SIGNALS:
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:
            continue
        _PREVIOUS_HANDLERS[signum] = previous
        signal.signal(signum, _signal_handler)


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_PREVIOUS_HANDLERS.items()):
        if signal.getsignal(signum) is _signal_handler:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _PREVIOUS_HANDLERS[signum]


# ---------------------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------------------

# next() on itertools.count is atomic in CPython, so threads get distinct instance ids.
_INSTANCE_IDS = itertools.count(1)


class ShapedNetwork:
    """Per-rank network namespaces on a bridge, with tc shaping on each rank's egress.

    Use as a context manager::

        with ShapedNetwork(2, bandwidth="100mbit") as net:
            print(net.check_links(1.5))
            result = net.run_ranks(["python", "train.py"])

    Args:
        num_ranks: Number of rank namespaces (2 to 250).
        bandwidth: One-way rate of a shaped link in tc syntax (``"100mbit"``); ``None``
            builds the same namespaces without any shaping (the baseline).
        latency: Added one-way delay of a shaped link (``"10ms"``), needs netem.
        loss: Random packet loss of a shaped link (``"0.1%"``), needs netem.
        shaped_pairs: Ordered ``(src, dst)`` rank pairs to shape; ``None`` shapes all
            traffic of every rank (tbf on the whole interface), a set shapes only traffic
            from ``src`` to ``dst`` (htb with a u32 filter per destination).
        prefix: Namespace name prefix, for :func:`cleanup_stale` and tests.
        master_port: ``MASTER_PORT`` given to the ranks.

    Raises:
        ValueError: Invalid sizes, rates or pairs.
        NetbenchUnavailableError: Not root, tools missing, namespaces or netem unavailable.
        NetbenchError: A setup command failed (everything created so far is removed).
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        bandwidth: Optional[str],
        latency: Optional[str] = None,
        loss: Optional[str] = None,
        shaped_pairs: Optional[Iterable[tuple]] = None,
        prefix: str = DEFAULT_PREFIX,
        master_port: int = DEFAULT_MASTER_PORT,
    ) -> None:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
            raise ValueError(f"num_ranks must be an integer, got {num_ranks!r}")
        if not 2 <= num_ranks <= _MAX_RANKS:
            raise ValueError(f"num_ranks must be in [2, {_MAX_RANKS}], got {num_ranks}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z_]{0,15}", prefix):
            raise ValueError(f"prefix must be 1-16 letters or '_', got {prefix!r}")
        if bandwidth is None:
            if latency or loss:
                raise ValueError("latency and loss need a bandwidth (they shape the same links)")
            self.shape: Optional[LinkShape] = None
        else:
            self.shape = LinkShape.from_strings(bandwidth, latency, loss)
        self.num_ranks = num_ranks
        self.master_port = int(master_port)
        self.prefix = prefix
        all_pairs = {(s, d) for s in range(num_ranks) for d in range(num_ranks) if s != d}
        if shaped_pairs is None:
            self._pair_set: Optional[FrozenSet[tuple]] = None
        else:
            pairs = frozenset((int(s), int(d)) for s, d in shaped_pairs)
            bad = sorted(pairs - all_pairs)
            if bad:
                raise ValueError(f"invalid rank pairs {bad} for {num_ranks} ranks")
            self._pair_set = pairs
        self._all_pairs = frozenset(all_pairs)

        instance = next(_INSTANCE_IDS)
        pid = os.getpid()
        self._base = f"{prefix}{pid}-{instance}"
        self._subnet = f"10.213.{(pid + instance) % 250 + 1}"
        self._created: List[str] = []
        self._processes: List[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.RLock()

    # -- names and addresses ------------------------------------------------------------

    @property
    def switch_namespace(self) -> str:
        """Name of the namespace that holds the bridge."""
        return f"{self._base}-sw"

    def namespace(self, rank: int) -> str:
        """Name of a rank's namespace."""
        return f"{self._base}-r{rank}"

    def address(self, rank: int) -> str:
        """IPv4 address of a rank's ``eth0``."""
        return f"{self._subnet}.{rank + 1}"

    @property
    def namespaces(self) -> List[str]:
        """Names of the namespaces this instance has created (and will delete)."""
        return list(self._created)

    @property
    def shaped_pairs(self) -> FrozenSet[tuple]:
        """Ordered rank pairs whose traffic is shaped (empty for an unshaped network)."""
        if self.shape is None:
            return frozenset()
        return self._all_pairs if self._pair_set is None else self._pair_set

    def describe_shaping(self) -> str:
        """One-line description of what is shaped and how."""
        if self.shape is None:
            return "unshaped (same namespaces, no tc)"
        if self._pair_set is None:
            return f"{self.shape.describe()} on every link (tbf on each rank's egress)"
        return (
            f"{self.shape.describe()} on {len(self._pair_set)} of {len(self._all_pairs)} "
            "directed links (htb + u32 per destination)"
        )

    # -- setup and teardown -------------------------------------------------------------

    def __enter__(self) -> "ShapedNetwork":
        self.create()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        # Recorded before creation so that a signal arriving during "ip netns add" still
        # gets it deleted; deletion tolerates a namespace that does not exist.
        self._created.append(name)
        _run(["ip", "netns", "add", name])

    def _setup_commands(self, rank: int) -> List[List[str]]:
        ns, sw, dev, peer = self.namespace(rank), self.switch_namespace, RANK_IFNAME, f"p{rank}"
        return [
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", sw],
            # No IPv6 link-local address: gloo must see exactly one address on eth0.
            ["ip", "-n", ns, "link", "set", dev, "addrgenmode", "none"],
            ["ip", "-n", sw, "link", "set", peer, "addrgenmode", "none"],
            ["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", dev],
            ["ip", "-n", sw, "link", "set", peer, "master", _BRIDGE],
            ["ip", "-n", sw, "link", "set", peer, "up"],
            ["ip", "-n", ns, "link", "set", dev, "up"],
        ]

    def _shaping_commands(self, rank: int) -> List[List[str]]:
        if self._pair_set is None:
            return tc_commands(self.shape, RANK_IFNAME)
        destinations = {d: self.address(d) for s, d in self._pair_set if s == rank}
        return tc_commands(self.shape, RANK_IFNAME, destinations)

    def create(self) -> None:
        """Build the namespaces, bridge, veth pairs and shaping (idempotence not supported).

        On any failure everything created so far is removed before the error propagates.
        """
        if self._created or self._closed:
            raise NetbenchError("a ShapedNetwork can only be created once")
        _check_tools()
        with _LIVE_LOCK:
            _LIVE.add(self)
            _install_cleanup_hooks()
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        existing = set(_list_namespaces())
        names = [self.switch_namespace] + [self.namespace(r) for r in range(self.num_ranks)]
        clash = [n for n in names if n in existing]
        if clash:
            raise NetbenchError(
                f"namespaces {clash} already exist (left by a killed run with a reused pid?); "
                f"remove them with 'ip netns del NAME'"
            )
        try:
            self._add_namespace(self.switch_namespace)
        except NetbenchError as exc:
            raise NetbenchUnavailableError(
                f"cannot create a network namespace ({exc}); in a container, run it with "
                "--privileged or --cap-add NET_ADMIN --cap-add SYS_ADMIN"
            ) from exc
        sw = self.switch_namespace
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", _BRIDGE, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", _BRIDGE, "addrgenmode", "none"])
        _run(["ip", "-n", sw, "link", "set", _BRIDGE, "up"])
        for rank in range(self.num_ranks):
            self._add_namespace(self.namespace(rank))
            for argv in self._setup_commands(rank):
                _run(argv)
        for rank in range(self.num_ranks):
            for argv in self._shaping_commands(rank):
                try:
                    _run(["ip", "netns", "exec", self.namespace(rank)] + argv)
                except NetbenchError as exc:
                    if "netem" in argv and "unknown" in str(exc).lower():
                        raise NetbenchUnavailableError(
                            "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM / module "
                            "sch_netem), which --latency and --loss need; try 'modprobe "
                            "sch_netem', or drop --latency/--loss"
                        ) from exc
                    raise

    def close(self) -> None:
        """Stop any rank or probe processes and delete every namespace this instance made.

        Idempotent and re-entrant: a signal handler or ``atexit`` calling it while a normal
        close is under way finishes the remaining deletions. Deleting a namespace also
        deletes the interfaces inside it (the bridge, both ends of each veth pair).
        """
        errors = []
        with self._lock:
            self._closed = True
            self._kill_processes(self._processes)
            while self._created:
                name = self._created[-1]
                error = _delete_namespace(name)
                if error:
                    errors.append(error)
                # A nested close (from a signal handler) may have emptied the list already.
                if self._created and self._created[-1] == name:
                    self._created.pop()
        with _LIVE_LOCK:
            _LIVE.discard(self)
            if not _LIVE:
                _restore_signal_handlers()
        if errors:
            print(f"netbench: could not delete {'; '.join(errors)}", file=sys.stderr)

    def _require_open(self) -> None:
        if self._closed or not self._created:
            raise NetbenchError("the network is not created (use it inside 'with')")

    # -- processes ----------------------------------------------------------------------

    def _spawn(self, argv: List[str], env: Optional[Mapping[str, str]] = None, **kwargs):
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kwargs)
        self._processes.append(proc)
        return proc

    @staticmethod
    def _kill_processes(processes: Iterable[subprocess.Popen]) -> None:
        alive = [p for p in processes if not _process_gone(p)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in alive:
                try:
                    # Each process leads its own session, so this reaches its children too.
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + (_KILL_GRACE_S if sig == signal.SIGTERM else 2.0)
            while alive and time.monotonic() < deadline:
                alive = [p for p in alive if not _process_gone(p)]
                if alive:
                    time.sleep(0.02)
            if not alive:
                return

    # -- link check ---------------------------------------------------------------------

    def measure_link(self, src: int, dst: int, duration_s: float = 1.5) -> LinkMeasurement:
        """Measure TCP throughput from ``src`` to ``dst`` for about ``duration_s`` seconds."""
        self._require_open()
        receiver = self._spawn(
            ["ip", "netns", "exec", self.namespace(dst), sys.executable, "-u", str(_LINKCHECK)]
            + ["recv", str(CHECK_PORT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready = _readline_with_timeout(receiver.stdout, 20.0)
            if ready.strip() != "READY":
                raise NetbenchError(
                    f"link-check receiver in {self.namespace(dst)} did not start: "
                    f"{ready!r} {receiver.stderr.read() if receiver.poll() is not None else ''}"
                )
            sender = subprocess.run(
                ["ip", "netns", "exec", self.namespace(src), sys.executable, str(_LINKCHECK)]
                + ["send", self.address(dst), str(CHECK_PORT), str(duration_s)],
                capture_output=True,
                text=True,
                timeout=duration_s + 30.0,
            )
            if sender.returncode != 0:
                raise NetbenchError(
                    f"link-check sender {src} -> {dst} failed: {sender.stderr.strip()}"
                )
            out, err = receiver.communicate(timeout=30.0)
        finally:
            self._kill_processes([receiver])
            self._processes.remove(receiver)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if receiver.returncode != 0 or not lines:
            raise NetbenchError(f"link-check receiver {src} -> {dst} failed: {err.strip()}")
        stats = json.loads(lines[-1])
        seconds = float(stats["seconds"])
        num_bytes = int(stats["bytes"])
        return LinkMeasurement(
            src=src,
            dst=dst,
            shaped=(src, dst) in self.shaped_pairs,
            mb_per_s=num_bytes / seconds / 1e6 if seconds > 0 else 0.0,
            num_bytes=num_bytes,
            seconds=seconds,
        )

    def check_links(
        self, duration_s: float = 1.5, *, max_links: int = 4, include_unshaped: bool = True
    ) -> List[LinkMeasurement]:
        """Measure the throughput of a representative set of links, one at a time.

        The shaped links are chosen by
        :func:`megatron_ext.netbench.topology.select_check_links` (one per sender first,
        all of them when there are at most ``max_links``); one unshaped link is added when
        ``include_unshaped`` and such a link exists.

        Args:
            duration_s: Seconds of traffic per link.
            max_links: Most shaped links to measure.
            include_unshaped: Also measure one unshaped link as a reference.

        Returns:
            One measurement per link, shaped links first.
        """
        shaped, unshaped = select_check_links(
            self.num_ranks,
            set(self.shaped_pairs),
            max_links=max_links,
            include_unshaped=include_unshaped,
        )
        links = shaped + ([unshaped] if unshaped is not None else [])
        return [self.measure_link(src, dst, duration_s) for src, dst in links]

    # -- training ranks -----------------------------------------------------------------

    def rank_env(self, rank: int, env_extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """Variables given to a rank: torchrun's set, gloo's interface, unbuffered output.

        All ranks share one machine (and its accelerators), so ``LOCAL_RANK`` is the global
        rank and ``LOCAL_WORLD_SIZE`` the world size, as torchrun would set on one node.
        """
        return torchrun_env(rank, self.num_ranks, self.address(0), self.master_port, env_extra)

    def start(
        self,
        rank: int,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        hostname: Optional[str] = None,
        **popen_kwargs,
    ) -> subprocess.Popen:
        """Start ``command`` inside a rank's namespace and return at once (no waiting).

        For callers that start, kill and restart processes one by one (separate jobs, fault
        injection); :meth:`run_ranks` is the one-world launcher. The process leads its own
        session (``os.killpg(proc.pid, sig)`` reaches its children) and is stopped by
        :meth:`close` if still running.

        Args:
            rank: Namespace index.
            command: The argv to run.
            env: Variables added to the caller's environment (``rank_command``).
            hostname: Run it in its own UTS namespace with this host name (e.g. the rank's
                address): programs that advertise ``socket.gethostname()`` to peers in other
                namespaces (torchft's managers) then advertise a reachable name.
            **popen_kwargs: Passed to ``subprocess.Popen`` (``stdout``, ``cwd``, ...).
        """
        self._require_open()
        if not command:
            raise ValueError("empty command")
        argv = rank_command(self.namespace(rank), env, command)
        if hostname is not None:
            if shutil.which("unshare") is None:
                raise NetbenchUnavailableError(
                    "'unshare' not found on PATH (util-linux); it gives a job its own host name"
                )
            # unshare(1) without --fork execs: the pid stays the command's.
            argv = argv[:4] + ["unshare", "--uts", "--", "sh", "-c"]
            argv += ['hostname "$0" && exec "$@"', hostname] + rank_command("", env, command)[4:]
        return self._spawn(argv, **popen_kwargs)

    def interface_counters(self) -> List[Dict[str, int]]:
        """Per rank, the ``tx_bytes`` / ``rx_bytes`` counters of its ``eth0`` now."""
        out = []
        for rank in range(self.num_ranks):
            stats = {}
            for key in ("tx_bytes", "rx_bytes"):
                text = _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.namespace(rank),
                        "cat",
                        f"/sys/class/net/{RANK_IFNAME}/statistics/{key}",
                    ]
                )
                stats[key] = int(text.strip())
            out.append(stats)
        return out

    def run_ranks(
        self,
        command: Sequence[str],
        env_extra: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        *,
        show_all_ranks: bool = False,
        output: Optional[TextIO] = None,
        tail_lines: int = 200,
    ) -> RankRunResult:
        """Run ``command`` once per rank, each inside its namespace, and wait for all.

        Output lines are printed with a ``[rank N]`` prefix; by default only rank 0 and the
        last rank are printed (the last rank reports the loss with pipeline parallelism).
        The output of every rank is kept (last ``tail_lines`` lines) and a failing hidden
        rank's tail is printed. When a rank exits non-zero, or the timeout passes, the
        other ranks get SIGTERM and, after a grace period, SIGKILL.

        Args:
            command: The training command (argv list).
            env_extra: Extra environment variables for every rank (override ours).
            timeout: Seconds before all ranks are stopped; ``None`` waits forever.
            show_all_ranks: Print every rank's output, not only the first and last.
            output: Where to print (default ``sys.stdout``).
            tail_lines: Lines of output kept per rank in the result.

        Returns:
            Exit codes, wall time, whether it timed out, and the output tails.
        """
        self._require_open()
        if not command:
            raise ValueError("empty command")
        stream = output if output is not None else sys.stdout
        shown = set(range(self.num_ranks)) if show_all_ranks else {0, self.num_ranks - 1}
        print_lock = threading.Lock()
        tails: List[Deque[str]] = [
            collections.deque(maxlen=tail_lines) for _ in range(self.num_ranks)
        ]
        before = self.interface_counters()
        start = time.monotonic()
        procs = [
            self._spawn(
                rank_command(self.namespace(r), self.rank_env(r, env_extra), command),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for r in range(self.num_ranks)
        ]
        readers = [
            threading.Thread(
                target=_pump,
                args=(p.stdout, r, r in shown, tails[r], stream, print_lock),
                daemon=True,
            )
            for r, p in enumerate(procs)
        ]
        for reader in readers:
            reader.start()
        timed_out = False
        failed_rank: Optional[int] = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                for r, code in enumerate(codes):
                    if code not in (None, 0) and failed_rank is None:
                        failed_rank = r
                if failed_rank is not None:
                    self._kill_processes(procs)
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    timed_out = True
                    self._kill_processes(procs)
                    break
                time.sleep(0.05)
        finally:
            self._kill_processes(procs)
            wall = time.monotonic() - start
            for reader in readers:
                reader.join(timeout=5.0)
            for proc in procs:
                self._processes.remove(proc)
        exit_codes = [p.poll() for p in procs]
        after = self.interface_counters()
        moved = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        if failed_rank is None:
            failed_rank = next((r for r, c in enumerate(exit_codes) if c not in (0, None)), None)
        if failed_rank is not None and failed_rank not in shown:
            with print_lock:
                print(
                    f"netbench: rank {failed_rank} failed with {exit_codes[failed_rank]}; "
                    "its last lines:",
                    file=stream,
                )
                for line in list(tails[failed_rank])[-20:]:
                    print(f"[rank {failed_rank}] {line}", file=stream)
                stream.flush()
        return RankRunResult(
            exit_codes=exit_codes,
            wall_time_s=wall,
            timed_out=timed_out,
            failed_rank=failed_rank,
            output_tails=[list(t) for t in tails],
            interface_bytes=moved,
        )


def _process_gone(proc: subprocess.Popen) -> bool:
    # Popen.poll() returns None without reaping when another poll()/wait() holds its lock,
    # which is the case when a signal handler interrupts the main thread inside poll().
    # An exited but unreaped process (zombie) no longer holds its namespace, so it counts
    # as gone; it is reaped by a later poll() or, if this process exits first, by init.
    if proc.poll() is not None:
        return True
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _pump(pipe, rank: int, show: bool, tail: Deque[str], stream: TextIO, lock) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        tail.append(line)
        if show:
            with lock:
                stream.write(f"[rank {rank}] {line}\n")
                stream.flush()
    pipe.close()


def _readline_with_timeout(pipe, timeout: float) -> str:
    result: List[str] = []
    reader = threading.Thread(target=lambda: result.append(pipe.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return result[0] if result else ""
