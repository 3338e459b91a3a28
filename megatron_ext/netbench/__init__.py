"""netbench: run a training command over shaped links between network namespaces.

What it does:
    Answers "how much faster does training run with compression at my bandwidth?" on one
    machine: every rank runs in its own Linux network namespace, the namespaces are joined
    by a bridge, and tc shapes each rank's egress to the requested rate (optionally with
    delay and loss, and optionally only for pipeline or data-parallel links, or only for the
    links between sites of consecutive data-parallel ranks). The entry point is
    ``megatron-ext netbench [options] -- COMMAND...`` (:func:`cli.main`).

Why:
    Real TCP over a real bottleneck, with the unmodified training command and gloo, is the
    measurement users trust; an unshaped run in the same namespaces is the baseline.

Constraints:
    Linux, root, iproute2 (``ip``, ``tc``). Pure Python plus subprocess calls: this
    package never imports torch or Megatron, so it starts fast and runs anywhere.
"""

from megatron_ext.netbench.netns import (
    DEFAULT_PREFIX,
    LinkMeasurement,
    NetbenchError,
    NetbenchUnavailableError,
    RankRunResult,
    ShapedNetwork,
    cleanup_stale,
    netns_unavailable_reason,
)
from megatron_ext.netbench.shaping import LinkShape, parse_loss, parse_rate, parse_time
from megatron_ext.netbench.sitejobs import SiteJobsNetwork, site_job_pairs
from megatron_ext.netbench.topology import SCOPES, ParallelLayout, select_check_links

__all__ = [
    "DEFAULT_PREFIX",
    "SCOPES",
    "LinkMeasurement",
    "LinkShape",
    "NetbenchError",
    "NetbenchUnavailableError",
    "ParallelLayout",
    "RankRunResult",
    "ShapedNetwork",
    "SiteJobsNetwork",
    "cleanup_stale",
    "netns_unavailable_reason",
    "parse_loss",
    "parse_rate",
    "parse_time",
    "select_check_links",
    "site_job_pairs",
]
