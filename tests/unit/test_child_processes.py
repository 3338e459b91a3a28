"""Children of a process that called ``children_die_with_parent`` die when it is killed.

A helper process starts one multiprocessing child with the spawn method (as megatron-core's
checkpoint writer starts its manager) and one with fork (as it starts its writers), prints
their pids and waits; the test SIGKILLs it and requires both children to be gone. Without
the call both stay alive, adopted by init (the leak of issue 26).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_HELPER = """
import multiprocessing as mp, sys, time
from megatron_ext.child_processes import children_die_with_parent
if __name__ == "__main__":
    if sys.argv[1] == "on":
        assert children_die_with_parent()
    procs = [mp.get_context(m).Process(target=time.sleep, args=(600,)) for m in ("spawn", "fork")]
    for p in procs:
        p.start()
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
"""


def _alive(pid):
    """Running (not gone, not a zombie left for a parent that does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _orphans_after_kill(tmp_path, mode, wait_s):
    script = tmp_path / "helper.py"
    script.write_text(_HELPER)
    parent = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + wait_s
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        return [p for p in pids if _alive(p)]
    finally:
        parent.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_spawned_and_forked_children_die_with_their_parent(tmp_path):
    assert _orphans_after_kill(tmp_path, "on", wait_s=10) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_it_children_outlive_their_parent(tmp_path):
    # The control: the leak this module exists for (so the test above can fail).
    assert len(_orphans_after_kill(tmp_path, "off", wait_s=2)) == 2
