"""Megatron-LM run files (YAML): kept here for its users; the loader is :mod:`megatron_ext.runfile`.

What it does:
    Re-exports :func:`~megatron_ext.runfile.run_file_args`, :class:`~megatron_ext.runfile.
    RunFileError` and ``main`` (``python -m megatron_ext.megatron.lm.runfile [--null] FILE``).

Why:
    The loader moved out of ``megatron_ext.megatron`` (whose import brings torch and the
    CPU stand-ins) so that ``scripts/pretrain_gpt_ext.sh``'s pre-flight
    (:mod:`megatron_ext.preflight`) reads run files in a fraction of a second on every node.

Constraints:
    Nothing of its own.
"""

import sys

from megatron_ext.runfile import RunFileError, main, run_file_args

__all__ = ["RunFileError", "run_file_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
