"""Checks that a refusal is the last thing a user sees, under torchrun or not.

:func:`assert_cause_last` looks at the end of a launch's combined output;
:func:`torchrun_summary` renders, with torch's own formatter, the summary torchrun prints
when a worker fails after writing ``message`` to its error file (what
:func:`megatron_ext.refusal.report_refusal` does under torchrun), so refusals checked in one
process (no launch each) are checked against torchrun's real last lines.
"""

from __future__ import annotations

import os
from typing import List

LAST_LINES = 5
"""The cause must be within this many last lines of the output."""


def last_lines(output: str, n: int = LAST_LINES) -> List[str]:
    """The last ``n`` non-blank lines of ``output``."""
    return [line for line in output.splitlines() if line.strip()][-n:]


def assert_cause_last(output: str, cause: str, n: int = LAST_LINES) -> None:
    """``cause`` appears in one of the last ``n`` non-blank lines of ``output``."""
    tail = last_lines(output, n)
    assert any(cause in line for line in tail), (
        f"{cause!r} not in the last {n} lines:\n" + "\n".join(tail) + "\n---\n" + output[-3000:]
    )


def torchrun_summary(error_file: str, exitcode: int = 2) -> str:
    """torchrun's failure summary (``ChildFailedError``) for a worker that exited with
    ``exitcode`` after writing ``error_file``, followed by a worker stopped by torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    failed = ProcessFailure(local_rank=1, pid=2, exitcode=exitcode, error_file=error_file)
    stopped = ProcessFailure(
        local_rank=0, pid=1, exitcode=-15, error_file=os.path.join(error_file, "absent")
    )
    error = ChildFailedError("megatron_ext.train", {1: failed, 0: stopped})
    return f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {error}"
