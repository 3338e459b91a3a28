"""Write the option strings and dests of a Megatron-LM checkout's argument parser.

Usage:
    python scripts/dev/dump_megatron_lm_flags.py /path/to/Megatron-LM tests/data/NAME.txt

The file lists Megatron-LM's flags (``--foo``) and argument dests (``dest:foo``), one per
line. ``tests/unit/test_flags.py`` checks that megatron-ext's flags collide with none of
them, so CI can check without a checkout. Regenerate it for each supported release.
"""

import argparse
import sys


def main() -> int:
    checkout, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, checkout)
    # The parser needs no triton (absent on CPU-only machines; megatron/training/initialize.py
    # and 0.19's schedules import triton kernels at module level) and, for 0.19 on Python
    # 3.11, typing.override (see megatron_ext/megatron/lm/compat.py).
    from megatron_ext.megatron.lm.compat import apply_python_shims
    from megatron_ext.megatron.lm.cpu import register_triton_stand_ins
    from megatron_ext.megatron.lm.releases import detect_checkout_release

    apply_python_shims(detect_checkout_release(checkout).requires_python)
    register_triton_stand_ins()
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    flags = sorted({o for a in parser._actions for o in a.option_strings})
    dests = sorted({a.dest for a in parser._actions})
    with open(out, "w") as f:
        f.write(f"# Megatron-LM argument parser of {checkout}\n")
        f.writelines(f"{flag}\n" for flag in flags)
        f.writelines(f"dest:{dest}\n" for dest in dests)
    print(f"{len(flags)} flags, {len(dests)} dests -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
