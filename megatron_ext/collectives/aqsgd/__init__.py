"""AQ-SGD and DirectQ: compressed pipeline activations (pure torch; ``docs/methods/aqsgd.md``).

What it does:
    AQ-SGD sends, across a pipeline boundary, each training sample's activation as a
    quantized delta against the last value both sides agreed on; DirectQ quantizes the
    activations themselves. One idea a module:

    * ``codecs.py``: the P2P codecs (:class:`AQSGDCodec`, :class:`DirectQCodec`): what
      crosses the boundary, how a step stages and commits buffer updates, checkpoints.
    * ``buffers.py``: :class:`SampleBuffers`, the per-sample activation buffers in device,
      host or disk memory, and their size (:func:`buffer_nbytes`).
    * ``sizing.py``: payload sizes, the tokens a rank keeps per sample, the buffer dtype,
      the warm-up in steps, the collective fit decision.

Why a package:
    The three change for different reasons and are read separately; the public names are
    re-exported here, so ``from megatron_ext.collectives.aqsgd import X`` stays the one
    import path (the method, preflight, benchmarks and tests use it).

Constraints:
    torch only (torch.distributed to read this rank's pipeline position and to agree at
    set-up whether the buffers fit); never imports Megatron or ``megatron_ext.methods``.
"""

from megatron_ext.collectives.aqsgd.buffers import SampleBuffers, buffer_nbytes
from megatron_ext.collectives.aqsgd.codecs import AQSGDCodec, DirectQCodec
from megatron_ext.collectives.aqsgd.sizing import (
    boundary_sides,
    local_rows,
    resolve_buffer_dtype,
    scale_groups,
    warmup_steps,
)
from megatron_ext.state_plan import format_bytes  # ``1.50 GB`` style (torch-free, preflight)

__all__ = [
    "SampleBuffers",
    "scale_groups",
    "warmup_steps",
    "AQSGDCodec",
    "DirectQCodec",
    "boundary_sides",
    "buffer_nbytes",
    "format_bytes",
    "local_rows",
    "resolve_buffer_dtype",
]
