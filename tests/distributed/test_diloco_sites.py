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
from tests.helpers.driver import base_flags, start_driver
from tests.helpers.paths import REPO
from tests.helpers.torchft_sites import commit_events, start_lighthouse

pytestmark = pytest.mark.slow

pytest.importorskip("torchft")

TIMEOUT = 240.0


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
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


def _same_global_weights(a, b):
    """Two sites' records of one outer step: the same snapshots (the global weights) of every
    parameter, the same weights of the fragment synchronized (the others hold each site's own
    progress since their last outer step; with one fragment, every parameter)."""
    assert a["synced"] == b["synced"], (a["synced"], b["synced"])
    for n in a["snapshot"]:
        assert torch.equal(a["snapshot"][n], b["snapshot"][n]), n
    for n in a["synced"]:
        assert torch.equal(a["weights"][n], b["weights"][n]), n


@pytest.mark.parametrize(
    "compression, fragments, delay", [("none", 1, 0), ("quantized", 3, 0), ("none", 1, 2)]
)
def test_site_killed_and_restarted(tmp_path, compression, fragments, delay):
    """Dense, and streaming (3 fragments, one synchronized after every step) with the 4-bit
    exchange with error feedback (``quantized``: what a site sends is its pseudo-gradient
    times ``w / sum(w)``, the sites receive the same compressed sum; site 2 is killed while
    the others are inside the exchange's collectives: their attempt fails, is not committed
    and is repeated over the two of them). With fragments, after an outer step the sites
    hold the same snapshots (global weights) of every fragment and the same weights of the
    fragment synchronized; the restarted site joins at the fragment the others are at.
    Overlapped (``--outer-delay 2`` of H = 3; dense): the restarted site starts its join while
    site 0's exchange is in flight (site 0 holds it until then); that exchange lands, and the
    restarted site joins the next outer step."""
    out = str(tmp_path)
    procs = {}
    logs = {}
    try:
        procs["lighthouse"], address = start_lighthouse(
            _env(), 2, "--join-timeout-ms", "30000", "--heartbeat-timeout-ms", "2000"
        )

        def start(site, tag):
            log = open(os.path.join(out, f"site{site}{tag}.log"), "w")
            logs[f"site{site}{tag}"] = log
            procs[f"site{site}{tag}"] = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.ft_site", str(site), out],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(
                    TORCHFT_LIGHTHOUSE=address,
                    MASTER_PORT=free_port(),
                    FT_COMPRESSION=compression,
                    FT_FRAGMENTS=fragments,
                    FT_DELAY=delay,
                    FT_JOIN_IN_FLIGHT=int(bool(delay and tag)),
                    FT_STALL_SITE=2 if compression != "none" and not tag else -1,
                ),
                cwd=REPO,
            )

        for site in range(3):
            start(site, "")
        # 1. site 2 contributed to an outer step (weight 3): kill it (compressed: inside
        # the next exchange).
        _wait(
            lambda: any(float(r["event"]["total_weight"]) == 3 for r in _records(out, 2).values()),
            "an outer step with three sites",
            procs,
        )
        if compression != "none":
            _wait(lambda: os.path.exists(os.path.join(out, "stalled")), "the stall", procs)
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
        # two sites of equal weight (two cycles' if the kill failed an overlapped step)
        assert float(a["event"]["total_weight"]) == 2 * float(a["event"]["weight"]) >= 2.0
        if compression != "none":  # the attempt with site 2 inside failed, was repeated
            assert a["event"]["attempts"] >= 2 and b["event"]["attempts"] >= 2, (a, b)
        if compression == "none":
            # the pseudo-gradient averaged over who is there: the sum of what sites 0, 1 sent
            torch.testing.assert_close(a["sum"], a["sent"] + b["sent"], rtol=1e-6, atol=1e-7)
        assert torch.equal(a["sum"], b["sum"])
        _same_global_weights(a, b)
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
        # The sites' first outer step (torchft step 1) is the joins of the first quorum's
        # sites (at least two, none has trained yet): nobody contributed, and the dense
        # exchange sent the weights' sum alone, no model-sized buffer.
        firsts = [recs[s][1] for s in range(3) if 1 in recs[s]]
        assert len(firsts) >= 2, {s: sorted(recs[s]) for s in range(3)}
        for first in firsts:
            assert float(first["event"]["total_weight"]) == 0.0, first["event"]
            if compression == "none":
                assert first["sent"].numel() == 1, first["sent"].shape
        final = max(recs[2])
        join = min(s for s in recs[2] if s > step)
        assert float(recs[2][join]["event"]["weight"]) == 0.0  # joined without a contribution
        if compression == "none":
            assert recs[2][join]["sent"][-1] == 0.0
        else:  # its share w / sum(w) of its pseudo-gradient: zero
            assert not recs[2][join]["sent"].any()
        assert final > join
        for s in (join, final):
            _same_global_weights(recs[0][s], recs[1][s])
            _same_global_weights(recs[0][s], recs[2][s])
        # the restarted site joined at the fragment the others synchronized, then followed
        # their schedule
        for s in (join, final):
            assert recs[2][s]["synced"] == recs[0][s]["synced"], s
            assert recs[2][s]["event"]["fragment"] == recs[0][s]["event"]["fragment"], s
        assert float(recs[2][final]["event"]["total_weight"]) == 3.0
        if delay:
            # the join was asked for while site 0's exchange was in flight: that exchange
            # landed after the request, and the restarted site joined the next outer step
            asked = float(open(os.path.join(out, "joining")).read())
            landed = min(
                (r["event"]["time"], s) for s, r in recs[0].items() if r["event"]["time"] > asked
            )
            assert landed[1] == join - 1, (landed, join)
        if fragments > 1:
            # after the join each site weighs a fragment by the share of the cycle it trained
            # it: the restarted one less, until it has trained a whole cycle
            partial = [
                float(recs[2][s]["event"]["weight"]) for s in sorted(recs[2]) if join < s < final
            ]
            assert any(0 < w < 1 for w in partial), partial
            assert len(set(recs[0][final]["synced"])) < len(recs[0][final]["weights"])
        # the steps between the kill and the rejoin went on over two sites
        assert all(recs[0][s]["event"]["sites"] == 2 for s in range(step, join))
    finally:
        _kill_all(procs, logs)


def test_driver_sites_survive_a_killed_site(tmp_path):
    """The same through the driver, each site a ``torchrun`` job of its own: gpt-tiny in a
    pipeline of 2 stages with Protocol Models inside each site (its subspace-confined
    pipeline traffic between the site's two ranks; a torchft Manager per rank, one replica
    per site), streaming DiLoCo's 2 fragments (an outer step every 2 steps, each of half the
    parameters, its exchange overlapped with the next step). 2 sites reading disjoint data (their first losses differ); once both have
    contributed to an outer step, site 1's torchrun is SIGKILLed (its ranks die with it);
    site 0 completes the next outer step alone (weight of one site's tokens) and finishes
    training (exit code 0)."""
    out = str(tmp_path)
    procs, logs = {}, {}
    try:
        procs["lighthouse"], address = start_lighthouse(_env(), 1, "--heartbeat-timeout-ms", "2000")
        for site in range(2):
            procs[f"site{site}"], logs[site] = start_driver(
                base_flags(log_interval=1, eval_iters=0)
                + ["--num-threads", "1"]
                + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
                + ["--subspace-method", "protocol", "--subspace-rank", "32"]
                + ["--hidden-dropout", "0"]
                + ["--train-iters", "24", "--outer-method", "diloco"]
                + ["--outer-interval", "4", "--outer-fragments", "2", "--outer-delay", "1"]
                + ["--outer-transport", "torchft"]
                + ["--outer-site-id", str(site), "--outer-sites", "2"]
                + ["--outer-lighthouse", address, "--outer-timeout", "20"],
                tmp_path / f"site{site}.log",
                ["--master-port", str(free_port())],
                env=_env(),
            )

        def text(site):
            return open(os.path.join(out, f"site{site}.log")).read()

        def commits(site):
            return commit_events(text(site), site)

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
        # the fragments alternate, one every 2 steps, each applied a step after its start
        # (after the join, which is at the fragment the other site is at if it started
        # first; the last, started at the last iteration, lands when training ends)
        pairs = list(zip(done[1:], done[2:]))
        assert all(a["fragment"] != b["fragment"] for a, b in pairs), done
        steady = pairs[:-1]
        assert all(int(b["iteration"]) - int(a["iteration"]) == 2 for a, b in steady), done
        # started after even steps, applied after the next (odd) one
        assert all(int(c["iteration"]) % 2 == 1 for c in done[:-1]), done
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


# -- the compressed exchanges over torchft's groups (one launch of 3 ranks) -------------------

SHAPES = [("w", (48, 64)), ("b", (64,))]
NUMEL = 48 * 64 + 64


def _x(site, step):
    """Site ``site``'s weighted pseudo-gradient of outer step ``step`` (already scaled)."""
    gen = torch.Generator().manual_seed(100 * step + site)
    return torch.randn(NUMEL, generator=gen) * (0.1 + 0.05 * site)


def _over_torchft(rank, world, store_port):
    """Per method: the exchange over torchft's reconfigurable gloo groups (unregistered in
    torch.distributed, as in a site job), regrouped at every new quorum as the hook does,
    against the same exchange over the registered world; a step whose collectives fail (a
    site silent past the group's timeout) and is ended unapplied; the site leaving (a group
    of two), then rejoining with a peer's shared state (a group of three again)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import ProcessGroupGloo

    from megatron_ext.collectives.outer_exchange import OuterExchange
    from megatron_ext.optim.diloco_ft import _local_exchange

    dist.init_process_group("gloo")
    if rank == 0:
        # Held for the test's length: the other ranks' stores connect to it.
        _store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    dist.barrier()

    def ft_group(name, members, timeout=60.0):
        pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout))
        pg.configure(
            f"127.0.0.1:{store_port}/{name}", f"site_{rank}", members.index(rank), len(members)
        )
        return pg.parent  # what TorchftTransport.group() gives

    out = {}
    for method in ("quantized", "radius", "powersgd", "separate"):
        res = out[method] = {"equal": [], "applied": torch.zeros(NUMEL)}
        ft = _local_exchange(method, None, NUMEL, None, "cpu", name="outer/0", shapes=SHAPES)
        ref = OuterExchange(
            method,
            None,
            NUMEL,
            dist.group.WORLD,
            "cpu",
            name="outer/0",
            shapes=SHAPES,
            reduce="sum",
        )
        # 1. three sites, three outer steps: bit for bit the exchange over the world.
        ft = ft.regroup(ft_group(f"{method}/three", [0, 1, 2]))
        for step in range(3):
            got = ft.average(_x(rank, step), commit=False)
            ft.end(True)
            want = ref.average(_x(rank, step))
            res["equal"].append(torch.equal(got, want))
            res["applied"] += got
        res["equal"].append(torch.equal(ft.residual(), ref.residual()))
        res["residual_after_three"] = ft.residual()
        # 2. a failed step (site 2 silent): an exception, and the state stays as it was.
        if method in ("quantized", "radius"):
            ft = ft.regroup(ft_group(f"{method}/fail", [0, 1, 2], timeout=2.0))
            before = ft.state_dict()
            if rank < 2:
                try:
                    ft.average(_x(rank, 3), commit=False)
                    res["failed"] = False
                except Exception:
                    res["failed"] = True
                ft.end(False)
                after = ft.state_dict()
                res["unchanged"] = set(before) == set(after) and all(
                    (
                        torch.equal(before[k], after[k])
                        if torch.is_tensor(before[k])
                        else before[k] == after[k]
                    )
                    for k in before
                )
        dist.barrier()
        # 3. site 2 gone: sites 0, 1 go on over a group of two (two steps).
        if rank < 2:
            ft = ft.regroup(ft_group(f"{method}/two", [0, 1]))
            for step in (3, 4):
                res["applied"] += ft.average(_x(rank, step), commit=False)
                ft.end(True)
        # 4. site 2 back with a fresh exchange and site 0's shared state; one step of three.
        shared = [ft.shared_state_dict() if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        if rank == 2:
            ft = _local_exchange(method, None, NUMEL, None, "cpu", name="outer/0", shapes=SHAPES)
            ft.load_state_dict(shared[0])
            res["fresh_residual_zero"] = bool((ft.residual() == 0).all())
        ft = ft.regroup(ft_group(f"{method}/back", [0, 1, 2]))
        last = ft.average(_x(rank, 5), commit=False)
        ft.end(True)
        res["last"] = last
        res["applied"] += last
        res["residual"] = ft.residual()
        res["syncs"] = ft.syncs
    dist.barrier()
    return out


def test_compressed_exchanges_over_torchft_groups():
    """What a compressed exchange promises over torchft's groups (one launch, 3 ranks):

    * over three sites it is the same exchange, bit for bit, as over a registered world
      (reduce SUM: each site sends its share ``w / sum(w) * delta``), residuals included;
    * a step whose collectives fail raises on the sites waiting, and ``end(False)`` leaves
      their state bit for bit as before (the step is a transaction);
    * error feedback stays exact among the sites present (all but SEPARATE, whose error
      feedback is a moving average by design): after three steps of three sites, two of two
      (site 2 gone, its residual with it) and one of three (site 2 back with zero residual),
      ``sum of what was applied + the residuals of the sites present == sum of what every
      site present sent - the residual site 2 took away``;
    * every site applies the same update, and the outer sync count is the peer's.
    """
    from tests.helpers.dist import run_ranks

    res = run_ranks(_over_torchft, 3, free_port())
    for method in ("quantized", "radius", "powersgd", "separate"):
        r = [res[k][method] for k in range(3)]
        for k in range(3):
            assert all(r[k]["equal"]), (method, k, r[k]["equal"])
        assert torch.equal(r[0]["last"], r[1]["last"]) and torch.equal(r[0]["last"], r[2]["last"])
        assert r[2]["fresh_residual_zero"], method
        assert [x["syncs"] for x in r] == [6, 6, 6], method
        if method in ("quantized", "radius"):
            for k in (0, 1):
                assert r[k]["failed"] and r[k]["unchanged"], (method, k)
        if method == "separate":
            continue
        # every rank applied the same updates (sites 0, 1 all six, site 2 steps 0-2 and 5)
        assert torch.equal(r[0]["applied"], r[1]["applied"]), method
        sent = sum(_x(s, t) for s in range(3) for t in (0, 1, 2, 5))
        sent = sent + sum(_x(s, t) for s in (0, 1) for t in (3, 4))
        lhs = r[0]["applied"] + sum(x["residual"] for x in r)
        rhs = sent - r[2]["residual_after_three"]
        torch.testing.assert_close(lhs, rhs, rtol=0, atol=2e-5, msg=method)
        # ... and the residual is not zero (the check is not of an uncompressed exchange)
        assert r[0]["residual"].abs().max() > 1e-3, method
