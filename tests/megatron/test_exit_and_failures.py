"""``megatron-ext train`` when the run is stopped or its environment fails.

Each test launches the driver as users do (torchrun, 2 CPU ranks, gloo, tiny GPT):

* ``--exit-signal-handler``: a signal at any moment (Ctrl-C before the first save, SIGTERM
  to torchrun between saves, SIGUSR1 to every process of the ranks' groups while a save is
  in flight) stops every rank at the same iteration, completes or writes a checkpoint there
  and exits 0; the run resumed after each of them equals an uninterrupted one bit for bit
  (losses, every tensor of the final checkpoint).
* A rank killed (SIGKILL) while it saves takes megatron-core's checkpoint writer
  processes with it (they used to run for ever, adopted by init), and a torchrun killed
  with SIGKILL takes its ranks (they used to train on, unsupervised).
* A refusal is printed exactly once, with 2 ranks (after setup, pipeline stages) and 8
  (while parsing): once per job, not once per rank, and never lost.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.driver import base_flags, run_driver, start_driver
from tests.helpers.paths import REPO
from tests.helpers.procs import assert_all_gone, children, descendants

BASE = base_flags(log_interval=1)


def _wait_for(path, text, proc, timeout=300):
    """Wait until ``text`` appears in the file ``path`` (or the process ends)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in Path(path).read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {text!r}:\n{Path(path).read_text()[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} after {timeout} s:\n{Path(path).read_text()[-4000:]}")


def _iteration_line(n):
    return f" iteration {n:8d}/"


def _signal_groups(pids, sig):
    """Signal every process of each pid's process group (what torchrun's forward does)."""
    for pid in pids:
        os.killpg(pid, sig)


def _wait_for_files(folder, pattern, count, proc, timeout=300):
    deadline = time.time() + timeout
    while len(list(Path(folder).glob(pattern))) < count:
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"no {count} x {pattern} in {folder} (run ended: {proc.poll()})")
        time.sleep(0.05)


def _stopped(out, save, sig, proc, rc, torchrun_signalled):
    """Checks of a run stopped by ``sig``; returns the iteration it stopped (and saved) at."""
    text = out.read_text()
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert f"> exiting after receiving {sig.name} at iteration {stopped}; checkpoint" in text, text[
        -4000:
    ]
    assert text.count("> exiting after receiving") == 1
    # The iteration the ranks agreed on is the last one logged: nothing ran after it.
    assert _iteration_line(stopped) in text and _iteration_line(stopped + 1) not in text
    # Every rank exited 0: torchrun reports no failed child (it killed none after its
    # shutdown timeout), no rank died of the signal, no save failed.
    for bad in ("ChildFailedError", "BrokenPipeError", "could not be written", "SIGKILL"):
        assert bad not in text, (bad, text[-4000:])
    if torchrun_signalled:
        # torchrun re-raises the signal it forwarded once its workers stopped (torch's
        # behaviour, torch/distributed/elastic/agent/server/api.py): its status is 1.
        assert rc == 1 and "SignalException" in text, text[-4000:]
    else:
        assert rc == 0 and "Traceback" not in text, text[-4000:]
    return stopped


def _losses(path):
    import json

    return [json.loads(line)["lm_loss"] for line in Path(path).read_text().splitlines()]


def _checkpoint_tensors(directory):
    """Every tensor of a torch_dist checkpoint (model, optimizer, RNG), by key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = Path(str(directory) + ".pt")
    dcp_to_torch_save(str(directory), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


# The driver's own signal handling (megatron_ext/signals.py) at three moments: run once, in
# the main pass. The seam it goes through, megatron-core's checkpoint writer processes
# receiving a forwarded signal while they hold a save, runs on every release in
# tests/megatron_lm/test_slurm_requeue.py (the writers held by save_gate, the save completed,
# the run resumed).
@pytest.mark.release_covered
@pytest.mark.slow
def test_a_signal_at_any_moment_saves_and_the_run_resumes_exactly(tmp_path):
    """Three interruptions of one run, each resumed, equal an uninterrupted run bit for bit:
    Ctrl-C before the first save; SIGTERM to torchrun between saves, after a save started
    megatron-core's writer processes (the moment whose save used to fail with
    BrokenPipeError); SIGUSR1 to every process of the ranks' groups while a save is in
    flight (its writers held by tests/helpers/save_gate until the signal is delivered)."""
    iters = 24
    args = BASE + ["--train-iters", str(iters), "--eval-iters", "0"]
    args += ["--hidden-dropout", "0", "--attention-dropout", "0", "--exit-signal-handler"]
    # torchrun gives its workers this long to stop after it forwards a signal (default 30 s;
    # a checkpoint on a loaded 2-core CI machine can take 10 s).
    torchrun_args = ["--shutdown-timeout", "180"]
    ref, save = tmp_path / "ref", tmp_path / "run"
    out = tmp_path / "ref.txt"
    proc, f = start_driver(args + ["--save", str(ref), "--save-interval", "4"], out)
    try:
        assert proc.wait(timeout=600) == 0, out.read_text()[-4000:]
    finally:
        proc.kill()
        f.close()
    resume = ["--save", str(save), "--load", str(save)]

    # 1. Ctrl-C before any save (none due before the end): SIGINT to torchrun.
    out = tmp_path / "1.txt"
    proc, f = start_driver(args + resume + ["--save-interval", "1000"], out, torchrun_args)
    try:
        _wait_for(out, _iteration_line(2), proc)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=600)
    finally:
        proc.kill()
        f.close()
    first = _stopped(out, save, signal.SIGINT, proc, rc, torchrun_signalled=True)
    assert 2 <= first < iters

    # 2. SIGTERM to torchrun once this run has saved (its writer manager is alive).
    out = tmp_path / "2.txt"
    proc, f = start_driver(args + resume + ["--save-interval", "4"], out, torchrun_args)
    saved = (first // 4 + 1) * 4
    try:
        _wait_for(out, f"saved checkpoint at iteration {saved:8d}", proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=600)
    finally:
        proc.kill()
        f.close()
    assert f"resumed from {save} at iteration {first}" in out.read_text()
    second = _stopped(out, save, signal.SIGTERM, proc, rc, torchrun_signalled=True)
    assert saved <= second < iters - 4

    # 3. SIGUSR1 to the ranks' process groups while the next periodic save is being written.
    gated = (second // 4 + 1) * 4
    gate = tmp_path / "gate"
    gate.mkdir()
    out = tmp_path / "3.txt"
    env = {
        "PYTHONPATH": f"{REPO / 'tests' / 'helpers' / 'save_gate'}:{REPO}",
        "SAVE_GATE_DIR": str(gate),
        "SAVE_GATE_MATCH": f"iter_{gated:07d}/",
    }
    proc, f = start_driver(args + resume + ["--save-interval", "4"], out, torchrun_args, env=env)
    try:
        ranks = []
        while len(ranks) < 2:
            assert proc.poll() is None, out.read_text()[-4000:]
            ranks = children(proc.pid)
            time.sleep(0.1)
        # Both ranks' writers hold the save's data.
        for rank in range(2):
            _wait_for_files(gate, f"writing.{rank}.*", 1, proc)
        _signal_groups(ranks, signal.SIGUSR1)
        (gate / "release").touch()
        rc = proc.wait(timeout=600)
    finally:
        proc.kill()
        f.close()
    third = _stopped(out, save, signal.SIGUSR1, proc, rc, torchrun_signalled=False)
    # The save in flight completed; the ranks stopped right after it, saving nothing more.
    assert third == gated and "saved checkpoint at iteration" in out.read_text()

    # 4. To the end; everything equals the uninterrupted run.
    out = tmp_path / "4.txt"
    proc, f = start_driver(args + resume + ["--save-interval", "4"], out)
    try:
        assert proc.wait(timeout=600) == 0, out.read_text()[-4000:]
    finally:
        proc.kill()
        f.close()
    text = out.read_text()
    assert f"resumed from {save} at iteration {third}" in text
    assert "> verified the crc32 checksums of" in text
    assert _losses(save / "log.jsonl") == _losses(ref / "log.jsonl")
    a, b = _checkpoint_tensors(ref / f"iter_{iters:07d}"), _checkpoint_tensors(
        save / f"iter_{iters:07d}"
    )
    assert a.keys() == b.keys() and len(a) > 10
    import torch

    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.slow
def test_ranks_die_with_their_killed_launcher(tmp_path):
    """kill -9 of torchrun: its ranks (in their own sessions) and their writer processes are
    gone within seconds and the run directory stops changing; they used to train on to the
    end, unsupervised."""
    save = tmp_path / "run"
    args = BASE + ["--train-iters", "400", "--save", str(save), "--save-interval", "2"]
    out = tmp_path / "out.txt"
    proc, f = start_driver(args, out)
    try:
        _wait_for(out, "saved checkpoint at iteration        4", proc)
        processes = descendants(proc.pid)
        ranks = children(proc.pid)
        assert len(ranks) == 2 and len(processes) > 2, processes  # + writer managers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        # Generous for a loaded machine; measured 0.2 s on an idle one.
        assert_all_gone(processes, within=60, poll=0.1)
    finally:
        proc.kill()
        f.close()
    text = out.read_text()
    assert "megatron-ext: the launcher of rank 0" in text and "is gone" in text, text[-3000:]
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert stopped < 400 and _iteration_line(400) not in text


@pytest.mark.slow
def test_checkpoint_writer_processes_die_with_a_killed_rank(tmp_path):
    # A save every iteration: most of the run is spent saving, so the kill lands in one.
    args = BASE + ["--train-iters", "200", "--save", str(tmp_path / "run"), "--save-interval", "1"]
    out = tmp_path / "out.txt"
    proc, f = start_driver(args, out)
    try:
        _wait_for(out, "saved checkpoint at iteration        2", proc)
        rank = min(children(proc.pid))
        # megatron-core's writer: a spawned multiprocessing manager (plus its resource
        # tracker), started on the rank's first save and alive since.
        helpers = descendants(rank)
        assert any("spawn_main" in Path(f"/proc/{p}/cmdline").read_text() for p in helpers)
        os.kill(rank, signal.SIGKILL)
        proc.wait(timeout=120)
        assert_all_gone(helpers, within=15, poll=0.2)
    finally:
        proc.kill()
        f.close()


# Refused after the process groups and the model exist, on 2 ranks: printed once too
# (test_driver_cli.py's AQ-SGD refusals).
@pytest.mark.release_independent
@pytest.mark.parametrize(
    "nproc, args, line",
    [
        # Refused while parsing, on 8 ranks at once.
        (
            8,
            ["--grad-compression", "topk"],
            "megatron-ext train: error: argument --grad-compression",
        ),
    ],
)
def test_driver_refusal_reaches_the_terminal_once(nproc, args, line, tmp_path):
    proc = run_driver(
        BASE + ["--train-iters", "4"] + args,
        tmp_path,
        nproc=nproc,
        timeout=600,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    assert proc.stderr.count(line) == 1, proc.stderr[-4000:]
    assert " iteration " not in proc.stdout
