"""SEPARATE as a data-parallel gradient reducer (optionally G-SEPARATE).

What it does, per bucket and step (docs/methods/separate.md):
    1. ``h = g + e`` for the bucket's weight matrices, packed as rows of ``block_size``;
    2. ``P = H Omega`` with the step's common Gaussian block (one matmul);
    3. error feedback on the *local* estimate, ``e <- (1-beta) e + beta (h - P Omega^T/k)``,
       or ``e <- 0`` every ``reset_interval`` steps;
    4. one all-reduce of ``P`` together with the bucket's 1-D parameters (biases, norms),
       which travel densely;
    5. ``H_hat = P_avg Omega^T / k`` written back as the gradient. With the distributed
       optimizer only the rows that cover this rank's shard are reconstructed: the
       projection is linear, so the all-reduced coefficients determine every shard.

    With ``overlap_grad_reduce`` steps 1-4 run when megatron marks the bucket ready (inside
    backward) and step 5 when megatron waits on the handle, so communication overlaps the
    rest of the backward pass.

    The projection block is an orthonormalized common Gaussian block scaled by
    ``sqrt(block_size)`` (:func:`~megatron_ext.compressors.separate.projection_block`): the
    estimate stays unbiased, has variance ``(ratio - 1)|h|^2`` instead of the plain
    Gaussian's ``(c + 1)/k |h|^2``, and is exact at ratio 1. Error feedback uses
    ``beta = scale / ratio`` (``scale`` = 1 unless ``--separate-ef-beta`` is given): the
    local estimate misses ``h`` by about ``sqrt(ratio - 1)|h|``, so the recursion only stays
    bounded for ``beta < 2/ratio`` (config.py refuses larger values; the paper's 0.95
    diverged to NaN in our runs).

    G-SEPARATE (``--separate-adaptive``): every ``adapt_interval`` steps the packed ``h`` is
    also all-reduced densely, and per parameter the cosine between the compressed estimate
    and that dense average decides the next ratio and beta: above twice the cosine of a
    plain projection at that ratio (``1/sqrt(1+ratio)``: error feedback is working well)
    the ratio doubles and the beta scale grows by 2%; below the plain cosine the ratio
    halves and the scale shrinks by 2%; ratio within [min_ratio, max_ratio], scale within
    [0.5, 1.5] (so beta stays below 2/ratio). Our decision where the paper's Algorithm 3
    (step 6) is not legible; all ranks compute it from all-reduced values, so they agree
    without extra communication.

State (rank-local, keyed by parameter FQN): ``residual/<fqn>`` error buffers and, with
G-SEPARATE, ``ratio/<fqn>`` and ``beta_scale/<fqn>``.

Constraints:
    torch.distributed only; never imports Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.collectives.configured import ConfiguredReducer
from megatron_ext.collectives.grad_reducer import (
    BucketGroupSpec,
    CompressedReduction,
    ParamSlice,
    scale_state,
)
from megatron_ext.compressors.separate import (
    projection_block,
    random_projection_cosine,
    reconstruct,
)
from megatron_ext.kernels.packing import Region, Runs, gather
from megatron_ext.kernels.separate import separate_compress, separate_decompress
from megatron_ext.options.separate import SeparateConfig
from megatron_ext.protocols import SAME, SUM

__all__ = ["SeparateReducer", "projection_peak_bytes"]


@dataclass
class _Segment:
    """Weight matrices of one bucket compressed with the same ratio and beta."""

    index: int
    ratio: int
    beta: float
    slices: List[ParamSlice]
    pack_offsets: List[int]
    numel: int
    rows: int
    block: int
    key: str  # what the projection is keyed by: the bucket, or the parameter (blocks=layer)
    error: torch.Tensor  # [rows, block] fp32, zero past numel
    runs: Runs  # where the packed matrices live in the bucket (the fused kernels' layout)
    regions: Dict[Tuple[int, int], Region] = field(default_factory=dict)  # by bucket range


def projection_peak_bytes(block: int, num_projections: int) -> int:
    """Peak bytes of drawing one projection block (``c = block``, ``k = num_projections``):
    :func:`~megatron_ext.compressors.separate.projection_block` draws a float64 ``c x k``
    Gaussian (8 c k), takes its QR factors (Q: 8 c k, R: 8 k^2) and a scaled copy of Q
    (8 c k) before the fp32 result: ``24 c k + 8 k^2``."""
    c, k = int(block), int(num_projections)
    return 24 * c * k + 8 * k * k


class _SeparateReduction(CompressedReduction):
    """SEPARATE on one bucket group: per bucket, segments of matrices sharing a setting."""

    def __init__(self, cfg: SeparateConfig, spec: BucketGroupSpec):
        super().__init__(spec)
        self.cfg = cfg
        self._staged: Optional[Tuple[list, list]] = None
        self.block = cfg.block_size
        self.per_layer = cfg.blocks == "layer"
        self._omega_cache: Dict[Tuple[str, int, int, int], torch.Tensor] = {}
        self.ratio: Dict[str, int] = {}
        self.beta_scale: Dict[str, float] = {}
        for split in self.splits:
            for s in split.matrices:
                self.ratio[s.fqn] = cfg.ratio
                self.beta_scale[s.fqn] = cfg.beta_scale
        self.segments = [self._build_segments(split) for split in self.splits]
        self._check_projection_memory()
        self._check_projections_agree()

    def _build_segments(
        self, split: Any, residuals: Optional[Dict[str, torch.Tensor]] = None
    ) -> List[_Segment]:
        device = split.view.grad.device
        by_setting: Dict[Tuple[str, int, float], List[ParamSlice]] = {}
        for s in split.matrices:
            ratio = self.ratio[s.fqn]
            # blocks=layer: one segment per weight matrix, rows = the matrix's rows.
            owner = s.fqn if self.per_layer else ""
            by_setting.setdefault((owner, ratio, self.beta_scale[s.fqn] / ratio), []).append(s)
        segments = []
        for i, ((owner, ratio, beta), slices) in enumerate(sorted(by_setting.items())):
            block = slices[0].shape[-1] if owner else self.block
            if block % ratio:
                raise ValueError(
                    f"--separate-ratio {ratio} must divide the row length {block} of {owner} "
                    "(--separate-blocks layer projects each weight matrix row by row)"
                )
            offsets, total = [], 0
            for s in slices:
                offsets.append(total)
                total += s.numel
            rows = math.ceil(total / block)
            seg = _Segment(
                index=i,
                ratio=ratio,
                beta=beta,
                slices=slices,
                pack_offsets=offsets,
                numel=total,
                rows=rows,
                block=block,
                key=owner,
                error=torch.zeros(rows, block, dtype=torch.float32, device=device),
                runs=Runs.build([s.start for s in slices], [s.numel for s in slices], device),
            )
            if residuals:
                flat = seg.error.view(-1)
                for s, off in zip(slices, offsets):
                    if s.fqn in residuals:
                        flat[off : off + s.numel].copy_(residuals[s.fqn])
            segments.append(seg)
        return segments

    def _omega(self, key: str, seg: _Segment, step: int) -> torch.Tensor:
        """The segment's projection at ``step``: drawn afresh every ``refresh_interval``
        steps (0: at every error reset), keyed by the bucket or, with blocks=layer, by the
        parameter name."""
        every = self.cfg.refresh_interval or self.cfg.reset_interval
        draw = step // every
        name = seg.key or f"{key}#{seg.index}"
        cache_key = (name, seg.ratio, seg.block, draw)
        omega = self._omega_cache.get(cache_key)
        if omega is None:
            omega = projection_block(
                self.cfg.seed,
                draw,
                f"{name}/r{seg.ratio}",
                seg.block,
                seg.block // seg.ratio,
                device=self.spec.buckets[0].grad.device,
            )
            if every > 1:  # keep only the current draw of each segment
                for stale in [k for k in self._omega_cache if k[:3] == cache_key[:3]]:
                    del self._omega_cache[stale]
                self._omega_cache[cache_key] = omega
        return omega

    def _check_projection_memory(self) -> None:
        """Refuse projections that cannot be drawn on this device (a block size of 10^6
        asked numpy-sized 500 GB of host memory) before the first one is drawn: the largest
        segment's :func:`projection_peak_bytes`, plus the fp32 blocks kept between draws
        when the projection is reused (``--separate-refresh-interval`` other than 1)."""
        from megatron_ext.options.base import ConfigError
        from megatron_ext.validation import agreed_minimum, available_memory, format_bytes

        sizes = [
            (seg.block, seg.block // self._smallest_ratio(seg))
            for segments in self.segments
            for seg in segments
        ]
        device = self.spec.buckets[0].grad.device
        if device.type == "meta":
            return  # no memory behind it (the strict-device tests)
        need = max((projection_peak_bytes(c, k) for c, k in sizes), default=0)
        if self.cfg.refresh_interval != 1:
            need += sum(4 * c * k for c, k in sizes)
        # The smallest over the group (collective): every rank refuses alike, in one line.
        free = agreed_minimum(available_memory(device), self.spec.group, device)
        if free is not None and need > free:
            c, k = max(sizes, key=lambda ck: ck[0] * ck[1])
            raise ConfigError(
                ["--separate-block-size", "--separate-ratio"],
                f"drawing SEPARATE's random projection of a {c} x {k} block needs about "
                f"{format_bytes(need)} of {device.type} memory (24 c k + 8 k^2 bytes for "
                f"c = block size, k = c / ratio), more than the {format_bytes(free)} "
                "available; use a smaller --separate-block-size (default 256)",
            )

    def _smallest_ratio(self, seg: _Segment) -> int:
        """The smallest ratio ``seg`` may take (G-SEPARATE halves ratios down to its min)."""
        if self.cfg.adaptive:
            return min(seg.ratio, self.cfg.min_ratio)
        return seg.ratio

    def _check_projections_agree(self) -> None:
        """One cheap all-reduce: every rank must generate bit-identical projections."""
        sums = [
            self._omega(split.view.key, seg, 0).double().sum()
            for split, segments in zip(self.splits, self.segments)
            for seg in segments
        ]
        if not sums:
            return
        local = torch.stack(sums)
        lo, hi = local.clone(), local.clone()
        group = self.spec.group
        with ProcessGroupTrafficMeter.untracked():
            torch.distributed.all_reduce(lo, torch.distributed.ReduceOp.MIN, group)
            torch.distributed.all_reduce(hi, torch.distributed.ReduceOp.MAX, group)
        if not torch.equal(lo, hi) or not torch.equal(lo, local):
            raise RuntimeError(
                "SEPARATE: data-parallel ranks generated different random projections "
                "(different --separate-seed, torch version or bucket layout?)"
            )

    # -- the reduction ---------------------------------------------------------------------

    def _is_adapt_step(self, step: int) -> bool:
        return self.cfg.adaptive and step > 0 and step % self.cfg.adapt_interval == 0

    def launch(self, step: int, force_all_reduce: bool = False) -> Optional[Any]:
        self._staged = None  # a replayed step starts again from the committed state
        reset = step % self.cfg.reset_interval == 0
        adapt = self._is_adapt_step(step)
        reduce_scatter = self.spec.distributed_optimizer and not force_all_reduce
        works, pending, staged = [], [], []
        for index, (split, segments) in enumerate(zip(self.splits, self.segments)):
            grad = split.view.grad
            payloads, omegas, dense_h, bad = [], [], [], []
            for seg in segments:
                omega = self._omega(split.view.key, seg, step)
                if adapt:
                    dense_h.append(self._packed(grad, seg).add_(seg.error).view(-1)[: seg.numel])
                # One fused kernel: h = pack(g) + e, P = h Omega, whether h is finite, and
                # the error this step commits if it is applied (staged until end_step; the
                # committed error changes only there).
                stage = not (reset or seg.beta == 0.0)
                r = seg.runs
                p, seg_bad, new_error = separate_compress(
                    grad,
                    seg.error,
                    omega,
                    r.table,
                    r.chunk,
                    seg.numel,
                    r.starts,
                    r.offsets,
                    r.numels,
                    seg.beta,
                    stage,
                )
                staged.append((seg, new_error if stage else None))
                bad.append(seg_bad)
                payloads.append(p.reshape(-1))
                omegas.append(omega)
            dense_part = self.pack_dense(split)
            # This rank's input: every segment's h = g + e (checked by its kernel) and the
            # leftovers (packed in fp32: the cast keeps NaN and Inf), one pass each.
            flag = self.input_flag(grad.device, dense_part, known=bad)
            payloads += [dense_part, flag]
            dense = self.dense_wire_bytes(split.view, force_all_reduce)
            payload = torch.cat(payloads)
            works.append(self.all_reduce(payload, dense=dense))
            pending.append((index, payload, omegas, dense_h))
        self._staged = (staged, pending if adapt else [])

        def then():
            for index, payload, omegas, dense_h in pending:
                self._decompress(index, payload[:-1], omegas, reduce_scatter)
                self.poison(self.splits[index].view, payload[-1:], reduce_scatter)

        return self.finish(works, then)

    def end_step(self, applied: bool, rescale: Optional[torch.Tensor] = None) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and applied:
            errors, adapting = staged
            for seg, new_error in errors:
                if new_error is None:  # an error reset (or beta 0)
                    seg.error.zero_()
                    continue
                # update_error's e <- (1 - beta) e + beta (h - H_hat_local), computed at
                # launch by the compress kernel: committing it is a swap.
                seg.error = new_error
            for index, payload, omegas, dense_h in adapting:
                self._adapt(index, payload, omegas, dense_h)
        for segments in self.segments:
            for seg in segments:
                scale_state(seg.error, rescale)

    def _decompress(self, index: int, payload, omegas, reduce_scatter: bool) -> None:
        split, segments = self.splits[index], self.segments[index]
        grad = split.view.grad
        lo, hi = split.view.region(reduce_scatter)
        offset = 0
        for seg, omega in zip(segments, omegas):
            k = seg.block // seg.ratio
            p = payload[offset : offset + seg.rows * k].view(seg.rows, k)
            offset += seg.rows * k
            # Packed interval of this segment that falls inside [lo, hi): its rows only are
            # reconstructed (the projection is linear, so the reduced coefficients
            # determine every shard).
            region = seg.regions.get((lo, hi))
            if region is None:
                region = seg.regions[(lo, hi)] = seg.runs.region(lo, hi)
            if region.last <= region.first:
                continue
            r0, r1 = region.first // seg.block, math.ceil(region.last / seg.block)
            separate_decompress(
                p[r0:r1],
                omega,
                grad,
                seg.runs.table,
                seg.runs.chunk,
                r0 * seg.block,
                region.first,
                region.last,
                region.dst,
                region.src,
                region.lengths,
            )
        self.unpack_dense(split, payload[offset:])

    @staticmethod
    def _packed(grad: torch.Tensor, seg: _Segment) -> torch.Tensor:
        """The segment's packed gradient, ``[rows, block]`` fp32 (G-SEPARATE's reference)."""
        r = seg.runs
        flat = gather(
            grad, seg.rows * seg.block, seg.numel, r.table, r.chunk, r.starts, r.offsets, r.numels
        )
        return flat.view(seg.rows, seg.block)

    # -- G-SEPARATE ------------------------------------------------------------------------

    def _adapt(self, index: int, payload, omegas, dense_h) -> None:
        """Cosine of estimate vs dense average per parameter -> next ratio and beta."""
        if not dense_h:
            return
        split, segments = self.splits[index], self.segments[index]
        reference = torch.cat(dense_h)
        # Measurement overhead: no dense counterpart in megatron.
        self.all_reduce(reference, dense=0, async_op=False)
        offset = ref_offset = 0
        residuals: Dict[str, torch.Tensor] = {}
        changed = False
        allowed = [r for r in range(1, self.block + 1) if self.block % r == 0]
        for seg, omega in zip(segments, omegas):
            k = seg.block // seg.ratio
            p = payload[offset : offset + seg.rows * k].view(seg.rows, k)
            offset += seg.rows * k
            estimate = reconstruct(p, omega).view(-1)
            flat_err = seg.error.view(-1)
            cosines = [
                torch.nn.functional.cosine_similarity(
                    estimate[off : off + s.numel],
                    reference[ref_offset + off : ref_offset + off + s.numel],
                    dim=0,
                    eps=1e-30,
                )
                for s, off in zip(seg.slices, seg.pack_offsets)
            ]
            # One host sync per segment, not per parameter.
            for s, off, cos in zip(seg.slices, seg.pack_offsets, torch.stack(cosines).tolist()):
                ratio, scale = self.ratio[s.fqn], self.beta_scale[s.fqn]
                if cos >= 2.0 * random_projection_cosine(ratio):
                    new_ratio, new_scale = ratio * 2, min(scale * 1.02, 1.5)
                elif cos < random_projection_cosine(ratio):
                    new_ratio, new_scale = max(ratio // 2, 1), max(scale * 0.98, 0.5)
                else:
                    new_ratio, new_scale = ratio, scale
                new_ratio = min(max(new_ratio, self.cfg.min_ratio), self.cfg.max_ratio)
                new_ratio = max(r for r in allowed if r <= new_ratio)
                if (new_ratio, new_scale) != (ratio, scale):
                    changed = True
                self.ratio[s.fqn], self.beta_scale[s.fqn] = new_ratio, new_scale
                residuals[s.fqn] = flat_err[off : off + s.numel].clone()
            ref_offset += seg.numel
        if changed:
            self.segments[index] = self._build_segments(split, residuals)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for segments in self.segments:
            for seg in segments:
                flat = seg.error.view(-1)
                for s, off in zip(seg.slices, seg.pack_offsets):
                    out[f"residual/{s.fqn}"] = flat[off : off + s.numel].clone()
                    if self.cfg.adaptive:
                        out[f"ratio/{s.fqn}"] = self.ratio[s.fqn]
                        out[f"beta_scale/{s.fqn}"] = self.beta_scale[s.fqn]
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        residuals = {}
        for key, value in state.items():
            role, fqn = key.split("/", 1)
            if role == "residual":
                residuals[fqn] = value
            elif role == "ratio":
                self.ratio[fqn] = int(value)
            elif role == "beta_scale":
                self.beta_scale[fqn] = float(value)
        self.segments = [self._build_segments(split, residuals) for split in self.splits]


class SeparateReducer(ConfiguredReducer[SeparateConfig]):
    """SEPARATE gradient reduction (see module docstring); ``cfg`` is a
    :class:`~megatron_ext.options.separate.SeparateConfig`."""

    name = "separate"
    elastic_rules: ClassVar[Mapping[str, str]] = {
        "residual": SUM,
        "ratio": SAME,
        "beta_scale": SAME,
    }
    supports = ("all_reduce", "reduce_scatter")
    reduction = _SeparateReduction
