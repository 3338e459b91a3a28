"""megatron-ext: communication-efficient training for Megatron-LM and megatron-core."""

import glob
import os
import re

from setuptools import find_packages, setup


def _data_files(top):
    """Install a repository folder (configs/, patches/) under share/megatron-ext/."""
    out = {}
    for path in glob.glob(os.path.join(top, "**", "*"), recursive=True):
        if os.path.isfile(path):
            out.setdefault(os.path.join("share", "megatron-ext", os.path.dirname(path)), []).append(
                path
            )
    return sorted(out.items())


def _version():
    """``megatron_ext.__version__``, read without importing the package (one source)."""
    with open(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_ext", "__init__.py")
    ) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


# What Megatron-LM's pretrain_gpt.py / megatron/training import beyond megatron-core
# (megatron_ext/megatron/lm/requirements.py; pyyaml and psutil are required below):
# core_v0.16.1 imports six, regex, pydantic at start-up; pybind11 builds the dataset helpers
# of a checkout's megatron/core. triton (0.19's schedules) comes with CUDA builds of torch
# and has a CPU stand-in.
_MEGATRON_LM = ["six", "regex", "pydantic", "pybind11"]

setup(
    name="megatron-ext",
    version=_version(),
    description=(
        "Compressed data-parallel, pipeline-parallel and row-sparse communication for "
        "Megatron-LM / megatron-core training"
    ),
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The CPU wheel is pinned by the README's install command; any torch >= 2.6 works.
        "torch>=2.6",
        # The supported release lines (megatron_ext/megatron/mcore): 0.16.x and 0.19.x. pip
        # takes the newest the Python allows: 0.16.1 on Python 3.11 (0.17+ declare >= 3.12),
        # 0.19.x on 3.12. 0.17/0.18 are excluded (their method bodies are not verified; the
        # adapters would refuse them at run time, naming the supported releases).
        "megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20",
        "numpy",
        # megatron-core's parallel_state imports it for several distributed-optimizer
        # instances (DiLoCo's sites with --use-distributed-optimizer); Megatron-LM needs it.
        "einops",
        "sentencepiece",
        "datasets",
        "pyyaml",
        "psutil",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        # transformers: the tests of --tokenizer-type HuggingFaceTokenizer (a tokenizer built
        # locally; no download). torchft: tests/distributed/test_diloco_torchft.py compares
        # --outer-method diloco with torchft's DiLoCo on the same inputs. The "megatron-lm"
        # extra's packages: the tests of Megatron-LM's pretrain_gpt.py (tests/megatron_lm),
        # which CI runs on every submission.
        "test": [
            "pytest",
            "pytest-xdist",
            "tensorboard",
            "matplotlib",
            "transformers",
            "torchft==0.2.0",
        ]
        + _MEGATRON_LM,
        # --tokenizer-type HuggingFaceTokenizer (prepare-data, the driver; Megatron-LM's own
        # HuggingFaceTokenizer needs it too).
        "hf": ["transformers"],
        "report": ["matplotlib", "tensorboard"],
        # Megatron-LM's training code (_MEGATRON_LM above).
        "megatron-lm": _MEGATRON_LM,
    },
    # Model presets, run files and Megatron-LM patches, found there by a non-editable install.
    data_files=_data_files("configs") + _data_files("patches"),
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
