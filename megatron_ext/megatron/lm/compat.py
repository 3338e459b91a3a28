"""Python-version shims a Megatron-LM release needs on an interpreter older than it declares.

What it does:
    Megatron-LM 0.17+ declares Python >= 3.12. Its ``megatron.training`` (core_v0.19.0 and
    the megatron-core 0.19.2 wheel) has no 3.12-only syntax (every file compiles on 3.11);
    the one 3.12-only name it imports is ``typing.override`` (PEP 698), in
    ``megatron/training/models/gpt.py`` and ``models/hybrid.py``, which
    ``import megatron.training`` reaches through ``config/container.py``. On 3.11
    ``import megatron.training`` therefore fails with ``ImportError: cannot import name
    'override' from 'typing'``. :func:`apply_python_shims` sets ``typing.override`` to
    ``typing_extensions.override`` (the same decorator: it sets ``__override__`` and
    returns its argument) when the release asks for a newer Python than the running one.

Why:
    So that the 0.19 hooks can be exercised on the 3.11 machines the rest of megatron-ext
    supports (CPU CI, laptops). It is a shim, not support: Megatron-LM does not test 3.11.

Constraints:
    Must run before ``megatron.training`` is first imported (done by
    :func:`~megatron_ext.megatron.lm.install_megatron_lm_hooks`, which the patched
    ``pretrain_gpt.py`` and the launcher call first). Adds an attribute to the standard
    ``typing`` module only where it is missing; never replaces an existing one.
"""

from __future__ import annotations

import sys
import typing
from typing import List, Tuple

__all__ = ["apply_python_shims"]


def apply_python_shims(requires_python: Tuple[int, int]) -> List[str]:
    """Backport what the release imports from a newer Python; returns what was added.

    Args:
        requires_python: the release's minimum Python (major, minor).
    """
    added: List[str] = []
    if sys.version_info[:2] >= requires_python:
        return added
    if not hasattr(typing, "override"):
        import typing_extensions  # a dependency of torch

        typing.override = typing_extensions.override
        added.append("typing.override")
    return added
