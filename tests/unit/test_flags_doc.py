"""``docs/flags.md`` is what ``scripts/flags_doc.py`` generates from the option dataclasses now.

A field added, renamed or re-documented in an options dataclass changes the generated
reference; this test fails until ``python scripts/flags_doc.py`` has been run and its output
committed. It also checks that the reference has every flag megatron-ext adds to a parser.
"""

import argparse
import importlib.util

from tests.helpers.paths import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("flags_doc", REPO / "scripts" / "flags_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_reference_is_current_and_complete():
    from megatron_ext.config import add_args

    text = _generator().render()
    committed = (REPO / "docs" / "flags.md").read_text(encoding="utf-8")
    assert committed == text, "docs/flags.md is stale: run python scripts/flags_doc.py"
    flags = {s for a in add_args(argparse.ArgumentParser())._actions for s in a.option_strings}
    missing = [f for f in flags - {"-h", "--help"} if f"`{f}`" not in text]
    assert not missing, missing
