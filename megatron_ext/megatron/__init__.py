"""The only package of megatron_ext that imports Megatron: thin adapters around its seams.

Importing it registers, on machines without triton, stand-ins for the megatron-core
modules that import triton at module level only to define GPU kernels (0.19's MoE paged
stash, imported by ``megatron.core`` itself; the batch-invariant kernels Megatron-LM's
``initialize.py`` imports). Using those features without triton raises an error naming
them; everything else in megatron-core imports and runs (see
:func:`megatron_ext.megatron.cpu.register_triton_stand_ins`).
"""

from megatron_ext.megatron.cpu import register_triton_stand_ins as _register_triton_stand_ins

_register_triton_stand_ins()
