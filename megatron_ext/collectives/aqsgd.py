"""AQ-SGD and DirectQ: pipeline activations as quantized per-sample deltas, or quantized.

What it does (aq-sgd.txt Algorithm 1; methods.md section 4):
    Both sides of a pipeline boundary keep ``m(xi)``, the last activation of training
    sample ``xi`` they agreed on, in :class:`SampleBuffers` (device memory, pinned host
    memory or a memory-mapped file), one row ``[seq, hidden]`` per sample this data-parallel
    rank owns (fixed-sample mode: sample ``i`` always on rank ``i % dp``, slot ``i // dp``).

    * Forward, first visit of a sample: its activation travels in full precision and both
      sides store it (rounded to the buffer dtype).
    * Forward, later visits: the sender quantizes ``delta = a - m`` to ``fw`` bits (fp16
      max-abs scale per hidden channel over the sequence, or per token), both sides set
      ``m <- m + dequantize(codes)``; the receiver computes with that value. Sender and
      receiver run the same operations on the same codes, so their buffers stay
      bit-identical (a test checks their checksums).
    * Backward: activation gradients quantized directly to ``bw`` bits, no buffer.
    * Evaluation (forward only): activations travel in full precision, buffers untouched.

    :class:`DirectQCodec` is the baseline that quantizes the activations themselves.

    Payloads are one uint8 tensor per transfer: the raw bytes of the first-visit samples'
    activations, then the packed codes of the other samples (each padded to a multiple of 8
    values), then their fp16 scales.
    Its size is a pure function of (shape, dtype, bits, which samples were visited), and both
    sides hold the same visit flags, so the receiver allocates it in advance.

    Buffer updates and visit flags are staged during a step and committed by
    :meth:`AQSGDCodec.end_step`, so a step that Megatron replays (its rerun state machine)
    never applies a delta twice.

Checkpoints:
    Default: the buffers are not saved; the state records that they must be rebuilt, and a
    resumed run starts every sample with a full-precision first visit again (never reusing
    stale buffers). ``--aqsgd-checkpoint-buffers`` saves them with the visit flags (per rank),
    so a resumed run continues bit-exactly; they are large (``samples x seq x hidden x
    bytes`` per boundary).

Constraints:
    torch only (no torch.distributed besides reading this rank's pipeline position, never
    Megatron). Needs the non-interleaved schedule and sample ids (the P2P seam refuses
    otherwise) and fixed-sample mode (refused at install, naming ``--fixed-samples``).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron_ext.collectives.p2p import P2PCodec, P2PContext
from megatron_ext.compressors.quantize import (
    Quantized,
    dequantize,
    pack_bits,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack_bits,
)
from megatron_ext.compressors.seeding import seeded_generator
from megatron_ext.config import ConfigError

__all__ = ["SampleBuffers", "AQSGDCodec", "DirectQCodec", "buffer_nbytes", "format_bytes"]

_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


def format_bytes(n: float) -> str:
    """``1.50 GB`` style."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.2f} TB"


def buffer_nbytes(num_slots: int, rows: int, cols: int, dtype: torch.dtype) -> int:
    """Bytes of one boundary's buffer."""
    return num_slots * rows * cols * torch.tensor([], dtype=dtype).element_size()


class SampleBuffers:
    """``m(xi)`` of one side of one boundary: ``[num_slots, rows, cols]`` plus visit flags.

    Args:
        num_slots: samples this rank owns.
        rows: sequence length (of this rank's shard).
        cols: hidden size.
        dtype: storage dtype.
        where: "device", "host" (pinned when CUDA exists) or "disk" (memory-mapped file).
        device: where rows are used.
        path: the file of "disk" buffers.
    """

    def __init__(
        self,
        num_slots: int,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        where: str,
        device: torch.device,
        path: Optional[str] = None,
    ):
        self.num_slots, self.rows, self.cols, self.dtype = num_slots, rows, cols, dtype
        self.where, self.device, self.path = where, device, path
        self.visited = torch.zeros(num_slots, dtype=torch.bool)
        self.row_bytes = rows * cols * torch.tensor([], dtype=dtype).element_size()
        self._memmap = None
        self._data: Optional[torch.Tensor] = None
        if where == "device":
            self._data = torch.zeros(num_slots, rows, cols, dtype=dtype, device=device)
        elif where == "host":
            self._data = torch.zeros(
                num_slots, rows, cols, dtype=dtype, pin_memory=torch.cuda.is_available()
            )
        elif where == "disk":
            self._memmap = np.memmap(
                path, mode="w+", dtype=np.uint8, shape=(num_slots, self.row_bytes)
            )
        else:
            raise ValueError(f"unknown buffer place {where!r}")
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._prefetched: Dict[Tuple[int, ...], concurrent.futures.Future] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows."""
        return self.num_slots * self.row_bytes

    def _load(self, slots: Tuple[int, ...]) -> torch.Tensor:
        index = list(slots)
        if self._memmap is not None:
            raw = torch.from_numpy(np.ascontiguousarray(self._memmap[index]))
            rows = raw.view(self.dtype).view(len(index), self.rows, self.cols)
        else:
            rows = self._data[index]
        return rows.to(self.device, non_blocking=True)

    def prefetch(self, slots: torch.Tensor) -> None:
        """Start reading ``slots`` in the background (host and disk buffers)."""
        if self.where == "device":
            return
        key = tuple(int(s) for s in slots)
        if key in self._prefetched:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._prefetched[key] = self._executor.submit(self._load, key)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` on the device, ``[k, rows, cols]`` (a prefetched read if any)."""
        key = tuple(int(s) for s in slots)
        future = self._prefetched.pop(key, None)
        return future.result() if future is not None else self._load(key)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` (``[k, rows, cols]``, the storage dtype) at ``slots``."""
        index = [int(s) for s in slots]
        if self._memmap is not None:
            raw = values.detach().to("cpu").contiguous().view(torch.uint8).reshape(len(index), -1)
            self._memmap[index] = raw.numpy()
        else:
            self._data[index] = values.to(self._data.device)

    def checksum(self) -> float:
        """Sum of the stored values and visit flags (for the bit-identity tests)."""
        if self._memmap is not None:
            data = torch.from_numpy(np.asarray(self._memmap)).view(self.dtype)
        else:
            data = self._data
        return float(data.double().sum()) + float(self.visited.sum())

    def contents(self) -> torch.Tensor:
        """All rows, ``[num_slots, rows, cols]`` on the CPU (for checkpoints)."""
        if self._memmap is not None:
            self._memmap.flush()
            raw = torch.from_numpy(np.array(self._memmap))
            return raw.view(self.dtype).view(self.num_slots, self.rows, self.cols)
        return self._data.detach().to("cpu").clone()

    def restore(self, rows: torch.Tensor, visited: torch.Tensor) -> None:
        """Set every row and visit flag (from :meth:`contents` of a checkpoint)."""
        if tuple(rows.shape) != (self.num_slots, self.rows, self.cols):
            raise ValueError(
                f"AQ-SGD buffer of shape {tuple(rows.shape)} does not fit "
                f"{(self.num_slots, self.rows, self.cols)}"
            )
        self.write(torch.arange(self.num_slots), rows.to(self.dtype))
        self.visited.copy_(visited)

    def reset(self) -> None:
        """Forget every sample: the next visit of each is a full-precision first visit."""
        self.visited.zero_()
        self._prefetched.clear()


@dataclass
class _Staged:
    """A step's pending update of one buffer."""

    slots: torch.Tensor
    values: torch.Tensor


def _segment_nbytes(rows: int, cols: int, bits: int, granularity: str) -> int:
    """Wire bytes of one quantized ``[rows, cols]`` sample: packed codes and fp16 scales."""
    scales = 1
    for d in scale_shape((rows, cols), granularity):
        scales *= d
    return packed_nbytes(rows * cols, bits) + 2 * scales


class _QuantizingCodec(P2PCodec):
    """What AQ-SGD and DirectQ share: options, generators, gradient quantization."""

    def __init__(self, cfg: Any, ctx: Any):
        self.cfg = cfg
        self.ctx = ctx
        self.stage = 0

    def _generator(self, ctx: P2PContext, direction: str) -> Optional[torch.Generator]:
        if self.cfg.rounding != "stochastic":
            return None
        return seeded_generator(
            "aqsgd", self.cfg.seed, ctx.step, ctx.microbatch, direction, self.stage
        )

    def _quantize(self, x: torch.Tensor, bits: int, gen) -> Quantized:
        return quantize(
            x,
            bits,
            granularity=self.cfg.granularity,
            stochastic=self.cfg.rounding == "stochastic",
            generator=gen,
        )

    # -- [s, b, h] tensors as per-sample [rows, cols] blocks --------------------------------

    def _pack_samples(self, q: Quantized) -> torch.Tensor:
        """Quantized samples ``[k, rows, cols]`` on the wire: every sample's codes, packed
        (each padded to a multiple of 8 values, so samples stay byte-aligned), then every
        sample's fp16 scales."""
        k = q.codes.shape[0]
        codes = q.codes.reshape(k, -1)
        pad = (-codes.shape[1]) % 8
        if pad:
            codes = torch.cat([codes, codes.new_zeros(k, pad)], dim=1)
        scales = q.scales.contiguous().view(torch.uint8).reshape(-1)
        return torch.cat([pack_bits(codes, q.bits), scales])

    def _unpack_samples(
        self, payload: torch.Tensor, k: int, rows: int, cols: int, bits: int
    ) -> torch.Tensor:
        """Inverse of :meth:`_pack_samples`: ``[k, rows, cols]`` dequantized (fp32)."""
        n = rows * cols
        padded = n + (-n) % 8
        ncodes = k * packed_nbytes(padded, bits)
        codes = unpack_bits(payload[:ncodes], bits, k * padded).view(k, padded)[:, :n]
        sshape = (k,) + scale_shape((rows, cols), self.cfg.granularity)
        nscales = 2 * int(np.prod(sshape))
        scales = payload[ncodes : ncodes + nscales].clone().view(torch.float16).view(sshape)
        q = Quantized(codes=codes.reshape(k, rows, cols), scales=scales, bits=bits)
        return dequantize(q)

    def _grad_spec(self, shape, dtype) -> Tuple[Tuple[int, ...], torch.dtype]:
        s, b, h = shape
        return (b * _segment_nbytes(s, h, self.cfg.bw_bits, self.cfg.granularity),), torch.uint8

    def _encode_grad(self, g: torch.Tensor, ctx: P2PContext) -> torch.Tensor:
        gen = self._generator(ctx, "backward")
        return self._pack_samples(self._quantize(g.transpose(0, 1), self.cfg.bw_bits, gen))

    def _decode_grad(self, payload, shape, dtype) -> torch.Tensor:
        s, b, h = shape
        out = self._unpack_samples(payload, b, s, h, self.cfg.bw_bits)
        return out.transpose(0, 1).to(dtype)

    @staticmethod
    def _raw(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(torch.uint8).reshape(-1)

    @staticmethod
    def _from_raw(payload: torch.Tensor, shape, dtype) -> torch.Tensor:
        return payload.clone().view(dtype).view(shape)


class DirectQCodec(_QuantizingCodec):
    """Direct quantization of activations (``fw`` bits) and their gradients (``bw`` bits)."""

    name = "directq"

    def payload_spec(self, shape, dtype, ctx):
        if ctx.direction == "backward":
            return self._grad_spec(shape, dtype)
        if ctx.forward_only:
            return tuple(shape), dtype
        s, b, h = shape
        return (b * _segment_nbytes(s, h, self.cfg.fw_bits, self.cfg.granularity),), torch.uint8

    def encode(self, tensor, ctx):
        if ctx.direction == "backward":
            return self._encode_grad(tensor, ctx)
        if ctx.forward_only:
            return tensor
        gen = self._generator(ctx, "forward")
        return self._pack_samples(self._quantize(tensor.transpose(0, 1), self.cfg.fw_bits, gen))

    def decode(self, payload, ctx, shape, dtype):
        if ctx.direction == "backward":
            return self._decode_grad(payload, shape, dtype)
        if ctx.forward_only:
            return payload
        s, b, h = shape
        return self._unpack_samples(payload, b, s, h, self.cfg.fw_bits).transpose(0, 1).to(dtype)


class AQSGDCodec(_QuantizingCodec):
    """AQ-SGD (see module docstring).

    Args:
        cfg: an :class:`~megatron_ext.methods.aqsgd.AQSGDConfig`.
        ctx: the method's :class:`~megatron_ext.methods.registry.MethodContext`; its
            handles (model config, sample space) are read by :meth:`setup`.
    """

    name = "aqsgd"
    needs_sample_ids = True

    def __init__(self, cfg: Any, ctx: Any):
        super().__init__(cfg, ctx)
        self.send: Optional[SampleBuffers] = None
        self.recv: Optional[SampleBuffers] = None
        self._staged: Dict[str, List[_Staged]] = {"send": [], "recv": []}
        self.samples = None

    # -- allocation -----------------------------------------------------------------------

    def setup(self) -> None:
        """Size, check and allocate the buffers (called when the runtime installs)."""
        from megatron_ext.logging import print_rank_0

        handles = self.ctx.handles
        samples = handles.samples
        if samples is None or not samples.fixed:
            raise ConfigError(
                ["--p2p-compression", "--fixed-samples"],
                "aqsgd keeps an activation per training sample; it needs fixed-sample mode "
                "(--fixed-samples N), where a sample id means the same tokens in every epoch",
            )
        config = handles.model_config
        pp = self.ctx.groups.pp
        rows = samples.seq_length
        tp = getattr(config, "tensor_model_parallel_size", 1)
        if getattr(config, "sequence_parallel", False):
            rows //= tp  # the local shard of the sequence
        device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        sides, per_side = self.allocate(
            samples,
            rows,
            config.hidden_size,
            stage=torch.distributed.get_rank(pp),
            num_stages=torch.distributed.get_world_size(pp),
            device=device,
            file_tag=f"rank{torch.distributed.get_rank():05d}",
        )
        itemsize = torch.tensor([], dtype=_DTYPES[self.cfg.buffer_dtype]).element_size()
        print_rank_0(
            f"> aqsgd: buffers of {samples.num_slots} samples x {rows} tokens x "
            f"{config.hidden_size} x {itemsize} B = {format_bytes(per_side)} per boundary side "
            f"per rank ({', '.join(sides)} on stage {self.stage}) in {self.cfg.buffer} memory; "
            f"forward {self.cfg.fw_bits} bits, backward {self.cfg.bw_bits} bits, scales per "
            f"{self.cfg.granularity}, {self.cfg.rounding} rounding"
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
    ) -> Tuple[List[str], int]:
        """Check and allocate this stage's buffers; returns the sides and bytes per side.

        A stage keeps a "send" buffer unless it is the last and a "recv" buffer unless it
        is the first (the forward activations of the boundaries it touches).
        """
        self.samples = samples
        self.stage = stage
        dtype = _DTYPES[self.cfg.buffer_dtype]
        where = self.cfg.buffer
        sides = []
        if stage < num_stages - 1:
            sides.append("send")
        if stage > 0:
            sides.append("recv")
        per_side = buffer_nbytes(samples.num_slots, rows, cols, dtype)
        self._check_fits(per_side * len(sides), where)
        for side in sides:
            path = None
            if where == "disk":
                path = os.path.join(self.cfg.buffer_dir, f"aqsgd-{file_tag}-{side}.bin")
            setattr(
                self, side, SampleBuffers(samples.num_slots, rows, cols, dtype, where, device, path)
            )
        return sides, per_side

    def _check_fits(self, nbytes: int, where: str) -> None:
        flag = ["--aqsgd-buffer", "--fixed-samples"]
        if where == "disk":
            directory = self.cfg.buffer_dir
            if not directory:
                raise ConfigError("--aqsgd-buffer-dir", "disk buffers need a directory")
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as err:
                raise ConfigError("--aqsgd-buffer-dir", f"cannot create {directory}: {err}")
            if not os.access(directory, os.W_OK):
                raise ConfigError("--aqsgd-buffer-dir", f"{directory} is not writable")
            free = shutil.disk_usage(directory).free
            if nbytes > free:
                raise ConfigError(
                    flag + ["--aqsgd-buffer-dir"],
                    f"the buffers need {format_bytes(nbytes)} but {directory} has "
                    f"{format_bytes(free)} free",
                )
            return
        if where == "device" and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            place = "GPU memory"
        else:
            import psutil

            free = psutil.virtual_memory().available
            place = "host memory"
        # Keep room for training itself: the buffers may take at most half of what is free.
        if nbytes > free // 2:
            raise ConfigError(
                flag,
                f"the buffers need {format_bytes(nbytes)} but only {format_bytes(free)} of "
                f"{place} is free (at most half may go to buffers); use --aqsgd-buffer host "
                "or disk, or fewer --fixed-samples",
            )

    # -- the wire -------------------------------------------------------------------------

    def _side(self, ctx: P2PContext, sending: bool) -> SampleBuffers:
        # Forward activations go from this stage's "send" buffer to the next stage's "recv".
        buffers = self.send if sending else self.recv
        if buffers is None:
            raise RuntimeError("AQ-SGD buffers are not set up (runtime not installed?)")
        return buffers

    def _visited(self, buffers: SampleBuffers, ctx: P2PContext) -> torch.Tensor:
        if ctx.sample_ids is None:
            raise RuntimeError("AQ-SGD needs the sample ids of every microbatch")
        return buffers.visited[self.samples.slots(ctx.sample_ids)]

    def _forward_nbytes(self, shape, dtype, visited: torch.Tensor) -> int:
        s, b, h = shape
        raw = s * h * torch.tensor([], dtype=dtype).element_size()
        delta = _segment_nbytes(s, h, self.cfg.fw_bits, self.cfg.granularity)
        return sum(delta if v else raw for v in visited.tolist())

    def payload_spec(self, shape, dtype, ctx):
        if ctx.direction == "backward":
            return self._grad_spec(shape, dtype)
        if ctx.forward_only:
            return tuple(shape), dtype
        # Called by the receiving side; the sender's visit flags are the same.
        visited = self._visited(self._side(ctx, sending=False), ctx)
        return (self._forward_nbytes(shape, dtype, visited),), torch.uint8

    def encode(self, tensor, ctx):
        if ctx.direction == "backward":
            return self._encode_grad(tensor, ctx)
        if ctx.forward_only:
            return tensor
        buffers = self._side(ctx, sending=True)
        slots = self.samples.slots(ctx.sample_ids)
        visited = buffers.visited[slots]
        first, revisit = (~visited).nonzero().view(-1), visited.nonzero().view(-1)
        x = tensor.detach().transpose(0, 1)  # [b, s, h]
        new = torch.empty(x.shape, dtype=buffers.dtype, device=x.device)
        parts: List[torch.Tensor] = []
        # Payload: the first visits' raw activations, then the revisits' quantized deltas.
        if first.numel():
            parts.append(self._raw(x[first]))
            new[first] = x[first].to(buffers.dtype)
        if revisit.numel():
            m = buffers.read(slots[revisit]).float()
            q = self._quantize(
                x[revisit].float() - m, self.cfg.fw_bits, self._generator(ctx, "forward")
            )
            parts.append(self._pack_samples(q))
            new[revisit] = (m + dequantize(q)).to(buffers.dtype)
        self._staged["send"].append(_Staged(slots, new))
        self._prefetch_next(buffers, ctx)
        return torch.cat(parts)

    def decode(self, payload, ctx, shape, dtype):
        if ctx.direction == "backward":
            return self._decode_grad(payload, shape, dtype)
        if ctx.forward_only:
            return payload
        buffers = self._side(ctx, sending=False)
        slots = self.samples.slots(ctx.sample_ids)
        visited = buffers.visited[slots]
        first, revisit = (~visited).nonzero().view(-1), visited.nonzero().view(-1)
        s, b, h = shape
        out = torch.empty(b, s, h, dtype=dtype, device=payload.device)
        new = torch.empty(b, s, h, dtype=buffers.dtype, device=payload.device)
        offset = 0
        if first.numel():
            offset = first.numel() * s * h * torch.tensor([], dtype=dtype).element_size()
            x = self._from_raw(payload[:offset], (first.numel(), s, h), dtype)
            out[first] = x
            new[first] = x.to(buffers.dtype)
        if revisit.numel():
            m = buffers.read(slots[revisit]).float()
            value = m + self._unpack_samples(
                payload[offset:], revisit.numel(), s, h, self.cfg.fw_bits
            )
            out[revisit] = value.to(dtype)
            new[revisit] = value.to(buffers.dtype)
        self._staged["recv"].append(_Staged(slots, new))
        self._prefetch_next(buffers, ctx)
        return out.transpose(0, 1)

    def _prefetch_next(self, buffers: SampleBuffers, ctx: P2PContext) -> None:
        """Host and disk buffers: read the next microbatch's rows while this one computes."""
        if buffers.where == "device" or ctx.microbatch is None:
            return
        nxt = ctx.microbatch + 1
        if nxt < self.samples.num_microbatches and self._next_ids is not None:
            slots = self.samples.slots(self._next_ids(nxt))
            buffers.prefetch(slots[buffers.visited[slots]])

    _next_ids = None

    def begin_step(self, sample_ids_fn) -> None:
        """A training step starts: remember how to find the next microbatches' samples and
        prefetch the first one's rows."""
        self._next_ids = sample_ids_fn
        if sample_ids_fn is None:
            return
        for buffers in (self.send, self.recv):
            if buffers is not None and buffers.where != "device":
                slots = self.samples.slots(sample_ids_fn(0))
                buffers.prefetch(slots[buffers.visited[slots]])

    def end_step(self) -> None:
        """Commit the step's buffer updates and visit flags."""
        for side in ("send", "recv"):
            buffers = getattr(self, side)
            for staged in self._staged[side]:
                buffers.write(staged.slots, staged.values)
                buffers.visited[staged.slots] = True
            self._staged[side].clear()

    # -- state ----------------------------------------------------------------------------

    def checksums(self) -> Dict[str, float]:
        """Checksum of each buffer (send / recv) of this rank."""
        return {
            side: getattr(self, side).checksum() for side in ("send", "recv") if getattr(self, side)
        }

    def state_dict(self) -> Dict[str, Any]:
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
        for side in ("send", "recv"):
            buffers = getattr(self, side)
            if buffers is None:
                continue
            if state["policy"] == "saved":
                buffers.restore(state[f"{side}/rows"], state[f"{side}/visited"])
            else:
                # Never reuse stale buffers: every sample starts with a full-precision visit.
                buffers.reset()
