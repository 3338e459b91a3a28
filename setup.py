"""megatron-ext: communication-efficient training for Megatron-LM and megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-ext",
    version="0.1.0",
    description=(
        "Compressed data-parallel, pipeline-parallel and row-sparse communication for "
        "Megatron-LM / megatron-core training"
    ),
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The CPU wheel is pinned by the README's install command; any torch >= 2.6 works.
        "torch>=2.6",
        # Tested on 0.16.1. Newer releases are not locked out: the adapters check the
        # hook signatures they rely on at install time and fail with a clear error.
        "megatron-core>=0.16.1",
        "numpy",
        "sentencepiece",
        "datasets",
        "pyyaml",
        "psutil",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "tensorboard"],
        "report": ["matplotlib", "tensorboard"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
