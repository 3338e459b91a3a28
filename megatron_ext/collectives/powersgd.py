"""PowerSGD as a data-parallel gradient reducer: the peer baseline, PyTorch's algorithm.

What it does:
    The algorithm of PyTorch's ``powerSGD_hook`` (Vogels et al., 2019), on megatron-core's
    bucket groups and keyed by parameter FQN instead of bucket index. Per weight matrix
    ``M`` (``n x m``) whose rank-``r`` form is at least ``min_compression_rate`` times
    smaller, with ``M`` including the previous error when error feedback is on:

    1. ``P = M Q`` (with warm start ``Q`` is the previous step's, re-orthogonalized as
       PyTorch does); all-reduce all ``P`` together with the bucket's uncompressed tensors
       (1-D parameters, small matrices);
    2. orthogonalize each ``P`` (QR); ``Q = M^T P``; all-reduce all ``Q``;
    3. ``M_hat = P Q^T`` becomes the gradient; error ``e = M - M_hat / W`` under SUM
       (megatron pre-scales each rank's gradient by ``1/W``, so ``M_hat`` estimates the sum
       of the ranks' ``M``) and ``e = M - M_hat`` under AVG: either way the ranks' errors
       add up to the global residual, as in PyTorch's hook (which reduces unscaled
       gradients and averages).

    Before ``--powersgd-start-step`` the reduction is dense, as in PyTorch. Two collectives
    per bucket (a "multi-round" compressor): with ``overlap_grad_reduce`` the first one
    overlaps the backward pass and the rest runs when megatron waits on the handle. With
    the distributed optimizer the full ``M_hat`` is written (a superset of the shard).

    Matrices of one shape are compressed as one batch (PyTorch's
    ``batch_tensors_with_same_shape``): a batched matmul and a batched QR per shape, so the
    device ops per bucket do not grow with the number of layers.

State (rank-local, keyed by FQN): ``error/<fqn>`` and ``q/<fqn>`` (the warm start).

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional

import torch

from megatron_ext.collectives.configured import ConfiguredReducer
from megatron_ext.collectives.grad_reducer import (
    BucketGroupSpec,
    CompressedReduction,
    ParamSlice,
    _DenseReduction,
    scale_state,
)
from megatron_ext.compressors.lowrank import compressible, initial_q, orthogonalize
from megatron_ext.kernels.packing import Runs
from megatron_ext.kernels.powersgd import powersgd_compress, powersgd_decompress
from megatron_ext.options.powersgd import PowerSGDConfig
from megatron_ext.protocols import SAME, SUM

__all__ = ["PowerSGDReducer"]


@dataclass
class _Shape:
    """The bucket's weight matrices of one shape, compressed as one batch (as PyTorch's hook
    does with ``batch_tensors_with_same_shape``): one batched matmul and one batched QR per
    shape instead of per matrix."""

    slices: List[ParamSlice]
    rows: int
    cols: int
    q: torch.Tensor  # [B, cols, r]: the warm start
    offset: int  # of the batch in the bucket's packed buffers (M, the error)

    @property
    def numel(self) -> int:
        return len(self.slices) * self.rows * self.cols

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This batch's ``[B, rows, cols]`` of a bucket's packed buffer."""
        return flat[self.offset : self.offset + self.numel].view(-1, self.rows, self.cols)


@dataclass
class _Bucket:
    """A bucket's compressed matrices, shape by shape, packed back to back: ``M`` and the
    error are one flat fp32 buffer each (the fused kernels' unit of work)."""

    groups: List[_Shape]
    runs: Runs  # every matrix, batch after batch
    dims: List[int]  # (B, rows, cols) of each batch, flattened
    error: Optional[torch.Tensor]  # [total] fp32 with error feedback

    @property
    def layout(self) -> tuple:
        """The fused kernels' trailing arguments: the runs' ``table, chunk, starts, offsets,
        numels`` and ``dims``."""
        runs = self.runs
        return (runs.table, runs.chunk, runs.starts, runs.offsets, runs.numels, self.dims)


class _PowerSGDReduction(CompressedReduction):
    """PowerSGD on one bucket group: two all-reduces per bucket (P, then Q)."""

    def __init__(self, cfg: PowerSGDConfig, spec: BucketGroupSpec):
        self.cfg = cfg
        super().__init__(spec)
        self._dense = _DenseReduction(spec)
        self._staged: Optional[list] = None
        self.buckets: List[_Bucket] = []
        r = cfg.approx_rank
        for split in self.splits:
            device = split.view.grad.device
            by_shape: Dict[tuple, List[ParamSlice]] = {}
            for s in split.matrices:
                by_shape.setdefault((s.shape[0], s.numel // s.shape[0]), []).append(s)
            groups, offset = [], 0
            for (rows, cols), slices in by_shape.items():
                q = torch.stack([initial_q(cfg.seed, s.fqn, 0, cols, r, device) for s in slices])
                groups.append(_Shape(slices=slices, rows=rows, cols=cols, q=q, offset=offset))
                offset += groups[-1].numel
            ordered = [s for g in groups for s in g.slices]
            self.buckets.append(
                _Bucket(
                    groups=groups,
                    runs=Runs.build([s.start for s in ordered], [s.numel for s in ordered], device),
                    dims=[d for g in groups for d in (len(g.slices), g.rows, g.cols)],
                    error=(
                        torch.zeros(offset, dtype=torch.float32, device=device)
                        if cfg.error_feedback
                        else None
                    ),
                )
            )

    def compresses(self, s: ParamSlice) -> bool:
        if not s.is_matrix:
            return False
        rows = s.shape[0]
        return compressible(
            rows, s.numel // rows, self.cfg.approx_rank, self.cfg.min_compression_rate
        )

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        self._staged = None  # a replayed step starts again from the committed state
        if step < self.cfg.start_step:
            return self._dense.launch(step, force_all_reduce)
        reduce_scatter = self.spec.distributed_optimizer and not force_all_reduce
        works, pending = [], []
        self._staged = []
        for split, bucket in zip(self.splits, self.buckets):
            grad = split.view.grad
            ps, m, bad = [], None, []
            if bucket.groups:
                qs = [self._q(group, step, grad.device) for group in bucket.groups]
                # One fused kernel for the bucket: M = pack(G) + E (fp32, a fresh buffer that
                # becomes the new error in place), P = M Q per shape, whether M is finite.
                m, ps, m_bad = powersgd_compress(
                    grad,
                    bucket.error if bucket.error is not None else grad.new_empty(0),
                    qs,
                    *bucket.layout,
                )
                bad.append(m_bad)
            dense_part = self.pack_dense(split)
            flag = self.input_flag(grad.device, dense_part, known=bad)
            payload = torch.cat([p.reshape(-1) for p in ps] + [dense_part, flag])
            dense = self.dense_wire_bytes(split.view, force_all_reduce)
            works.append(self.all_reduce(payload, dense=dense))
            pending.append((split, bucket, m, payload))

        def then():
            for split, bucket, m, payload in pending:
                self._second_round(split, bucket, m, payload[:-1])
                self.poison(split.view, payload[-1:], reduce_scatter)

        return self.finish(works, then)

    def _q(self, group: _Shape, step: int, device: torch.device) -> torch.Tensor:
        if self.cfg.warm_start:
            # PyTorch re-orthogonalizes the previous step's (all-reduced) Q.
            return orthogonalize(group.q)
        return torch.stack(
            [
                initial_q(self.cfg.seed, s.fqn, step, group.cols, self.cfg.approx_rank, device)
                for s in group.slices
            ]
        )

    def _second_round(self, split, bucket: _Bucket, m, payload) -> None:
        grad = split.view.grad
        r = self.cfg.approx_rank
        offset = 0
        ps = []
        for group in bucket.groups:
            count = len(group.slices) * group.rows * r
            p = payload[offset : offset + count].view(len(group.slices), group.rows, r)
            offset += count
            ps.append(orthogonalize(p))
        self.unpack_dense(split, payload[offset:])
        if not bucket.groups:
            return
        q_payload = torch.cat(
            [
                torch.bmm(group.view(m).transpose(1, 2), p).reshape(-1)
                for group, p in zip(bucket.groups, ps)
            ]
        )
        # The dense equivalent was recorded with the first round.
        self.all_reduce(q_payload, dense=0, async_op=False)
        qs, offset = [], 0
        for group in bucket.groups:
            count = len(group.slices) * group.cols * r
            qs.append(q_payload[offset : offset + count].view(len(group.slices), group.cols, r))
            offset += count
        # ``approx`` is in the units of the reduction's result: the sum of the ranks' shares
        # with SUM (megatron pre-scales each share by 1/W), their mean with AVG. A rank's
        # error must stay in the units of its own input, so that the ranks' errors add up
        # (SUM) or average (AVG) to the global residual ``reduce(m) - approx``.
        # One fused kernel: M_hat = P Q^T into the bucket and, staged until end_step, the
        # new error in m's own buffer (m -= share * M_hat).
        powersgd_decompress(
            m, ps, qs, self.spec.share, bucket.error is not None, grad, *bucket.layout
        )
        error = m if bucket.error is not None else None
        self._staged.append((bucket, error, [q.clone() for q in qs]))

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and applied:
            for bucket, error, qs in staged:
                if error is not None:
                    bucket.error = error
                for group, q in zip(bucket.groups, qs):
                    group.q = q
        for bucket in self.buckets:
            scale_state(bucket.error, rescale)

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for bucket in self.buckets:
            for group in bucket.groups:
                error = group.view(bucket.error) if bucket.error is not None else None
                for i, s in enumerate(group.slices):
                    out[f"q/{s.fqn}"] = group.q[i].clone()
                    if error is not None:
                        out[f"error/{s.fqn}"] = error[i].clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for split, bucket in zip(self.splits, self.buckets):
            device = split.view.grad.device
            for group in bucket.groups:
                # A checkpoint may be loaded onto the CPU (map_location="cpu"): the warm
                # start belongs on the gradient's device.
                group.q = torch.stack(
                    [
                        state[f"q/{s.fqn}"].to(device=device, dtype=torch.float32)
                        for s in group.slices
                    ]
                )
                if bucket.error is not None:
                    error = group.view(bucket.error)
                    for i, s in enumerate(group.slices):
                        error[i].copy_(state[f"error/{s.fqn}"])


class PowerSGDReducer(ConfiguredReducer[PowerSGDConfig]):
    """PowerSGD gradient reduction (see module docstring); ``cfg`` is a
    :class:`~megatron_ext.options.powersgd.PowerSGDConfig`."""

    name = "powersgd"
    elastic_rules: ClassVar[Mapping[str, str]] = {"error": SUM, "q": SAME}
    supports = ("all_reduce", "reduce_scatter")
    reduction = _PowerSGDReduction
