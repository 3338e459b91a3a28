"""``megatron-ext pretrain``: run an unmodified Megatron-LM ``pretrain_gpt.py`` with megatron-ext.

What it does:
    ``megatron-ext pretrain [--cpu] [--core-from auto|checkout|installed]
    PATH/pretrain_gpt.py [Megatron-LM args] [megatron-ext args]``, started by ``torchrun``
    like the script itself:

    1. detects the checkout's release (``megatron/core/package_info.py``) and refuses an
       unsupported one before importing anything of it;
    2. puts the checkout on ``sys.path`` (``--core-from``: ``megatron.core`` from the
       checkout, or from the installed megatron-core wheel of the same release, which
       ships the dataset helpers prebuilt; ``auto`` picks the wheel when its version is
       the checkout's). ``installed`` also accepts a wheel of another version of the same
       Megatron-LM tag (core_v0.19.0's checkout says 0.19.1, the wheel on PyPI may be
       0.19.2). The megatron-core 0.19 wheels also ship ``megatron/training``, which then
       shadows the checkout's: only ``pretrain_gpt.py``, ``gpt_builders.py``,
       ``model_provider.py`` and the packages the wheel lacks (``megatron/post_training``,
       ``megatron/rl``) come from the checkout;
    3. refuses Megatron-LM flags left at a default that fails only after start-up
       (:func:`megatron_ext.preflight.check_megatron_lm_defaults`: ``--eval-interval``, ...);
       names every Python package Megatron-LM's training code needs that is missing
       (:mod:`megatron_ext.megatron.lm.requirements`) and stops, before importing any;
    4. installs megatron-ext's hooks (:func:`~megatron_ext.megatron.lm.
       install_megatron_lm_hooks`), with CPU execution on ``--cpu`` or ``MEGATRON_EXT_CPU=1``;
    5. executes the script's source as ``__main__`` with ``sys.argv`` = the script and the
       remaining arguments, so Megatron-LM parses them, megatron-ext's flags included.

Why exec in this process's ``__main__``:
    The torch_dist checkpoint writer starts a ``multiprocessing`` manager with the *spawn*
    method, which re-imports ``__main__`` in the child. Running the script through
    ``runpy.run_path`` would make the child import ``pretrain_gpt.py`` itself, without
    megatron-ext's CPU stand-ins (triton import) and hooks; executing its code in our own
    ``__main__`` keeps the child's import light and correct.

Constraints:
    Launcher options come before the script path; ``--cpu`` is also taken from anywhere
    after it (Megatron-LM has no ``--cpu`` flag). Everything else goes to Megatron-LM.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import List, Optional, Sequence, Tuple

__all__ = ["main", "parse_launcher_args", "resolve_core_from", "setup_sys_path"]

_USAGE = """\
usage: megatron-ext pretrain [--cpu] [--core-from {auto,checkout,installed}]
                             PATH/pretrain_gpt.py [Megatron-LM args] [megatron-ext args]

Run an unmodified Megatron-LM pretrain_gpt.py with megatron-ext's hooks (start it with
torchrun, as the script itself). Supported releases: %s.

launcher options (before the script path):
  --cpu          run on CPU with gloo (also MEGATRON_EXT_CPU=1); needs
                 --distributed-backend gloo --transformer-impl local
                 --no-gradient-accumulation-fusion --no-persist-layer-norm
                 and sets --no-masked-softmax-fusion --no-rope-fusion itself
                 (CUDA-only fusions). Without it, a machine where torch sees
                 no CUDA device is refused before Megatron-LM is imported.
  --core-from    where megatron.core comes from: the checkout, the installed
                 megatron-core wheel (a version of the checkout's tag; 0.19 wheels
                 also bring megatron.training), or auto (the wheel if its version
                 is the checkout's, else the checkout). Default: auto.

megatron-ext flags (--grad-compression, --p2p-compression, --comm-report, ...):
  see 'megatron-ext train --help'; they are added to Megatron-LM's parser.
"""


def _usage() -> str:
    from megatron_ext.megatron.lm.releases import supported_releases_text

    return _USAGE % supported_releases_text()


def parse_launcher_args(argv: Sequence[str]) -> Tuple[dict, Optional[str], List[str]]:
    """Split ``argv`` into launcher options, the script path and the arguments for Megatron-LM.

    Raises:
        ValueError: unknown launcher option or missing value.
    """
    options = {"cpu": False, "core_from": "auto", "help": False}
    argv = list(argv)
    script = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            options["help"] = True
        elif arg == "--cpu":
            options["cpu"] = True
        elif arg == "--core-from" or arg.startswith("--core-from="):
            value = (
                arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            )
            if value not in ("auto", "checkout", "installed"):
                raise ValueError(
                    f"--core-from: expected auto, checkout or installed, got {value!r}"
                )
            options["core_from"] = value
            i += 0 if "=" in arg else 1
        elif arg.startswith("-"):
            raise ValueError(
                f"{arg}: unknown launcher option (Megatron-LM and megatron-ext flags go after "
                "the pretrain_gpt.py path)"
            )
        else:
            script = arg
            i += 1
            break
        i += 1
    rest = []
    for arg in argv[i:]:
        if arg == "--cpu":
            options["cpu"] = True
        else:
            rest.append(arg)
    return options, script, rest


def _installed_core_version() -> Optional[str]:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def resolve_core_from(release_version: str, core_from: str) -> str:
    """``auto``/``checkout``/``installed`` -> where ``megatron.core`` will come from.

    Returns:
        ``"checkout"`` or ``"installed"``.

    Raises:
        ValueError: ``installed`` asked for but no megatron-core of the checkout's tag is
            installed.
    """
    from megatron_ext.megatron.lm.releases import same_release_family

    installed = _installed_core_version()
    if core_from == "auto":
        core_from = "installed" if installed == release_version else "checkout"
    if core_from == "installed" and not (
        installed == release_version or same_release_family(installed or "", release_version)
    ):
        raise ValueError(
            f"--core-from installed: the installed megatron-core is {installed or 'missing'}, "
            f"the checkout is {release_version} (a release of another Megatron-LM tag)"
        )
    return core_from


def setup_sys_path(checkout: str, release_version: str, core_from: str) -> str:
    """Put ``checkout`` on ``sys.path`` so ``megatron.core`` comes from where asked.

    ``megatron`` is a namespace package in both the checkout and the wheel, so the order of
    ``sys.path`` decides which ``megatron/core`` is found first.

    Returns:
        ``"checkout"`` or ``"installed"``.

    Raises:
        ValueError: ``installed`` asked for but no matching megatron-core is installed.
    """
    core_from = resolve_core_from(release_version, core_from)
    while checkout in sys.path:
        sys.path.remove(checkout)
    if core_from == "installed":
        sys.path.append(checkout)
    else:
        sys.path.insert(0, checkout)
    return core_from


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (returns only if the script returns)."""
    from megatron_ext import quiet

    quiet.install()  # known-harmless warnings of the imports below (megatron_ext/quiet.py)
    from megatron_ext.megatron.lm.cpu import CPU_ENV_VAR, cpu_requested_by_env
    from megatron_ext.megatron.lm.releases import (
        UnsupportedReleaseError,
        detect_checkout_release,
    )
    from megatron_ext.megatron.lm.requirements import (
        format_missing,
        missing_requirements,
    )
    from megatron_ext.refusal import report_refusal

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, script, rest = parse_launcher_args(argv)
    except ValueError as exc:
        report_refusal(f"{_usage()}\nmegatron-ext pretrain: error: {exc}")
        return 2
    if options["help"]:
        print(_usage())
        return 0
    if script is None:
        report_refusal(f"{_usage()}\nmegatron-ext pretrain: error: no pretrain_gpt.py path given")
        return 2
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        report_refusal(f"megatron-ext pretrain: error: {script}: no such file")
        return 2
    checkout = os.path.dirname(script)
    cpu = options["cpu"] or cpu_requested_by_env()
    if not cpu:
        from megatron_ext.megatron.lm.cpu import no_cuda_message

        message = no_cuda_message("--cpu (megatron-ext pretrain --cpu PATH/pretrain_gpt.py ...)")
        if message:
            report_refusal(f"megatron-ext pretrain: error: {message}")
            return 2
    from megatron_ext.preflight import _megatron_subset, check_megatron_lm_defaults

    try:
        release = detect_checkout_release(checkout)
        # Before Megatron-LM is imported: a default it would fail on minutes later.
        check_megatron_lm_defaults(_megatron_subset(rest))
        core_from = setup_sys_path(checkout, release.version, options["core_from"])
        missing = missing_requirements(
            release.tag, cpu=cpu, core_checkout=checkout if core_from == "checkout" else None
        )
        if missing:
            raise ValueError(format_missing(release.tag, missing))
        if cpu:
            # A spawned checkpoint writer inherits the environment, not our arguments.
            os.environ[CPU_ENV_VAR] = "1"
        from megatron_ext.megatron.lm import install_megatron_lm_hooks

        install_megatron_lm_hooks(cpu=cpu)
    except (UnsupportedReleaseError, ValueError) as exc:  # PreflightError is a ValueError
        report_refusal(f"megatron-ext pretrain: error: {exc}")
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        import megatron.core
        import megatron.training

        print(
            f"> megatron-ext pretrain: Megatron-LM {release.tag} at {checkout}; megatron.core "
            f"from {os.path.dirname(megatron.core.__file__)} ({core_from}), megatron.training "
            f"from {os.path.dirname(megatron.training.__file__)}",
            flush=True,
        )
    with open(script, encoding="utf-8") as f:
        code = compile(f.read(), script, "exec")
    sys.argv = [script] + rest
    main_module = sys.modules["__main__"]
    # Run as the script would run: its globals in __main__, __name__ == "__main__".
    namespace = main_module.__dict__
    namespace["__name__"] = "__main__"
    exec(code, namespace)
    return 0
