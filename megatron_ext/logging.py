"""Logging helpers in Megatron's style: rank-0 / last-rank printing and warn-once.

Megatron-LM prints progress with ``print_rank_0`` (first rank) and ``print_rank_last``
(the last rank, where the loss lives with pipeline parallelism). megatron-core modules use
``logging.getLogger(__name__)``. megatron_ext follows both conventions and never imports
Megatron here, so these helpers work in pure-torch code and in tests without a process
group.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

__all__ = [
    "get_logger",
    "is_rank_0",
    "is_last_rank",
    "print_rank_0",
    "print_rank_last",
    "log_rank_0",
]


def get_logger(name: str) -> logging.Logger:
    """Logger for a megatron_ext module (``logging.getLogger`` with our namespace)."""
    return logging.getLogger(name)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    # Before init_process_group: the launcher's RANK (torchrun sets it), else 0.
    return int(os.environ.get("RANK", "0"))


def is_rank_0() -> bool:
    """True on global rank 0 (before the process group exists: ``RANK`` 0 or unset)."""
    return _rank() == 0


def is_last_rank() -> bool:
    """True on the last global rank, or when no process group is initialized."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    return True


def print_rank_0(message: str, file=None) -> None:
    """Print on global rank 0 only (Megatron-LM's ``print_rank_0``)."""
    if is_rank_0():
        print(message, flush=True, file=file or sys.stdout)


def print_rank_last(message: str, file=None) -> None:
    """Print on the last global rank only (Megatron-LM's ``print_rank_last``)."""
    if is_last_rank():
        print(message, flush=True, file=file or sys.stdout)


def log_rank_0(logger: logging.Logger, level: int, message: str) -> None:
    """``logger.log`` on global rank 0 only (megatron-core's ``log_single_rank``)."""
    if is_rank_0():
        logger.log(level, message)
