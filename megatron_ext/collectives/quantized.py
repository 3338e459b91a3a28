"""k-bit quantized data-parallel gradient exchange with worker and server error compensation.

What it does (quantized gradients with worker and server error compensation, the exchange
of Tang et al. 2021 applied to the raw gradient under unmodified Adam; not QuantizedAdam,
which the AQ-SGD paper pairs with AQ-SGD, section 4.3: error compensation does not carry
through Adam's variance, so QuantizedAdam freezes the variance and exchanges the momentum,
``--grad-compression quantized-adam``, which reuses this collective), per bucket:

    1. worker: ``h = g + e_w`` (this rank's gradient share plus its worker error); the flat
       bucket is split into one partition per rank (megatron's shards with the distributed
       optimizer, equal chunks otherwise), each quantized to ``bits`` bits in rows of
       ``block_size`` values with one fp16 max-abs scale per row;
       ``e_w <- h - dequantize(q(h))``;
    2. one all-to-all: partition ``j`` of every rank goes to rank ``j``, which dequantizes
       the ``W`` copies and reduces them (sum under megatron's default pre-scaled SUM, mean
       under AVG);
    3. server (the partition's owner): ``s = r + e_s``, quantized again,
       ``e_s <- s - dequantize(q(s))``; one all-gather of the quantized partitions gives
       every rank the whole reduced bucket. With the distributed optimizer a rank needs
       only its own shard: step 3 is skipped and the exact reduction ``r`` is written.

    Both errors are fed back, so nothing is lost: the ranks' worker errors add up (SUM) or
    average (AVG) to the global residual of step 1, the server error carries step 3's.
    Every rank applies the same dequantized values (from the all-gather), so replicas agree.

    With ``overlap_grad_reduce`` the all-to-all runs asynchronously when the bucket is ready
    and the rest when megatron waits on it.

State (rank-local, keyed by FQN): ``worker_error/<fqn>`` and ``server_error/<fqn>`` (the
part of a parameter inside this rank's partition; zeros elsewhere).

Constraints:
    torch.distributed only (all_to_all, all_gather); never imports Megatron.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.collectives.grad_reducer import (
    BoundReduction,
    BucketGroupSpec,
    BucketView,
    CompressedReduction,
    GradReducer,
    ParamSlice,
    all_gather_flat,
    scale_state,
)
from megatron_ext.compressors.quantize import (
    Quantized,
    dequantize,
    pack_bits,
    packed_nbytes,
    quantize,
    unpack_bits,
)

__all__ = ["QuantizedReducer"]


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[W', n]`` uint8 columns reinterpreted as ``dtype``: a fresh copy, since a slice of the
    payload starts at a byte offset that need not be a multiple of the item size (one
    partition, ``W' = 1``, makes the slice contiguous at that offset, and ``view`` refuses)."""
    return raw.clone(memory_format=torch.contiguous_format).view(dtype)


class QuantizedReducer(GradReducer):
    """k-bit quantized gradient exchange (see module docstring).

    Args:
        cfg: a :class:`~megatron_ext.methods.quantized.QuantizedConfig`.
    """

    name = "quantized"
    supports = ("all_reduce", "reduce_scatter")

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg

    def _bind(self, spec: BucketGroupSpec) -> BoundReduction:
        return _QuantizedReduction(self.cfg, spec)


class _Partitioned:
    """One bucket cut into ``W`` partitions, each padded to whole rows of ``block``."""

    def __init__(self, view: BucketView, size: int, block: int):
        n = view.grad.numel()
        self.n = n
        # Megatron's shards with the distributed optimizer; equal chunks otherwise.
        self.part = view.shard[1] - view.shard[0] if view.shard is not None else -(-n // size)
        self.rows = -(-self.part // block)
        self.padded = self.rows * block
        self.size = size
        self.block = block

    def spread(self, flat: torch.Tensor) -> torch.Tensor:
        """``[W, padded]`` fp32: partition ``j`` in row ``j`` (zeros past the bucket).

        A fixed number of device ops whatever ``W`` (no loop over ranks)."""
        out = torch.zeros(self.size, self.padded, dtype=torch.float32, device=flat.device)
        if self.part == self.padded:
            out.view(-1)[: self.n].copy_(flat)
        else:
            chunks = torch.zeros(self.size * self.part, dtype=torch.float32, device=flat.device)
            chunks[: self.n].copy_(flat)
            out[:, : self.part].copy_(chunks.view(self.size, self.part))
        return out

    def gather(self, parts: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`spread`: the flat ``[n]`` bucket."""
        return parts[:, : self.part].reshape(-1)[: self.n]


class _QuantizedReduction(CompressedReduction):
    """The quantized exchange of one bucket group (see module docstring)."""

    def __init__(self, cfg: Any, spec: BucketGroupSpec):
        super().__init__(spec)
        self.cfg = cfg
        self.layouts = [_Partitioned(v, spec.group_size, cfg.block_size) for v in spec.buckets]
        device = spec.buckets[0].grad.device if spec.buckets else None
        self.worker_error = [
            torch.zeros(p.size, p.padded, dtype=torch.float32, device=device) for p in self.layouts
        ]
        self.server_error = [
            torch.zeros(p.padded, dtype=torch.float32, device=device) for p in self.layouts
        ]
        # New errors of the step in flight, committed by end_step: ("worker"|"server", i).
        self._staged: Dict[Tuple[str, int], torch.Tensor] = {}

    def compresses(self, s: ParamSlice) -> bool:
        return True  # the whole flat bucket, vectors included

    # -- quantized partitions on the wire -------------------------------------------------
    #
    # Every rank's partitions are packed, sent, unpacked and dequantized as one batch of
    # ``W`` rows: the device ops per bucket do not grow with the data-parallel size.

    def _code_width(self, layout: _Partitioned) -> int:
        """Codes per partition as packed: ``padded``, rounded up to whole groups of 8 below
        8 bits (what :func:`pack_bits` does to a single partition)."""
        if self.cfg.bits == 8:
            return layout.padded
        return -(-layout.padded // 8) * 8

    def _partition_nbytes(self, layout: _Partitioned) -> int:
        return packed_nbytes(layout.padded, self.cfg.bits) + 2 * layout.rows

    def _quantize_rows(self, x: torch.Tensor, layout: _Partitioned) -> Quantized:
        """``x``: ``[..., padded]`` -> codes per row of ``block``, one fp16 scale a row."""
        shape = x.shape[:-1] + (layout.rows, layout.block)
        return quantize(
            x.reshape(shape),
            self.cfg.bits,
            granularity="token",
            stochastic=self.cfg.rounding == "stochastic",
        )

    def _pack_rows(self, q: Quantized, layout: _Partitioned, extra=None) -> torch.Tensor:
        """``[W', nbytes]`` uint8: each partition's packed codes then its fp16 scales (and
        ``extra`` bytes per row, if given), for ``q`` of ``W'`` partitions."""
        codes = q.codes.reshape(-1, layout.padded)
        width = self._code_width(layout)
        if width != layout.padded:
            codes = torch.nn.functional.pad(codes, (0, width - layout.padded))
        count = codes.shape[0]
        parts = [
            pack_bits(codes, self.cfg.bits).view(count, -1),
            q.scales.contiguous().view(torch.uint8).reshape(count, -1),
        ]
        if extra is not None:
            parts.append(extra)
        return torch.cat(parts, dim=1)

    def _unpack_rows(self, payload: torch.Tensor, layout: _Partitioned) -> torch.Tensor:
        """Dequantized ``[W', padded]`` fp32 of ``[W', nbytes]`` partition bytes."""
        count = payload.shape[0]
        ncodes = packed_nbytes(layout.padded, self.cfg.bits)
        width = self._code_width(layout)
        codes = unpack_bits(payload[:, :ncodes].reshape(-1), self.cfg.bits, count * width)
        codes = codes.view(count, width)[:, : layout.padded]
        scales = _bytes_as(payload[:, ncodes : ncodes + 2 * layout.rows], torch.float16)
        q = Quantized(
            codes=codes.reshape(count, layout.rows, layout.block),
            scales=scales.reshape(count, layout.rows, 1),
            bits=self.cfg.bits,
        )
        return dequantize(q).reshape(count, layout.padded)

    # -- the reduction --------------------------------------------------------------------

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        self._staged = {}  # a replayed step starts again from the committed state
        spec = self.spec
        reduce_scatter = spec.distributed_optimizer and not force_all_reduce
        works, pending = [], []
        for i, (view, layout) in enumerate(zip(spec.buckets, self.layouts)):
            h = layout.spread(view.grad.float())
            if self.cfg.error_feedback:
                h += self.worker_error[i]
            q = self._quantize_rows(h, layout)
            if self.cfg.error_feedback:
                self._staged[("worker", i)] = h - dequantize(q).reshape(h.shape)
            # This rank's input flag rides along with every partition (4 bytes each).
            flag = self.input_flag(h.device, h).expand(layout.size).contiguous()
            send = self._pack_rows(q, layout, flag.view(torch.uint8).view(layout.size, 4))
            send = send.reshape(-1)
            recv = torch.empty_like(send)
            with ProcessGroupTrafficMeter.tagged("dp-grad"):
                work = torch.distributed.all_to_all_single(
                    recv, send, group=spec.group, async_op=spec.async_op
                )
            self.record("all_to_all", send, self.dense_wire_bytes(view, force_all_reduce))
            works.append(work)
            pending.append((i, view, layout, recv))

        def then():
            for i, view, layout, recv in pending:
                self._finish(i, view, layout, recv, reduce_scatter)

        return self.finish(works, then)

    def _finish(self, i, view: BucketView, layout: _Partitioned, recv, reduce_scatter) -> None:
        spec = self.spec
        nbytes = self._partition_nbytes(layout)
        rows = recv.view(layout.size, nbytes + 4)
        flag = _bytes_as(rows[:, nbytes:], torch.float32).sum().reshape(1)
        r = self._unpack_rows(rows[:, :nbytes], layout).sum(dim=0)
        if spec.op != torch.distributed.ReduceOp.SUM:
            r /= layout.size
        me = spec.group_rank
        lo, hi = me * layout.part, min((me + 1) * layout.part, layout.n)
        if reduce_scatter:
            # Only this rank's shard is needed: the exact reduction of the workers' codes.
            view.grad[lo:hi].copy_(r[: hi - lo])
            self.poison(view, flag, reduce_scatter)
            return
        s = r + self.server_error[i] if self.cfg.error_feedback else r
        q = self._quantize_rows(s, layout)
        if self.cfg.error_feedback:
            self._staged[("server", i)] = s - dequantize(q).reshape(-1)
        mine = self._pack_rows(q, layout).reshape(-1)
        gathered = torch.empty(layout.size * nbytes, dtype=torch.uint8, device=mine.device)
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            all_gather_flat(gathered, mine, spec.group)
        # Dense equivalent recorded with the all-to-all.
        self.record("all_gather", gathered, 0)
        parts = self._unpack_rows(gathered.view(layout.size, nbytes), layout)
        view.grad.copy_(layout.gather(parts).to(view.grad.dtype))
        self.poison(view, flag, reduce_scatter)

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        staged, self._staged = self._staged, {}
        if applied:
            for (kind, i), error in staged.items():
                (self.worker_error if kind == "worker" else self.server_error)[i] = error
        for error in self.worker_error + self.server_error:
            scale_state(error, rescale)

    # -- state ----------------------------------------------------------------------------

    def _slices(self) -> List[Tuple[int, ParamSlice, _Partitioned]]:
        return [
            (i, s, layout)
            for i, (view, layout) in enumerate(zip(self.spec.buckets, self.layouts))
            for s in view.params
        ]

    def state_dict(self) -> Dict[str, Any]:
        if not self.cfg.error_feedback:
            return {}
        out: Dict[str, Any] = {}
        for i, s, layout in self._slices():
            flat_w = layout.gather(self.worker_error[i])
            out[f"worker_error/{s.fqn}"] = flat_w[s.start : s.end].clone()
            server = torch.zeros(layout.size, layout.padded, device=flat_w.device)
            server[self.spec.group_rank] = self.server_error[i]
            out[f"server_error/{s.fqn}"] = layout.gather(server)[s.start : s.end].clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for i, view, layout in [
            (i, v, l) for i, (v, l) in enumerate(zip(self.spec.buckets, self.layouts))
        ]:
            flat_w = torch.zeros(layout.n, device=view.grad.device)
            flat_s = torch.zeros(layout.n, device=view.grad.device)
            for s in view.params:
                flat_w[s.start : s.end] = state[f"worker_error/{s.fqn}"]
                flat_s[s.start : s.end] = state[f"server_error/{s.fqn}"]
            self.worker_error[i] = layout.spread(flat_w)
            self.server_error[i] = layout.spread(flat_s)[self.spec.group_rank].clone()
