"""Megatron-LM run files: YAML mappings of flag names to values, turned into arguments.

What it does:
    A run file (``configs/megatron_lm/<model>_<size>_<algo>_<cluster>.yaml``) lists the
    Megatron-LM and megatron-ext flags of one experiment, grouped by concern::

        model:                      # a group: one level of nesting, for reading only
          num-layers: 24
          hidden-size: 1024
        data:
          data-path: ${DATA_PREFIX}                  # environment variable, required
          split: ${SPLIT:-949,50,1}                  # with a default
        grad-compression: separate
        bf16: true                                   # a switch: --bf16
        use-distributed-optimizer: false             # false / null: flag left out
        eval-iters: [10]                             # a list: --eval-iters 10 (nargs)

    :func:`run_file_args` returns ``["--num-layers", "24", ...]``. ``python -m
    megatron_ext.runfile FILE`` prints them NUL-separated (``--null``) or one
    shell-quoted line, for ``scripts/pretrain_gpt_ext.sh``.

Why:
    One reviewable file per run instead of a long launcher line; keys are exactly
    Megatron-LM's flag names, so nothing is renamed and Megatron-LM's parser validates them.
    Later command-line flags override the file's (argparse keeps the last value).

Constraints:
    Pure Python (PyYAML); never imports Megatron or torch. An unset variable without a default is an
    error naming the file, the key and the variable.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import Any, List, Optional, Sequence

__all__ = ["RunFileError", "run_file_args", "print_args", "main"]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RunFileError(ValueError):
    """A run file that cannot be turned into arguments."""


def _expand(value: str, where: str) -> str:
    def substitute(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise RunFileError(f"{where}: environment variable {name} is not set (and has no default)")

    return _VAR.sub(substitute, value)


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        raise RunFileError(f"{where}: expected a number or a string, got {value!r}")
    return _expand(str(value), where)


def _flag_args(key: str, value: Any, where: str) -> List[str]:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", key):
        raise RunFileError(f"{where}: keys are flag names without '--', e.g. num-layers")
    flag = f"--{key}"
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, list):
        return [flag] + [_scalar(v, where) for v in value]
    return [flag, _scalar(value, where)]


def run_file_args(path: str) -> List[str]:
    """The command-line arguments a run file stands for (see module docstring).

    Raises:
        RunFileError: not a mapping, nested deeper than one group, bad key or value, unset
            environment variable.
    """
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise RunFileError(f"{path}: expected a mapping of flag names to values")
    out: List[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if isinstance(sub_value, dict):
                    raise RunFileError(f"{path}: {key}.{sub_key}: groups nest one level only")
                out += _flag_args(str(sub_key), sub_value, f"{path}: {key}.{sub_key}")
        else:
            out += _flag_args(str(key), value, f"{path}: {key}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_ext.runfile [--null] FILE``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.runfile",
        description="Print the Megatron-LM arguments of a run file.",
    )
    parser.add_argument("file", help="run file (YAML)")
    parser.add_argument(
        "--null", action="store_true", help="NUL-separated (for bash 'mapfile -d \"\"')"
    )
    args = parser.parse_args(argv)
    try:
        values = run_file_args(args.file)
    except (OSError, RunFileError) as exc:
        print(f"run file: error: {exc}", file=sys.stderr)
        return 2
    print_args(values, args.null)
    return 0


def print_args(values: Sequence[str], null: bool) -> None:
    """Write ``values`` for a shell: NUL-terminated (``mapfile -d ''``) or shell-quoted."""
    if null:
        sys.stdout.write("".join(v + "\0" for v in values))
    else:
        print(shlex.join(values))


if __name__ == "__main__":
    sys.exit(main())
