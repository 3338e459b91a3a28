"""The repository root, as every test that runs a command or reads a shipped file names it."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The megatron-ext checkout the tests run from."""
