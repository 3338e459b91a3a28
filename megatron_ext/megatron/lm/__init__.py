"""megatron-ext inside Megatron-LM's ``pretrain_gpt.py`` (``megatron.training``).

What it does:
    Wires megatron-ext into an unmodified Megatron-LM training loop, in one of two ways:

    * **patched**: ``megatron-ext patch /path/to/Megatron-LM`` adds two hunks to
      ``pretrain_gpt.py`` (``patches/<tag>/``): a call to :func:`install_megatron_lm_hooks`
      before Megatron-LM is imported, and :func:`megatron_lm_extra_args` around the
      ``extra_args_provider`` it passes. Then ``torchrun pretrain_gpt.py ... --grad-compression
      separate`` works as usual.
    * **zero-touch**: ``megatron-ext pretrain /path/to/pretrain_gpt.py ...``
      (:mod:`megatron_ext.megatron.lm.launcher`) installs the same hooks and runs the
      unmodified script as ``__main__``.

    :func:`install_megatron_lm_hooks` finds the release of the imported megatron-core in
    :data:`~megatron_ext.megatron.lm.releases.RELEASES`, refuses an unknown one, switches on
    CPU execution when asked (``cpu=True`` or ``MEGATRON_EXT_CPU=1``) and installs that
    release's hooks (core_v0.16.x: :mod:`megatron_ext.megatron.lm.core_v0_16`, core_v0.19.x:
    :mod:`megatron_ext.megatron.lm.core_v0_19`), after the Python shims the release needs
    (:mod:`megatron_ext.megatron.lm.compat`).

Why:
    Megatron-LM users keep their launch scripts and flags; megatron-ext's flags join
    Megatron's parser, its bytes join Megatron's log line and its state joins Megatron's
    checkpoints.

Constraints:
    Importing this package does not import Megatron (the launcher sets ``sys.path`` first).
    One installation per process; :func:`install_megatron_lm_hooks` is idempotent.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Optional

__all__ = ["install_megatron_lm_hooks", "megatron_lm_extra_args", "installed_hooks"]

_HOOKS: Any = None

# A flag megatron-ext always adds: its presence means the parser already has our flags.
_MARKER_FLAG = "--grad-compression"


def megatron_lm_extra_args(provider: Optional[Callable] = None) -> Callable:
    """An ``extra_args_provider`` that adds megatron-ext's flags after ``provider``'s.

    Idempotent: a parser that already has megatron-ext's flags is returned as is, so the
    patched ``pretrain_gpt.py`` and the hooked ``parse_args`` can both chain it.

    Args:
        provider: the provider pretrain_gpt passes (``add_modelopt_args`` or None).

    Returns:
        A provider that returns the parser, as Megatron-LM requires.
    """
    if getattr(provider, "__megatron_ext_args__", False):
        return provider

    def extra_args_provider(parser):
        if provider is not None:
            parser = provider(parser)
        if _MARKER_FLAG not in parser._option_string_actions:
            from megatron_ext.config import add_args

            parser = add_args(parser)
            _add_data_args(parser)
        # A bad flag or value: one line, printed once for the job (argparse prints
        # Megatron-LM's ~700-line usage on every rank, which buries the cause).
        parser.error = functools.partial(_parse_error, parser)
        return parser

    extra_args_provider.__megatron_ext_args__ = True
    return extra_args_provider


def _parse_error(parser: Any, message: str) -> None:
    """argparse's ``error`` for Megatron-LM's parser: the refusal line without the usage."""
    from megatron_ext.refusal import report_refusal

    report_refusal(f"{parser.prog}: error: {message} ('{parser.prog} --help' lists the flags)")
    sys.exit(2)


def _add_data_args(parser) -> None:
    """The driver's data flags that Megatron-LM runs need too (``--fixed-samples``)."""
    group = parser.add_argument_group(title="megatron-ext data")
    from megatron_ext.config import _field_docstrings
    from megatron_ext.data.config import DataConfig

    group.add_argument(
        "--fixed-samples",
        type=int,
        default=None,
        help=(
            _field_docstrings(DataConfig)["fixed_samples"] + " Needs --dataloader-type single."
        ).replace("%", "%%"),
    )


def installed_hooks() -> Any:
    """The installed :class:`~megatron_ext.megatron.lm.hooks.MegatronLMHooks`, or None."""
    return _HOOKS


def _checkout_version_next_to_training() -> Optional[str]:
    """Release of the checkout ``megatron.training`` comes from (None: no package_info.py)."""
    from megatron_ext.megatron.lm.releases import read_checkout_version

    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.submodule_search_locations:
        return None
    checkout = os.path.dirname(os.path.dirname(list(spec.submodule_search_locations)[0]))
    return read_checkout_version(checkout)


def _core_version_on_disk() -> str:
    """Version in the ``megatron/core/package_info.py`` that ``import megatron.core`` would
    load, read without importing megatron.core (which must come after the Python shims)."""
    from megatron_ext.megatron.lm.releases import read_checkout_version

    spec = importlib.util.find_spec("megatron.core")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    version = None
    if locations:
        version = read_checkout_version(os.path.dirname(os.path.dirname(locations[0])))
    if version is None:
        from megatron_ext.megatron.version import mcore_version  # raises the import error

        version = mcore_version()
    return version


def install_megatron_lm_hooks(cpu: Optional[bool] = None) -> Any:
    """Install megatron-ext's Megatron-LM hooks for the imported release (idempotent).

    Args:
        cpu: run on CPU with gloo (:mod:`megatron_ext.megatron.lm.cpu`); None reads
            ``MEGATRON_EXT_CPU``.

    Returns:
        The hooks handle (``remove()`` restores Megatron-LM's functions).

    Raises:
        UnsupportedReleaseError: the imported megatron-core (or the checkout holding
            ``megatron.training``) is not a supported release.
        SystemExit: (2) CPU execution is off and torch sees no CUDA device; the message
            naming ``MEGATRON_EXT_CPU=1`` is printed first.
    """
    global _HOOKS
    if _HOOKS is not None:
        return _HOOKS
    from megatron_ext import quiet

    quiet.install()  # before megatron is imported: its import-time warnings are known
    from megatron_ext.megatron.lm.compat import apply_python_shims
    from megatron_ext.megatron.lm.cpu import (
        cpu_requested_by_env,
        enable_megatron_lm_cpu,
    )
    from megatron_ext.megatron.lm.releases import (
        UnsupportedReleaseError,
        release_for_version,
    )
    from megatron_ext.megatron.lm.session import MegatronLMSession

    if cpu is None:
        cpu = cpu_requested_by_env()
    if not cpu:
        from megatron_ext.megatron.lm.cpu import no_cuda_message

        message = no_cuda_message("MEGATRON_EXT_CPU=1 (MEGATRON_EXT_CPU=1 torchrun ...)")
        if message:
            # Before Megatron-LM is imported: its triton import or its CUDA assertion would
            # come first and name neither the cause nor the fix.
            from megatron_ext.refusal import report_refusal

            report_refusal(f"megatron-ext: error: {message}")
            raise SystemExit(2)
    release = release_for_version(_core_version_on_disk(), "the imported megatron-core")
    # Before anything imports megatron.training (0.19 on Python 3.11: typing.override).
    shims = apply_python_shims(release.requires_python)
    # Triton may be missing on CPU machines: the stand-in must precede megatron.training.
    cpu_on = cpu and enable_megatron_lm_cpu() is not None
    from megatron_ext.megatron.version import mcore_version

    if mcore_version() != release.version:
        raise UnsupportedReleaseError(
            f"megatron.core reports {mcore_version()} but its package_info.py on disk says "
            f"{release.version}"
        )
    training_version = _checkout_version_next_to_training()
    if training_version is not None and training_version != release.version:
        raise UnsupportedReleaseError(
            f"megatron.training comes from a Megatron-LM {training_version} checkout but "
            f"megatron.core is {release.version}; use one release for both"
        )
    module_name, function_name = release.hooks.split(":")
    install = getattr(importlib.import_module(module_name), function_name)
    session = MegatronLMSession(release, cpu=bool(cpu_on))
    session.python_shims = shims
    # megatron-core's checkpoint writer processes must not outlive a killed rank, nor a rank
    # its killed launcher.
    from megatron_ext.child_processes import bind_process_lifetimes

    bind_process_lifetimes()
    _HOOKS = install(session)
    if cpu_on:
        from megatron_ext.megatron.lm.cpu import disable_megatron_lm_cpu

        _HOOKS.on_remove.append(disable_megatron_lm_cpu)
    _HOOKS.on_remove.append(_forget_hooks)
    return _HOOKS


def _forget_hooks() -> None:
    global _HOOKS
    _HOOKS = None
