"""Pipeline send/receive seam: a megatron-core ``P2PCommunicator`` that sends codec payloads.

What it does:
    :class:`ExtP2PCommunicator` subclasses megatron-core's ``P2PCommunicator`` and
    overrides ``_communicate``, the single method every public send/receive goes through.
    Each tensor sent is encoded by a :class:`~megatron_ext.collectives.p2p.P2PCodec` into a
    payload; receivers allocate payload buffers of the size the codec declares, and decode
    them into tensors of the shape the schedule expects (forward receives come back as
    leaves with ``requires_grad=True``, as megatron's ``backward_step`` needs). With the
    :class:`IdentityCodec` the transfers are exactly megatron-core's.

    It also knows which microbatch and which dataset samples a tensor belongs to. In the
    non-interleaved 1F1B schedule (and in forward-only evaluation) each stage sends and
    receives activations in microbatch order 0..N-1, and activation gradients likewise
    (megatron pops ``input_tensors`` FIFO), so per-iteration counters per direction are
    exact. Sample ids come from the sampler's formula (``sample_ids_fn``) because middle
    stages read no data. The training loop calls :meth:`ExtP2PCommunicator.begin_step`
    before each ``forward_backward_func`` call.

How it is plugged in:
    Through the schedules' official ``p2p_communicator=`` argument (together with
    ``pg_collection=``, which megatron requires alongside it).

Constraints:
    * With the interleaved schedule the microbatch of a transfer is not determined by call
      order; contexts then carry ``microbatch=None`` and codecs that need sample ids are
      refused at construction.
    * ``use_ring_exchange_p2p`` is refused for non-identity codecs (no such transport on
      gloo/CPU and not needed).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.pipeline_parallel import p2p_communication as _p2p
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter
from megatron_ext.collectives.p2p import IdentityCodec, P2PCodec, P2PContext
from megatron_ext.config import ConfigError
from megatron_ext.megatron import mcore

__all__ = ["ExtP2PCommunicator"]


class _DecodeOnWait:
    """Wraps an async receive: ``wait()`` finishes the transfer, then decodes in place."""

    def __init__(self, req: Any, finish: Callable[[], None]):
        self._req = req
        self._finish = finish

    def wait(self):
        self._req.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None

    def is_completed(self):
        return self._req.is_completed()


class ExtP2PCommunicator(P2PCommunicator):
    """megatron-core P2P communicator whose transfers go through a codec.

    Args:
        pp_group: pipeline-parallel process group.
        config: the model's ``ModelParallelConfig`` / ``TransformerConfig``.
        codec: activation codec (default: identity).
        meter: byte accounting (categories ``pp-act`` and ``pp-grad``).
    """

    def __init__(
        self,
        pp_group: torch.distributed.ProcessGroup,
        config: Any,
        codec: Optional[P2PCodec] = None,
        meter: Optional[CommMeter] = None,
    ):
        # _communicate below re-implements megatron-core's body around the codec: only for
        # the supported releases (identical in 0.16 and 0.19).
        mcore.release()
        super().__init__(pp_group=pp_group, config=config)
        self.codec = codec or IdentityCodec()
        self.meter = meter
        self.interleaved = self.virtual_pipeline_model_parallel_size is not None
        if self.codec.needs_sample_ids and self.interleaved:
            raise ConfigError(
                ["--p2p-compression", "--num-layers-per-virtual-pipeline-stage"],
                f"'{self.codec.name}' keys state by sample and needs the non-interleaved "
                "1F1B schedule",
            )
        if not isinstance(self.codec, IdentityCodec) and config.use_ring_exchange_p2p:
            raise ConfigError(
                ["--p2p-compression", "--use-ring-exchange-p2p"],
                "compressed payloads use batched / ordered isend-irecv, not ring exchange",
            )
        self.step = 0
        self.forward_only = False
        self._sample_ids_fn: Optional[Callable[[int], torch.Tensor]] = None
        self._counters = {"fwd_send": 0, "fwd_recv": 0, "bwd_send": 0, "bwd_recv": 0}
        self.trace: Optional[List[Tuple[str, str, Optional[int], Optional[List[int]]]]] = None

    def begin_step(
        self,
        step: int,
        *,
        sample_ids_fn: Optional[Callable[[int], torch.Tensor]] = None,
        forward_only: bool = False,
    ) -> None:
        """Start an iteration: reset microbatch counters.

        Args:
            step: training iteration.
            sample_ids_fn: microbatch index -> int64 tensor of dataset sample indices.
            forward_only: evaluation (no backward transfers).
        """
        self.step = step
        self.forward_only = forward_only
        self._sample_ids_fn = sample_ids_fn
        for k in self._counters:
            self._counters[k] = 0
        if not forward_only:
            self.codec.begin_step(sample_ids_fn if self.codec.needs_sample_ids else None)

    # -- contexts ----------------------------------------------------------------------------

    def _context(self, direction: str, counter: str) -> P2PContext:
        microbatch: Optional[int] = None
        sample_ids = None
        if not self.interleaved:
            microbatch = self._counters[counter]
            self._counters[counter] += 1
            # Only codecs that key state by sample (and the test trace) need the ids.
            wanted = self.codec.needs_sample_ids or self.trace is not None
            if wanted and self._sample_ids_fn is not None:
                sample_ids = self._sample_ids_fn(microbatch)
        ctx = P2PContext(
            direction=direction,
            microbatch=microbatch,
            sample_ids=sample_ids,
            step=self.step,
            forward_only=self.forward_only,
        )
        if self.trace is not None:
            ids = None if sample_ids is None else [int(i) for i in sample_ids]
            self.trace.append((direction, counter, microbatch, ids))
        return ctx

    def _record(self, category: str, *, payload: torch.Tensor, dense_shape, dense_dtype, send):
        if self.meter is None:
            return
        nbytes = payload.numel() * payload.element_size()
        dense = torch.Size(dense_shape).numel() * dense_dtype.itemsize
        if send:
            self.meter.record(category, sent=nbytes, dense_sent=dense)
        else:
            self.meter.record(category, recv=nbytes, dense_recv=dense)

    # -- the choke point ---------------------------------------------------------------------

    def _communicate(
        self,
        *,
        tensor_send_next: Optional[torch.Tensor],
        tensor_send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape,
        wait_on_reqs: bool = True,
    ):
        config = self.config
        if config.variable_seq_lengths or config.mtp_standalone:
            recv_prev_shape, recv_next_shape = self._communicate_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next
            )
        else:
            recv_prev_shape = tensor_shape
            recv_next_shape = tensor_shape
        if (recv_prev or recv_next) and config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be provided to receive tensors")
        if (recv_prev or recv_next) and tensor_shape is None:
            raise RuntimeError(
                "tensor_shape must be specified to receive tensors. "
                "Common tensor_shape is (seq_length, micro_batch_size, hidden_size)"
            )
        # Sends: forward activations to the next stage, gradients to the previous one.
        send_next_payload = send_prev_payload = None
        if tensor_send_next is not None:
            send_next_payload = self._send_payload(
                tensor_send_next, "forward", "fwd_send", "pp-act"
            )
        if tensor_send_prev is not None:
            send_prev_payload = self._send_payload(
                tensor_send_prev, "backward", "bwd_send", "pp-grad"
            )

        # Receives: payload buffers of the codec's declared size.
        dtype = config.pipeline_dtype
        recv_prev_payload = recv_next_payload = None
        recv_prev_ctx = recv_next_ctx = None
        if recv_prev:
            recv_prev_ctx, recv_prev_payload = self._recv_buffer(
                recv_prev_shape, dtype, "forward", "fwd_recv"
            )
        if recv_next:
            recv_next_ctx, recv_next_payload = self._recv_buffer(
                recv_next_shape, dtype, "backward", "bwd_recv"
            )

        if config.use_ring_exchange_p2p:

            def p2p_func(**kwargs):
                torch.distributed.ring_exchange(**kwargs)
                return []

        elif config.batch_p2p_comm:
            assert wait_on_reqs
            p2p_func = _p2p._batched_p2p_ops
        else:
            p2p_func = _p2p._p2p_ops

        with ProcessGroupTrafficMeter.tagged("pp"):
            p2p_reqs = p2p_func(
                tensor_send_prev=send_prev_payload,
                tensor_recv_prev=recv_prev_payload,
                tensor_send_next=send_next_payload,
                tensor_recv_next=recv_next_payload,
                group=self.pp_group,
                prev_pipeline_rank=self.prev_rank,
                next_pipeline_rank=self.next_rank,
            )
        if config.use_ring_exchange_p2p or config.batch_p2p_comm:
            reqs: Any = list(p2p_reqs)
        else:
            reqs = dict(p2p_reqs)

        # Outputs: identity receives are the payload buffers themselves (megatron's exact
        # tensors); compressed receives are decoded after the transfer completed.
        tensor_recv_prev = tensor_recv_next = None
        finishers: Dict[str, Callable[[], None]] = {}
        if recv_prev:
            tensor_recv_prev = self._recv_output(
                "recv_prev",
                "pp-act",
                recv_prev_payload,
                recv_prev_ctx,
                recv_prev_shape,
                dtype,
                finishers,
            )
        if recv_next:
            tensor_recv_next = self._recv_output(
                "recv_next",
                "pp-grad",
                recv_next_payload,
                recv_next_ctx,
                recv_next_shape,
                dtype,
                finishers,
            )

        if wait_on_reqs and len(reqs) > 0:
            for req in reqs if isinstance(reqs, list) else reqs.values():
                req.wait()
            reqs = None
        if reqs is None or len(reqs) == 0:
            for finish in finishers.values():
                finish()
        elif finishers:
            reqs = self._wrap_async(reqs, finishers)

        if config.batch_p2p_comm and config.batch_p2p_sync:
            torch.cuda.synchronize()
        return tensor_recv_prev, tensor_recv_next, reqs

    def _send_payload(self, tensor, direction: str, counter: str, category: str):
        """The codec's payload for one send, its bytes recorded under ``category``."""
        payload = self.codec.encode(tensor, self._context(direction, counter))
        self._record(
            category,
            payload=payload,
            dense_shape=tensor.shape,
            dense_dtype=tensor.dtype,
            send=True,
        )
        return payload

    def _recv_buffer(self, shape, dtype, direction: str, counter: str):
        """Context and payload buffer for one receive (megatron's exact buffer for identity)."""
        ctx = self._context(direction, counter)
        pshape, pdtype = self.codec.payload_spec(tuple(shape), dtype, ctx)
        payload = torch.empty(
            pshape,
            requires_grad=isinstance(self.codec, IdentityCodec),
            device=torch.cuda.current_device(),
            dtype=pdtype,
        )
        return ctx, payload

    def _recv_output(self, key, category, payload, ctx, shape, dtype, finishers):
        """The tensor handed to the schedule for a receive; decoding is deferred to
        ``finishers[key]`` for compressed payloads."""
        self._record(category, payload=payload, dense_shape=shape, dense_dtype=dtype, send=False)
        if isinstance(self.codec, IdentityCodec):
            return payload
        out = torch.empty(shape, requires_grad=True, device=payload.device, dtype=dtype)
        finishers[key] = self._decoder(payload, ctx, out)
        return out

    def _decoder(self, payload: torch.Tensor, ctx: P2PContext, out: torch.Tensor):
        codec = self.codec

        def finish():
            with torch.no_grad():
                out.copy_(codec.decode(payload, ctx, tuple(out.shape), out.dtype))

        return finish

    @staticmethod
    def _wrap_async(reqs: Any, finishers: Dict[str, Callable[[], None]]) -> Any:
        """Attach decoders to the receive requests of an asynchronous transfer.

        Only megatron's ordered (non-batched) transport is asynchronous; it returns its
        requests keyed by "recv_prev" / "recv_next" / "send_*".
        """
        out = dict(reqs)
        for key, finish in finishers.items():
            out[key] = _DecodeOnWait(out[key], finish)
        return out
