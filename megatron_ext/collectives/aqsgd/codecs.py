"""AQ-SGD and DirectQ: pipeline activations as quantized per-sample deltas, or quantized.

What it does (Algorithm 1 of the AQ-SGD paper; ``docs/methods/aqsgd.md``):
    Both sides of a pipeline boundary keep ``m(xi)``, the last activation of training
    sample ``xi`` they agreed on, in :class:`SampleBuffers` (device memory, host memory
    read through pinned staging, or a memory-mapped file), one row per sample this
    data-parallel rank owns (fixed-sample mode: sample ``i`` always on rank ``i % dp``, slot
    ``i // dp``) holding this rank's tokens of it (:func:`local_rows`: the sequence divided
    by the context-parallel size, and by the tensor-parallel size with sequence
    parallelism) by the hidden size.

    * Forward, first visit of a sample: its activation travels in full precision and both
      sides store it (in the buffer dtype: by default the activations' own).
    * Forward, later visits: the sender quantizes ``delta = a - m`` to ``fw`` bits (fp16
      max-abs scale per sample and hidden channel over the sequence, per hidden channel over
      the micro-batch's samples and the sequence as the authors' code does, or per token;
      :func:`scale_groups`), both sides set
      ``m <- m + dequantize(codes)``; the receiver computes with that value. Sender and
      receiver run the same operations on the same codes, so their buffers stay
      bit-identical (the tests compare them element by element, bitwise).
    * Backward: activation gradients quantized directly to ``bw`` bits, no buffer.
    * Evaluation (forward only): activations travel in full precision, buffers untouched.
    * Warm-up (``--aqsgd-warmup-epochs``, the authors' first epoch; steps before
      ``warmup_steps``): activations and gradients travel in full precision and both
      buffers store every sample's exact activation (the authors' ``no_compress`` /
      ``no_decompress`` write the cache), so the first compressed step sends deltas
      against them. :func:`warmup_steps` converts epochs to steps.

    :class:`DirectQCodec` is the baseline that quantizes the activations themselves.

    Payloads are one uint8 tensor per transfer: the raw bytes of the first-visit samples'
    activations, then the packed codes of the other samples (each padded to a multiple of 8
    values), then their fp16 scales.
    Its size is a pure function of (shape, dtype, bits, which samples were visited), and both
    sides hold the same visit flags, so the receiver allocates it in advance.

    Buffer updates and visit flags are staged during a step and committed by
    :meth:`AQSGDCodec.end_step`, so a step that Megatron replays (its rerun state machine)
    never applies a delta twice, and a step whose optimizer update Megatron skipped is not
    committed at all. A sample whose value is non-finite (an inf or NaN activation) is
    never written, and a finite value beyond an explicitly chosen narrower buffer dtype
    (a bf16 70000 in fp16 buffers) is stored clamped to that dtype's range, never as inf.
    Both sides decide this from the same value, so their buffers stay bit-identical.

Why:
    The codecs are the protocol of a pipeline boundary (what is sent, what both sides
    write, when a step commits); the storage they write lives in ``buffers.py``, the
    sizes both sides compute alike in ``sizing.py``.

Kernels:
    Each chain is one fused op (``megatron_ext/kernels/quant.py``, eager or compiled by
    ``--fused-kernels``). Device buffers are passed whole with the revisits' slots: the
    sender's delta against its rows quantized and packed (``aqsgd_encode_rows``), the
    receiver's activations ``m + dequantize`` (``aqsgd_decode_rows``), and at the commit the
    buffer update ``m + dequantize`` with its finite / range checks applied to the rows in
    place (``aqsgd_commit_rows``, the same op on both sides of the boundary, so their
    buffers stay bit-identical compiled too): no gathered or staged copy of the rows, the
    step keeps only the payloads until its commit. Host and disk buffers read their rows
    first and stage the updated rows (``quant_pack``, ``aqsgd_decode_stage``). First visits
    are staged (``aqsgd_stage``); gradients and DirectQ's activations packed and unpacked
    (``quant_pack``, ``unpack_dequant``). Stochastic rounding hashes each value's index with
    a seed drawn on the device from the generator of (seed, step, microbatch, direction,
    stage).

Checkpoints:
    Default: the buffers are not saved; the state records that they must be rebuilt, and a
    resumed run starts every sample with a full-precision first visit again (never reusing
    stale buffers). ``--aqsgd-checkpoint-buffers`` saves them with the visit flags (per rank),
    so a resumed run continues bit-exactly; they are large (``samples x seq x hidden x
    bytes`` per boundary).

Constraints:
    torch only (torch.distributed only to read this rank's pipeline position and, once at
    set-up, to agree across ranks whether the buffers fit; never Megatron). Slot indices
    and visit flags live on the host (payload sizes must be known before a receive is
    posted). :meth:`AQSGDCodec.begin_step` builds every microbatch's indices of the step
    on the host and copies them to the device at once (one pinned, non-blocking copy);
    the commit writes device buffers on the device (a revisit's update keeps the current
    row where its value is not finite; first visits keep theirs with a ``where``; a slot
    written twice in one step has each update computed against the rows before the step,
    then written in order), and the host reads
    the per-sample finite flags (which decide the visit flags) at the next
    ``begin_step``, non-blocking on CUDA, waiting for them only when a sample of the
    commit comes back in the very next step. So a step announced by ``begin_step`` copies
    nothing between host and device in its microbatches and at its commit (device
    buffers; host and disk buffers copy rows by design). Needs the non-interleaved
    schedule and sample ids (the P2P seam refuses otherwise) and fixed-sample mode (refused
    at install, naming ``--fixed-samples``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_ext.collectives.aqsgd.buffers import SampleBuffers, _Plan, _Staged, buffer_nbytes
from megatron_ext.collectives.aqsgd.sizing import (
    _NAMES,
    _agree_on_fit,
    _quantized_nbytes,
    boundary_sides,
    local_rows,
    resolve_buffer_dtype,
    warmup_steps,
)
from megatron_ext.collectives.p2p import P2PCodec, P2PContext
from megatron_ext.compressors.seeding import device_generator
from megatron_ext.kernels.quant import (
    aqsgd_commit_rows,
    aqsgd_decode_rows,
    aqsgd_decode_stage,
    aqsgd_encode_rows,
    aqsgd_stage,
    draw_seed,
    quant_pack,
    unpack_dequant,
)
from megatron_ext.options.aqsgd import AQSGDConfig
from megatron_ext.options.base import ConfigError
from megatron_ext.protocols import RESET, SAME
from megatron_ext.state_plan import format_bytes  # ``1.50 GB`` style (torch-free, preflight)

__all__ = ["AQSGDCodec", "DirectQCodec"]


class _QuantizingCodec(P2PCodec):
    """What AQ-SGD and DirectQ share: options, generators, gradient quantization."""

    def __init__(self, cfg: AQSGDConfig, ctx: Any):
        self.cfg = cfg
        self.ctx = ctx
        self.stage = 0
        self.warmup_steps = 0
        """Training steps before this one travel uncompressed (set from
        ``--aqsgd-warmup-epochs`` at install; :func:`warmup_steps`)."""

    def warming_up(self, ctx: P2PContext) -> bool:
        """The transfer belongs to a training step of the uncompressed warm-up."""
        return not ctx.forward_only and ctx.step < self.warmup_steps

    def set_warmup(self, samples: Any) -> None:
        """Set :attr:`warmup_steps` from ``--aqsgd-warmup-epochs`` and ``samples`` (checked
        against its ``train_iters``) and publish it on the method's step clock, so the
        data-parallel exchange stays dense as long (the runtime reads the clock)."""
        self.warmup_steps = warmup_steps(self.cfg.warmup_epochs, samples)
        clock = getattr(self.ctx, "clock", None)
        if clock is not None:
            clock.dense_before_step = max(clock.dense_before_step, self.warmup_steps)

    def describe_warmup(self) -> str:
        """The warm-up in words (for the install log line)."""
        if not self.warmup_steps:
            return "no warm-up"
        return (
            f"warm-up {self.cfg.warmup_epochs} epoch(s) = {self.warmup_steps} steps "
            "uncompressed (pipeline and data-parallel)"
        )

    def _generator(
        self, ctx: P2PContext, direction: str, device: torch.device
    ) -> Optional[torch.Generator]:
        """Stochastic rounding's generator, on the device of the tensor it rounds (CUDA
        kernels refuse CPU generators); seeded from (seed, step, microbatch, direction,
        stage) whatever the call order."""
        if self.cfg.rounding != "stochastic":
            return None
        return device_generator(
            device, "aqsgd", self.cfg.seed, ctx.step, ctx.microbatch, direction, self.stage
        )

    def _seed(self, ctx: P2PContext, direction: str, device: torch.device):
        """Stochastic rounding's seed (None: nearest rounding), drawn on ``device`` from
        :meth:`_generator`'s generator: the fused kernels hash it with each element's index
        (``megatron_ext/kernels/quant.py``)."""
        if self.cfg.rounding != "stochastic":
            return None
        return draw_seed(device, self._generator(ctx, direction, device))

    # -- [s, b, h] tensors as per-sample [rows, cols] blocks --------------------------------
    #
    # On the wire, ``k`` quantized samples ``[k, rows, cols]`` are every sample's codes,
    # packed (each padded to a multiple of 8 values, so samples stay byte-aligned), then
    # the fp16 scales of :func:`scale_groups`: one fused op each way
    # (:func:`~megatron_ext.kernels.quant.quant_pack`, ``unpack_dequant``).

    def _grad_spec(self, shape, dtype, ctx) -> Tuple[Tuple[int, ...], torch.dtype]:
        if self.warming_up(ctx):
            return tuple(shape), dtype
        s, b, h = shape
        return (_quantized_nbytes(b, s, h, self.cfg.bw_bits, self.cfg.granularity),), torch.uint8

    def _encode_samples(self, x: torch.Tensor, bits: int, ctx: P2PContext) -> torch.Tensor:
        """The payload of ``x`` (``[s, b, h]``) quantized as ``b`` samples."""
        seed = self._seed(ctx, ctx.direction, x.device)
        return quant_pack(x.transpose(0, 1), None, seed, bits, self.cfg.granularity)

    def _decode_samples(self, payload, shape, dtype, bits: int) -> torch.Tensor:
        """Inverse of :meth:`_encode_samples`: ``[s, b, h]`` of ``dtype``."""
        s, b, h = shape
        out = unpack_dequant(payload, bits, self.cfg.granularity, b, s, h, dtype)
        return out.transpose(0, 1)

    def _encode_grad(self, g: torch.Tensor, ctx: P2PContext) -> torch.Tensor:
        if self.warming_up(ctx):
            return g
        return self._encode_samples(g, self.cfg.bw_bits, ctx)

    def _decode_grad(self, payload, shape, dtype, ctx) -> torch.Tensor:
        if self.warming_up(ctx):
            return payload
        return self._decode_samples(payload, shape, dtype, self.cfg.bw_bits)

    @staticmethod
    def _raw(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(torch.uint8).reshape(-1)

    @staticmethod
    def _from_raw(payload: torch.Tensor, shape, dtype) -> torch.Tensor:
        return payload.clone().view(dtype).view(shape)


class DirectQCodec(_QuantizingCodec):
    """Direct quantization of activations (``fw`` bits) and their gradients (``bw`` bits)."""

    name = "directq"
    elastic_rules: ClassVar[Mapping[str, str]] = {}

    def payload_spec(self, shape, dtype, ctx):
        if ctx.direction == "backward":
            return self._grad_spec(shape, dtype, ctx)
        if ctx.forward_only or self.warming_up(ctx):
            return tuple(shape), dtype
        s, b, h = shape
        return (_quantized_nbytes(b, s, h, self.cfg.fw_bits, self.cfg.granularity),), torch.uint8

    def encode(self, tensor, ctx):
        if ctx.direction == "backward":
            return self._encode_grad(tensor, ctx)
        if ctx.forward_only or self.warming_up(ctx):
            return tensor
        return self._encode_samples(tensor, self.cfg.fw_bits, ctx)

    def decode(self, payload, ctx, shape, dtype):
        if ctx.direction == "backward":
            return self._decode_grad(payload, shape, dtype, ctx)
        if ctx.forward_only or self.warming_up(ctx):
            return payload
        return self._decode_samples(payload, shape, dtype, self.cfg.fw_bits)


class AQSGDCodec(_QuantizingCodec):
    """AQ-SGD (see module docstring).

    Args:
        cfg: an :class:`~megatron_ext.options.aqsgd.AQSGDConfig`.
        ctx: the method's :class:`~megatron_ext.methods.registry.MethodContext`; its
            handles (model config, sample space) are read by :meth:`setup`.
    """

    name = "aqsgd"
    elastic_rules: ClassVar[Mapping[str, str]] = {"policy": SAME, "send": RESET, "recv": RESET}
    needs_sample_ids = True

    def __init__(self, cfg: AQSGDConfig, ctx: Any):
        super().__init__(cfg, ctx)
        self.send: Optional[SampleBuffers] = None
        self.recv: Optional[SampleBuffers] = None
        self._staged: Dict[str, List[_Staged]] = {"send": [], "recv": []}
        self._warned = {"nonfinite": False, "range": False}
        # (side, microbatch) -> the step's indices, prepared by begin_step.
        self._plans: Dict[Tuple[str, int], _Plan] = {}
        # Committed updates whose per-sample flags the host has not read yet, and the
        # copies of such flags on their way to the host: (entries, host flags, CUDA event).
        self._pending: List[Tuple[str, _Staged]] = []
        self._inflight: List[Tuple[List[Tuple[str, _Staged]], torch.Tensor, Any]] = []
        self.samples = None
        self.buffer_dtype: Optional[torch.dtype] = None

    # -- allocation -----------------------------------------------------------------------

    def setup(self, reserve_nbytes: int = 0) -> None:
        """Size, check and allocate the buffers (called when the runtime installs, on
        every rank: the fit decision is collective).

        Args:
            reserve_nbytes: device memory still to be taken before training settles (the
                optimizer state that is allocated lazily at the first step).
        """
        from megatron_ext.logging import print_rank_0

        handles = self.ctx.handles
        samples = handles.samples
        if samples is None or not samples.fixed:
            raise ConfigError(
                ["--p2p-compression", "--fixed-samples"],
                "aqsgd keeps an activation per training sample; it needs fixed-sample mode "
                "(--fixed-samples N), where a sample id means the same tokens in every epoch",
            )
        self.set_warmup(samples)
        config = handles.model_config
        pp = self.ctx.groups.pp
        rows = local_rows(samples.seq_length, config)
        device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        activation_dtype = getattr(config, "pipeline_dtype", None) or torch.float32
        sides, per_side = self.allocate(
            samples,
            rows,
            config.hidden_size,
            stage=torch.distributed.get_rank(pp),
            num_stages=torch.distributed.get_world_size(pp),
            device=device,
            file_tag=f"rank{torch.distributed.get_rank():05d}",
            activation_dtype=activation_dtype,
            reserve_nbytes=reserve_nbytes,
            group=torch.distributed.group.WORLD,
        )
        itemsize = torch.tensor([], dtype=self.buffer_dtype).element_size()
        print_rank_0(
            f"> aqsgd: buffers of {samples.num_slots} samples x {rows} tokens x "
            f"{config.hidden_size} x {itemsize} B ({_NAMES[self.buffer_dtype]}) = "
            f"{format_bytes(per_side)} per boundary side per rank ({', '.join(sides)} on "
            f"stage {self.stage}) in {self.cfg.buffer} memory; forward {self.cfg.fw_bits} "
            f"bits, backward {self.cfg.bw_bits} bits, scales per {self.cfg.granularity}, "
            f"{self.cfg.rounding} rounding, {self.describe_warmup()}"
        )

    def allocate(
        self,
        samples: Any,
        rows: int,
        cols: int,
        *,
        stage: int,
        num_stages: int,
        device: torch.device,
        file_tag: str = "rank00000",
        activation_dtype: torch.dtype = torch.float32,
        reserve_nbytes: int = 0,
        group: Any = None,
    ) -> Tuple[List[str], int]:
        """Check and allocate this stage's buffers; returns the sides and bytes per side.

        A stage keeps a "send" buffer unless it is the last and a "recv" buffer unless it
        is the first (the forward activations of the boundaries it touches).

        Args:
            samples: the :class:`~megatron_ext.methods.registry.SampleSpace` of training.
            rows: tokens per sample on this rank (:func:`local_rows`).
            cols: hidden size.
            stage: this rank's pipeline stage.
            num_stages: pipeline stages.
            device: where the activations live.
            file_tag: names this rank's files of disk buffers.
            activation_dtype: dtype of the activations sent (the buffer dtype of
                ``--aqsgd-buffer-dtype auto``).
            reserve_nbytes: memory of the device still to be taken by training (the
                optimizer state allocated at the first step).
            group: process group of every rank that allocates (None: decide alone).
                Every rank of it must call this: the buffers fit everywhere or every rank
                raises the same :class:`ConfigError`, so no rank is left waiting in a
                collective for ranks that stopped.
        """
        self.samples = samples
        self.stage = stage
        self.buffer_dtype = resolve_buffer_dtype(self.cfg.buffer_dtype, activation_dtype)
        where = self.cfg.buffer
        sides = boundary_sides(stage, num_stages)
        per_side = buffer_nbytes(samples.num_slots, rows, cols, self.buffer_dtype)
        problem = self._check_fits(per_side * len(sides), where, reserve_nbytes)
        _agree_on_fit(problem, group)
        for side in sides:
            path = None
            if where == "disk":
                path = os.path.join(self.cfg.buffer_dir, f"aqsgd-{file_tag}-{side}.bin")
            setattr(
                self,
                side,
                SampleBuffers(
                    samples.num_slots, rows, cols, self.buffer_dtype, where, device, path
                ),
            )
        return sides, per_side

    def _check_fits(
        self, nbytes: int, where: str, reserve_nbytes: int = 0
    ) -> Optional[Tuple[List[str], str]]:
        """This rank's reason the buffers cannot be allocated (flags, message), or None."""
        flag = ["--aqsgd-buffer", "--fixed-samples"]
        if where == "disk":
            directory = self.cfg.buffer_dir
            if not directory:
                return ["--aqsgd-buffer-dir"], "disk buffers need a directory"
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as err:
                return ["--aqsgd-buffer-dir"], f"cannot create {directory}: {err}"
            if not os.access(directory, os.W_OK):
                return ["--aqsgd-buffer-dir"], f"{directory} is not writable"
            free = shutil.disk_usage(directory).free
            if nbytes > free:
                return (
                    flag + ["--aqsgd-buffer-dir"],
                    f"the buffers need {format_bytes(nbytes)} but {directory} has "
                    f"{format_bytes(free)} free",
                )
            return None
        if where == "device" and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            place = "GPU memory"
        else:
            import psutil

            free = psutil.virtual_memory().available
            place = "host memory"
        # The optimizer state still to come lives next to device buffers (GPU memory, or
        # host memory on a CPU run); it is taken first. Keep room for training itself:
        # the buffers may take at most half of what is left.
        reserve = reserve_nbytes if where == "device" else 0
        if nbytes > max(free - reserve, 0) // 2:
            pending = (
                f", {format_bytes(reserve)} of which the optimizer state allocated at the "
                "first step will take"
                if reserve
                else ""
            )
            return (
                flag,
                f"the buffers need {format_bytes(nbytes)} but only {format_bytes(free)} of "
                f"{place} is free{pending} (at most half of the rest may go to buffers); use "
                "--aqsgd-buffer host or disk, or fewer --fixed-samples",
            )
        return None

    # -- the wire -------------------------------------------------------------------------

    def _side(self, ctx: P2PContext, sending: bool) -> SampleBuffers:
        # Forward activations go from this stage's "send" buffer to the next stage's "recv".
        buffers = self.send if sending else self.recv
        if buffers is None:
            raise RuntimeError("AQ-SGD buffers are not set up (runtime not installed?)")
        return buffers

    def _slots(self, ctx: P2PContext) -> torch.Tensor:
        """This rank's buffer slots of the transfer's samples (host int64)."""
        if ctx.sample_ids is None:
            raise RuntimeError("AQ-SGD needs the sample ids of every microbatch")
        return self.samples.slots(ctx.sample_ids).cpu()

    def _check_rows(self, buffers: SampleBuffers, s: int, h: int) -> None:
        if (s, h) != (buffers.rows, buffers.cols):
            raise RuntimeError(
                f"AQ-SGD buffers hold [{buffers.rows}, {buffers.cols}] per sample but the "
                f"pipeline sends [{s}, {h}] (sequence / --context-parallel-size / "
                "tensor-parallel size with --sequence-parallel, by hidden size)"
            )

    def _plan(self, side: str, ctx: P2PContext) -> _Plan:
        """The transfer's indices: prepared by :meth:`begin_step` (device copies made
        there), or, for a caller that did not announce the step, built here (small
        host-to-device copies of the indices)."""
        slots = self._slots(ctx)
        plan = self._plans.get((side, ctx.microbatch))
        if plan is not None and torch.equal(plan.slots, slots):
            return plan
        self._settle()
        return self._make_plans([(side, slots)], getattr(self, side).device)[0]

    def _make_plans(
        self, requests: List[Tuple[str, torch.Tensor]], device: torch.device
    ) -> List[_Plan]:
        """Plans of microbatches ``(side, host slots)``: every host index is built first,
        then all travel to ``device`` in one copy (pinned and non-blocking on CUDA)."""
        host: List[torch.Tensor] = []
        for side, slots in requests:
            flags = getattr(self, side).visited[slots]
            first, revisit = (~flags).nonzero().view(-1), flags.nonzero().view(-1)
            host += [first, revisit, slots[revisit], slots[first], slots]
        flat = torch.cat(host)
        if device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        plans, offset = [], 0
        for i, (_, slots) in enumerate(requests):
            views = []
            for part in host[5 * i : 5 * i + 5]:
                views.append(flat[offset : offset + part.numel()])
                offset += part.numel()
            plans.append(
                _Plan(
                    slots=slots,
                    num_first=host[5 * i].numel(),
                    revisit_slots=host[5 * i + 2],
                    first_slots=host[5 * i + 3],
                    first=views[0],
                    revisit=views[1],
                    revisit_index=views[2],
                    first_index=views[3],
                    index=views[4],
                )
            )
        return plans

    def payload_spec(self, shape, dtype, ctx):
        if ctx.direction == "backward":
            return self._grad_spec(shape, dtype, ctx)
        if ctx.forward_only:
            return tuple(shape), dtype
        # Called by the receiving side; the sender's visit flags are the same.
        plan = self._plan("recv", ctx)
        s, _, h = shape
        raw = s * h * torch.tensor([], dtype=dtype).element_size()
        if self.warming_up(ctx):
            return (plan.slots.numel() * raw,), torch.uint8
        revisits = plan.slots.numel() - plan.num_first
        delta = _quantized_nbytes(revisits, s, h, self.cfg.fw_bits, self.cfg.granularity)
        return (delta + plan.num_first * raw,), torch.uint8

    def _stage_rows(
        self, side: str, slots: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Stage full-precision ``rows`` (``[k, rows, cols]``, what both sides agree on: a
        first visit or a warm-up step) at ``slots`` for :meth:`end_step`: samples with a
        non-finite value are marked to be skipped, finite values beyond the buffer dtype's
        range are clamped to it (never stored as inf); one fused op."""
        buffers = getattr(self, side)
        values, finite, clamped = aqsgd_stage(rows, buffers.dtype)
        self._staged[side].append(_Staged(slots, values, finite, clamped, index))

    def _stage_revisits(
        self, side: str, plan: _Plan, payload: torch.Tensor, m: torch.Tensor, out_dtype=None
    ) -> Optional[torch.Tensor]:
        """Stage the revisits' new rows ``m + dequantize(payload)`` (``m``: their buffer
        rows) and return those values in ``out_dtype`` (the receiver's activations; None:
        nothing). Sender and receiver run this same op on the same bytes and rows, so their
        buffers stay bit-identical, compiled or eager."""
        values, finite, clamped, out = aqsgd_decode_stage(
            payload, m, self.cfg.fw_bits, self.cfg.granularity, out_dtype
        )
        self._staged[side].append(
            _Staged(plan.revisit_slots, values, finite, clamped, plan.revisit_index, exact=True)
        )
        return out if out_dtype is not None else None

    def _defer_revisits(self, side: str, plan: _Plan, payload: torch.Tensor) -> None:
        """Device buffers: keep the revisits' ``payload`` for :meth:`end_step`, which applies
        it to the buffer rows in place (one fused op, the same on both sides)."""
        self._staged[side].append(
            _Staged(plan.revisit_slots, None, None, None, plan.revisit_index, payload=payload)
        )

    def encode(self, tensor, ctx):
        if ctx.direction == "backward":
            return self._encode_grad(tensor, ctx)
        if ctx.forward_only:
            return tensor
        buffers = self._side(ctx, sending=True)
        plan = self._plan("send", ctx)
        x = tensor.detach().transpose(0, 1)  # [b, s, h]
        self._check_rows(buffers, x.shape[1], x.shape[2])
        if self.warming_up(ctx):
            # Every sample in full precision; both buffers store the exact activation.
            self._stage_rows("send", plan.slots, plan.index, x)
            self._prefetch_next(buffers, ctx)
            return self._raw(x)
        b = x.shape[0]
        parts: List[torch.Tensor] = []
        # Payload: the first visits' raw activations, then the revisits' quantized deltas.
        if plan.num_first:
            rows = x if plan.num_first == b else x.index_select(0, plan.first)
            parts.append(self._raw(rows))
            self._stage_rows("send", plan.first_slots, plan.first_index, rows)
        if plan.revisit_slots.numel():
            revisits = x if plan.num_first == 0 else x.index_select(0, plan.revisit)
            seed = self._seed(ctx, "forward", x.device)
            bits, granularity = self.cfg.fw_bits, self.cfg.granularity
            if buffers.where == "device":
                # The rows are read inside the kernel; the commit updates them in place.
                index = plan.revisit_index
                payload = aqsgd_encode_rows(revisits, buffers.table, index, seed, bits, granularity)
                self._defer_revisits("send", plan, payload)
            else:
                m = buffers.read(plan.revisit_slots, plan.revisit_index)
                payload = quant_pack(revisits, m, seed, bits, granularity)
                self._stage_revisits("send", plan, payload, m)
            parts.append(payload)
        self._prefetch_next(buffers, ctx)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def decode(self, payload, ctx, shape, dtype):
        if ctx.direction == "backward":
            return self._decode_grad(payload, shape, dtype, ctx)
        if ctx.forward_only:
            return payload
        buffers = self._side(ctx, sending=False)
        plan = self._plan("recv", ctx)
        s, b, h = shape
        self._check_rows(buffers, s, h)
        if self.warming_up(ctx):
            x = self._from_raw(payload, (b, s, h), dtype)
            self._stage_rows("recv", plan.slots, plan.index, x)
            self._prefetch_next(buffers, ctx)
            return x.transpose(0, 1)
        # One part only (all first visits, or all revisits: the steady state) is returned
        # as it is; a mix is assembled in one tensor.
        mixed = 0 < plan.num_first < b
        out = torch.empty(b, s, h, dtype=dtype, device=payload.device) if mixed else None
        offset = 0
        if plan.num_first:
            offset = plan.num_first * s * h * torch.tensor([], dtype=dtype).element_size()
            x = self._from_raw(payload[:offset], (plan.num_first, s, h), dtype)
            self._stage_rows("recv", plan.first_slots, plan.first_index, x)
            if mixed:
                out.index_copy_(0, plan.first, x)
            else:
                out = x
        if plan.revisit_slots.numel():
            deltas = payload[offset:]
            if buffers.where == "device":
                v = aqsgd_decode_rows(
                    deltas,
                    buffers.table,
                    plan.revisit_index,
                    self.cfg.fw_bits,
                    self.cfg.granularity,
                    dtype,
                )
                self._defer_revisits("recv", plan, deltas)
            else:
                m = buffers.read(plan.revisit_slots, plan.revisit_index)
                v = self._stage_revisits("recv", plan, deltas, m, dtype)
            if mixed:
                out.index_copy_(0, plan.revisit, v)
            else:
                out = v
        self._prefetch_next(buffers, ctx)
        return out.transpose(0, 1)

    def _prefetch_next(self, buffers: SampleBuffers, ctx: P2PContext) -> None:
        """Host and disk buffers: read the next microbatch's rows while this one computes."""
        if buffers.where == "device" or ctx.microbatch is None:
            return
        nxt = ctx.microbatch + 1
        if nxt < self.samples.num_microbatches and self._next_ids is not None:
            slots = self.samples.slots(self._next_ids(nxt)).cpu()
            buffers.prefetch(slots[buffers.visited[slots]])

    _next_ids = None

    def begin_step(self, sample_ids_fn) -> None:
        """A training step starts: read the previous step's visit flags (its commit left
        them on the device), prepare every microbatch's indices on both sides (one
        host-to-device copy for all of them), remember how to find the next microbatches'
        samples, and prefetch the first one's rows (host and disk buffers).

        Between this call and :meth:`end_step`, encode / decode / payload_spec of the
        announced microbatches copy nothing between host and device (device buffers)."""
        self._next_ids = sample_ids_fn
        self._plans.clear()
        # The flags copied at the previous begin_step have long arrived (they were queued
        # before that step's forward); this step's copy is only waited for when one of its
        # samples comes back in this very step.
        self._finish_copies()
        self._start_copy()
        if sample_ids_fn is None:
            self._finish_copies()
            return
        slots = [
            self.samples.slots(sample_ids_fn(mb)).cpu()
            for mb in range(self.samples.num_microbatches)
        ]
        if self._inflight:
            now = torch.cat(slots)
            late = torch.cat([st.slots for entries, _, _ in self._inflight for _, st in entries])
            if bool(torch.isin(now, late).any()):  # host tensors: no device sync
                self._finish_copies()
        sides = [side for side in ("send", "recv") if getattr(self, side) is not None]
        if not sides:
            return
        keys = [(side, mb) for side in sides for mb in range(len(slots))]
        device = getattr(self, sides[0]).device
        plans = self._make_plans([(side, slots[mb]) for side, mb in keys], device)
        self._plans.update(zip(keys, plans))
        for side in sides:
            buffers = getattr(self, side)
            if buffers.where != "device":
                buffers.prefetch(slots[0][buffers.visited[slots[0]]])

    def end_step(self, commit: bool = True) -> None:
        """Commit the step's buffer updates and visit flags, or drop them.

        Args:
            commit: False when the optimizer step was not taken (Megatron skipped it:
                non-finite gradients, fp16 loss-scale overflow): the buffers stay as they
                were before the step. Every rank gets the same answer from Megatron, so
                both sides of a boundary drop the same updates.

        Samples whose value was non-finite on arrival are never written (both sides saw
        the same value, so both skip them; a first visit stays unvisited and is sent in
        full precision again next time). Device buffers are written on the device (a
        ``where`` keeps the old row of a non-finite sample), and the per-sample flags the
        visit flags need are read by the host at the next :meth:`begin_step` (or at the
        next read of the flags): a step announced by ``begin_step`` never waits for the
        device here. Host and disk buffers, and a step not announced by ``begin_step``,
        read the flags here (one device-to-host copy).
        """
        staged = [(side, st) for side in ("send", "recv") for st in self._staged[side]]
        announced = bool(self._plans)
        self._plans.clear()
        for side in ("send", "recv"):
            self._staged[side].clear()
            if getattr(self, side) is not None:
                getattr(self, side).drop_prefetched()  # read before this commit: stale
        if not commit or not staged:
            return
        defer = announced
        # A side whose step wrote each slot once can store the revisits' rows as they are
        # (they hold the current row of a non-finite sample already); a slot written twice
        # in a step (fewer fixed samples than a step's batch) keeps the row-by-row choice
        # against what the earlier write left.
        distinct = {}
        for side in ("send", "recv"):
            slots = [st.slots for s, st in staged if s == side]
            if slots:
                flat = torch.cat(slots)  # host tensors: no device sync
                distinct[side] = torch.unique(flat).numel() == flat.numel()
        bits, granularity = self.cfg.fw_bits, self.cfg.granularity
        for side, st in staged:
            if st.payload is not None and not distinct[side]:
                # A slot written twice: each update is against the rows before the step, so
                # every deferred one is computed before anything is written.
                m = getattr(self, side).read(st.slots, st.index)
                st.values, st.finite, st.clamped, _ = aqsgd_decode_stage(
                    st.payload, m, bits, granularity, None
                )
                st.payload, st.exact = None, True
        for side, st in staged:
            buffers = getattr(self, side)
            if st.payload is not None:
                # Distinct slots: the update applied to the rows in place, in one fused op.
                st.finite, st.clamped = aqsgd_commit_rows(
                    st.payload, buffers.table, st.index, bits, granularity
                )
                st.written, st.payload = True, None
            elif buffers.where == "device":
                keep = None if st.exact and distinct[side] else st.finite
                buffers.write(st.slots, st.values, index=st.index, keep=keep)
                st.written, st.values = True, None  # only the flags are still needed
            else:
                defer = False
            self._pending.append((side, st))
        if not defer:
            self._settle()

    def _start_copy(self) -> None:
        """Start copying the committed steps' per-sample flags to the host (pinned and
        non-blocking on CUDA; elsewhere the copy is done when this returns)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        finite = torch.cat([st.finite for _, st in pending])
        clamped = torch.cat([st.clamped for _, st in pending])
        flags = torch.stack([finite, clamped])
        event = None
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))
        else:
            host = flags.cpu()
        self._inflight.append((pending, host, event))

    def _settle(self) -> None:
        """Read every committed step's per-sample flags on the host now."""
        self._start_copy()
        self._finish_copies()

    def _finish_copies(self) -> None:
        """Wait for the flag copies under way and apply them: set the visit flags of the
        finite samples, write the rows of host and disk buffers, and warn about skipped or
        clamped samples."""
        inflight, self._inflight = self._inflight, []
        for pending, flags, event in inflight:
            if event is not None:
                event.synchronize()
            self._apply_flags(pending, flags[0], flags[1])

    def _apply_flags(
        self, pending: List[Tuple[str, _Staged]], finite: torch.Tensor, clamped: torch.Tensor
    ) -> None:
        """Apply host flags ``finite`` / ``clamped`` (bool, one per sample of ``pending``)."""
        offset = 0
        for side, st in pending:
            buffers = getattr(self, side)
            k = st.slots.numel()
            keep = finite[offset : offset + k]
            offset += k
            if not st.written:
                if bool(keep.all()):
                    buffers.write(st.slots, st.values)
                elif bool(keep.any()):
                    rows = keep.nonzero().view(-1)
                    buffers.write(
                        st.slots[rows], st.values.index_select(0, rows.to(st.values.device))
                    )
            buffers.visited[st.slots[keep]] = True
        skipped, over = int((~finite).sum()), int(clamped.sum())
        if skipped and not self._warned["nonfinite"]:
            self._warned["nonfinite"] = True
            warnings.warn(
                f"aqsgd: {skipped} sample(s) arrived with non-finite activations; their "
                "buffers were left as before the step (warned once)"
            )
        if over and not self._warned["range"]:
            self._warned["range"] = True
            warnings.warn(
                f"aqsgd: {over} sample(s) hold activations beyond the range of the "
                f"{_NAMES[self.buffer_dtype]} buffers; they were stored clamped to it (the "
                "values sent were exact; later deltas carry the difference). Use "
                "--aqsgd-buffer-dtype matching the training dtype (warned once)"
            )

    # -- state ----------------------------------------------------------------------------

    def checksums(self) -> Dict[str, float]:
        """Checksum of each buffer (send / recv) of this rank."""
        self._settle()
        return {
            side: getattr(self, side).checksum() for side in ("send", "recv") if getattr(self, side)
        }

    def state_dict(self) -> Dict[str, Any]:
        self._settle()
        if not self.cfg.checkpoint_buffers:
            return {"policy": "rebuild"}
        out: Dict[str, Any] = {"policy": "saved"}
        for side in ("send", "recv"):
            buffers = getattr(self, side)
            if buffers is not None:
                out[f"{side}/rows"] = buffers.contents()
                out[f"{side}/visited"] = buffers.visited.clone()
        return out

    def _state_keys(self) -> set:
        """Keys of :meth:`state_dict` (without copying the buffers)."""
        keys = {"policy"}
        if self.cfg.checkpoint_buffers:
            for side in ("send", "recv"):
                if getattr(self, side) is not None:
                    keys |= {f"{side}/rows", f"{side}/visited"}
        return keys

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        expected = self._state_keys()
        if set(state) != expected:
            raise ValueError(
                f"AQ-SGD state keys differ: saved {sorted(state)}, expected {sorted(expected)}"
            )
        self._settle()
        self._plans.clear()
        for side in ("send", "recv"):
            buffers = getattr(self, side)
            if buffers is None:
                continue
            if state["policy"] == "saved":
                buffers.restore(state[f"{side}/rows"], state[f"{side}/visited"])
            else:
                # Never reuse stale buffers: every sample starts with a full-precision visit.
                buffers.reset()
