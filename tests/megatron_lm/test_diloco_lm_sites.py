"""DiLoCo sites as separate jobs (``--outer-transport torchft``) in Megatron-LM's pretrain_gpt.py.

Two sites, each its own ``torchrun`` of one rank running Megatron-LM's own pretrain_gpt.py
(zero-touch launcher, the tiny GPT on mock data), H = 3, 6 iterations, a lighthouse of
``megatron-ext lighthouse`` that waits for both (``--outer-min-sites 2``):

* Megatron-LM builds the training split for both sites (twice one job's samples) and each
  site reads its own block through Megatron-LM's sampler: their first losses differ (same
  initial weights, other samples);
* the sites join before the first step, then complete the outer steps after iterations 3
  and 6 together (2 sites, each weighing one site's tokens), with ``outer`` bytes on those
  iterations' lines only (the join's on iteration 1's);
* both exit 0.

The kill of a site and its restart are tested through the driver and the torchft transport
itself (``tests/distributed/test_diloco_sites.py``): the transport is the same; what
pretrain_gpt.py adds is its data, its loop and its end of training, checked here.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.dist import free_port
from tests.megatron_lm.lm_runs import REPO, iterations, pretrain, tiny_args

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]

pytest.importorskip("torchft")


def test_pretrain_gpt_sites_in_separate_jobs_over_torchft(tmp_path):
    lm_dir = Path(os.environ["MEGATRON_LM_DIR"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "megatron_ext", "lighthouse", "--min-replicas", "2"]
        + ["--bind", f"127.0.0.1:{free_port()}", "--join-timeout-ms", "60000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        address = lighthouse.stdout.readline().split()[1]
        runs = {}

        def site(s):
            flags = tiny_args(
                grad_compression="none",
                outer_method="diloco",
                outer_interval="3",
                train_iters="6",
                outer_transport="torchft",
                outer_site_id=str(s),
                outer_sites="2",
                outer_min_sites="2",
                outer_lighthouse=address,
                outer_timeout="30",
            )
            (tmp_path / str(s)).mkdir()
            runs[s] = pretrain(lm_dir / "pretrain_gpt.py", flags, cwd=tmp_path / str(s), nproc=1)

        threads = [threading.Thread(target=site, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        lighthouse.kill()
        lighthouse.wait()
    for s in range(2):
        runs[s].check()
    out = {s: runs[s].stdout for s in range(2)}
    # Megatron-LM builds both sites' samples (6 iterations x 8 per site, twice); each reads
    # its own half.
    for s in range(2):
        assert "    train:      96" in out[s], out[s][-3000:]
        blocks = [l for l in out[s].splitlines() if "reads the training samples" in l]
        assert len(blocks) == 1, blocks
        lo, hi = blocks[0].split("[")[1].split(")")[0].split(", ")
        total = int(blocks[0].rsplit(" of ", 1)[1])
        assert (int(lo), int(hi)) == (s * (total // 2), (s + 1) * (total // 2)), blocks
        assert total >= 96
    its = {s: iterations(out[s]) for s in range(2)}
    assert its[0][1]["loss"] != its[1][1]["loss"], (its[0][1], its[1][1])
    for s in range(2):
        assert sorted(its[s]) == [1, 2, 3, 4, 5, 6]
        for it, record in its[s].items():
            # the join (before iteration 1's forward pass) and the two outer steps
            assert ("outer " in record.get("bytes", "")) == (it in (1, 3, 6)), (s, it, record)
        head = f"megatron-ext: torchft site {s}: commit "
        commits = [
            dict(f.split("=", 1) for f in l.split() if "=" in f)
            for l in out[s].splitlines()
            if l.startswith(head)
        ]
        # the join (nobody contributes), then the outer steps after iterations 3 and 6
        assert [c["iteration"] for c in commits] == ["0", "3", "6"], commits
        assert all(c["sites"] == "2" for c in commits), commits
        assert float(commits[0]["total_weight"]) == 0
        for c in commits[1:]:
            assert float(c["total_weight"]) == 2 * float(c["weight"]) > 0, c
