"""Compression methods: one module each, declared to :mod:`megatron_ext.methods.registry`.

Each module in :data:`BUILTIN` defines its options dataclass and factory and registers a
:class:`~megatron_ext.methods.registry.Method`; the registry imports them on first use.
Adding a method is a new module plus one line here. The options that other layers read too
(DiLoCo's outer exchange compresses like the quantized, Radius, SEPARATE and PowerSGD
methods) live instead in the leaf package ``megatron_ext.options``.
"""

BUILTIN = (
    "megatron_ext.methods.none",
    "megatron_ext.methods.separate",
    "megatron_ext.methods.radius",
    "megatron_ext.methods.powersgd",
    "megatron_ext.methods.quantized",
    "megatron_ext.methods.quantized_adam",
    "megatron_ext.methods.aqsgd",
    "megatron_ext.methods.grass",
    "megatron_ext.methods.protocol",
    "megatron_ext.methods.diloco",
)
"""Modules that register the built-in methods, in ``--help`` order."""
