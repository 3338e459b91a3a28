"""Options of the linear seam (``--grass-layers``): which linear layers it wraps.

The family options of ``--grass-method`` (``megatron_ext.methods.registry`` declares the
family with them); here, in the leaf package, so that the registry need not import
``megatron_ext.config``, which imports the registry.
"""

from __future__ import annotations

from megatron_ext.options.base import options_dataclass

__all__ = ["DEFAULT_LINEAR_LAYERS", "LinearLayersConfig"]

DEFAULT_LINEAR_LAYERS = r"decoder\.layers\.\d+\.(self_attention\.(linear_qkv|linear_proj)|mlp\.(linear_fc1|linear_fc2))$"


@options_dataclass(group="megatron-ext: row-sparse linear backward (Grass)", prefix="grass")
class LinearLayersConfig:
    """Which linear layers the linear seam (``--grass-method``) wraps."""

    layers: str = DEFAULT_LINEAR_LAYERS
    """Regular expression matched (re.search) against the module names of the linear layers
    that get the megatron_ext forward/backward."""
