"""What a run's output must not hold by default: Python warnings and the rerun state
machine's lines (megatron_ext/quiet.py filters the known-harmless ones)."""

import re
from typing import List

from megatron_ext.quiet import RERUN_LINES

_WARNING = re.compile(r"\b[A-Z]\w*Warning: ")


def noise_lines(output: str) -> List[str]:
    """The Python warnings and rerun state machine lines of ``output``."""
    return [
        line
        for line in output.splitlines()
        if _WARNING.search(line) or any(text in line for text in RERUN_LINES)
    ]
