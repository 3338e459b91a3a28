"""The Python packages Megatron-LM's training code needs beyond megatron-core, checked up front.

What it does:
    ``pip install megatron-core`` brings torch, numpy and packaging only, but
    ``pretrain_gpt.py`` and ``megatron/training`` import more. :data:`REQUIREMENTS` lists,
    per Megatron-LM tag, the modules a CPU or GPU run of ``pretrain_gpt.py`` imports
    (found by importing it in a venv holding only torch and the megatron-core wheel, then
    training the tiny CPU run file with a ``torch_dist`` save and resume):

    * core_v0.16.1: ``six`` (``training/tokenizer/bert_tokenization.py``), ``regex``
      (``tokenizer/gpt2_tokenization.py``), ``yaml`` (``training/yaml_arguments.py``,
      imported by ``initialize.py``), ``pydantic`` (``megatron/rl``, imported by
      ``training.py``), all at import time;
    * core_v0.19.0: ``triton`` (megatron-core 0.19's ``pipeline_parallel/schedules.py``
      imports the MoE paged-stash kernels; CUDA builds of torch bring it, and on CPU
      :mod:`megatron_ext.megatron.lm.cpu` registers a stand-in instead); the tokenizers
      moved to ``megatron.core.tokenizers`` and ``megatron/rl`` is imported under
      ``try``, so six/regex/pydantic/yaml are no longer needed to train;
    * both: ``pybind11`` when ``megatron.core`` comes from a checkout whose dataset helpers
      (``megatron/core/datasets/helpers_cpp``) are not built yet (the wheel ships them).

    :func:`check_local_spec_kernels` checks the Apex CUDA extensions megatron-core's *local*
    layer spec loads under Megatron-LM's defaults (the spec Grass and Protocol Models
    force, and the driver's default): ``masked_softmax_fusion`` with fp16/bf16 imports
    ``scaled_masked_softmax_cuda`` / ``scaled_upper_triang_masked_softmax_cuda`` at the
    first forward, ``gradient_accumulation_fusion`` needs ``fused_weight_gradient_mlp_cuda``
    when the layers are built. On a Transformer-Engine-only install the user would learn it
    after a full start-up, from a traceback; the driver and the Megatron-LM session call
    it with the parsed flags before anything is built and name the flags that avoid it.

    ``psutil`` (torch_dist checkpoint saves) and ``pyyaml`` are megatron-ext requirements
    anyway. :func:`missing_requirements` names what is not importable (``find_spec``: nothing
    is imported); ``python -m megatron_ext.megatron.lm.requirements CHECKOUT [--cpu]
    [--core-from ...]`` prints them and exits 2, for ``scripts/pretrain_gpt_ext.sh`` to call before
    ``torchrun`` starts its processes.

Why:
    Without it a missing package surfaces as one ``ModuleNotFoundError`` per rank deep in
    Megatron-LM's imports, one package at a time.

Constraints:
    Pure Python; never imports Megatron. The ``megatron-lm`` extra of ``setup.py`` installs
    the union of these lists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "Requirement",
    "REQUIREMENTS",
    "LOCAL_SPEC_KERNELS",
    "CPU_HINT",
    "EXTRA_PACKAGES",
    "missing_requirements",
    "format_missing",
    "check_local_spec_kernels",
    "TOKENIZER_PACKAGES",
    "check_tokenizer_package",
    "main",
]


@dataclass(frozen=True)
class Requirement:
    """One module Megatron-LM's training code imports."""

    module: str
    """Top-level import name."""

    package: str
    """pip name."""

    why: str
    """Who imports it."""

    gpu_only: bool = False
    """Not needed on CPU (megatron-ext registers stand-ins for its users)."""


_PYBIND11 = Requirement(
    "pybind11", "pybind11", "building megatron/core/datasets/helpers_cpp of a checkout"
)

REQUIREMENTS: Dict[str, Tuple[Requirement, ...]] = {
    "core_v0.16.1": (
        Requirement("six", "six", "megatron/training/tokenizer/bert_tokenization.py"),
        Requirement("regex", "regex", "megatron/training/tokenizer/gpt2_tokenization.py"),
        Requirement("yaml", "pyyaml", "megatron/training/yaml_arguments.py"),
        Requirement("pydantic", "pydantic", "megatron/rl (imported by training.py)"),
        Requirement("psutil", "psutil", "torch_dist checkpoint saves"),
        Requirement(
            "triton",
            "triton",
            "megatron/core/transformer/custom_layers/batch_invariant_kernels.py",
            gpu_only=True,
        ),
    ),
    "core_v0.19.0": (
        Requirement("psutil", "psutil", "torch_dist checkpoint saves"),
        Requirement(
            "triton",
            "triton",
            "megatron/core/pipeline_parallel/schedules.py (moe/ops/paged_stash.py)",
            gpu_only=True,
        ),
    ),
}


LOCAL_SPEC_KERNELS: Dict[str, Tuple[str, ...]] = {
    "--no-masked-softmax-fusion": (
        "scaled_masked_softmax_cuda",
        "scaled_upper_triang_masked_softmax_cuda",
    ),
    "--no-gradient-accumulation-fusion": ("fused_weight_gradient_mlp_cuda",),
    # Without Apex the local spec's norm is torch's (WrappedTorchNorm), which refuses
    # persist_layer_norm by assertion at model build.
    "--no-persist-layer-norm": ("apex",),
}
"""The flag that turns each fused path off -> the Apex extension modules it imports."""


def check_local_spec_kernels(
    *,
    transformer_impl: str,
    half: bool,
    masked_softmax_fusion: bool,
    gradient_accumulation_fusion: bool,
    persist_layer_norm: bool = False,
) -> None:
    """Refuse a local-spec run whose fused kernels need Apex extensions that are absent.

    Args:
        transformer_impl: ``--transformer-impl`` ('local' is checked).
        half: fp16 or bf16 activations (only those take the fused softmax).
        masked_softmax_fusion: Megatron's ``masked_softmax_fusion``.
        gradient_accumulation_fusion: Megatron's ``gradient_accumulation_fusion``.
        persist_layer_norm: Megatron's ``persist_layer_norm`` (needs Apex's fused norm).

    Raises:
        ConfigError: naming ``--no-masked-softmax-fusion`` /
            ``--no-gradient-accumulation-fusion`` and ``--transformer-impl``.
    """
    from megatron_ext.config import ConfigError

    if transformer_impl != "local":
        return
    wanted = {
        "--no-masked-softmax-fusion": masked_softmax_fusion and half,
        "--no-gradient-accumulation-fusion": gradient_accumulation_fusion,
        "--no-persist-layer-norm": persist_layer_norm,
    }
    flags, lines = [], []
    for flag, modules in LOCAL_SPEC_KERNELS.items():
        missing = [m for m in modules if wanted[flag] and importlib.util.find_spec(m) is None]
        if missing:
            flags.append(flag)
            lines.append(f"{flag} ({', '.join(missing)} not importable)")
    if flags:
        raise ConfigError(
            flags + ["--transformer-impl"],
            "the local layer spec's fused kernels come from Apex and its CUDA extensions, which "
            "are not installed here; pass " + " and ".join(lines) + ", or use "
            "--transformer-impl transformer_engine where the methods allow it (Grass and "
            "Protocol Models need the local spec)",
        )


TOKENIZER_PACKAGES: Dict[str, Tuple[str, str]] = {
    "HuggingFaceTokenizer": ("transformers", "hf"),
}
"""``--tokenizer-type`` -> (the module Megatron-LM's tokenizer of that name imports when it is
built, the ``setup.py`` extra that installs it). Megatron-LM imports it only after start-up
(0.16: ``megatron/training/tokenizer``; 0.19: ``megatron/core/tokenizers``)."""


def check_tokenizer_package(tokenizer_type: Optional[str]) -> None:
    """Refuse a ``--tokenizer-type`` whose package is not installed, naming the extra.

    Raises:
        ConfigError: naming ``--tokenizer-type``.
    """
    from megatron_ext.config import ConfigError

    module, extra = TOKENIZER_PACKAGES.get(tokenizer_type or "", (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise ConfigError(
            "--tokenizer-type",
            f"{tokenizer_type} needs the {module} package, which is not installed: "
            f"pip install 'megatron-ext[{extra}]' (or: pip install {module})",
        )


def _helpers_built(checkout: str) -> bool:
    folder = os.path.join(checkout, "megatron", "core", "datasets")
    if not os.path.isdir(folder):  # no megatron/core there: nothing to build
        return True
    return any(name.startswith("helpers_cpp") for name in os.listdir(folder))


def missing_requirements(
    tag: str, *, cpu: bool, core_checkout: Optional[str] = None
) -> List[Requirement]:
    """The requirements of ``tag`` that are not importable here.

    Args:
        tag: the Megatron-LM tag (a key of :data:`REQUIREMENTS`).
        cpu: CPU execution (GPU-only requirements are skipped).
        core_checkout: the checkout ``megatron.core`` comes from, if any (pybind11 is
            needed there until its dataset helpers are built).
    """
    wanted = [r for r in REQUIREMENTS[tag] if not (cpu and r.gpu_only)]
    if core_checkout is not None and not _helpers_built(core_checkout):
        wanted.append(_PYBIND11)
    return [r for r in wanted if importlib.util.find_spec(r.module) is None]


CPU_HINT: str = (
    "No GPU here? Run on CPU instead: 'megatron-ext pretrain --cpu ...', MEGATRON_EXT_CPU=1 "
    "for a patched pretrain_gpt.py, CPU=1 for scripts/pretrain_gpt_ext.sh"
)
"""Where CPU execution is switched on, for messages about GPU-only requirements."""

EXTRA_PACKAGES: Tuple[str, ...] = ("six", "regex", "pydantic", "pybind11")
"""What the ``megatron-lm`` extra of ``setup.py`` installs (keep the two in step)."""


def format_missing(tag: str, missing: Sequence[Requirement]) -> str:
    """One message naming every missing package and what fixes it.

    Packages pip installs are named with their ``pip install`` command (and the
    ``megatron-ext[megatron-lm]`` extra when it holds them all). GPU-only ones (triton) are
    not installed with pip: a CUDA build of torch brings them, and a machine without a GPU
    needs CPU execution instead (:data:`CPU_HINT`).
    """
    lines = [f"Megatron-LM {tag} needs Python packages that are not installed:"]
    lines += [
        f"  {r.module} (pip: {r.package}): {r.why}"
        + ("; GPU runs only: CUDA builds of torch bring it" if r.gpu_only else "")
        for r in missing
    ]
    names = sorted({r.package for r in missing if not r.gpu_only})
    if names:
        extra = (
            "   (or: pip install 'megatron-ext[megatron-lm]')"
            if set(names) <= set(EXTRA_PACKAGES)
            else ""
        )
        lines.append(f"Install them: pip install {' '.join(names)}{extra}")
    if any(r.gpu_only for r in missing):
        lines.append(CPU_HINT)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_ext.megatron.lm.requirements CHECKOUT [--cpu]``; exit code 2 if
    something is missing."""
    from megatron_ext.megatron.lm.releases import (
        UnsupportedReleaseError,
        detect_checkout_release,
    )

    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.megatron.lm.requirements",
        description="Check the Python packages a Megatron-LM checkout's training code imports.",
    )
    parser.add_argument("checkout", help="Megatron-LM checkout (the folder of pretrain_gpt.py)")
    parser.add_argument("--cpu", action="store_true", help="CPU execution (no triton needed)")
    parser.add_argument(
        "--core-from",
        choices=("auto", "checkout", "installed"),
        default="auto",
        help="as for 'megatron-ext pretrain' (from the checkout: pybind11 until its dataset "
        "helpers are built)",
    )
    args = parser.parse_args(argv)
    from megatron_ext.megatron.lm.launcher import resolve_core_from

    try:
        release = detect_checkout_release(args.checkout)
        core_from = resolve_core_from(release.version, args.core_from)
    except (UnsupportedReleaseError, ValueError) as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2
    missing = missing_requirements(
        release.tag,
        cpu=args.cpu,
        core_checkout=args.checkout if core_from == "checkout" else None,
    )
    if missing:
        print(f"megatron-ext: error: {format_missing(release.tag, missing)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
