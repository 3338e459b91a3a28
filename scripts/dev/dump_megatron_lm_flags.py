"""Write the option strings and dests of a Megatron-LM checkout's argument parser.

Usage:
    python scripts/dev/dump_megatron_lm_flags.py /path/to/Megatron-LM tests/data/NAME.txt

The file lists Megatron-LM's flags (``--foo``) and argument dests (``dest:foo``), one per
line. ``tests/unit/test_flags.py`` checks that megatron-ext's flags collide with none of
them, so CI can check without a checkout. Regenerate it for each supported release.
"""

import argparse
import sys
import types


def main() -> int:
    checkout, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, checkout)
    # megatron/training/initialize.py imports triton kernels at module level; the parser does
    # not need them, and triton is absent on CPU-only machines.
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    try:
        __import__(name)
    except ImportError:
        stub = types.ModuleType(name)
        for attr in (
            "enable_batch_invariant_mode",
            "disable_batch_invariant_mode",
            "is_batch_invariant_mode_enabled",
            "set_batch_invariant_mode",
        ):
            setattr(stub, attr, lambda *a, **k: False)
        sys.modules[name] = stub
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
