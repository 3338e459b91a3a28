"""The two errors a checkpoint raises: one that ``--load`` names, one that a save could not write.

What it does:
    :class:`CheckpointError` is a :class:`~megatron_ext.config.ConfigError` naming ``--load``
    (absent, unreadable, truncated, other settings, non-finite values), so the driver prints
    it as a one-line refusal; :class:`CheckpointSaveError` is raised when a save failed and
    its torn directory was removed (:mod:`.save_failure`).

Why apart:
    Every other module of the package raises one of them (paths, reading, finiteness checks,
    save, load) and the Megatron-LM adapter re-exports them; a leaf module keeps the imports
    one way.

Constraints:
    ``CheckpointSaveError.detailed`` is true on rank 0 only (see the class): callers report
    rank 0's error.
"""

from __future__ import annotations

from typing import Sequence

from megatron_ext.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that ``--load`` names cannot be used: absent, unreadable, truncated,
    saved with other settings, or holding non-finite values. The message names the path
    (file or directory) and, for values, the tensor."""

    def __init__(self, message: str, flags: Sequence[str] = ("--load",)):
        super().__init__(list(flags), message)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; rank 0 removed its incomplete directory.

    Attributes:
        detailed: raised on rank 0, whose error holds every rank's failure (megatron-core's
            torch_dist save gathers them there); other ranks' errors may say only that the
            save failed, so they leave the report to rank 0.
    """

    def __init__(self, message: str, detailed: bool):
        super().__init__(message)
        self.detailed = detailed
