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

Kernels: the worker side (spread, error, quantize, new error, this rank's non-finite input
flag, pack), the server side (unpack, reduce, error, quantize, pack) and the final decode
into the gradient are one fused op each (``megatron_ext/kernels/quant.py``, eager or
compiled by ``--fused-kernels``). Stochastic rounding (``--quantized-rounding stochastic``)
hashes each value's index with a seed drawn on the device from its default generator.

Constraints:
    torch.distributed only (all_to_all, all_gather); never imports Megatron.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.collectives.configured import ConfiguredReducer
from megatron_ext.collectives.grad_reducer import (
    BucketGroupSpec,
    BucketView,
    CompressedReduction,
    ParamSlice,
    all_gather_flat,
    scale_state,
)
from megatron_ext.kernels.quant import (
    _spread as _spread_rows,
    draw_seed,
    quantized_decode_rows_into,
    quantized_encode_rows,
    quantized_reduce_rows,
    rows_layout,
)
from megatron_ext.options.quantized import QuantizedConfig
from megatron_ext.protocols import PARTITION, SUM

__all__ = ["QuantizedReducer"]


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

        A fixed number of device ops whatever ``W`` (no loop over ranks); the fused worker
        kernel (:func:`~megatron_ext.kernels.quant.quantized_encode_rows`) spreads the same
        way."""
        return _spread_rows(flat, self.size, self.part, self.padded)

    def gather(self, parts: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`spread`: the flat ``[n]`` bucket."""
        return parts[:, : self.part].reshape(-1)[: self.n]


class _QuantizedReduction(CompressedReduction):
    """The quantized exchange of one bucket group (see module docstring)."""

    def __init__(self, cfg: QuantizedConfig, spec: BucketGroupSpec):
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
    # Every rank's partitions are quantized, packed, sent, unpacked and dequantized as one
    # batch of ``W`` rows, each chain one fused op (megatron_ext/kernels/quant.py): the
    # device ops per bucket do not grow with the data-parallel size.

    def _partition_nbytes(self, layout: _Partitioned) -> int:
        """Wire bytes of one partition (codes and scales, without the sender's flag)."""
        return rows_layout(layout.part, layout.block, self.cfg.bits)[3]

    def _seed(self, device: torch.device) -> Optional[torch.Tensor]:
        """Stochastic rounding's seed, drawn on ``device`` from its default generator."""
        return draw_seed(device) if self.cfg.rounding == "stochastic" else None

    def encode_worker(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s worker side: ``[W, nbytes + 4]`` bytes to send (partition ``j`` to
        rank ``j``, this rank's input flag last); stages the new worker error."""
        view, layout, cfg = self.spec.buckets[i], self.layouts[i], self.cfg
        error = self.worker_error[i] if cfg.error_feedback else None
        send, new_error = quantized_encode_rows(
            view.grad,
            error,
            self._seed(view.grad.device),
            cfg.bits,
            layout.block,
            layout.size,
            layout.part,
        )
        if cfg.error_feedback:
            self._staged[("worker", i)] = new_error
        return send

    def reduce_server(
        self, i: int, rows: torch.Tensor, requantize: bool
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``i``'s server side of the received ``[W, nbytes + 4]`` rows: the summed
        input flags and either the exact reduction ``r`` (``[padded]`` fp32) or, with
        ``requantize``, this rank's partition quantized again (``[nbytes]`` bytes, the new
        server error staged)."""
        layout, cfg = self.layouts[i], self.cfg
        mean = self.spec.op != torch.distributed.ReduceOp.SUM
        error = self.server_error[i] if cfg.error_feedback and requantize else None
        seed = self._seed(rows.device) if requantize else None
        flag, r, mine, new_error = quantized_reduce_rows(
            rows, error, seed, cfg.bits, layout.block, layout.part, mean, requantize
        )
        if error is not None:
            self._staged[("server", i)] = new_error
        return flag, mine if requantize else r

    def decode_gathered(self, i: int, gathered: torch.Tensor) -> None:
        """Write the all-gathered ``[W, nbytes]`` partitions into bucket ``i``'s gradient."""
        view, layout = self.spec.buckets[i], self.layouts[i]
        quantized_decode_rows_into(
            gathered, self.cfg.bits, layout.block, layout.part, out=view.grad
        )

    # -- the reduction --------------------------------------------------------------------

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        self._staged = {}  # a replayed step starts again from the committed state
        spec = self.spec
        reduce_scatter = spec.distributed_optimizer and not force_all_reduce
        works, pending = [], []
        for i, (view, layout) in enumerate(zip(spec.buckets, self.layouts)):
            send = self.encode_worker(i).reshape(-1)
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
        if reduce_scatter:
            # Only this rank's shard is needed: the exact reduction of the workers' codes.
            flag, r = self.reduce_server(i, rows, requantize=False)
            me = spec.group_rank
            lo, hi = me * layout.part, min((me + 1) * layout.part, layout.n)
            view.grad[lo:hi].copy_(r[: hi - lo])
            self.poison(view, flag, reduce_scatter)
            return
        flag, mine = self.reduce_server(i, rows, requantize=True)
        gathered = torch.empty(layout.size * nbytes, dtype=torch.uint8, device=mine.device)
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            all_gather_flat(gathered, mine, spec.group)
        # Dense equivalent recorded with the all-to-all.
        self.record("all_gather", gathered, 0)
        self.decode_gathered(i, gathered.view(layout.size, nbytes))
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


class QuantizedReducer(ConfiguredReducer[QuantizedConfig]):
    """k-bit quantized gradient exchange (see module docstring); ``cfg`` is a
    :class:`~megatron_ext.options.quantized.QuantizedConfig`."""

    name = "quantized"
    elastic_rules: ClassVar[Mapping[str, str]] = {"worker_error": SUM, "server_error": PARTITION}
    supports = ("all_reduce", "reduce_scatter")
    reduction = _QuantizedReduction
