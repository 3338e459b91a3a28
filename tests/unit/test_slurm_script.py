"""``scripts/slurm/pretrain_gpt_ext.sbatch``: preemption and time limit handling.

The script runs under bash with fake ``srun`` and ``scontrol`` on PATH (no Slurm needed):
the fake srun records its arguments and the signals it receives, then exits as the ranks
would after saving. Checked: the script parses (``bash -n``); its ``#SBATCH`` lines ask for
SIGUSR1 to the batch shell before the time limit, requeueing and appended logs; Megatron-LM
gets ``--exit-signal-handler``; SIGUSR1 makes the script forward SIGTERM to srun, wait for it
and requeue the job; SIGTERM forwards without requeueing; torchrun's shutdown timeout is
shorter than the signal's lead time; the log path is valid in a fresh submit directory and a
job started outside the checkout says to set EXT_DIR. (The resume from the run's own
checkpoint and the dry run: tests/unit/test_launch_scripts.py.)
"""

import os
import re
import signal
import subprocess
import time

from tests.helpers.paths import REPO

SCRIPT = REPO / "scripts" / "slurm" / "pretrain_gpt_ext.sbatch"

_FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun.args"
echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > "$FAKE_LOG/shutdown_timeout"
# The ranks save and exit 0 when SIGTERM reaches them.
trap 'echo TERM >> "$FAKE_LOG/srun.signals"; exit 0' TERM
touch "$FAKE_LOG/srun.started"
# Bounded, so a script that fails to stop it does not leave it behind.
for _ in $(seq 400); do sleep 0.05; done
exit 3
"""

_FAKE_SCONTROL = """#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then echo node001; exit 0; fi
echo "$@" >> "$FAKE_LOG/scontrol.calls"
"""


def _sbatch_options():
    return [line.split(None, 1)[1] for line in SCRIPT.read_text().splitlines()
            if line.startswith("#SBATCH ")]  # fmt: skip


def test_sbatch_header_asks_for_a_warning_signal_and_requeueing():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    options = _sbatch_options()
    assert "--requeue" in options and "--open-mode=append" in options
    signal_opt = next(o for o in options if o.startswith("--signal="))
    match = re.fullmatch(r"--signal=B:USR1@(\d+)", signal_opt)
    assert match, signal_opt
    lead = int(match.group(1))
    default_timeout = int(
        re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)", SCRIPT.read_text()).group(1)
    )
    # torchrun must give the ranks time to save, and finish before Slurm's kill.
    assert 30 < default_timeout < lead


def test_log_path_is_valid_in_a_fresh_submit_directory(tmp_path):
    # Slurm opens --output before the script runs: a folder in it must exist at submission.
    output = next(o for o in _sbatch_options() if o.startswith("--output="))[len("--output=") :]
    folder = os.path.dirname(output.replace("%x", "name").replace("%j", "1"))
    assert folder == "" or (REPO / folder).is_dir() and not os.path.isabs(folder), output


def test_refuses_to_run_outside_the_checkout_naming_ext_dir(tmp_path):
    env = {**os.environ, "MEGATRON_LM_DIR": str(tmp_path), "SLURM_SUBMIT_DIR": str(tmp_path)}
    env.pop("EXT_DIR", None)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 2 and "set EXT_DIR" in proc.stderr


def _run(tmp_path, sig):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    log.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "MEGATRON_LM_DIR": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(REPO),  # where sbatch was run: the checkout
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node001",
        "SLURM_NNODES": "1",
    }
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--save", "/ckpt", "--load", "/ckpt"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 30
    while not (log / "srun.started").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    calls = (log / "scontrol.calls").read_text() if (log / "scontrol.calls").exists() else ""
    return proc.returncode, out, log, calls


def test_time_limit_warning_forwards_sigterm_then_requeues(tmp_path):
    rc, out, log, calls = _run(tmp_path, signal.SIGUSR1)
    assert rc == 0, out
    assert (log / "srun.signals").read_text().split() == ["TERM"], out
    args = (log / "srun.args").read_text().splitlines()
    assert "--exit-signal-handler" in args and args[-4:] == ["--save", "/ckpt", "--load", "/ckpt"]
    assert (log / "shutdown_timeout").read_text().strip() == "240"
    assert calls.split() == ["requeue", "4242"], out
    assert "requeueing job 4242" in out


def test_sigterm_forwards_without_requeueing(tmp_path):
    rc, out, log, calls = _run(tmp_path, signal.SIGTERM)
    assert rc == 0, out
    assert (log / "srun.signals").read_text().split() == ["TERM"], out
    assert calls == "", out
