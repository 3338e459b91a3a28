"""Separate site jobs over shaped links: one namespace per site job, plus one for a lighthouse.

What it does:
    :class:`SiteJobsNetwork` is a :class:`~megatron_ext.netbench.netns.ShapedNetwork` of
    ``sites + 1`` namespaces: namespace ``s < sites`` holds the whole job of site ``s`` (its
    own torch.distributed world of one or more ranks), namespace ``sites`` holds the
    coordinator every site must reach (torchft's lighthouse). Only the links between two site
    namespaces are shaped; the ranks inside one site talk over the namespace's own addresses
    (the kernel routes them through loopback, so they are never shaped), and the lighthouse's
    links are unshaped (heartbeats and quorum messages only). :meth:`SiteJobsNetwork.start_site`
    starts a site's command at once (no waiting), in its own UTS namespace whose host name
    is the site's address, with the torchrun variables of a one-rank world
    (``MASTER_ADDR`` = the site's address, so its store is reachable from the other sites).

Why:
    ``--outer-transport torchft`` makes each site its own job that fails and restarts alone;
    measuring that needs one command per site that the caller kills and restarts, which the
    one-world launcher (:meth:`ShapedNetwork.run_ranks`: one command, every rank stopped
    when one fails) cannot do. Giving each job its own host name matters because torchft's
    managers and its checkpoint server advertise ``socket.gethostname()`` to the other
    sites; the machine's name would not resolve to an address inside another namespace.

Constraints:
    What :class:`ShapedNetwork` needs, plus ``unshare`` (util-linux). A site job of R > 1
    ranks is the caller's ``torchrun --nproc-per-node R --master-addr <site address> ...``
    command (torchrun sets the per-rank variables; the ones given here are then
    overridden). Never imports torch.
"""

from __future__ import annotations

import subprocess
from typing import Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

from megatron_ext.netbench.netns import (
    DEFAULT_MASTER_PORT,
    DEFAULT_PREFIX,
    ShapedNetwork,
    torchrun_env,
)

__all__ = ["SiteJobsNetwork", "site_job_pairs"]


def site_job_pairs(sites: int) -> FrozenSet[Tuple[int, int]]:
    """The directed links between the namespaces of ``sites`` site jobs (0..sites-1); the
    namespace ``sites`` (the lighthouse's) is in none of them."""
    return frozenset((s, d) for s in range(sites) for d in range(sites) if s != d)


class SiteJobsNetwork:
    """Namespaces for ``sites`` separate site jobs and a lighthouse; only inter-site links shaped.

    Use as a context manager; everything is removed on exit (as :class:`ShapedNetwork`)::

        with SiteJobsNetwork(3, bandwidth="100mbit") as net:
            lh = net.start_lighthouse(["megatron-ext", "lighthouse", "--bind",
                                       f"{net.lighthouse_host}:29510"])
            jobs = [net.start_site(s, train_argv(s)) for s in range(3)]

    Args:
        sites: Number of site jobs (at least 2).
        bandwidth: Rate of an inter-site link (tc syntax), ``None``: nothing shaped.
        latency, loss: As :class:`ShapedNetwork` (need netem).
        prefix: Namespace name prefix.
        master_port: ``MASTER_PORT`` of every site's world (each namespace is private).
    """

    def __init__(
        self,
        sites: int,
        *,
        bandwidth: Optional[str],
        latency: Optional[str] = None,
        loss: Optional[str] = None,
        prefix: str = DEFAULT_PREFIX,
        master_port: int = DEFAULT_MASTER_PORT,
    ) -> None:
        if isinstance(sites, bool) or not isinstance(sites, int) or sites < 2:
            raise ValueError(f"sites must be an integer >= 2, got {sites!r}")
        self.sites = sites
        self.master_port = int(master_port)
        self.network = ShapedNetwork(
            sites + 1,
            bandwidth=bandwidth,
            latency=latency,
            loss=loss,
            shaped_pairs=site_job_pairs(sites),
            prefix=prefix,
            master_port=master_port,
        )

    def __enter__(self) -> "SiteJobsNetwork":
        self.network.create()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.network.close()

    def close(self) -> None:
        """Stop every process started here and delete the namespaces."""
        self.network.close()

    @property
    def lighthouse_host(self) -> str:
        """Address of the lighthouse's namespace (reachable from every site, unshaped)."""
        return self.network.address(self.sites)

    def address(self, site: int) -> str:
        """Address of a site job's namespace."""
        if not 0 <= site < self.sites:
            raise ValueError(f"site must be in [0, {self.sites}), got {site}")
        return self.network.address(site)

    def site_env(self, site: int, env_extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """A site job's variables: a one-rank world's torchrun set with ``MASTER_ADDR`` the
        site's address, gloo on the namespace's interface, unbuffered output."""
        return torchrun_env(0, 1, self.address(site), self.master_port, env_extra)

    def start_site(
        self,
        site: int,
        command: Sequence[str],
        env_extra: Optional[Mapping[str, str]] = None,
        **popen_kwargs,
    ) -> subprocess.Popen:
        """Start one site job's command in its namespace (host name = its address)."""
        return self.network.start(
            site,
            command,
            self.site_env(site, env_extra),
            hostname=self.address(site),
            **popen_kwargs,
        )

    def start_lighthouse(
        self,
        command: Sequence[str],
        env_extra: Optional[Mapping[str, str]] = None,
        **popen_kwargs,
    ) -> subprocess.Popen:
        """Start the coordinator's command (bind it to :attr:`lighthouse_host`)."""
        env = {"PYTHONUNBUFFERED": "1"}
        env.update({k: str(v) for k, v in (env_extra or {}).items()})
        return self.network.start(
            self.sites, command, env, hostname=self.lighthouse_host, **popen_kwargs
        )
