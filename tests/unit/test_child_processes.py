"""Process lifetimes of a rank (``megatron_ext/child_processes.py``).

* Children of a process that called ``children_die_with_parent`` die when it is killed: a
  helper process starts one multiprocessing child with the spawn method (as megatron-core's
  checkpoint writer starts its manager) and one with fork (as it starts its writers), prints
  their pids and waits; the test SIGKILLs it and requires both children to be gone. Without
  the call both stay alive, adopted by init.
* Shielded (``shield_children``, as ``--exit-signal-handler`` does), the same children
  ignore SIGTERM and SIGUSR1 sent to the whole process group (what torchrun's forward and
  Slurm do; without the shield the spawned one died of it and the next save failed with
  BrokenPipeError), and still die with their parent.
* A torchrun worker (``TORCHELASTIC_RUN_ID`` set) that called ``die_with_launcher`` is
  gone once its launcher is SIGKILLed; without the variable it keeps running (control); a
  launcher that started it from a thread which then ended does not take it down (what a
  ``PR_SET_PDEATHSIG`` in the rank would have done).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import REPO
from tests.helpers.procs import alive, survivors

_HELPER = """
import multiprocessing as mp, signal, sys, time
from megatron_ext.child_processes import children_die_with_parent, shield_children
def wait(started):
    started.set()
    time.sleep(600)
if __name__ == "__main__":
    if sys.argv[1] != "off":
        assert children_die_with_parent()
    if sys.argv[1] == "shield":
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda s, f: print("got", s, flush=True))
        shield_children((signal.SIGTERM, signal.SIGUSR1))
    procs = []
    for method in ("spawn", "fork"):
        ctx = mp.get_context(method)
        started = ctx.Event()
        procs.append(ctx.Process(target=wait, args=(started,)))
        procs[-1].start()
        # Running its target: a spawned child ran its prelude (as the manager megatron-core
        # starts has: Manager() returns once it serves).
        assert started.wait(120)
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
"""


def _ignored(pid):
    """The signals ``pid`` ignores (its SigIgn mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {s for s in signal.Signals if s < 64 and mask >> (s - 1) & 1}


def _orphans_after_kill(tmp_path, mode, wait_s, group_signals=()):
    script = tmp_path / "helper.py"
    script.write_text(_HELPER)
    parent = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    pids = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        if group_signals:
            # (The environment may ignore SIGINT already: a background job's does.)
            assert all(set(group_signals) <= _ignored(p) for p in pids)
            for sig in group_signals:
                os.killpg(parent.pid, sig)
                # The parent handled it: the signal went out to the whole group.
                assert parent.stdout.readline().split() == ["got", str(int(sig))]
            assert all(alive(p) for p in pids), "a shielded child died of a group signal"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        return survivors(pids, within=wait_s, poll=0.1)
    finally:
        parent.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_spawned_and_forked_children_die_with_their_parent(tmp_path):
    assert _orphans_after_kill(tmp_path, "on", wait_s=10) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_it_children_outlive_their_parent(tmp_path):
    # The control: the leak this module exists for (so the test above can fail).
    assert len(_orphans_after_kill(tmp_path, "off", wait_s=2)) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_shielded_children_outlive_group_signals_and_die_with_their_parent(tmp_path):
    signals = (signal.SIGTERM, signal.SIGUSR1)
    assert _orphans_after_kill(tmp_path, "shield", wait_s=10, group_signals=signals) == []


_LAUNCHER = """
import os, subprocess, sys, threading, time
rank = [None]
def start():
    rank[0] = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
if sys.argv[1] == "thread":
    worker = threading.Thread(target=start)
    worker.start()
    worker.join()  # the thread that started the rank is gone; the launcher lives on
else:
    start()
print(rank[0].pid, flush=True)
time.sleep(600)
"""

_RANK = """
import sys, time
from megatron_ext.child_processes import die_with_launcher
with open(sys.argv[1] if len(sys.argv) > 1 else {path!r}, "w") as f:
    f.write(str(die_with_launcher()))
time.sleep(600)
"""


def _rank_after_launcher_kill(tmp_path, how, torchrun_env, wait_s):
    """Start a launcher and its rank; SIGKILL the launcher once the rank watches it; return
    whether the rank is still alive after ``wait_s`` and the rank's watch mode."""
    mode_file = tmp_path / "mode.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TORCHELASTIC_RUN_ID", None)
    if torchrun_env:
        env["TORCHELASTIC_RUN_ID"] = "test"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, how, _RANK.format(path=str(mode_file))],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    rank = None
    try:
        rank = int(launcher.stdout.readline())
        deadline = time.time() + 120
        while not mode_file.exists() or not mode_file.read_text():
            assert time.time() < deadline and alive(rank), "the rank did not start"
            time.sleep(0.05)
        mode = mode_file.read_text()
        alive_with_launcher = alive(rank)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + wait_s
        while time.time() < deadline and alive(rank):
            time.sleep(0.05)
        return alive_with_launcher, alive(rank), mode
    finally:
        launcher.kill()
        if rank is not None and alive(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd / getppid watch")
@pytest.mark.parametrize("how", ["main", "thread"])
def test_a_torchrun_worker_dies_with_its_killed_launcher(tmp_path, how):
    alive_before, alive_after, mode = _rank_after_launcher_kill(tmp_path, how, True, wait_s=30)
    assert mode in ("pidfd", "poll")
    # Started from a thread that ended: still running while its launcher lives.
    assert alive_before
    assert not alive_after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd / getppid watch")
def test_without_torchrun_a_process_outlives_its_parent(tmp_path):
    # The control: a process started from a shell keeps running when the shell exits.
    alive_before, alive_after, mode = _rank_after_launcher_kill(tmp_path, "main", False, 2)
    assert mode == "None" and alive_before and alive_after
