"""GPU cost model on the CPU: launches, memory traffic and host time of each method's step.

What it does:
    For each method's steady step at the shapes of real models (default gpt2-345m and llama-1b)
    it reports three numbers, the measuring stick for fused kernels and host-side batching:

    * **launches per step**: device ops of the step, from the strict-device recorder
      (:class:`tests.helpers.strict_device.StrictDeviceMode`) running the method's public
      classes on ``meta`` tensors at the model's full shapes (no memory, no data);
    * **traffic vs copy**: the bytes every device op of the step reads plus writes (the rules
      are in ``tests/helpers/strict_device.py``'s docstring: compulsory traffic, each distinct
      tensor once; a fused kernel registered as a ``torch.library`` custom op counts as one op
      with its own inputs and outputs), as a ratio to one device copy of the tensor the
      method works on (a copy of N bytes moves 2N: read + write). The denominator of each
      row is written in its ``denominator`` field: the gradient buckets (DP reducers), the
      activations of the step (codec directions), the dense linear layers' own forward and
      backward traffic (Grass: a ratio to dense), the constrained parameters (Protocol's
      optimizer correction), the fp32 parameters (DiLoCo);
    * **host ms**: CPU wall time of the method's Python per step: the same step on CPU
      tensors at small sizes (every dimension divided by ``--host-shrink``, so the same
      parameters, buckets, layers and shape groups with a few thousand elements each) on
      torch's fake process group (collectives return at once), one torch thread, median of
      ``--repeats`` steps after a warm-up (``host_ms_min`` in the detail: the fastest, less
      disturbed by other processes on a shared machine). It includes the Python, the
      dispatcher and the small CPU kernels of the method's parts; it excludes communication
      and the harness's inputs. A proxy for the host cost on a GPU (where each launch adds
      its own overhead); never asserted in tests.

    Only the method's *parts* are charged (``tests/helpers/method_steps.py`` marks them):
    the DP reducers' launch, wait and commit over every bucket; a codec direction's encode
    and decode on both sides of the boundary (the forward one with ``begin_step`` and the
    buffer commit); Grass's forward, backward and optimizer hook; Protocol's codec
    directions and its optimizer correction; DiLoCo's hook. Inputs, the loss and
    megatron's own optimizer update are not charged.

Steps and shapes (``--models``, ``--microbatches``, ``--dp-size``, ``--bucket-size``):
    * DP reducers (``none``, ``separate`` ratio 16, ``powersgd`` at SEPARATE-16's bytes,
      ``quantized`` 4-bit, ``radius`` density 0.1): every gradient bucket of the model in
      megatron-core's layout (``--bucket-size``, default megatron's with
      ``--overlap-grad-reduce``: ``max(4e7, 1e6 x DP)`` elements; 0: one bucket), rank 0 of
      ``--dp-size`` (default 8) data-parallel ranks, all-reduce, fp32 and bf16 buckets; a
      ``--bf16`` run reduces fp32 buckets (megatron accumulates its gradients in fp32), so
      the top-level number is fp32's. Unit: one training step (all buckets).
    * AQ-SGD / DirectQ (4-bit forward, 8-bit backward): one pipeline boundary, activations
      ``[seq, micro-batch, hidden]``, ``--microbatches`` microbatches a step, AQ-SGD in its
      steady state (every sample revisited). Unit: one training step of that direction.
    * Grass (top-r, rank ``--grass-rank``): every default projected weight
      (:func:`megatron_ext.state_plan.grass_plan`: Q/K/V and gate/up parts), tokens = seq x
      micro-batch per microbatch, ``V``'s gradient accumulated in an fp32 ``main_grad`` as
      megatron's DDP does; a selection-free step. ``grass-dense`` is its reference: the same
      linears dense.
    * Protocol Models: the first stage of two (its constrained writers and embeddings), the
      default fixed subspace (k from ``--subspace-compression-rate``), codec directions and
      the optimizer correction (a step without re-projection).
    * DiLoCo (dense outer exchange, one fragment): an inner step between outer syncs and the
      outer step, over every parameter (bf16 weights, fp32 main copies).
    * ``copy``: one copy of the fp32 gradient, the calibration row (1 launch, 1.0).

Output:
    A table on stdout (method, model, dtype, launches per step, traffic vs copy, host ms, the
    target of :data:`TARGETS`); per top-level row the functions that move the most bytes and
    the ops launched most often (``--offenders N``); with ``--json PATH`` the report
    ``{"methods": {NAME: {"launches_per_step": int, "traffic_vs_copy": float, "host_ms":
    float, "model", "dtype", "target", "meets_target", "unit", "denominator", "detail":
    {MODEL: {DTYPE: {...}}}}}, "settings": {...}, "environment": {...}}``. Top-level numbers
    are the first model's (gpt2-345m) in the dtype a ``--bf16`` run uses; ``detail`` holds
    every model and dtype with traffic and launches by part, collective bytes, the top ops
    by traffic and by launches (op, ``megatron_ext`` frame, share) and the top functions by
    traffic.

Adding a method:
    1. Write its steps in ``tests/helpers/method_steps.py`` (the runtime's calls, shapes as
       parameters), each call the method makes inside ``mode.part(NAME)``; use them from
       ``tests/unit/test_strict_device.py`` too.
    2. Add a :class:`Case` to :data:`CASES` here: how to build it from a :class:`Ctx`, its
       first steady step, and one :class:`Entry` per reported row (its parts and its
       denominator). A fused kernel needs no change here: registered as a custom op with a
       fake implementation it is counted as one op.

Usage:
    python benchmarks/gpu_cost.py                           # gpt2-345m and llama-1b (minutes)
    python benchmarks/gpu_cost.py --quick                   # gpt-tiny and llama-tiny (seconds)
    python benchmarks/gpu_cost.py --json docs/performance/cost/gpu_cost.json
    python benchmarks/gpu_cost.py --methods separate,aqsgd --no-host

Constraints:
    Runs on the CPU only (meta tensors and small CPU tensors); needs a process without
    torch.distributed initialized (it makes its own fake process groups). The launch and
    traffic numbers are deterministic (the strict-device tests assert budgets on them); the
    host times are not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import environment, format_table, load_model_preset  # noqa: E402
from megatron_ext.state_plan import ModelShape, model_params  # noqa: E402

__all__ = [
    "MODELS",
    "CASES",
    "Case",
    "Entry",
    "Ctx",
    "TARGETS",
    "build_parser",
    "main",
    "measure",
    "model_shape",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

TARGETS: Dict[str, float] = {
    "separate": 3.0,
    "quantized": 2.0,
    "aqsgd-forward": 2.0,
    "aqsgd-backward": 2.0,
    "directq-forward": 2.0,
    "directq-backward": 2.0,
    "protocol-forward": 2.0,
    "protocol-backward": 2.0,
}
"""Traffic targets (times a copy) of the fused kernels: SEPARATE's compress + decompress +
error feedback at most 3 copies, the quantizer's and each codec direction's at most 2.
Reported beside the measurement (``target``, ``meets_target``); ``tests/unit/test_gpu_cost.py``
asserts them (expected failures until the kernels land)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model preset (``configs/models``) with the vocabulary and micro-batch it runs."""

    preset: str
    vocab: Optional[int]
    """Tokenizer vocabulary (None: the preset's ``vocab_size``), padded as Megatron-LM pads."""
    micro_batch: int


MODELS: Dict[str, ModelSpec] = {
    # GPT2BPETokenizer; micro-batch 8 as the H100 measurement (docs/performance/gpu).
    "gpt2-345m": ModelSpec("gpt2-345m", 50257, 8),
    # LLaMA's 32000-token tokenizer; micro-batch 16 as the H100 measurement.
    "llama-1b": ModelSpec("llama-1b", 32000, 16),
    "gpt-tiny": ModelSpec("gpt-tiny", None, 2),
    "llama-tiny": ModelSpec("llama-tiny", None, 2),
}
DEFAULT_MODELS = ("gpt2-345m", "llama-1b")
QUICK_MODELS = ("gpt-tiny", "llama-tiny")


def model_shape(name: str) -> ModelShape:
    """The :class:`ModelShape` Megatron-LM builds from preset ``name`` (vocabulary padded)."""
    from megatron_ext.preflight import model_shape as from_args

    spec = MODELS[name]
    argv: List[str] = []
    for key, value in load_model_preset(spec.preset).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    if spec.vocab is not None:
        argv += ["--vocab-size", str(spec.vocab)]
    shape = from_args(argv)
    if shape is None or not shape.vocab:
        raise ValueError(f"model preset {spec.preset!r} has no complete shape")
    return shape


def shrink_shape(shape: ModelShape, factor: int) -> ModelShape:
    """Every dimension divided by ``factor`` (rounded up, at least 1): the same layers,
    parameters, heads and query groups, each head ``factor`` times narrower."""
    if factor == 1:
        return shape

    def div(n: int) -> int:
        return max(1, -(-n // factor))

    head_dim = div(shape.head_dim)
    return replace(
        shape,
        hidden=shape.heads * head_dim,
        kv_channels=head_dim,
        ffn=div(shape.ffn),
        vocab=div(shape.vocab),
        seq=div(shape.seq),
    )


# -- what a case sees --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ctx:
    """One measurement: a model at its full shapes (meta) or shrunk (host time)."""

    model: str
    shape: ModelShape
    micro_batch: int
    dtype: torch.dtype
    device: torch.device
    dp_size: int
    microbatches: int
    buckets: Tuple[Tuple[Tuple[str, Tuple[int, ...]], ...], ...]
    """The gradient buckets, ``(fqn, shape)`` in buffer order (megatron's layout of the full
    model, the same parameters at shrunk shapes for host time)."""
    grass_rank: int
    shrink: int = 1

    @property
    def params(self) -> List[Tuple[str, Tuple[int, ...]]]:
        return model_params(self.shape)

    @property
    def activation(self) -> Tuple[int, int, int]:
        """``[seq, micro-batch, hidden]`` of one microbatch at a pipeline boundary."""
        return (self.shape.seq, self.micro_batch, self.shape.hidden)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


class _Runner:
    """A built case: ``step(mode, i)`` runs training step ``i`` under ``mode``."""

    def __init__(self, step: Callable[[Any, int], None], **extra: Any):
        self.step = step
        self.extra = extra


@dataclass(frozen=True)
class Entry:
    """One reported row of a case: the parts it charges and what it is compared with."""

    name: str
    parts: Tuple[str, ...]
    denominator: Callable[[Ctx], int]
    """Bytes of the reference traffic (one copy: 2 x the tensor's bytes)."""
    denominator_text: str
    unit: str


@dataclass(frozen=True)
class Case:
    """A method's step (see the module docstring, "Adding a method")."""

    name: str
    build: Callable[[Ctx], _Runner]
    entries: Tuple[Entry, ...]
    first_steady: Callable[[Ctx], int]
    """Index of the first steady step (earlier steps are warm-up, selections, epochs)."""
    dtypes: Tuple[str, ...] = ("fp32", "bf16")
    run_dtype: str = "bf16"
    """The dtype a ``--bf16`` training run uses (the top-level number's)."""
    period: int = 1
    """Measured steps are ``first_steady + k * period`` (DiLoCo's outer step every H)."""


# -- the cases ---------------------------------------------------------------------------------


def _grad_copy_bytes(ctx: Ctx) -> int:
    return 2 * sum(_numel(s) for b in ctx.buckets for _, s in b) * ctx.itemsize


def _copy_case() -> Case:
    def build(ctx: Ctx) -> _Runner:
        n = sum(_numel(s) for b in ctx.buckets for _, s in b)
        src = torch.zeros(n, dtype=ctx.dtype, device=ctx.device)
        dst = torch.empty_like(src)

        def step(mode, i):
            with mode.step("steady"), mode.part("copy"):
                dst.copy_(src)

        return _Runner(step)

    unit = "one copy of the whole gradient"
    entry = Entry(
        "copy", ("copy",), _grad_copy_bytes, "one copy of the gradient (2 x its bytes)", unit
    )
    return Case("copy", build, (entry,), lambda ctx: 0, run_dtype="fp32")


def _powersgd_rank(ctx: Ctx) -> int:
    from megatron_ext.compressors.lowrank import equal_bytes_rank

    shapes = [tuple(s) for _, s in ctx.params if len(s) == 2]
    return equal_bytes_rank(shapes, 16)


DP_OPTIONS: Dict[str, Callable[[Ctx], Dict[str, Any]]] = {
    "none": lambda ctx: {},
    "separate": lambda ctx: {"ratio": 16},
    "powersgd": lambda ctx: {"approx_rank": _powersgd_rank(ctx), "start_step": 1},
    "quantized": lambda ctx: {"bits": 4},
    "radius": lambda ctx: {"density": 0.1, "dense_steps": 1, "interval": 1000},
}
"""Options of the DP reducers as ``benchmarks/one_gpu.py`` runs them (PowerSGD at the rank
that sends SEPARATE-16's bytes; dense starts and selections before the first steady step)."""

_DP_FIRST = {"none": 0, "separate": 1, "powersgd": 2, "quantized": 1, "radius": 2}
"""First steady step: SEPARATE resets its error at step 0, PowerSGD starts at 1 (its first
compressed step draws Q), Radius selects at 1."""


def _dp_case(method: str) -> Case:
    def build(ctx: Ctx) -> _Runner:
        from tests.helpers.method_steps import DPReduction

        run = DPReduction(
            method,
            DP_OPTIONS[method](ctx),
            ctx.buckets,
            device=ctx.device,
            dtype=ctx.dtype,
            pad=0,
        )
        return _Runner(lambda mode, i: run.steps(mode, 1, i), buckets=len(ctx.buckets))

    unit = "one training step: every gradient bucket's launch, wait and commit"
    if method == "none":
        unit += " (megatron-core's own collectives)"
    entry = Entry(
        method,
        ("reduce",),
        _grad_copy_bytes,
        "one copy of the gradient buckets (2 x their bytes)",
        unit,
    )
    return Case(method, build, (entry,), lambda ctx: _DP_FIRST[method], run_dtype="fp32")


def _activation_copy_bytes(ctx: Ctx) -> int:
    return 2 * _numel(ctx.activation) * ctx.itemsize * ctx.microbatches


def _codec_case(method: str) -> Case:
    def build(ctx: Ctx) -> _Runner:
        from tests.helpers.method_steps import CodecBoundary

        seq, mbs, hidden = ctx.activation
        boundary = CodecBoundary(
            method,
            seq=seq,
            micro_batch=mbs,
            hidden=hidden,
            num_microbatches=ctx.microbatches,
            num_samples=2 * ctx.microbatches * mbs,
            device=ctx.device,
            dtype=ctx.dtype,
        )
        return _Runner(lambda mode, i: boundary.steps(mode, 1, i))

    text = "one copy of the step's activations ([seq, micro-batch, hidden] x microbatches)"
    unit = "one training step ({} microbatches), both sides of the boundary"
    entries = (
        Entry(
            f"{method}-forward",
            ("begin", "forward", "commit"),
            _activation_copy_bytes,
            text,
            unit + ", with begin_step and the buffer commit",
        ),
        Entry(f"{method}-backward", ("backward",), _activation_copy_bytes, text, unit),
    )
    # AQ-SGD: two steps an epoch (num_samples above); revisits from the second epoch on.
    return Case(method, build, entries, lambda ctx: 2 if method == "aqsgd" else 0)


def _grass_specs(ctx: Ctx):
    from megatron_ext.config import DEFAULT_LINEAR_LAYERS
    from megatron_ext.state_plan import grass_plan
    from tests.helpers.grass import spec_of_plan

    plan = grass_plan(
        ctx.shape,
        rank=ctx.grass_rank,
        method="topr",
        layers=DEFAULT_LINEAR_LAYERS,
        params_dtype="bf16" if ctx.dtype == torch.bfloat16 else "fp32",
    )
    return [spec_of_plan(w) for w in plan.weights]


def _tokens(ctx: Ctx) -> int:
    return ctx.shape.seq * ctx.micro_batch


def _dense_linear_step(mode: Any, ctx: Ctx, shapes: List[Tuple[int, int]]) -> None:
    """One step of the linears of ``shapes`` dense (forward + backward of every microbatch),
    recorded by ``mode`` (``tests/helpers/method_steps.py``: ``dense_linear_steps``)."""
    from tests.helpers.method_steps import dense_linear_steps

    dense_linear_steps(
        mode,
        shapes,
        1,
        microbatches=ctx.microbatches,
        tokens=_tokens(ctx),
        dtype=ctx.dtype,
        device=ctx.device,
    )


def _dense_linear_traffic(ctx: Ctx) -> int:
    """Forward + backward traffic of the dense linears Grass replaces (meta, one step)."""
    from tests.helpers.strict_device import StrictDeviceMode

    shapes = [s.shape for s in _grass_specs(ctx)]
    with StrictDeviceMode() as mode:
        _dense_linear_step(mode, ctx, shapes)
    return mode.named("steady")[0].traffic(("forward", "backward"))


def _grass_case() -> Case:
    def build(ctx: Ctx) -> _Runner:
        from tests.helpers.grass import GrassView, grass_setup
        from tests.helpers.method_steps import grass_steps

        layers, hook = grass_setup(
            "topr",
            True,
            ctx.device,
            lambda i, shape: torch.zeros(shape, dtype=ctx.dtype, device=ctx.device),
            specs=_grass_specs(ctx),
            interval=1000,
            sketch_size=min(256, ctx.shape.hidden),
            main_grad=True,
        )
        view = GrassView(layers)

        def step(mode, i):
            grass_steps(
                mode,
                layers,
                hook,
                view,
                1,
                i,
                microbatches=ctx.microbatches,
                tokens=_tokens(ctx),
                dtype=ctx.dtype,
            )

        return _Runner(step)

    unit = (
        "one training step ({} microbatches): every projected weight's forward and backward, "
        "the optimizer hook"
    )
    entry = Entry(
        "grass",
        ("forward", "backward", "hook"),
        _dense_linear_traffic,
        "the same linears dense: their forward + backward traffic (a ratio to dense)",
        unit,
    )
    # Step 0 sketches and selects (top-r needs the gradient); steady from step 1.
    return Case("grass", build, (entry,), lambda ctx: 1)


def _grass_dense_case() -> Case:
    def build(ctx: Ctx) -> _Runner:
        shapes = [s.shape for s in _grass_specs(ctx)]

        def step(mode, i):
            _dense_linear_step(mode, ctx, shapes)

        return _Runner(step)

    unit = (
        "one training step ({} microbatches): the linears Grass projects, dense forward and "
        "backward"
    )
    entry = Entry(
        "grass-dense",
        ("forward", "backward"),
        _dense_linear_traffic,
        "itself (the reference of grass)",
        unit,
    )
    return Case("grass-dense", build, (entry,), lambda ctx: 0)


def protocol_params(ctx: Ctx) -> List[Tuple[str, Tuple[int, ...], int]]:
    """The constrained parameters of the first of two pipeline stages
    (``megatron_ext.megatron.subspace.constrain_model``): each layer's ``linear_proj`` and
    ``linear_fc2`` weight and bias along the output dimension, the word (and learned
    position) embeddings along the hidden dimension."""
    layers = ctx.shape.num_layers // 2
    out = []
    for fqn, shape in ctx.params:
        if fqn.startswith("embedding."):
            out.append((fqn, shape, 1))
            continue
        parts = fqn.split(".")
        if parts[0] == "decoder" and parts[1] == "layers" and int(parts[2]) < layers:
            if parts[-2] in ("linear_proj", "linear_fc2"):
                out.append((fqn, shape, 0))
    return out


def _protocol_rank(ctx: Ctx) -> int:
    from megatron_ext.methods.protocol import SubspaceConfig

    return SubspaceConfig().rank_for(ctx.shape.hidden)


def _protocol_case() -> Case:
    def build(ctx: Ctx) -> _Runner:
        from tests.helpers.method_steps import protocol_stage, protocol_steps

        kw = dict(
            d=ctx.shape.hidden,
            k=_protocol_rank(ctx),
            vocab=ctx.shape.vocab,
            update_interval=0,
            reproject_interval=0,
            device=ctx.device,
            dtype=ctx.dtype,
        )
        first = protocol_stage(False, params=protocol_params(ctx), **kw)
        # The last stage: its layers stay free (the default), A is not accumulated with a
        # fixed subspace (the default update interval 0).
        last = protocol_stage(True, accumulate=False, params=[], **kw)

        def step(mode, i):
            protocol_steps(
                mode,
                first,
                last,
                1,
                i,
                microbatches=ctx.microbatches,
                shape=ctx.activation,
                vocab=ctx.shape.vocab,
                update_interval=0,
                dtype=ctx.dtype,
            )

        return _Runner(step)

    def constrained_copy(ctx: Ctx) -> int:
        return 2 * 4 * sum(_numel(s) for _, s, _ in protocol_params(ctx))

    text = "one copy of the step's activations ([seq, micro-batch, hidden] x microbatches)"
    unit = "one training step ({} microbatches), both sides of the boundary"
    entries = (
        Entry("protocol-forward", ("forward",), _activation_copy_bytes, text, unit),
        Entry("protocol-backward", ("backward",), _activation_copy_bytes, text, unit),
        Entry(
            "protocol-optimizer",
            ("hook",),
            constrained_copy,
            "one copy of the first stage's constrained fp32 parameters",
            "one optimizer step of the first of two stages (pre_step and post_step)",
        ),
    )
    return Case("protocol", build, entries, lambda ctx: 0)


DILOCO_H = 4
"""Inner steps between outer syncs in the measurement (cost per step does not depend on it)."""


def _diloco_case(outer: bool) -> Case:
    def build(ctx: Ctx) -> _Runner:
        from tests.helpers.method_steps import DiLoCoView, diloco_hook, diloco_steps

        view = DiLoCoView(dict(ctx.params), sharded=False, device=ctx.device)
        hook = diloco_hook(view, interval=DILOCO_H, fragments=1)
        return _Runner(lambda mode, i: diloco_steps(mode, hook, view, 1, i))

    def params_copy(ctx: Ctx) -> int:
        return 2 * 4 * sum(_numel(s) for _, s in ctx.params)

    name = "diloco-outer" if outer else "diloco-inner"
    unit = (
        "the outer step (dense all-reduce of the pseudo-gradient, outer Nesterov step)"
        if outer
        else "an inner step between outer syncs"
    )
    entry = Entry(name, ("hook",), params_copy, "one copy of the fp32 parameters", unit)
    return Case(
        name,
        build,
        (entry,),
        lambda ctx: DILOCO_H - 1 if outer else 1,
        dtypes=("bf16",),
        period=DILOCO_H if outer else 1,
    )


CASES: Tuple[Case, ...] = (
    _copy_case(),
    *(_dp_case(m) for m in DP_OPTIONS),
    _codec_case("aqsgd"),
    _codec_case("directq"),
    _grass_case(),
    _grass_dense_case(),
    _protocol_case(),
    _diloco_case(outer=False),
    _diloco_case(outer=True),
)
"""Every measured case, in table order."""


# -- measuring ---------------------------------------------------------------------------------


def _function(where: str) -> str:
    """``file (function)`` of a ``file:line (function)`` frame."""
    return re.sub(r":\d+ ", " ", where)


def _top(costs, key: str, n: int, total: float, by_function: bool = False) -> List[Dict[str, Any]]:
    """The ``n`` heaviest groups of ``costs`` by ``key`` ("traffic" or "launches"): groups of
    one op at one source line, or (``by_function``) of every op of one function."""
    groups: Dict[Tuple[str, str], List[Any]] = defaultdict(list)
    for c in costs:
        groups[("", _function(c.where)) if by_function else (c.op, c.where)].append(c)
    rows = []
    for (op, where), cs in groups.items():
        traffic = sum(c.traffic for c in cs)
        row = {"op": op, "where": where, "launches": len(cs)}
        if by_function:
            del row["op"]
            row["ops"] = sorted({c.op.split(".")[1] for c in cs})
        row["traffic_share"] = traffic / total if total else 0.0
        rows.append(row)
    sort = (lambda r: -r["traffic_share"]) if key == "traffic" else (lambda r: -r["launches"])
    return sorted(rows, key=sort)[:n]


def _measure_meta(case: Case, ctx: Ctx, top: int) -> Dict[str, Dict[str, Any]]:
    """Launches and traffic of one steady step of ``case`` at ``ctx`` (meta, rank 0)."""
    from tests.helpers.strict_device import run_ranks

    index = case.first_steady(ctx)

    def body(rank, mode):
        with mode.step("setup", sync_ok=True):
            runner = case.build(ctx)
        for i in range(index):
            runner.step(mode, i)
        before = len(mode.steps)
        runner.step(mode, index)
        return runner, mode.steps[before:]

    with warnings.catch_warnings():
        # Meta tensors hold no values: the strict-device mode answers AQ-SGD's per-sample
        # range check (read on the host) with made-up flags, and AQ-SGD warns about them.
        warnings.filterwarnings("ignore", message=".*beyond the range of the.*buffers")
        (run,) = run_ranks(ctx.dp_size, body, ranks=[0])
    runner, records = run.result
    out = {}
    for entry in case.entries:
        costs = [c for r in records for c in r.costs(entry.parts)]
        traffic = sum(c.traffic for c in costs)
        denominator = entry.denominator(ctx)
        by_part = {p: [c for c in costs if c.part == p] for p in entry.parts}
        result = {
            "launches_per_step": len(costs),
            "traffic_vs_copy": traffic / denominator if denominator else 0.0,
            "traffic_bytes": traffic,
            "denominator_bytes": denominator,
            "collective_bytes": sum(r.collective_bytes(entry.parts) for r in records),
            "launches_by_part": {p: len(cs) for p, cs in by_part.items()},
            "traffic_vs_copy_by_part": {
                p: (sum(c.traffic for c in cs) / denominator if denominator else 0.0)
                for p, cs in by_part.items()
            },
            "findings": sorted({str(f) for r in records for f in r.violations}),
            "top_by_traffic": _top(costs, "traffic", top, traffic),
            "top_by_launches": _top(costs, "launches", top, traffic),
            "top_functions": _top(costs, "traffic", top, traffic, by_function=True),
        }
        if "buckets" in runner.extra:
            result["buckets"] = runner.extra["buckets"]
            result["launches_per_bucket"] = len(costs) / runner.extra["buckets"]
        out[entry.name] = result
    return out


def _measure_host(case: Case, ctx: Ctx, repeats: int) -> Dict[str, Tuple[float, float]]:
    """Median and smallest host milliseconds per step of each entry of ``case`` at the
    (shrunk) ``ctx`` on CPU tensors, fake process group of ``ctx.dp_size`` ranks, rank 0,
    one thread."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.helpers.method_steps import NO_MODE, HostTimer

    if dist.is_initialized():
        raise RuntimeError("gpu_cost makes its own fake process group: run it without one")
    threads = torch.get_num_threads()
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ctx.dp_size)
    torch.set_num_threads(1)
    try:
        timer = HostTimer()
        runner = case.build(ctx)
        first = case.first_steady(ctx)
        warm = 2
        measured = [first + (warm + k) * case.period for k in range(repeats)]
        samples: Dict[str, List[float]] = defaultdict(list)
        for i in range(measured[-1] + 1):
            if i in measured:
                timer.take()
                runner.step(timer, i)
                spent = timer.take()
                for entry in case.entries:
                    samples[entry.name].append(sum(spent.get(p, 0.0) for p in entry.parts))
            else:
                runner.step(NO_MODE, i)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        torch.set_num_threads(threads)
    return {name: (1e3 * statistics.median(v), 1e3 * min(v)) for name, v in samples.items()}


def make_ctx(
    model: str,
    dtype: str,
    *,
    dp_size: int,
    microbatches: int,
    bucket_size: Optional[int],
    grass_rank: int,
    shrink: int = 1,
) -> Ctx:
    """The :class:`Ctx` of ``model`` in ``dtype``: full shapes on meta (``shrink`` 1), or
    every dimension divided by ``shrink`` on the CPU (the buckets keep the full model's
    layout: the same parameters in the same buckets)."""
    from benchmarks.state_memory import megatron_buckets
    from tests.helpers.strict_device import DEVICE

    full = model_shape(model)
    shape = shrink_shape(full, shrink)
    small = dict(model_params(shape))
    layout = megatron_buckets(model_params(full), dp_size, bucket_size)
    buckets = tuple(tuple((fqn, tuple(small[fqn])) for fqn, _ in b) for b in layout)
    micro_batch = MODELS[model].micro_batch
    return Ctx(
        model=model,
        shape=shape,
        micro_batch=micro_batch,
        dtype=DTYPES[dtype],
        device=DEVICE if shrink == 1 else torch.device("cpu"),
        dp_size=dp_size,
        microbatches=microbatches,
        buckets=buckets,
        grass_rank=max(1, grass_rank // shrink),
        shrink=shrink,
    )


def measure(
    cases: Sequence[Case],
    models: Sequence[str],
    *,
    dp_size: int = 8,
    microbatches: int = 4,
    bucket_size: Optional[int] = None,
    grass_rank: int = 256,
    host: bool = True,
    host_shrink: int = 32,
    repeats: int = 5,
    top: int = 5,
    log: Callable[[str], None] = lambda s: None,
) -> Dict[str, Any]:
    """Every case at every model and dtype; returns the ``"methods"`` mapping of the report."""
    methods: Dict[str, Any] = {}
    for case in cases:
        for model in models:
            for dtype in case.dtypes:
                kw = dict(
                    dp_size=dp_size,
                    microbatches=microbatches,
                    bucket_size=bucket_size,
                    grass_rank=grass_rank,
                )
                log(f"{case.name} {model} {dtype}")
                results = _measure_meta(case, make_ctx(model, dtype, **kw), top)
                hosts = {}
                if host:
                    hosts = _measure_host(
                        case, make_ctx(model, dtype, shrink=host_shrink, **kw), repeats
                    )
                for entry in case.entries:
                    r = results[entry.name]
                    r["host_ms"], r["host_ms_min"] = hosts.get(entry.name, (None, None))
                    row = methods.setdefault(
                        entry.name,
                        {
                            "unit": entry.unit.format(microbatches),
                            "denominator": entry.denominator_text,
                            "run_dtype": case.run_dtype,
                            "detail": {},
                        },
                    )
                    row["detail"].setdefault(model, {})[dtype] = r
    for name, row in methods.items():
        model = next(iter(row["detail"]))
        dtype = row.pop("run_dtype")
        if dtype not in row["detail"][model]:
            dtype = next(iter(row["detail"][model]))
        top_level = row["detail"][model][dtype]
        target = TARGETS.get(name)
        methods[name] = {
            "launches_per_step": top_level["launches_per_step"],
            "traffic_vs_copy": top_level["traffic_vs_copy"],
            "host_ms": top_level["host_ms"],
            "model": model,
            "dtype": dtype,
            "target": target,
            "meets_target": None if target is None else top_level["traffic_vs_copy"] <= target,
            **row,
        }
    return methods


# -- output ------------------------------------------------------------------------------------


def table(methods: Dict[str, Any], *, top_level: bool = False) -> str:
    """Method, model, dtype, launches per step, traffic vs copy, host ms (every detail row,
    or the top-level rows)."""
    rows = []
    for name, m in methods.items():
        if top_level:
            pairs = [(m["model"], m["dtype"], m)]
        else:
            pairs = [(mo, dt, r) for mo, d in m["detail"].items() for dt, r in d.items()]
        for model, dtype, r in pairs:
            rows.append(
                [
                    name,
                    model,
                    dtype,
                    r["launches_per_step"],
                    round(r["traffic_vs_copy"], 2),
                    None if r["host_ms"] is None else round(r["host_ms"], 2),
                    m.get("target"),
                ]
            )
    headers = [
        "method",
        "model",
        "dtype",
        "launches/step",
        "traffic vs copy",
        "host ms",
        "target",
    ]
    return format_table(headers, rows, digits=2)


def offenders(methods: Dict[str, Any], n: int) -> str:
    """Of each top-level row, the ``n`` functions that move the most bytes (their share of
    the traffic, their launches) and the ``n`` ops at one line launched most often."""
    lines = []
    for name, m in methods.items():
        r = m["detail"][m["model"]][m["dtype"]]
        if not r["top_functions"]:
            continue
        lines.append(f"{name} ({m['model']} {m['dtype']}, {r['launches_per_step']} launches):")
        for t in r["top_functions"][:n]:
            lines.append(
                f"  traffic {100 * t['traffic_share']:5.1f}%  {t['launches']:5d} launches  "
                f"{t['where']}: {', '.join(t['ops'])}"
            )
        for t in r["top_by_launches"][:n]:
            lines.append(f"  launches {t['launches']:5d} x {t['op']}  {t['where']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/gpu_cost.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu_cost.py",
        description="Launches, memory traffic (vs a copy) and host time of each method's "
        "steady step, on the CPU.",
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"Comma-separated model presets from {', '.join(MODELS)} (default "
        f"{','.join(DEFAULT_MODELS)}; --quick: {','.join(QUICK_MODELS)}).",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="Comma-separated cases (default all): " + ", ".join(c.name for c in CASES) + ".",
    )
    p.add_argument("--quick", action="store_true", help="Tiny models, 3 repeats (seconds).")
    p.add_argument("--json", default=None, metavar="PATH", help="Write the report here.")
    p.add_argument(
        "--dp-size", type=int, default=8, help="Data-parallel ranks of the DP reducers (default 8)."
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="Microbatches per step of the codecs, Grass and Protocol (default 4).",
    )
    p.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="Gradient bucket size in elements (default megatron-core's with "
        "--overlap-grad-reduce, max(4e7, 1e6 x DP); 0: one bucket).",
    )
    p.add_argument("--grass-rank", type=int, default=256, help="Grass rank (default 256).")
    p.add_argument(
        "--host-shrink",
        type=int,
        default=32,
        help="Host time runs every dimension divided by this (default 32).",
    )
    p.add_argument("--repeats", type=int, default=None, help="Host-time steps (default 7).")
    p.add_argument("--no-host", action="store_true", help="Skip the host time.")
    p.add_argument(
        "--offenders", type=int, default=3, help="Top ops printed per method (default 3)."
    )
    return p


def _positive(parser, args, name):
    value = getattr(args, name.replace("-", "_"))
    if value is not None and value < 1:
        parser.error(f"--{name} must be >= 1, got {value}")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the cost model; returns the report (also written to ``--json``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("dp-size", "microbatches", "grass-rank", "host-shrink", "repeats"):
        _positive(parser, args, name)
    if args.bucket_size is not None and args.bucket_size < 0:
        parser.error(f"--bucket-size must be >= 0, got {args.bucket_size}")
    models = (
        args.models.split(",")
        if args.models
        else list(QUICK_MODELS if args.quick else DEFAULT_MODELS)
    )
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    known = {c.name: c for c in CASES}
    names = args.methods.split(",") if args.methods else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(known)})")
    repeats = args.repeats or (3 if args.quick else 7)
    grass_rank = args.grass_rank if not args.quick or args.grass_rank != 256 else 32
    settings = {
        "models": models,
        "dp_size": args.dp_size,
        "microbatches": args.microbatches,
        "bucket_size": args.bucket_size,
        "grass_rank": grass_rank,
        "host_shrink": args.host_shrink,
        "repeats": repeats,
        "host": not args.no_host,
        "model_shapes": {m: model_shape(m).__dict__ for m in models},
    }
    methods = measure(
        [known[n] for n in names],
        models,
        dp_size=args.dp_size,
        microbatches=args.microbatches,
        bucket_size=args.bucket_size,
        grass_rank=grass_rank,
        host=not args.no_host,
        host_shrink=args.host_shrink,
        repeats=repeats,
        log=lambda s: print(f"[gpu_cost] {s}", file=sys.stderr, flush=True),
    )
    report = {"methods": methods, "settings": settings, "environment": environment(1)}
    print(table(methods))
    if args.offenders:
        print()
        print(offenders(methods, args.offenders))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
