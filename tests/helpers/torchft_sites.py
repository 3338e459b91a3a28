"""The lighthouse and the event lines of the tests of DiLoCo sites as separate jobs.

``start_lighthouse(env, min_replicas, *flags)`` starts ``megatron-ext lighthouse`` on a free
loopback port and returns the process and its address; ``commit_events(text, site)`` reads
the ``commit`` lines a site's first rank prints (``megatron_ext/optim/diloco_ft.py``), each a
dict of its ``key=value`` fields plus ``at`` (the unix time at the end of the line).
Used by tests/distributed/test_diloco_sites.py and tests/megatron_lm/test_diloco_lm_sites.py.
"""

import subprocess
import sys
from typing import Dict, List, Mapping, Tuple

from tests.helpers.dist import free_port


def start_lighthouse(
    env: Mapping[str, str], min_replicas: int, *flags: str
) -> Tuple[subprocess.Popen, str]:
    """A lighthouse of at least ``min_replicas`` sites per quorum (``flags``: e.g. its
    heartbeat timeout), and its address once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_ext", "lighthouse", "--min-replicas", str(min_replicas)]
        + ["--bind", f"127.0.0.1:{free_port()}", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(env),
    )
    line = proc.stdout.readline()
    assert line.startswith("lighthouse: http://127.0.0.1:"), line
    return proc, line.split()[1]


def commit_events(text: str, site: int) -> List[Dict[str, object]]:
    """The ``commit`` events in a site's output, in order."""
    head = f"megatron-ext: torchft site {site}: commit "
    out: List[Dict[str, object]] = []
    for line in text.splitlines():
        if line.startswith(head):
            fields: Dict[str, object] = dict(f.split("=", 1) for f in line.split() if "=" in f)
            fields["at"] = float(line.rsplit(" at ", 1)[1])
            out.append(fields)
    return out
