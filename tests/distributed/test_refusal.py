"""A refusal reaches the terminal exactly once, whichever rank exits first.

torchrun starts N ranks that all refuse with the same message through
:func:`megatron_ext.refusal.report_refusal` and exit with status 2, rank 0 two seconds
after the others (as when rank 0 has more to build before it reaches the check). Printing
on rank 0 only loses the message here: the first rank to exit makes torchrun kill rank 0
before it prints. A rank with a different message prints its own. Under torchrun the line
is torchrun's own summary's last line but one (megatron_ext.refusal), not above it.
"""

import pytest

from tests.helpers.driver import run_command, torchrun_command
from tests.helpers.refusal import assert_cause_last

_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
from megatron_ext.refusal import report_refusal
if rank == 0 and sys.argv[1] == "same":
    time.sleep(2.0)
message = "megatron-ext train: error: --flag: refused on purpose"
if sys.argv[1] == "differs" and rank == int(os.environ["WORLD_SIZE"]) - 1:
    message = "megatron-ext train: error: --other-flag: last stage only"
report_refusal(message)
sys.exit(2)
"""


def _launch(tmp_path, nproc, mode="same"):
    script = tmp_path / "refuse.py"
    script.write_text(_SCRIPT)
    proc = run_command(
        torchrun_command([str(script), mode], nproc, ["--standalone"]),
        tmp_path,
        timeout=300,
        env={"OMP_NUM_THREADS": "1"},
        merge_output=True,  # one stream, in the order a terminal shows it
    )
    assert proc.returncode != 0
    return proc.stdout


@pytest.mark.parametrize("nproc", [2, 8])
def test_refusal_is_printed_once_when_rank_0_is_late(nproc, tmp_path):
    for _ in range(2 if nproc == 2 else 1):
        out = _launch(tmp_path, nproc)
        assert out.count("--flag: refused on purpose") == 1, out[-3000:]
        # Under torchrun's summary, not above it.
        assert_cause_last(out, "megatron-ext train: error: --flag: refused on purpose")


def test_a_different_refusal_is_printed_too(tmp_path):
    out = _launch(tmp_path, 2, "differs")
    assert out.count("--flag: refused on purpose") == 1, out[-3000:]
    assert out.count("--other-flag: last stage only") == 1, out[-3000:]
    # The first refusal is torchrun's root cause: one of the two is on the last lines.
    tail = "\n".join(out.strip().splitlines()[-5:])
    assert "--flag: refused on purpose" in tail or "--other-flag: last stage only" in tail, tail
