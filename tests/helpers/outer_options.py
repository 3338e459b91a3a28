"""The options of a DiLoCo hook built by a test that drives the hook itself.

``outer_options(**overrides)`` is the ``--outer-*`` defaults
(:class:`megatron_ext.methods.diloco.OuterConfig`) with ``overrides``, as a plain namespace:
not validated, so that a test can hand the hook what the flags refuse (a NaN learning rate,
as a run file once could pass it).
"""

import dataclasses
import types


def outer_options(**overrides) -> types.SimpleNamespace:
    """OuterConfig's defaults with ``overrides`` (field names), unvalidated."""
    from megatron_ext.options.outer import OuterConfig

    unknown = set(overrides) - {f.name for f in dataclasses.fields(OuterConfig)}
    if unknown:
        raise TypeError(f"not OuterConfig fields: {sorted(unknown)}")
    defaults = {f.name: f.default for f in dataclasses.fields(OuterConfig)}
    return types.SimpleNamespace(**{**defaults, **overrides})
