"""The contract between the pipeline send/receive seam and an activation codec.

What it does:
    A :class:`P2PCodec` turns a tensor that one pipeline stage sends to its neighbour (an
    activation going forward, an activation gradient going backward) into one *payload*
    tensor, and back. The adapter ``megatron_ext.megatron.p2p`` sends payloads instead of
    tensors and tells the codec, in a :class:`P2PContext`, which direction, microbatch and
    dataset samples the tensor belongs to (AQ-SGD keys its buffers by sample id; middle
    stages read no data, so ids are computed from the sampler, not read from batches).
    :class:`IdentityCodec` is the pass-through.

Why a single payload tensor of deterministic size:
    megatron-core receivers pre-allocate their buffers from the expected shape (no header
    travels unless ``variable_seq_lengths`` is set), so the payload's shape and dtype must
    be a pure function of (tensor shape, dtype, codec config, transfer context) that sender
    and receiver evaluate alike. One payload tensor per
    message keeps megatron's own batched / ordered P2P transport usable unchanged.

Constraints:
    torch only; never imports Megatron or torch.distributed. Codecs never communicate.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple

import torch

__all__ = ["P2PContext", "P2PCodec", "IdentityCodec"]


@dataclass(frozen=True)
class P2PContext:
    """Which tensor a payload carries."""

    direction: str
    """'forward' (activation, to the next stage) or 'backward' (its gradient, to the
    previous stage)."""

    microbatch: Optional[int]
    """0-based microbatch index within the iteration (None where the schedule does not
    determine it, i.e. the interleaved schedule)."""

    sample_ids: Optional[torch.Tensor]
    """Dataset indices of the microbatch's samples, int64 ``[micro_batch_size]``, or None."""

    step: int
    """Training iteration."""

    forward_only: bool
    """True during evaluation (no backward will follow)."""


class P2PCodec(abc.ABC):
    """Base class of pipeline activation codecs (see module docstring)."""

    name: str = "base"
    needs_sample_ids: bool = False
    #: Role -> elastic-resume rule, declared by each concrete class in its own body
    #: (:func:`~megatron_ext.protocols.elastic_rules_of` reads only the class's own).
    elastic_rules: ClassVar[Mapping[str, str]]
    """Codecs keyed by sample (AQ-SGD) need the schedule to determine microbatch ids."""

    @abc.abstractmethod
    def payload_spec(
        self, shape: Tuple[int, ...], dtype: torch.dtype, ctx: P2PContext
    ) -> Tuple[Tuple[int, ...], torch.dtype]:
        """Shape and dtype of the payload of the transfer ``ctx`` for a tensor of ``shape`` /
        ``dtype``. Both sides call it with the same context, so it may depend on it (a
        sample's first visit in full precision, later ones compressed)."""

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor, ctx: P2PContext) -> torch.Tensor:
        """Payload for ``tensor`` (shape/dtype as :meth:`payload_spec` says)."""

    @abc.abstractmethod
    def decode(
        self, payload: torch.Tensor, ctx: P2PContext, shape: Tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Tensor of ``shape`` / ``dtype`` reconstructed from ``payload``."""

    def begin_step(self, sample_ids_fn: Optional[Any]) -> None:
        """A training iteration starts; ``sample_ids_fn(microbatch)`` gives the sample ids of
        each of its microbatches (default: nothing)."""

    def end_step(self, commit: bool = True) -> None:
        """The training iteration is over: commit per-step state, or drop it when
        ``commit`` is False (the optimizer step was skipped); default: nothing."""

    def state_dict(self) -> Dict[str, Any]:
        """Rank-local state (tensors and primitives only)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raise ValueError on missing / unexpected keys."""
        if state:
            raise ValueError(f"{self.name} codec has no state, got keys {sorted(state)}")


class IdentityCodec(P2PCodec):
    """Pass-through: the payload is the tensor itself."""

    name = "none"
    elastic_rules: ClassVar[Mapping[str, str]] = {}

    def payload_spec(self, shape, dtype, ctx):
        return tuple(shape), dtype

    def encode(self, tensor, ctx):
        return tensor

    def decode(self, payload, ctx, shape, dtype):
        return payload
