"""End-to-end tests of netbench: real namespaces, real tc shaping, a real gloo job.

They need root, iproute2 and permission to create network namespaces; the module is
skipped with the reason otherwise (the check creates and deletes a throwaway namespace,
which is what fails in an unprivileged container). The whole file takes about 23 s.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_ext.netbench import cli
from megatron_ext.netbench.netns import (
    NetbenchUnavailableError,
    ShapedNetwork,
    cleanup_stale,
    netns_unavailable_reason,
)
from tests.helpers.paths import REPO

_PREFIX = "mxnbtest"


def _skip_reason():
    try:
        return netns_unavailable_reason(_PREFIX)
    except Exception as exc:  # any failure of the probe itself means "cannot run here"
        return f"network namespace probe failed: {exc}"


_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

# All-reduce of a 4 MB float32 tensor, three times after a warm-up; prints the time.
_ALLREDUCE_SCRIPT = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1024 * 1024)
    dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(t)
    elapsed = time.perf_counter() - start
    assert t[0].item() == dist.get_world_size() ** 4
    print(f"ALLREDUCE_SECONDS {elapsed:.4f}", flush=True)
    dist.destroy_process_group()
    """)


def _namespaces(start: str):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(start)]


def _exited(pid):
    # An exited rank may stay a zombie until the init process reaps it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _allreduce_seconds(result):
    assert result.ok, (result.exit_codes, result.output_tails)
    times = []
    for tail in result.output_tails:
        match = [re.match(r"ALLREDUCE_SECONDS ([0-9.]+)", line) for line in tail]
        times += [float(m.group(1)) for m in match if m]
    assert len(times) == 2, result.output_tails
    return max(times)


def test_shaped_links_and_gloo_allreduce(capsys):
    own = f"{_PREFIX}{os.getpid()}-"
    with ShapedNetwork(2, bandwidth="100mbit", prefix=_PREFIX) as net:
        assert len(_namespaces(own)) == 3
        links = net.check_links(1.0)
        # 100mbit is 12.5 MB/s on the wire; TCP/IP headers leave about 12.0 MB/s.
        assert [(m.src, m.dst) for m in links] == [(0, 1), (1, 0)]
        for m in links:
            assert m.shaped and 9.0 <= m.mb_per_s <= 14.0, links
        shaped = _allreduce_seconds(
            net.run_ranks([sys.executable, "-c", _ALLREDUCE_SCRIPT], timeout=60)
        )
    assert _namespaces(own) == []

    with ShapedNetwork(2, bandwidth=None, prefix=_PREFIX) as net:
        (link,) = net.check_links(0.5)
        assert not link.shaped and link.mb_per_s > 100.0
        unshaped = _allreduce_seconds(
            net.run_ranks([sys.executable, "-c", _ALLREDUCE_SCRIPT], timeout=60)
        )
    assert _namespaces(own) == []

    # Three 4 MB ring all-reduces on 2 ranks move 3 * 4 MB per direction: about 1 s at
    # 12 MB/s. Unshaped, the same takes a few tens of ms; 5x leaves room for a busy CI box.
    assert "[rank 0] ALLREDUCE_SECONDS" in capsys.readouterr().out
    with capsys.disabled():
        print(f"\ngloo all-reduce 3 x 4 MB: shaped {shaped:.3f} s, unshaped {unshaped:.3f} s")
    assert shaped > 0.5
    assert shaped > 5 * unshaped


def test_failing_rank_stops_the_others():
    with ShapedNetwork(2, bandwidth="1gbit", prefix=_PREFIX) as net:
        start = time.monotonic()
        result = net.run_ranks(
            ["sh", "-c", 'if [ "$RANK" = 1 ]; then echo boom; exit 3; fi; exec sleep 60'],
            timeout=30,
        )
    assert time.monotonic() - start < 10
    assert result.failed_rank == 1 and result.exit_codes[1] == 3
    assert result.exit_codes[0] == -signal.SIGTERM
    assert result.output_tails[1] == ["boom"]
    assert _namespaces(f"{_PREFIX}{os.getpid()}-") == []


def test_cli_report_and_exit_code(tmp_path, capsys):
    report = tmp_path / "report.json"
    code = cli.main(
        ["--nproc", "3", "--bandwidth", "50mbit", "--shape", "dp", "--check-seconds", "0.3"]
        + ["--report", str(report), "--", "sh", "-c", 'echo "rank $RANK of $WORLD_SIZE"']
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 3" in out and "[rank 2] rank 2 of 3" in out
    assert "[rank 1]" not in out
    data = json.loads(report.read_text())
    assert data["exit_codes"] == [0, 0, 0]
    assert data["settings"]["bandwidth"] == "50mbit"
    assert data["command"] == ["sh", "-c", 'echo "rank $RANK of $WORLD_SIZE"']
    assert all(4.0 <= m["mb_per_s"] <= 7.0 for m in data["link_check"] if m["shaped"])
    # the failing rank's exit code (one rank fails: which of several fails first is a race)
    assert cli.main(["--no-check", "--unshaped", "--", "sh", "-c", "exit $((RANK * 5))"]) == 5


_BLOCKING_RUNNER = textwrap.dedent("""
    import sys
    from megatron_ext.netbench.netns import ShapedNetwork
    pid_dir = sys.argv[1]
    with ShapedNetwork(2, bandwidth="100mbit", prefix=%r) as net:
        print("NAMESPACES", " ".join(net.namespaces), flush=True)
        net.run_ranks(["sh", "-c", 'echo $$ > %%s/rank$RANK; echo started; exec sleep 60'
                       %% pid_dir])
    """ % _PREFIX)


def _rank_pids(pid_dir: Path, num_ranks: int, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        texts = [p.read_text().strip() for p in pid_dir.iterdir()]
        if len(texts) == num_ranks and all(texts):
            return [int(t) for t in texts]
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start: {list(pid_dir.iterdir())}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_cleanup_after_signal_mid_run(signum, tmp_path):
    """SIGINT/SIGTERM: the runner cleans up itself; SIGKILL: cleanup_stale does it."""
    runner = subprocess.Popen(
        [sys.executable, "-c", _BLOCKING_RUNNER, str(tmp_path)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell that starts pytest in the background (`cmd &`, nohup) ignores SIGINT and
        # the runner would inherit that: give it the disposition of a terminal's Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    own = f"{_PREFIX}{runner.pid}-"
    try:
        first = runner.stdout.readline()
        assert first.startswith("NAMESPACES"), (first, runner.stderr.read())
        assert len(_namespaces(own)) == 3
        rank_pids = _rank_pids(tmp_path, 2)
        runner.send_signal(signum)
        runner.wait(timeout=20)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    # An uncaught KeyboardInterrupt also ends Python with SIGINT, so -signum every time.
    assert runner.returncode == -signum
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in runner.stderr.read()
    if signum == signal.SIGKILL:
        # Nothing could run in the runner: namespaces and orphaned ranks are left behind.
        assert len(_namespaces(own)) == 3
        assert not any(_exited(pid) for pid in rank_pids)
        assert set(_namespaces(own)) <= set(cleanup_stale(_PREFIX))
    assert _namespaces(own) == []
    assert all(_exited(pid) for pid in rank_pids)


def test_latency_needs_netem_or_works():
    """Delay and loss need netem; without it the error says so and nothing is left behind."""
    own = f"{_PREFIX}{os.getpid()}-"
    try:
        with ShapedNetwork(2, bandwidth="100mbit", latency="5ms", prefix=_PREFIX) as net:
            link, _ = net.check_links(1.0)
            assert 9.0 <= link.mb_per_s <= 14.0
    except NetbenchUnavailableError as exc:
        assert "netem" in str(exc)
    assert _namespaces(own) == []


def test_cli_sites_shapes_only_links_between_sites(tmp_path):
    """4 ranks in 2 sites: the cross-site links run at the rate, the in-site link does not."""
    report = tmp_path / "sites.json"
    start = time.monotonic()
    code = cli.main(
        ["--nproc", "4", "--bandwidth", "50mbit", "--shape", "sites", "--sites", "2"]
        + ["--check-seconds", "0.5", "--check-links", "2", "--report", str(report)]
        + ["--", "true"]
    )
    assert code == 0
    data = json.loads(report.read_text())
    assert data["settings"]["sites"] == 2 and data["settings"]["num_shaped_links"] == 8
    links = data["link_check"]
    shaped = [m for m in links if m["shaped"]]
    inside = [m for m in links if not m["shaped"]]
    assert len(shaped) == 2 and len(inside) == 1, links
    # 50mbit = 6.25 MB/s on the wire, about 6.0 MB/s of TCP payload.
    for m in shaped:
        assert m["src_site"] != m["dst_site"] and 4.0 <= m["mb_per_s"] <= 7.0, links
    (m,) = inside
    assert m["src_site"] == m["dst_site"] and m["mb_per_s"] > 50.0, links
    assert time.monotonic() - start < 15
