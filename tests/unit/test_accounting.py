"""Byte accounting: the ring convention, per-step / per-run counters, the log-line field."""

import pytest

from megatron_ext.accounting import (
    CATEGORIES,
    CommMeter,
    Traffic,
    collective_device,
    collective_wire_bytes,
    comm_report,
    comm_scalars,
    format_bytes,
    format_traffic,
)


@pytest.mark.parametrize(
    "op, nbytes, p, expected",
    [
        ("all_reduce", 1000, 2, 1000),  # 2 (p-1)/p N
        ("all_reduce", 1200, 4, 1800),
        ("reduce_scatter", 1000, 2, 500),  # (p-1)/p N of the full input
        ("all_gather", 1200, 4, 900),  # (p-1)/p N of the full output
        ("broadcast", 1000, 2, 500),
        ("send", 123, 2, 123),
        ("recv", 123, 2, 123),
        ("all_reduce", 1000, 1, 0),  # a group of one moves nothing
        ("barrier", 0, 4, 0),
    ],
)
def test_ring_convention(op, nbytes, p, expected):
    assert collective_wire_bytes(op, nbytes, p) == expected


def test_unknown_collective_is_an_error():
    with pytest.raises(ValueError):
        collective_wire_bytes("gossip", 1, 2)


def test_meter_steps_and_totals():
    meter = CommMeter()
    meter.record("dp-grad", sent=100, recv=100, dense_sent=1600, dense_recv=1600)
    meter.record("pp-act", sent=10)
    step = meter.end_step()
    assert step["dp-grad"] == Traffic(100, 100, 1600, 1600, 1)
    assert step["pp-act"] == Traffic(10, 0, 10, 0, 1)
    meter.record("dp-grad", sent=50, recv=50)
    assert meter.current_step()["dp-grad"].sent == 50
    meter.end_step()
    total = meter.totals()
    assert total["dp-grad"] == Traffic(150, 150, 1650, 1650, 2)
    assert meter.num_steps == 2
    with pytest.raises(ValueError):
        meter.record("gossip", sent=1)


def test_disabled_meter_records_nothing():
    meter = CommMeter(enabled=False)
    meter.record("dp-grad", sent=100)
    assert meter.end_step() == {}


def test_log_field():
    counts = {
        "dp-grad": Traffic(sent=3_690_000, dense_sent=59_090_000, num_ops=1),
        "other": Traffic(sent=16, dense_sent=16, num_ops=1),
    }
    line = format_traffic(counts, num_steps=1)
    assert line.startswith(" bytes sent/step (all ranks): ")
    assert "dp-grad 3.69 MB (dense 59.09 MB, x16.0)" in line
    assert "other 16 B" in line and line.endswith(" |")
    assert format_traffic({}, 1) == ""
    assert format_bytes(1_500) == "1.50 KB" and format_bytes(2e9) == "2.00 GB"


def test_categories_are_the_documented_ones():
    """The categories, in report order, are the ones ``--comm-accounting``'s help lists (what
    ``megatron-ext train --help`` and docs/flags.md show users)."""
    from megatron_ext.config import CommAccountingConfig, _field_docstrings

    doc = " ".join(_field_docstrings(CommAccountingConfig)["accounting"].split())
    listed = doc.split("by category (", 1)[1].split(")", 1)[0]
    assert CATEGORIES == tuple(listed.split(", ")), listed


def test_comm_report_scalars_and_path_without_a_process_group():
    meter = CommMeter()
    for _ in range(2):
        meter.record("dp-grad", sent=100, recv=100, dense_sent=1600, dense_recv=1600)
        meter.end_step()
    comm = comm_report(meter)
    assert comm["steps"] == 2
    assert comm["all_ranks_total"]["dp-grad"]["sent"] == 200
    assert comm["all_ranks_per_step"]["dp-grad"]["dense_sent"] == 1600
    assert comm["per_rank_total"] == [{"dp-grad": Traffic(200, 200, 3200, 3200, 2).as_dict()}]
    assert comm_scalars(meter.totals(), 2) == {
        "comm/dp-grad bytes sent per step": 100.0,
        "comm/dp-grad dense bytes per step": 1600.0,
    }


def test_collective_device_follows_the_backend(monkeypatch):
    import torch

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert collective_device().type == "cpu"
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collective_device() == torch.device("cuda", 0)
