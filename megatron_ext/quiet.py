"""Keep known-harmless library warnings off the screen of megatron-ext's launchers.

What it does:
    :func:`install` (called first thing by the driver's ``main``, by
    :func:`~megatron_ext.megatron.lm.install_megatron_lm_hooks` and by the zero-touch
    launcher, before megatron is imported) ignores the Python warnings of
    :data:`KNOWN_WARNINGS` and drops the rerun state machine's start-up lines
    (:data:`RERUN_LINES`, logged by ``megatron.core.rerun_state_machine``). With
    ``MEGATRON_EXT_VERBOSE_WARNINGS=1`` in the environment, or any ``-W`` /
    ``PYTHONWARNINGS`` setting of the user's, it does nothing: everything is shown again.

Why:
    A short CPU run through ``pretrain_gpt.py`` printed ~20 such warnings (each with its
    source line) and ten rerun-state-machine lines, none of them actionable, all of them
    between the user and the lines that matter. The warnings megatron-ext itself caused are
    fixed at their cause instead (deprecated collectives: ``collectives/grad_reducer.py``
    ``REDUCE_SCATTER``, ``autograd/grass.py``); this list is for what megatron-core,
    Megatron-LM and torch say about each other.

Constraints:
    Only exact known messages are filtered (never a whole category or module), so a new
    warning still shows. Idempotent; pure Python (imports neither torch nor megatron).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Tuple, Type

__all__ = ["VERBOSE_ENV", "KNOWN_WARNINGS", "RERUN_LINES", "verbose", "install"]

VERBOSE_ENV = "MEGATRON_EXT_VERBOSE_WARNINGS"
"""Set to 1 to see every warning the launchers otherwise filter."""

KNOWN_WARNINGS: Tuple[Tuple[Type[Warning], str, str], ...] = (
    (
        UserWarning,
        r"Transformer Engine and Apex are not installed",
        "megatron-core/Megatron-LM fall back to torch implementations: what --cpu and "
        "--transformer-impl local run; Transformer Engine is checked by megatron-ext itself",
    ),
    (UserWarning, r"Apex is not installed", "the same fallback (torch norms)"),
    (UserWarning, r".*full scope is deprecated", "megatron-core's own deprecation notice"),
    (
        FutureWarning,
        r"`load_state_dict` is deprecated",
        "megatron-core's dist-checkpointing load calls torch's deprecated name (every load)",
    ),
    (
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "megatron-core's torch_dist strategy builds ShardedTensors (every load; shown at "
        "megatron/cpu.py's redirection frame on CPU, which only passes the call on)",
    ),
    (
        FutureWarning,
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        "megatron-core's collectives under torch >= 2.13 (megatron-ext's own use the new names)",
    ),
    (
        UserWarning,
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent "
        r"is to load in a single process",
        "megatron-core 0.19's load_common_state_dict reads the common state in one process "
        "on purpose (no_dist=True)",
    ),
    (
        UserWarning,
        r"The argument order of load has been changed",
        "torch.distributed.checkpoint on megatron-core 0.19's call of load (every load)",
    ),
    (
        UserWarning,
        r"Only transformer-engine>=\S+ supports MoE experts",
        "megatron-core 0.19's spec provider without Transformer Engine: local linears, as "
        "--transformer-impl local asks",
    ),
    (
        UserWarning,
        r"MimoModelConfig is experimental",
        "a megatron-core 0.19 module Megatron-LM imports, unused here",
    ),
    (
        UserWarning,
        r"'pin_memory' argument is set as true but no accelerator is found",
        "Megatron-LM's data loader on CPU",
    ),
    (
        UserWarning,
        r"Constraints for invoking optimized fused softmax kernel are not met",
        "Megatron-LM's fused softmax is a CUDA kernel; the unfused path computes the same",
    ),
    (
        UserWarning,
        r"Overriding default arguments for ",
        "Megatron-LM saying that the user's own flag (--tokenizer-type) wins over "
        "pretrain_gpt.py's default for it, as it should",
    ),
)
"""(category, message regex matched at its start, why it is harmless) of each filtered
warning."""

RERUN_LINES: Tuple[str, ...] = (
    "Implicit initialization of Rerun State Machine!",
    "RerunStateMachine initialized in mode",
    "Setting RerunStateMachine mode",
    "Result validation enabled",
)
"""Starts of the rerun state machine's start-up and mode lines (information, printed by
every rank at WARNING level)."""

_installed = False


def verbose() -> bool:
    """Whether every warning is to be shown (``MEGATRON_EXT_VERBOSE_WARNINGS=1`` or the
    user's own ``-W``/``PYTHONWARNINGS``)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0") or bool(sys.warnoptions)


class _RerunLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(RERUN_LINES)


def install() -> bool:
    """Filter :data:`KNOWN_WARNINGS` and :data:`RERUN_LINES` in this process unless
    :func:`verbose`; returns whether the filters are (now) installed."""
    global _installed
    if _installed:
        return True
    if verbose():
        return False
    for category, message, _ in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.getLogger("megatron.core.rerun_state_machine").addFilter(_RerunLines())
    _installed = True
    return True
