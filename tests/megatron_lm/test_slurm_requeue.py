"""A Slurm preemption of ``pretrain_gpt.py``, end to end: time-limit signal, save, requeue,
resume.

``scripts/slurm/pretrain_gpt_ext.sbatch`` runs under bash as Slurm would run it, with a fake
``srun`` that runs its task on this machine (``exec``, so the script's signal reaches
torchrun itself) and a fake ``scontrol`` that records the requeue: a tiny GPT (the shipped
CPU run file, 8 iterations, a torch_dist checkpoint every 2), 2 ranks, zero-touch launcher.

1. The writers of the iteration-4 save are held (tests/helpers/save_gate) while SIGUSR1
   (Slurm's ``--signal=B:USR1``) reaches the batch script: it forwards SIGTERM to torchrun,
   which forwards it to each rank's process group (writer processes included); then the
   save goes on. Megatron-LM's ``--exit-signal-handler`` finishes the next iteration,
   saves it and exits; the script requeues the job. This used to fail with
   ``BrokenPipeError`` in the save (the writer manager died of the forwarded SIGTERM),
   leaving an incomplete checkpoint directory.
2. The requeued job (``SLURM_RESTART_COUNT=1``, same command) resumes from the checkpoint
   the signal wrote, after verifying its checksums, and trains to the end.

(The resumed state equals an uninterrupted run's bit for bit in
tests/megatron_lm/test_pretrain_gpt.py; for the driver, after a signal at each moment, in
tests/megatron/test_exit_and_failures.py.)
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.dist import free_port
from tests.megatron_lm.lm_runs import REPO, TINY_RUN_FILE, iterations

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow]

SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt_ext.sbatch"

_FAKE_SRUN = """#!/usr/bin/env bash
# One node: drop srun's options and become the task (SLURM_NODEID 0).
while [[ "$1" == --* ]]; do shift; done
export SLURM_NODEID=0
exec "$@"
"""

_FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_LOG/scontrol.calls"
"""


def _environment(tmp_path, restart, gate=None):
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in [("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)]:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    pythonpath = str(REPO)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node001",
        "SLURM_NNODES": "1",
        "SLURM_RESTART_COUNT": str(restart),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GPUS_PER_NODE": "2",
        "CPU": "1",
        "CONFIG": str(TINY_RUN_FILE),
        "TRAIN_ITERS": "8",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    if gate is not None:
        pythonpath = f"{REPO / 'tests' / 'helpers' / 'save_gate'}:{pythonpath}"
        env.update({"SAVE_GATE_DIR": str(gate), "SAVE_GATE_MATCH": "iter_0000004/"})
    env["PYTHONPATH"] = pythonpath
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    return env


def _wait(condition, proc, out, what, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"no {what} (exit {proc.poll()}):\n{out.read_text()[-5000:]}")
        time.sleep(0.05)


def test_time_limit_signal_saves_requeues_and_the_job_resumes(tmp_path):
    save = tmp_path / "ckpt"
    args = [str(SBATCH), "--save", str(save), "--save-interval", "2"]

    # 1. The time-limit warning arrives while the iteration-4 checkpoint is being written.
    gate = tmp_path / "gate"
    gate.mkdir()
    out = tmp_path / "first.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            ["bash", *args],
            cwd=tmp_path,
            env=_environment(tmp_path, 0, gate),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        try:
            for rank in range(2):
                _wait(lambda: list(gate.glob(f"writing.{rank}.*")), proc, out, f"rank {rank} save")
            proc.send_signal(signal.SIGUSR1)
            # torchrun forwarded SIGTERM to both ranks' process groups; then the save goes on.
            _wait(
                lambda: out.read_text().count("closing signal SIGTERM") >= 2,
                proc,
                out,
                "SIGTERM forwarded to both ranks",
            )
            (gate / "release").touch()
            rc = proc.wait(timeout=600)
        finally:
            proc.kill()
    text = out.read_text()
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    # Megatron-LM finishes the iteration after the save in flight, then saves it and exits.
    assert 5 <= stopped < 8, text[-5000:]
    assert "time limit near (SIGUSR1); asking the ranks to save and exit (SIGTERM)" in text
    assert "exiting program after receiving SIGTERM" in text, text[-5000:]
    for bad in ("BrokenPipeError", "ChildFailedError", "forcefully exiting"):
        assert bad not in text, (bad, text[-5000:])
    assert sorted(iterations(text)) == list(range(1, stopped + 1))
    for it in (4, stopped):
        assert (save / f"iter_{it:07d}" / "megatron_ext_checksums.json").is_file()
    # torchrun exits 1 after it forwarded a signal (torch's behaviour), the script with it.
    assert rc == 1 and "SignalException" in text
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    assert "requeueing job 4242" in text

    # 2. The requeued job: the same command resumes from the checkpoint the signal wrote.
    (tmp_path / "scontrol.calls").unlink()
    out = tmp_path / "second.out"
    with open(out, "w") as f:
        proc = subprocess.run(
            ["bash", *args],
            cwd=tmp_path,
            env=_environment(tmp_path, 1),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    text = out.read_text()
    assert proc.returncode == 0, text[-5000:]
    directory = save / f"iter_{stopped:07d}"
    assert "> verified the crc32 checksums of " in text and f" in {directory} (" in text
    assert f"loaded the state of 2 ranks from {directory}" in text, text[-5000:]
    assert sorted(iterations(text)) == list(range(stopped + 1, 9))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert not (tmp_path / "scontrol.calls").exists()
