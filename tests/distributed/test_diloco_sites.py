"""DiLoCo sites that fail alone (``--outer-transport torchft``): kill one, restart it.

One set of launches on loopback, each site its own process with its own gloo world and
master port (tests/helpers/ft_site.py), the lighthouse started by ``megatron-ext
lighthouse`` (at least 2 sites per quorum):

1. sites 0, 1, 2 start and train; once site 2 has contributed to an outer step it is
   SIGKILLed;
2. sites 0 and 1 complete the next outer step over the two of them: what they received is
   the sum of what the two sent (the pseudo-gradient average over who is there, weight 2),
   and they train on without a restart; the time from the kill to that step is printed
   (bounded by the lighthouse's heartbeat timeout and --outer-timeout, not asserted);
3. site 2 is started again: it heals from a live site at its first step (torchft's live
   recovery, no checkpoint on disk), contributes nothing to that outer step (weight 0) and
   ends it with the others' weights; at the next outer step all three contribute (weight 3)
   and all hold the same weights; every site then exits 0.

Events are checked by order (commit records, file contents), not by time. The processes
and the lighthouse are killed in ``finally`` whatever happens.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.dist import free_port

pytestmark = pytest.mark.slow

pytest.importorskip("torchft")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 240.0


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _wait(cond, what, procs):
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        for name, p in procs.items():
            if p.poll() not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"{name} exited with {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _records(out, site):
    found = {}
    for name in os.listdir(out):
        s, _, step = name[: -len(".pt")].partition("_")
        if name.endswith(".pt") and int(s) == site:
            try:
                found[int(step)] = torch.load(os.path.join(out, name))
            except Exception:  # being written
                continue
    return found


def _kill_all(procs, logs):
    """SIGKILL every process still running (sites, lighthouse); close the logs."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
    for log in logs.values():
        log.close()


def test_site_killed_and_restarted(tmp_path):
    out = str(tmp_path)
    procs = {}
    logs = {}
    try:
        lighthouse = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_ext",
                "lighthouse",
                "--min-replicas",
                "2",
                "--bind",
                f"127.0.0.1:{free_port()}",
                "--join-timeout-ms",
                "30000",
                "--heartbeat-timeout-ms",
                "2000",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
        )
        procs["lighthouse"] = lighthouse
        line = lighthouse.stdout.readline()
        assert line.startswith("lighthouse: http://127.0.0.1:"), line
        address = line.split()[1]

        def start(site, tag):
            log = open(os.path.join(out, f"site{site}{tag}.log"), "w")
            logs[f"site{site}{tag}"] = log
            procs[f"site{site}{tag}"] = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.ft_site", str(site), out],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(TORCHFT_LIGHTHOUSE=address, MASTER_PORT=free_port()),
                cwd=REPO,
            )

        for site in range(3):
            start(site, "")
        # 1. site 2 contributed to an outer step (weight 3): kill it.
        _wait(
            lambda: any(float(r["event"]["total_weight"]) == 3 for r in _records(out, 2).values()),
            "an outer step with three sites",
            procs,
        )
        killed_after = max(_records(out, 2))
        procs["site2"].send_signal(signal.SIGKILL)
        procs["site2"].wait()
        killed_at = time.time()
        # 2. the survivors' next outer step is over the two of them.
        _wait(
            lambda: any(
                r["event"]["sites"] == 2 and s > killed_after for s, r in _records(out, 0).items()
            ),
            "the survivors' outer step without site 2",
            procs,
        )
        rec0, rec1 = _records(out, 0), _records(out, 1)
        step = min(s for s, r in rec0.items() if s > killed_after and r["event"]["sites"] == 2)
        _wait(lambda: step in _records(out, 1), "site 1's record of that step", procs)
        rec1 = _records(out, 1)
        a, b = rec0[step], rec1[step]
        done_at = a["event"]["time"]
        print(
            f"site 2 killed after outer step {killed_after}; the survivors' outer step {step} "
            f"(over 2 sites) completed {done_at - killed_at:.2f} s after the kill"
        )
        assert done_at > killed_at
        assert float(a["event"]["total_weight"]) == 2.0
        # the pseudo-gradient averaged over who is there: the sum of what sites 0 and 1 sent
        torch.testing.assert_close(a["sum"], a["sent"] + b["sent"], rtol=1e-6, atol=1e-7)
        assert torch.equal(a["sum"], b["sum"])
        for n in a["weights"]:
            assert torch.equal(a["weights"][n], b["weights"][n]), n
        # 3. restart site 2: it heals, joins with weight 0, then contributes.
        open(os.path.join(out, "stop"), "w").close()  # end at the next step of three
        start(2, "-restarted")
        for name in ("site0", "site1", "site2-restarted"):
            procs[name].wait(timeout=TIMEOUT)
            assert procs[name].returncode == 0, (
                name,
                open(os.path.join(out, f"{name}.log")).read(),
            )
        log2 = open(os.path.join(out, "site2-restarted.log")).read()
        assert "healed" in log2, log2
        recs = {s: _records(out, s) for s in range(3)}
        final = max(recs[2])
        join = min(s for s in recs[2] if s > step)
        assert float(recs[2][join]["event"]["weight"]) == 0.0  # joined without a contribution
        assert recs[2][join]["sent"][-1] == 0.0
        assert final > join
        for s in (join, final):
            for n in recs[0][s]["weights"]:
                assert torch.equal(recs[2][s]["weights"][n], recs[0][s]["weights"][n]), (s, n)
                assert torch.equal(recs[1][s]["weights"][n], recs[0][s]["weights"][n]), (s, n)
        assert float(recs[2][final]["event"]["total_weight"]) == 3.0
        # the steps between the kill and the rejoin went on over two sites
        assert all(recs[0][s]["event"]["sites"] == 2 for s in range(step, join))
    finally:
        _kill_all(procs, logs)


def test_driver_sites_survive_a_killed_site(tmp_path):
    """The same through the driver, each site a ``torchrun`` job of its own: gpt-tiny in a
    pipeline of 2 stages with Protocol Models inside each site (its subspace-confined
    pipeline traffic between the site's two ranks; a torchft Manager per rank, one replica
    per site). 2 sites reading disjoint data (their first losses differ); once both have
    contributed to an outer step, site 1's torchrun is SIGKILLed (its ranks die with it);
    site 0 completes the next outer step alone (weight of one site's tokens) and finishes
    training (exit code 0)."""
    out = str(tmp_path)
    procs, logs = {}, {}
    try:
        port = free_port()
        procs["lighthouse"] = lighthouse = subprocess.Popen(
            [sys.executable, "-m", "megatron_ext", "lighthouse", "--min-replicas", "1"]
            + ["--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms", "2000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
        )
        address = lighthouse.stdout.readline().split()[1]
        for site in range(2):
            path = os.path.join(out, f"site{site}.log")
            logs[site] = open(path, "w")
            procs[f"site{site}"] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
                + ["--master-port", str(free_port()), "-m", "megatron_ext.train"]
                + ["--cpu", "--model", "gpt-tiny", "--num-threads", "1"]
                + ["--no-progress", "--log-interval", "1", "--eval-iters", "0"]
                + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
                + ["--subspace-method", "protocol", "--subspace-rank", "32"]
                + ["--hidden-dropout", "0"]
                + ["--train-iters", "24", "--lr-warmup-iters", "2", "--outer-method", "diloco"]
                + ["--outer-interval", "4", "--outer-transport", "torchft"]
                + ["--outer-site-id", str(site), "--outer-sites", "2"]
                + ["--outer-lighthouse", address, "--outer-timeout", "20"],
                stdout=logs[site],
                stderr=subprocess.STDOUT,
                env=_env(),
                cwd=out,
            )

        def text(site):
            return open(os.path.join(out, f"site{site}.log")).read()

        def commits(site):
            head = f"megatron-ext: torchft site {site}: commit "
            out = []
            for line in text(site).splitlines():
                if line.startswith(head):
                    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                    fields["at"] = float(line.rsplit(" at ", 1)[1])
                    out.append(fields)
            return out

        def both(c):  # an outer step both sites contributed to (tokens of two sites)
            return float(c["total_weight"]) == 2 * float(c["weight"]) > 0

        _wait(lambda: any(both(c) for c in commits(1)), "an outer step of both sites", procs)
        procs["site1"].send_signal(signal.SIGKILL)
        procs["site1"].wait()
        killed_at = time.time()
        procs["site0"].wait(timeout=TIMEOUT)
        assert procs["site0"].returncode == 0, text(0)[-3000:]
        done = commits(0)
        assert done[-1]["iteration"] == "24", done
        # the outer steps after the last one with both sites: alone, after the kill
        last_both = max(i for i, c in enumerate(done) if c["sites"] == "2")
        after = done[last_both + 1 :]
        assert after and after[0]["at"] > killed_at, done
        print(f"driver: site 0's next outer step {after[0]['at'] - killed_at:.2f} s after the kill")
        # the average over who is there: site 0's tokens alone
        for c in after:
            assert c["sites"] == "1" and float(c["total_weight"]) == float(c["weight"]) > 0, c
        # disjoint shards: the two sites' first losses differ
        first = [
            [l for l in text(s).splitlines() if "iteration        1/" in l][0].split("lm loss:")[1]
            for s in range(2)
        ]
        assert first[0] != first[1], first
        # Protocol Models inside the site: the pipeline sent k of d coordinates per token.
        last = [l for l in text(0).splitlines() if "iteration       24/" in l][0]
        assert "pp-act" in last and "(dense" in last, last
    finally:
        _kill_all(procs, logs)
