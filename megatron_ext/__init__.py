"""megatron-ext: communication-efficient training for Megatron-LM and megatron-core.

Importing the package imports nothing else (no torch, no Megatron): the subpackages load what
they need. ``__version__`` is the package version; ``setup.py`` reads it from here.
"""

__version__ = "0.1.0"
