"""Option dataclasses and the machinery that turns them into flags: a leaf package.

What: :mod:`megatron_ext.options.base` (``ConfigError``, ``arg``, ``flag_of``,
``add_config_args`` ...) and the options dataclasses that more than one layer reads: the
quantized, Radius, SEPARATE and PowerSGD options (a data-parallel method's flags, and the
compression of DiLoCo's outer exchange), AQ-SGD's (its methods and codecs), QuantizedAdam's
(its method and momentum exchange) and the outer exchanges' table
(:mod:`megatron_ext.options.outer`).

Why: the methods (``megatron_ext.methods``), the pure-torch collectives and the flag parser
(``megatron_ext.config``) all read these; here none of them has to import another, and flags
parse without torch. The collectives of DiLoCo's outer exchange
(``megatron_ext.collectives.outer_exchange``) and QuantizedAdam's momentum exchange
(``megatron_ext.collectives.quantized_adam``) read a data-parallel method's options without
importing the method registry.

Constraints:
    Standard library only, and only this package: no torch, no Megatron, no other
    megatron_ext package (``tests/unit/test_layers.py`` checks it).
"""
