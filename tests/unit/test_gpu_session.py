"""``benchmarks/gpu_session.sh --dry-run`` on the CPU: the GPU session's own logic.

A lease is rare and short, so the script that spends it is checked here: stages run in the
order given and each one's result reaches the summary; a stage the deadline leaves too little
time for is reported as not run rather than started; an unknown stage is named; every log is
packed into the one archive a lease brings back. (The stages' content is the test suite's:
``tests/gpu`` dry-runs on the CPU with ``MEGATRON_EXT_GPU_TESTS_DEVICE=cpu``.)
"""

import os
import subprocess
import sys
import tarfile

from tests.helpers.paths import REPO


def _session(tmp_path, *stages, deadline="300"):
    env = {**os.environ, "OUT": str(tmp_path), "DEADLINE": deadline, "PYTHON": sys.executable}
    env.pop("MEGATRON_LM_DIR", None)
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "--dry-run", *stages],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (tmp_path / "summary.txt").read_text()
    return proc, summary


def test_dry_run_runs_stages_names_unknown_ones_and_packs_one_archive(tmp_path):
    proc, summary = _session(tmp_path, "env", "bogus")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== stage env rc=0" in summary, summary
    assert "unknown stage bogus" in summary, summary
    assert "dry run 1" in summary, summary
    with tarfile.open(tmp_path / "gpu-session.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"session/env.log", "session/summary.txt", "session/setup.log"} <= names, names
    env_log = (tmp_path / "session" / "env.log").read_text()
    assert "copy GB/s" in env_log and "device cpu" in env_log, env_log


def test_a_stage_the_deadline_cannot_fit_is_reported_not_started(tmp_path):
    proc, summary = _session(tmp_path, "checks", deadline="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== stage checks NOT RUN" in summary, summary
    assert not (tmp_path / "session" / "checks.log").exists()
