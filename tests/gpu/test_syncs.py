"""The sync recorder itself: it attributes each sync to the right code and captures on CUDA.

On CUDA a deliberate ``item()`` must be recorded (else the steady-step assertions of
``test_seams_cuda.py`` would pass vacuously); on the CPU dry run the recorder must say that
it captured nothing.
"""

import traceback

import pytest
import torch

from tests.gpu.syncs import SyncRecorder, _where

pytestmark = pytest.mark.gpu


def _frame(path, line, name):
    return traceback.FrameSummary(path, line, name)


def test_sync_is_attributed_to_the_innermost_frame_outside_torch():
    torch_frame = _frame("/x/site-packages/torch/_tensor.py", 1, "item")
    ext = _frame("/r/megatron_ext/collectives/radius.py", 10, "select")
    adapter = _frame("/r/megatron_ext/megatron/ddp.py", 20, "start")
    core = _frame("/x/site-packages/megatron/core/optimizer/clip_grads.py", 30, "norm")
    test = _frame("/r/tests/gpu/test_seams_cuda.py", 40, "_train")
    assert (
        _where([test, adapter, ext, torch_frame]).where
        == "megatron_ext/collectives/radius.py:10 (select)"
    )
    sync = _where([test, core, torch_frame])
    assert (sync.origin, sync.where) == (
        "megatron",
        "megatron/core/optimizer/clip_grads.py:30 (norm)",
    )
    # megatron-core's grad-norm sync reached through megatron_ext's driver is megatron-core's
    sync = _where([test, adapter, core, torch_frame])
    assert sync.origin == "megatron" and sync.where.startswith("megatron/core/optimizer")
    # megatron_ext code called back by megatron-core is megatron_ext's
    stdlib = _frame("/usr/lib/python3.12/contextlib.py", 5, "__exit__")
    sync = _where([test, core, adapter, stdlib, torch_frame])
    assert sync.origin == "megatron_ext" and sync.where.startswith("megatron_ext/megatron/ddp.py")
    assert _where([test, torch_frame]).origin == "other"


def test_recorder_captures_a_deliberate_sync(dev):
    recorder = SyncRecorder("probe", dev)
    x = torch.ones(4, device=dev)
    with recorder.step("sync"):
        x.sum().item()
    with recorder.step("quiet"):
        y = x * 2
    y.sum()
    summary = recorder.summary()
    if dev.type != "cuda":
        assert not summary["captured"] and "no-op" in summary["note"]
        return
    counts = {s["step"]: s["count"] for s in summary["steps"]}
    assert counts["sync"] >= 1 and counts["quiet"] == 0, summary
    first = summary["steps"][0]["syncs"][0]
    assert first["origin"] == "other" and "test_syncs.py" in first["where"], first


def test_a_kernels_sync_is_excused_only_in_a_step_that_compiled():
    from tests.gpu.syncs import StepSyncs, Sync

    recorder = SyncRecorder("filter", torch.device("cpu"))
    run = Sync("megatron_ext", "megatron_ext/kernels/__init__.py:167 (run)", "")
    other = Sync("megatron_ext", "megatron_ext/collectives/separate.py:10 (launch)", "")
    recorder.steps = [
        StepSyncs("first", True, [run, other], compiled=True),
        StepSyncs("later", True, [run], compiled=False),
    ]
    assert recorder.ext_syncs() == [
        "first: megatron_ext/collectives/separate.py:10 (launch)",
        "later: megatron_ext/kernels/__init__.py:167 (run)",
    ]


def test_a_compile_inside_a_step_marks_it(dev):
    recorder = SyncRecorder("compile", dev)
    fn = torch.compile(lambda t: t * 3 + 1, fullgraph=True)
    x = torch.ones(4, device=dev)
    with recorder.step("compiles"):
        fn(x)
    with recorder.step("replays"):
        fn(x)
    # On the CPU the recorder captures nothing (a no-op): no step is marked.
    expected = [True, False] if recorder.captured else [False, False]
    assert [s.compiled for s in recorder.steps] == expected
