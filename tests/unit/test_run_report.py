"""The run's report: where it goes, what a resume keeps, and --load of a finished run."""

import json
import os

import pytest

from megatron_ext.config import ConfigError
from megatron_ext.run_report import check_not_finished, fresh_run_dir, report_file, write_report


def test_the_report_goes_to_the_run_directory_never_to_the_working_directory(tmp_path):
    assert report_file("x.json", "ckpt", "runs/a") == "x.json"
    assert report_file(None, "ckpt", "runs/a") == os.path.join("ckpt", "comm_report.json")
    assert report_file(None, None, "runs/a") == os.path.join("runs/a", "comm_report.json")
    # Two runs started in the same second get two directories.
    base = str(tmp_path / "runs")
    first, second = fresh_run_dir(base), fresh_run_dir(base)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--save: without --save the run's reports"):
        fresh_run_dir(str(tmp_path / "file" / "runs"))


def _report(start, end, loss):
    return {
        "start_iteration": start,
        "iterations": end,
        "final_lm_loss": loss,
        "history": [{"iteration": i} for i in range(start + 1, end + 1)],
    }


def _read(path):
    return json.loads(path.read_text())


def test_a_resume_adds_its_segment_and_a_new_run_replaces(tmp_path):
    path = tmp_path / "comm_report.json"
    assert write_report(str(path), _report(0, 4, 3.0), 0) == []
    assert [s["iterations"] for s in _read(path)["segments"]] == [4]
    notes = write_report(str(path), _report(4, 8, 2.0), 4)
    assert notes == [f"{path}: added to the report of the earlier segments"]
    report = _read(path)
    # The top level is the last segment's; every segment is listed; the history continues.
    assert report["final_lm_loss"] == 2.0 and report["start_iteration"] == 4
    assert [(s["start_iteration"], s["iterations"]) for s in report["segments"]] == [(0, 4), (4, 8)]
    assert "history" not in report["segments"][0]
    assert [h["iteration"] for h in report["history"]] == list(range(1, 9))
    # A resume from iteration 2 supersedes the segment that started at 4 and its history.
    write_report(str(path), _report(2, 8, 1.5), 2)
    report = _read(path)
    assert [(s["start_iteration"], s["iterations"]) for s in report["segments"]] == [(0, 4), (2, 8)]
    assert [h["iteration"] for h in report["history"]] == list(range(1, 9))
    # A run from scratch in the same place replaces the report.
    write_report(str(path), _report(0, 3, 4.0), 0)
    assert [s["iterations"] for s in _read(path)["segments"]] == [3]
    # A report of the format before segments counts as one segment.
    path.write_text(json.dumps({"iterations": 4, "final_lm_loss": 3.0}))
    write_report(str(path), _report(4, 6, 2.5), 4)
    assert [s["iterations"] for s in _read(path)["segments"]] == [4, 6]


def test_load_of_a_finished_run_is_refused_naming_the_flags_that_extend_it():
    check_not_finished("ckpt", 4, 8)
    check_not_finished("ckpt", None, 8)
    check_not_finished("ckpt", 8, 8, finetune=True)
    check_not_finished("ckpt", 8, None)  # counted in samples
    with pytest.raises(ConfigError) as info:
        check_not_finished("ckpt", 8, 8)
    message = str(info.value)
    assert message.startswith("--load, --train-iters: ckpt holds a finished run (iteration 8")
    for flag in ("--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        assert flag in message
