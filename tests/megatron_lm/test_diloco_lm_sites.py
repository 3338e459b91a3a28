"""DiLoCo sites as separate jobs (``--outer-transport torchft``) in Megatron-LM's pretrain_gpt.py.

Two sites, each its own ``torchrun`` of one rank running Megatron-LM's own pretrain_gpt.py
(zero-touch launcher, the tiny GPT on mock data) with ``--fp16``, H = 3, 90 iterations, a
lighthouse of ``megatron-ext lighthouse`` (heartbeat timeout 2 s):

* Megatron-LM builds the training split for both sites (twice one job's samples) and each
  site reads its own block through Megatron-LM's sampler: their first losses differ (same
  initial weights, other samples);
* fp16's loss scaler starts at 2^32, so the first iterations overflow and are skipped on
  both sites while outer steps go on over torchft; the sites come out of it as one-world
  training does (tests/megatron_lm/test_fp16.py): a loss scale far above 1, at most two
  skipped iterations among the last 20;
* once both sites have completed an outer step together after that phase (each weighing one
  site's tokens), site 1's torchrun is SIGKILLed; site 0 completes its next outer steps alone
  (its own tokens) and finishes training, exit code 0;
* ``outer`` bytes are on the lines of the iterations whose outer step site 0 took with the
  other site (its join's on iteration 1's line); alone it sends none.

A restart of the killed site (live recovery) is tested through the driver and the torchft
transport itself (``tests/distributed/test_diloco_sites.py``): the transport is the same;
what pretrain_gpt.py adds is its data, its loop and its end of training, checked here.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.dist import free_port
from tests.helpers.driver import launch_env, torchrun_command
from tests.helpers.torchft_sites import commit_events, start_lighthouse
from tests.megatron_lm.lm_runs import iterations, tiny_args

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]

pytest.importorskip("torchft")

TIMEOUT = 300.0


def test_pretrain_gpt_sites_in_separate_jobs_over_torchft(tmp_path):
    lm_dir = Path(os.environ["MEGATRON_LM_DIR"])
    env = launch_env({"OMP_NUM_THREADS": "1"})
    env.pop("MEGATRON_EXT_CPU", None)
    procs, logs = {}, {}

    def text(s):
        return (tmp_path / f"site{s}.log").read_text()

    try:
        procs["lighthouse"], address = start_lighthouse(env, 1, "--heartbeat-timeout-ms", "2000")
        # Started together; one may train alone until the other's torchft Manager runs
        # (start-up differs by seconds), then they train together: 90 iterations leave
        # room for both before and after the kill.
        for s in range(2):
            flags = tiny_args(
                grad_compression="none",
                outer_method="diloco",
                outer_interval="3",
                train_iters="90",
                outer_transport="torchft",
                outer_site_id=str(s),
                outer_sites="2",
                outer_lighthouse=address,
                outer_timeout="20",
            ) + ["--fp16"]
            (tmp_path / str(s)).mkdir()
            logs[s] = open(tmp_path / f"site{s}.log", "w")
            procs[s] = subprocess.Popen(
                torchrun_command(
                    ["-m", "megatron_ext", "pretrain", "--cpu", str(lm_dir / "pretrain_gpt.py")]
                    + flags,
                    1,
                    ["--master-addr", "127.0.0.1", "--master-port", str(free_port())],
                ),
                stdout=logs[s],
                stderr=subprocess.STDOUT,
                cwd=tmp_path / str(s),
                env=env,
            )

        def both(c):  # an outer step both sites contributed to (tokens of two sites), after
            # the overflowing start (site 1 has logged a loss: it is out of it)
            return float(c["total_weight"]) == 2 * float(c["weight"]) > 0 and any(
                "loss" in r for r in iterations(text(1)).values()
            )

        deadline = time.monotonic() + TIMEOUT
        while not any(both(c) for c in commit_events(text(1), 1)):
            for s in range(2):
                assert procs[s].poll() is None, f"site {s} ended early:\n{text(s)[-4000:]}"
            assert time.monotonic() < deadline, "no outer step of both sites"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        killed_at = time.time()
        procs[0].wait(timeout=TIMEOUT)
        assert procs[0].returncode == 0, text(0)[-6000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs.values():
            log.close()
    out = {s: text(s) for s in range(2)}
    # Megatron-LM builds both sites' samples (90 iterations x 8 per site, twice); each reads
    # its own half.
    for s in range(2):
        assert "    train:      1440" in out[s], out[s][-3000:]
        blocks = [l for l in out[s].splitlines() if "reads the training samples" in l]
        assert len(blocks) == 1, blocks
        lo, hi = blocks[0].split("[")[1].split(")")[0].split(", ")
        total = int(blocks[0].rsplit(" of ", 1)[1])
        assert (int(lo), int(hi)) == (s * (total // 2), (s + 1) * (total // 2)), blocks
        assert total >= 1440
    its = {s: iterations(out[s]) for s in range(2)}
    assert "loss" not in its[1][1], its[1][1]  # fp16's start overflowed: the phase was met
    # (each site's own data decides the iteration its loss scale stops overflowing)
    first = min(i for i in its[1] if "loss" in its[1][i] and "loss" in its[0].get(i, {}))
    assert its[0][first]["loss"] != its[1][first]["loss"], (its[0][first], its[1][first])
    assert sorted(its[0]) == list(range(1, 91))
    scales = [float(r["loss_scale"]) for r in its[0].values()]
    skipped = [int(r["skipped"]) for r in its[0].values()]
    assert scales[-1] > 1e3 and sum(skipped[-20:]) <= 2, (scales[-20:], skipped[-20:])
    done = commit_events(out[0], 0)
    assert done[-1]["iteration"] == "90", done
    # every outer step's bytes on its iteration's line (the join's on iteration 1's); alone,
    # a site sends nothing
    stepped = {max(1, int(c["iteration"])) for c in done if c["sites"] != "1"}
    for it, record in its[0].items():
        assert ("outer " in record.get("bytes", "")) == (it in stepped), (it, record)
    # after the last step of both sites: alone, after the kill, the average over who is there
    last_both = max(i for i, c in enumerate(done) if c["sites"] == "2")
    after = done[last_both + 1 :]
    assert after and after[0]["at"] > killed_at, done
    for c in after:
        assert c["sites"] == "1" and float(c["total_weight"]) == float(c["weight"]) > 0, c
    print(
        f"pretrain_gpt.py: site 0's next outer step {after[0]['at'] - killed_at:.2f} s after the kill"
    )
