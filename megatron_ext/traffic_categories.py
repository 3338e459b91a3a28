"""The byte-accounting categories, in report order.

:mod:`megatron_ext.accounting` counts each transfer under one of them (its module docstring
says what each covers); ``megatron-ext report`` (``megatron_ext/report.py``) lists them in
this order. A module of its own so that the report reads them without importing torch.
"""

from __future__ import annotations

from typing import Tuple

__all__ = ["CATEGORIES"]

CATEGORIES: Tuple[str, ...] = (
    "dp-grad",
    "dp-param",
    "pp-act",
    "pp-grad",
    "subspace",
    "tp",
    "outer",
    "other",
)
