"""The ``megatron-ext`` console script: one entry point, one subcommand per tool.

Subcommands are resolved lazily so that ``megatron-ext --help`` and the light tools do not
import torch or megatron-core.
"""

from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional, Tuple

__all__ = ["main", "SUBCOMMANDS"]

# name -> (module with a main(argv) function, one-line description)
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "train": ("megatron_ext.train", "train a GPT/LLaMA model on megatron-core (torchrun)"),
    "prepare-data": (
        "megatron_ext.megatron.prepare_data",
        "write Megatron's indexed dataset from local text/JSON/parquet files",
    ),
    "netbench": (
        "megatron_ext.netbench.cli",
        "run a training command with every rank in a traffic-shaped network namespace",
    ),
    "pretrain": (
        "megatron_ext.megatron.lm.launcher",
        "run Megatron-LM's unmodified pretrain_gpt.py with megatron-ext (torchrun)",
    ),
    "patch": (
        "megatron_ext.megatron.lm.patch",
        "patch (or --revert) a Megatron-LM checkout's pretrain_gpt.py to load megatron-ext",
    ),
    "lighthouse": (
        "megatron_ext.lighthouse",
        "serve torchft's lighthouse for DiLoCo sites in separate jobs (--outer-transport torchft)",
    ),
    "report": (
        "megatron_ext.report",
        "plots (PNG) and a markdown table from benchmark and training run directories",
    ),
}


def _usage() -> str:
    lines = ["usage: megatron-ext <command> [args...]", "", "commands:"]
    width = max(len(n) for n in SUBCOMMANDS)
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {text}")
    lines.append("")
    lines.append("Run 'megatron-ext <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch ``megatron-ext <command> ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"megatron-ext: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
