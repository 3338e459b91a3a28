"""``megatron-ext train`` when the run is stopped or its environment fails (issue 26).

Each test launches the driver as users do (torchrun, 2 CPU ranks, gloo, tiny GPT):

* ``--exit-signal-handler``: SIGTERM to the ranks (what Slurm sends a step) stops every rank
  at the same iteration, saves there and exits 0; the resumed run continues from that
  checkpoint and Ctrl-C (SIGINT to torchrun, which forwards it) saves again, without a
  traceback from any rank.
* A rank killed (SIGKILL) while it saves takes megatron-core's checkpoint writer
  processes with it (they used to run for ever, adopted by init).
* A refusal is printed exactly once, with 2 ranks (after setup, pipeline stages) and 8
  (while parsing): once per job, not once per rank, and never lost.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BASE = [
    "--cpu",
    "--model",
    "gpt-tiny",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1",
    "--eval-iters",
    "1",
    "--no-progress",
]


def _env(extra=None):
    return {**os.environ, "PYTHONPATH": str(REPO), **(extra or {})}


def _torchrun_cmd(args, nproc=2, torchrun_args=()):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        *torchrun_args,
        "-m",
        "megatron_ext.train",
        *args,
    ]


def _children(pid):
    """Direct children of ``pid`` (from /proc, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces; the fields after its closing parenthesis do not.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


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


def _start(args, out, torchrun_args=()):
    f = open(out, "w")
    proc = subprocess.Popen(
        _torchrun_cmd(args, torchrun_args=torchrun_args),
        stdout=f,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=out.parent,
        env=_env(),
    )
    return proc, f


def _iteration_line(n):
    return f" iteration {n:8d}/"


@pytest.mark.slow
def test_exit_signal_handler_saves_and_exits_cleanly_then_resumes(tmp_path):
    save = tmp_path / "run"
    args = BASE + ["--train-iters", "200", "--save", str(save), "--exit-signal-handler"]
    # torchrun gives its workers this long to stop after it forwards a signal (default 30 s;
    # a checkpoint on a loaded 2-core CI machine can take 10 s).
    torchrun_args = ["--shutdown-timeout", "180"]

    # 1. SIGTERM to each rank, as Slurm signals the processes of a step.
    out = tmp_path / "first.txt"
    proc, f = _start(args, out, torchrun_args)
    try:
        _wait_for(out, _iteration_line(2), proc)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
        f.close()
    text = out.read_text()
    assert rc == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stopped < 200
    assert text.count("> exiting after receiving SIGTERM") == 1, text[-4000:]
    assert f"> exiting after receiving SIGTERM at iteration {stopped}; checkpoint" in text
    # The iteration the ranks agreed on is the last one logged: nothing ran after it.
    assert _iteration_line(stopped) in text and _iteration_line(stopped + 1) not in text

    # 2. Resume from it, then Ctrl-C: SIGINT to torchrun only (its workers run in their own
    # sessions, so a terminal's Ctrl-C reaches torchrun, which forwards it to them).
    out = tmp_path / "second.txt"
    proc, f = _start(args + ["--load", str(save)], out, torchrun_args)
    try:
        _wait_for(out, _iteration_line(stopped + 2), proc)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
        f.close()
    text = out.read_text()
    assert f"resumed from {save} at iteration {stopped}" in text, text[-4000:]
    assert _iteration_line(stopped + 1) in text
    resumed_stop = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert resumed_stop >= stopped + 2
    assert f"> exiting after receiving SIGINT at iteration {resumed_stop}; checkpoint" in text
    # No rank died of the signal (KeyboardInterrupt) nor was killed by torchrun's timeout.
    assert "KeyboardInterrupt" not in text and "SIGKILL" not in text, text[-4000:]
    # torchrun itself re-raises the signal it received after its workers stopped (torch's
    # behaviour, torch/distributed/elastic/agent/server/api.py): its status is 1.
    assert rc == 1 and "SignalException" in text, text[-4000:]


def _descendants(pid):
    found = []
    for child in _children(pid):
        found += [child] + _descendants(child)
    return found


def _alive(pid):
    """Running (not gone, not a zombie left for an init that does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_checkpoint_writer_processes_die_with_a_killed_rank(tmp_path):
    # A save every iteration: most of the run is spent saving, so the kill lands in one.
    args = BASE + ["--train-iters", "200", "--save", str(tmp_path / "run"), "--save-interval", "1"]
    out = tmp_path / "out.txt"
    proc, f = _start(args, out)
    left = []
    try:
        _wait_for(out, "saved checkpoint at iteration        2", proc)
        rank = min(_children(proc.pid))
        # megatron-core's writer: a spawned multiprocessing manager (plus its resource
        # tracker), started on the rank's first save and alive since.
        helpers = _descendants(rank)
        assert any("spawn_main" in Path(f"/proc/{p}/cmdline").read_text() for p in helpers)
        os.kill(rank, signal.SIGKILL)
        proc.wait(timeout=120)
        deadline = time.time() + 15
        while time.time() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.2)
        left = [p for p in helpers if _alive(p)]
        assert left == [], [Path(f"/proc/{p}/cmdline").read_text() for p in left]
    finally:
        proc.kill()
        f.close()
        for pid in left:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "nproc, args, line",
    [
        # Refused after the process groups and the model exist (pipeline stages differ).
        (
            2,
            ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
            + ["--p2p-compression", "aqsgd"],
            "megatron-ext train: error: --p2p-compression, --fixed-samples:",
        ),
        # Refused while parsing, on 8 ranks at once.
        (
            8,
            ["--grad-compression", "topk"],
            "megatron-ext train: error: argument --grad-compression",
        ),
    ],
)
def test_driver_refusal_reaches_the_terminal_once(nproc, args, line, tmp_path):
    proc = subprocess.run(
        _torchrun_cmd(BASE + ["--train-iters", "4"] + args, nproc=nproc),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=_env({"OMP_NUM_THREADS": "1"}),
    )
    assert proc.returncode != 0
    assert proc.stderr.count(line) == 1, proc.stderr[-4000:]
    assert " iteration " not in proc.stdout
