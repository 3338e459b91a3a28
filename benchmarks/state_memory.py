"""State memory of every method at GPT2-XL and LLaMA-8B shapes, counted without allocating.

What it does:
    Instantiates each method's real state-holding classes on ``meta`` tensors (no memory is
    allocated; a fake process group stands in for the data-parallel group) and runs them
    through a few steps, while a dispatch mode follows every tensor storage the method
    creates: bytes alive, the peak, and what stays alive between steps.

    * **persistent**: storages the method created that are still alive after a step (error
      residuals, warm starts, masks, cached projections and indices, per-sample buffers,
      the subspace basis, ``T_fixed``), measured after the last step;
    * **transient**: the peak of storages alive during a step above what was alive before
      it (work buffers, payloads, clones), the largest over the measured steps.

    Methods and what runs (each method's defaults unless noted):

    * ``separate``, ``radius``, ``powersgd``, ``quantized``: the DP gradient reducers bound
      to megatron-style buckets (parameters in backward order, a bucket closes at
      ``max(40M, 1M x DP)`` elements, megatron-core's default), fp32 gradient buffers,
      all-reduce (no distributed optimizer), DP = ``--dp-size``. Each runs the compressed
      phase (PowerSGD's ``start_step`` and Radius's dense steps are skipped over); with
      ``--overlap`` every bucket group launches before the first is waited on, as with
      ``overlap_grad_reduce`` (megatron waits on all groups in ``finish_grad_sync``).
      Radius runs its selection step too (dense reduction, then
      :class:`~megatron_ext.collectives.radius.RadiusOptimizerHook`'s top-k from Adam's
      moments, which are given on meta); on meta, ``nonzero`` returns the sizes its masks
      select (``ceil(density x numel)`` per matrix, as ``topk_mask`` picks; each bucket's
      positions afterwards) and the check that every weight has optimizer state passes;
      megatron's dense collectives of that step run without torch's coalescing manager
      (no meta kernel) and allocate nothing.
    * ``grass``: a :class:`~megatron_ext.autograd.grass.GrassLayer` per default Grass layer
      (QKV, attention output, fc1, fc2), split into parts as a run splits them (Q, K, V;
      SwiGLU's gate and up; ``r`` each), with its virtual parameter, selection and sketch:
      one sketched step and a top-r selection (``sketch_bytes``: the sketches and ``Omega``
      alive at the selection). The virtual parameters' gradients and Adam state are
      megatron's (listed separately: ``grass_param_grad_adam_bytes``), which shrink the full
      weights' gradient and Adam state. ``plan_*``: what
      :func:`megatron_ext.state_plan.grass_plan` computes from the shape, the figure the
      launch scripts print before a job starts.
    * ``aqsgd``: :class:`~megatron_ext.collectives.aqsgd.AQSGDCodec`'s per-sample buffers
      (``samples x seq x hidden x bytes`` per boundary side, ``--aqsgd-samples`` samples
      per DP rank, bf16) of one middle pipeline stage (a send and a receive side), and
      (``per_node_8_stages``) what a node of 8 GPUs holding 8 stages keeps, from
      :func:`megatron_ext.memory.aqsgd_buffer_plan`, the figure the launch scripts
      print before a job starts.
    * ``protocol``: :class:`~megatron_ext.compressors.subspace.Subspace` (``U``, ``A``,
      ``T_fixed``) and :class:`~megatron_ext.optim.subspace.SubspaceOptimizerHook`'s step on
      the constrained parameters (word and position embeddings, every layer's attention
      output and fc2 but the last ``uncompressed_last_layers``), fp32 main parameters and
      Adam moments as megatron keeps them, k = d / 100, no pipeline split (every
      constrained parameter on one rank; ``A`` is the last stage's, ``T_fixed`` every
      stage's). ``held_from_pre_to_post_step`` is what the hook keeps between its pre- and
      post-step (copies of the constrained main parameters). ``plan_*``:
      :func:`megatron_ext.state_plan.protocol_plan`'s ``U``, ``T_fixed`` and last-stage
      accumulators, the figure the launch scripts print.

    Adam's own state with mixed precision (fp32 main parameters and two fp32 moments:
    12 B/param) is shown beside each row; "B/param" divides by the whole model's parameters.

Usage:
    python benchmarks/state_memory.py [--models gpt2-xl,llama-8b] [--methods ...]
        [--dp-size 8] [--overlap] [--aqsgd-samples 1024] [--out runs/bench-state-memory]

Constraints:
    Runs on CPU in seconds; nothing of model size is allocated. The model shapes are
    :class:`megatron_ext.state_plan.ModelShape` (megatron-core's parameter names and shapes
    for GPT-2 and LLaMA-3 layouts, vocabulary padded to a multiple of 128 as Megatron-LM
    pads it), the pre-flight's. Ops whose
    output size depends on values (``nonzero``) get the sizes stated above; host-side
    draws (Protocol Models' ``U`` and ``T_fixed``, Grass's sketch matrices) are made on meta
    too, and what Protocol Models' install briefly holds is reported apart
    (``install_transient``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, write_results  # noqa: E402

METHODS = ("separate", "radius", "powersgd", "quantized", "grass", "aqsgd", "protocol")

ADAM_BYTES_PER_PARAM = 12
"""fp32 main parameter + exp_avg + exp_avg_sq with mixed precision."""

from megatron_ext.state_plan import (  # noqa: E402  (no torch)
    ModelShape,
    model_params as _shape_params,
    padded_vocab,
)

MODELS: Dict[str, ModelShape] = {
    # GPT2-XL (1.5B): learned positions, tied embeddings, biases, GELU MLP.
    "gpt2-xl": ModelShape(num_layers=48, hidden=1600, heads=25, kv_heads=25, ffn=6400,
                          vocab=padded_vocab(50257), seq=1024),
    # LLaMA-3 8B: RoPE, untied output, no biases, SwiGLU (fc1 holds gate and up), GQA.
    "llama-8b": ModelShape(num_layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                           vocab=padded_vocab(128256), seq=8192, swiglu=True, bias=False,
                           learned_positions=False, untied=True),
    # The unit test's models.
    "tiny": ModelShape(num_layers=2, hidden=64, heads=4, kv_heads=4, ffn=256,
                       vocab=padded_vocab(512), seq=32),
    "tiny-llama": ModelShape(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn=96,
                             vocab=padded_vocab(512), seq=32, swiglu=True, bias=False,
                             learned_positions=False, untied=True),
}  # fmt: skip
"""Megatron-LM's shapes (vocabulary padded to a multiple of 128, TP=1)."""


def model_params(model: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(megatron-core FQN, shape)`` of every parameter, in model order
    (:func:`megatron_ext.state_plan.model_params`)."""
    return _shape_params(MODELS[model])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- counting storages on meta ---------------------------------------------------------------


def _storage(t: Any) -> Optional[Tuple[int, int]]:
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def _flatten(x: Any) -> List[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    return [x]


_FACTORIES = ("randn", "rand", "zeros", "ones", "empty", "full")


def live_bytes_mode(
    data_dependent: Optional[Dict[str, Callable]] = None, cpu_factories_to_meta: bool = False
):
    """A dispatch mode counting the bytes of the storages created under it (see module doc).

    Args:
        data_dependent: maps an aten op name (``nonzero``) to a function giving its meta
            output from its arguments.
        cpu_factories_to_meta: create on ``meta`` what a method creates on the CPU with a
            factory (``randn``, ``zeros``, ...): seeded draws made on the host and moved to
            the device, such as Protocol Models' ``T_fixed`` (vocab x d
            fp32) or Grass's sketch matrices, would otherwise really be allocated.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs: Dict[int, int] = {}
            self.sizes: Dict[int, int] = {}
            self.live = 0
            self.peak = 0

        def _release(self, key: int) -> None:
            self.refs[key] -= 1
            if self.refs[key] == 0:
                del self.refs[key]
                self.live -= self.sizes.pop(key)

        def _track(self, t: Any, inputs: set) -> None:
            found = _storage(t)
            if found is None:
                return
            key, nbytes = found
            if key not in self.refs:
                if key in inputs:  # an alias of a storage created before the mode
                    return
                self.refs[key] = 0
                self.sizes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)

        def __enter__(self):
            # What existed before is not collected while measuring: gc passes stay short.
            gc.collect()
            gc.freeze()
            return super().__enter__()

        def __exit__(self, *exc):
            gc.unfreeze()
            return super().__exit__(*exc)

        def reset_peak(self) -> None:
            gc.collect()
            self.peak = self.live

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name == "equal":  # agreement checks across ranks: replicas agree
                return True
            if (
                cpu_factories_to_meta
                and name in _FACTORIES
                and torch.device(kwargs.get("device") or "cpu").type == "cpu"
            ):
                kwargs = {**kwargs, "device": torch.device("meta"), "pin_memory": False}
            if data_dependent and name in data_dependent:
                out = data_dependent[name](*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            inputs = {_storage(a)[0] for a in _flatten(list(args) + list(kwargs.values()))
                      if isinstance(a, torch.Tensor)}  # fmt: skip
            for t in _flatten(out):
                self._track(t, inputs)
            return out

    return LiveBytes()


class _Measure:
    """Persistent and transient bytes of one method, with the mode around everything."""

    def __init__(self, mode: Any):
        self.mode = mode
        self.transient = 0

    def step(self, fn: Callable[[], None]) -> None:
        """Run one step; keep the largest peak above what was alive before and after it
        (what a step leaves behind, such as a cache made on first use, is persistent)."""
        self.mode.reset_peak()
        before = self.mode.live
        fn()
        gc.collect()
        self.transient = max(self.transient, self.mode.peak - max(before, self.mode.live))

    @property
    def persistent(self) -> int:
        gc.collect()
        return self.mode.live


# -- the data-parallel reducers ---------------------------------------------------------------


class _FakeDPGroup:
    """A fake process group of ``dp_size`` ranks (torch's ``fake`` backend: collectives
    return at once and touch nothing), destroyed on exit."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size

    def __enter__(self):
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError(
                "state_memory binds the reducers to a fake process group of its own: run it "
                "in a process without torch.distributed initialized"
            )
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.dp_size)
        return dist.group.WORLD

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


def megatron_buckets(
    params, dp_size: int, bucket_size: Optional[int] = None
) -> List[List[Tuple[str, Tuple[int, ...]]]]:
    """Parameters in backward order, split like megatron-core's buckets: a bucket closes once
    it holds ``bucket_size`` elements (default megatron-core's with
    ``--overlap-grad-reduce``, ``max(4e7, 1e6 x DP)``; 0: one bucket, as without it)."""
    limit = max(40_000_000, 1_000_000 * dp_size) if bucket_size is None else bucket_size
    buckets, current, size = [], [], 0
    for name, shape in reversed(params):
        current.append((name, shape))
        size += _numel(shape)
        if limit and size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _reducer(method: str, options: Dict[str, Any]):
    if method == "separate":
        from megatron_ext.collectives.separate import SeparateReducer
        from megatron_ext.methods.separate import SeparateConfig

        cfg = SeparateConfig(**options)
        return SeparateReducer(cfg), cfg, 1
    if method == "radius":
        from megatron_ext.collectives.radius import RadiusReducer
        from megatron_ext.methods.radius import RadiusConfig

        cfg = RadiusConfig(**options)
        return RadiusReducer(cfg), cfg, cfg.dense_steps + 1
    if method == "powersgd":
        from megatron_ext.collectives.powersgd import PowerSGDReducer
        from megatron_ext.methods.powersgd import PowerSGDConfig

        cfg = PowerSGDConfig(**options)
        return PowerSGDReducer(cfg), cfg, cfg.start_step
    if method == "quantized":
        from megatron_ext.collectives.quantized import QuantizedReducer
        from megatron_ext.methods.quantized import QuantizedConfig

        cfg = QuantizedConfig(**options)
        return QuantizedReducer(cfg), cfg, 0
    raise ValueError(method)


class _NoCoalescing:
    """Stands in for torch's ``_coalescing_manager`` (no meta kernel for the coalesced
    collectives): the collectives inside run one by one; ``wait()`` does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self):
        pass


@contextlib.contextmanager
def _without_coalescing():
    """megatron's dense reduction (Radius's dense and selection steps) on meta tensors."""
    from megatron_ext.collectives import grad_reducer

    original = grad_reducer._coalescing_manager
    grad_reducer._coalescing_manager = _NoCoalescing
    try:
        yield
    finally:
        grad_reducer._coalescing_manager = original


def measure_reducer(
    method: str, model: str, dp_size: int, overlap: bool, options: Dict[str, Any]
) -> Dict[str, Any]:
    """Bind ``method``'s reducer to every bucket and run two compressed steps."""

    with _FakeDPGroup(dp_size) as group:
        return _measure_reducer(group, method, model, dp_size, overlap, options)


def _measure_reducer(group, method, model, dp_size, overlap, options) -> Dict[str, Any]:
    import torch

    from megatron_ext.collectives.grad_reducer import BucketGroupSpec, ParamSlice
    from megatron_ext.collectives.radius import RadiusOptimizerHook
    from megatron_ext.compressors.topk import num_selected
    from megatron_ext.protocols import ParamOptimState

    params = model_params(model)
    reducer, cfg, first = _reducer(method, options)
    specs = []
    for index, bucket in enumerate(megatron_buckets(params, dp_size)):
        slices, start = [], 0
        for name, shape in bucket:
            slices.append(ParamSlice(name, start, start + _numel(shape), tuple(shape)))
            start += _numel(shape)
        pad = -start % dp_size  # megatron pads each bucket to a multiple of DP
        grad = torch.zeros(start + pad, dtype=torch.float32, device="meta")
        key = f"bucket{index}:{bucket[0][0]}..{bucket[-1][0]}"
        specs.append(BucketGroupSpec.create([(grad, slices, key)], group, async_op=overlap))

    # Radius's value-dependent sizes on meta: nonzero's output by input size (a matrix's
    # mask, a bucket's sent positions) and the bool-mask indexing of its check that every
    # weight has optimizer state.
    sizes: Dict[str, Dict[int, int]] = {"nonzero": {}, "masked": {}}

    def nonzero(x):
        return torch.empty(sizes["nonzero"][x.numel()], 1, dtype=torch.long, device="meta")

    def index(x, indices):
        mask = indices[0] if len(indices) == 1 else None
        if mask is not None and mask.dtype == torch.bool:
            return torch.empty(sizes["masked"][mask.numel()], dtype=x.dtype, device="meta")
        return torch.ops.aten.index.Tensor(x, indices)

    def size_of(table: str, numel: int, count: int) -> None:
        if sizes[table].setdefault(numel, count) != count:
            raise RuntimeError(f"Radius: two {table} inputs of {numel} elements differ")

    states = {}
    if method == "radius":
        for spec in specs:
            for view in spec.buckets:
                matrices = [s for s in view.params if s.is_matrix]
                size_of("masked", view.grad.numel(), sum(s.numel for s in matrices))
                for s in matrices:
                    # Adam's state as megatron keeps it (not counted: it is not Radius's)
                    states[s.fqn] = ParamOptimState(
                        fqn=s.fqn,
                        model_param=torch.zeros(s.shape, dtype=torch.bfloat16, device="meta"),
                        main_param=torch.zeros(s.shape, device="meta"),
                        state={
                            "exp_avg": torch.zeros(s.shape, device="meta"),
                            "exp_avg_sq": torch.zeros(s.shape, device="meta"),
                            "step": 1,
                        },
                        group={"lr": 1e-4, "weight_decay": 0.1, "betas": (0.9, 0.95),
                               "eps": 1e-8},
                    )  # fmt: skip
                    size_of("nonzero", s.numel, num_selected(s.numel, cfg.density))
                # the positions the bucket sends: its selections and its 1-D parameters (a
                # bucket of one matrix gives the same count as that matrix's mask)
                count = sum(
                    num_selected(s.numel, cfg.density) if s.is_matrix else s.numel
                    for s in view.params
                )
                size_of("nonzero", view.grad.numel(), count)

    scalar = {"_local_scalar_dense": lambda *a, **k: True, "is_nonzero": lambda *a, **k: True}
    mode = live_bytes_mode({"nonzero": nonzero, "index": index, **scalar})
    select_transient = None
    with mode, contextlib.ExitStack() as stack:
        measure = _Measure(mode)
        measure.step(lambda: [reducer.bind(spec) for spec in specs])
        bind_bytes = mode.live

        def one_step(step: int):
            handles = [b.launch(step) for b in reducer.bound]
            for handle in handles:
                if handle is not None:
                    handle.wait()
            del handles
            end_step = getattr(reducer, "end_step", None)
            if end_step is not None:  # a reducer with a step transaction: the step applied
                end_step(True)

        measure.transient = 0
        if method == "radius":
            stack.enter_context(_without_coalescing())
            # The selection step: dense reduction, then the hook's top-k after Adam's step.
            hook = RadiusOptimizerHook(reducer)
            view = _MetaOptimizerView(states, step=cfg.dense_steps)

            def select_step():
                one_step(cfg.dense_steps)
                hook.post_step(view, True)

            measure.step(select_step)
            select_transient = measure.transient
        for step in (first, first + 1):
            measure.step(lambda step=step: one_step(step))
        persistent = measure.persistent
    n = sum(_numel(s) for _, s in params)
    return {
        "persistent": persistent,
        "transient": measure.transient,
        "after_bind": bind_bytes,
        "select_step_transient": select_transient,
        "num_buckets": len(specs),
        "steps": [first, first + 1],
        "settings": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "num_params": n,
    }


# -- Grass, AQ-SGD, Protocol Models -------------------------------------------------------------


def measure_grass(model: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """GrassLayers of the default layers: one sketched step, then a top-r selection.

    The weights and their parts (Q, K, V; SwiGLU's gate and up) are
    :func:`megatron_ext.state_plan.grass_plan`'s, the figure the launch scripts print;
    ``plan_*`` beside the measurement are that function's.
    """
    import torch

    from megatron_ext.autograd.grass import GrassLayer
    from megatron_ext.config import DEFAULT_LINEAR_LAYERS
    from megatron_ext.methods.grass import GrassConfig
    from megatron_ext.state_plan import grass_plan

    cfg = GrassConfig(**options)
    plan = grass_plan(
        MODELS[model], rank=cfg.rank, method="topr", sketch_size=cfg.sketch_size,
        layers=DEFAULT_LINEAR_LAYERS, params_dtype="bf16",
    )  # fmt: skip
    params = model_params(model)
    tokens = MODELS[model].seq
    mode = live_bytes_mode(cpu_factories_to_meta=True)
    layers = []
    # The selection: top-r's r distinct positions of each part (a meta sketch has no values)
    # with rho all ones, host tensors as select() returns them in a run (made before the
    # mode, which would turn CPU factories into meta, and outside the measured steps): the
    # layer then knows on the host that rho scales nothing, as it does in training.
    selections = []
    for w in plan.weights:
        sizes = [w.units // w.parts] * w.parts
        index = torch.cat([i * sizes[0] + torch.arange(w.rank) for i in range(w.parts)])
        selections.append((index, torch.ones(w.parts * w.rank)))
    with mode:
        measure = _Measure(mode)
        # Megatron's bf16 weights and the virtual parameters (model parameters, whose
        # gradient and Adam state megatron keeps) exist outside Grass: not counted here.
        frozen, virtual = [], []
        for w in plan.weights:
            frozen.append(torch.zeros(w.local_shape, dtype=torch.bfloat16, device="meta"))
            virtual.append(torch.zeros(w.virtual_shape, dtype=torch.bfloat16, device="meta"))
        # Each part's rows: CPU tensors in a run (host memory), made outside the count.
        rows = [
            (
                None
                if w.part_rows is None
                else tuple(torch.cat([torch.arange(s, s + n) for s, n in b]) for b in w.part_rows)
            )
            for w in plan.weights
        ]
        outside = mode.live

        def build():
            for w, weight, v, part_rows in zip(plan.weights, frozen, virtual, rows):
                layers.append(
                    GrassLayer(
                        fqn=w.fqn,
                        weight=weight,
                        param=v,
                        mode=w.mode,
                        rank=w.rank,
                        method="topr",
                        sketch_size=cfg.sketch_size,
                        seed=cfg.seed,
                        part_rows=part_rows,
                        num_col_parts=w.parts if w.mode == "col" else 1,
                    )
                )

        measure.step(build)
        sketches = {}

        def sketch_and_select():
            # One layer at a time, as the backward reaches them; the sketches of every
            # layer stay until the selection after the backward.
            before = mode.live
            for layer in layers:
                layer.start_sketch(0)
                m, n = layer.weight.shape
                dy = torch.zeros(tokens, m, dtype=torch.bfloat16, device="meta")
                x = torch.zeros(tokens, n, dtype=torch.bfloat16, device="meta")
                layer.projected_grad(dy, x)
                del dy, x
            gc.collect()
            sketches["bytes"] = mode.live - before
            for layer, (index, rho) in zip(layers, selections):
                layer.sketch_norms()
                layer.set_selection(index.clone(), rho.clone(), layer.param)
                layer.sketching, layer.sketch, layer.omega = False, None, None

        measure.step(sketch_and_select)

        def selected_step():
            for layer in layers:
                m, n = layer.weight.shape
                dy = torch.zeros(tokens, m, dtype=torch.bfloat16, device="meta")
                x = torch.zeros(tokens, n, dtype=torch.bfloat16, device="meta")
                layer.projected_grad(dy, x)
                del dy, x
                layer.write_rows(layer.param)

        measure.step(selected_step)
        persistent = measure.persistent - outside
    num_virtual = sum(_numel(v.shape) for v in virtual)
    projected = sum(_numel(w.local_shape) for w in plan.weights)
    return {
        "persistent": persistent,
        "transient": measure.transient,
        "sketch_bytes": sketches["bytes"],
        "virtual_params": num_virtual,
        "projected_params": projected,
        # bf16 parameter + fp32 gradient + Adam's 12 B: the virtual parameters against the
        # weights they stand for (megatron's allocations, not measured here)
        "grass_param_grad_adam_bytes": 18 * num_virtual,
        "dense_grad_adam_bytes": 16 * projected,
        "plan_selection_bytes": plan.selection_bytes,
        "plan_sketch_bytes": plan.sketch_bytes,
        "plan_virtual_bytes": plan.virtual_bytes,
        "plan_dense_bytes": plan.dense_bytes,
        "tokens_per_microbatch": tokens,
        "settings": {"rank": cfg.rank, "sketch_size": cfg.sketch_size, "method": "topr"},
        "num_params": sum(_numel(s) for _, s in params),
    }


def measure_aqsgd(model: str, samples: int, options: Dict[str, Any]) -> Dict[str, Any]:
    """AQ-SGD's per-sample buffers of a middle stage (send and receive sides)."""
    import torch

    from megatron_ext.collectives.aqsgd import AQSGDCodec
    from megatron_ext.memory import aqsgd_buffer_plan
    from megatron_ext.methods.aqsgd import AQSGDConfig
    from megatron_ext.methods.registry import SampleSpace

    cfg = AQSGDConfig(**options)
    m = MODELS[model]
    space = SampleSpace(fixed=True, num_samples=samples, dp_rank=0, dp_size=1,
                        micro_batch_size=1, num_microbatches=1, seq_length=m.seq)  # fmt: skip
    codec = AQSGDCodec(cfg, ctx=None)
    codec._check_fits = lambda *a, **k: None  # the host's free memory is not the GPU's
    extra = {}
    if "activation_dtype" in inspect.signature(codec.allocate).parameters:
        extra["activation_dtype"] = torch.bfloat16  # mixed precision (--aqsgd-buffer-dtype auto)
    mode = live_bytes_mode()
    with mode:
        measure = _Measure(mode)
        result = {}

        def allocate():
            result["sides"], result["per_side"] = codec.allocate(
                space, m.seq, m.hidden, stage=1, num_stages=3,
                device=torch.device("meta"), **extra,
            )  # fmt: skip

        measure.step(allocate)
        persistent = measure.persistent
    itemsize = torch.tensor([], dtype=codec.send.dtype).element_size()
    # What the launch scripts print before a job starts (megatron_ext.preflight), from the
    # functions the codec allocated with: 8 stages on one 8-GPU node (the AQ-SGD paper's).
    plan = aqsgd_buffer_plan(
        num_samples=samples, seq_length=m.seq, hidden_size=m.hidden,
        activation_dtype=torch.bfloat16, pipeline_parallel=8, world_size=8, ranks_per_node=8,
    )  # fmt: skip
    return {
        "persistent": persistent,
        "transient": None,
        "samples": samples,
        "sides": result["sides"],
        "per_side": result["per_side"],
        "per_node_8_stages": plan.per_node_max,
        "per_side_formula": f"{samples} x {m.seq} x {m.hidden} x {itemsize} B",
        "settings": {"buffer_dtype": str(codec.send.dtype), "buffer": cfg.buffer},
        "num_params": sum(_numel(s) for _, s in model_params(model)),
    }


class _MetaOptimizerView:
    """fp32 main parameters and Adam moments as megatron-core keeps them, on meta."""

    def __init__(self, states: Dict[str, Any], step: int):
        self._states, self._step = states, step

    def fqns(self):
        return list(self._states)

    def param_state(self, fqn):
        return self._states.get(fqn)

    @property
    def step(self):
        return self._step


def measure_protocol(model: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """Subspace and SubspaceOptimizerHook at stage 0: one optimizer step (pre and post)."""
    import torch

    from megatron_ext.compressors.subspace import Subspace
    from megatron_ext.methods.protocol import SubspaceConfig
    from megatron_ext.optim.subspace import SubspaceOptimizerHook
    from megatron_ext.protocols import ParamOptimState
    from megatron_ext.state_plan import protocol_plan

    cfg = SubspaceConfig(**options)
    m = MODELS[model]
    d = m.hidden
    k = cfg.rank_for(d)
    params = model_params(model)
    free = m.num_layers - cfg.uncompressed_last_layers
    constrained = {}
    for name, shape in params:
        if name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
            constrained[name] = 1
        elif name.endswith(
            (
                "self_attention.linear_proj.weight",
                "mlp.linear_fc2.weight",
                "self_attention.linear_proj.bias",
                "mlp.linear_fc2.bias",
            )
        ):
            if int(name.split(".")[2]) < free:
                constrained[name] = 0
    shapes = dict(params)
    states = {}
    for name in constrained:
        shape = shapes[name]
        model_param = torch.zeros(shape, dtype=torch.bfloat16, device="meta")
        model_param.grad = torch.zeros(shape, dtype=torch.bfloat16, device="meta")
        states[name] = ParamOptimState(
            fqn=name,
            model_param=model_param,
            main_param=torch.zeros(shape, dtype=torch.float32, device="meta"),
            state={
                "exp_avg": torch.zeros(shape, device="meta"),
                "exp_avg_sq": torch.zeros(shape, device="meta"),
                "step": 1,
            },
            group={"lr": 1e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8},
        )
    view = _MetaOptimizerView(states, step=0)
    mode = live_bytes_mode(cpu_factories_to_meta=True)
    with mode:
        measure = _Measure(mode)
        holder = {}

        def build():
            subspace = Subspace(d, k, cfg.seed).to("meta")
            subspace.make_fixed(m.vocab, 0.02, torch.bfloat16, "meta")
            subspace.accumulate(torch.zeros(m.seq, d, device="meta"))  # the last stage's A
            holder["hook"] = SubspaceOptimizerHook(
                subspace,
                dict(constrained),
                update_interval=cfg.update_interval,
                reproject_interval=cfg.reproject_interval,
            )

        measure.step(build)
        install_transient, measure.transient = measure.transient, 0
        hook = holder.pop("hook")

        held = {}

        def optimizer_step():
            before = mode.live
            hook.pre_step(view)
            gc.collect()
            held["between"] = mode.live - before  # kept from pre_step to post_step
            hook.post_step(view, True)

        measure.step(optimizer_step)
        persistent = measure.persistent
    word = _numel(shapes["embedding.word_embeddings.weight"])
    # What the launch scripts print (megatron_ext.state_plan.protocol_plan): U and T_fixed
    # of every stage, and the last stage's A (kept) and staged g^T g (the measured build
    # stages one) when U moves.
    plan = protocol_plan(m, k=k, update_interval=1, params_dtype="bf16", pipeline_parallel=2)
    return {
        "plan_u_bytes": plan.u_bytes,
        "plan_fixed_bytes": plan.fixed_bytes,
        "plan_accumulator_bytes": plan.accumulator_bytes,
        "plan_last_stage_bytes": plan.per_stage[-1],
        "persistent": persistent,
        "transient": measure.transient,
        "constrained_params": sum(_numel(shapes[n]) for n in constrained),
        "held_from_pre_to_post_step": held["between"],
        "install_transient": install_transient,
        "word_embedding_fp32_bytes": 4 * word,
        "settings": {"rank": k, "hidden": d, "update_interval": cfg.update_interval},
        "num_params": sum(_numel(s) for _, s in params),
    }


# -- the benchmark -----------------------------------------------------------------------------


def measure(method: str, model: str, args: Any) -> Dict[str, Any]:
    """One row: ``method`` at ``model``'s shape."""
    if method in ("separate", "radius", "powersgd", "quantized"):
        row = measure_reducer(method, model, args.dp_size, args.overlap, {})
    elif method == "grass":
        # the tiny model's layers are 64 wide: fewer rows than the default 128
        row = measure_grass(model, {"rank": 8, "sketch_size": 16} if model == "tiny" else {})
    elif method == "aqsgd":
        row = measure_aqsgd(model, args.aqsgd_samples, {})
    elif method == "protocol":
        # the committed table: k = d / 100 (the paper's rate; the default since raised it
        # to 32 below d 3200) and, without a pipeline split, the last layer free
        row = measure_protocol(model, {"min_rank": 0, "uncompressed_last_layers": 1})
    else:
        raise ValueError(f"--methods: unknown method {method!r} (choose from {METHODS})")
    n = row["num_params"]
    row.update(
        model=model,
        method=method,
        persistent_per_param=row["persistent"] / n,
        transient_per_param=None if row["transient"] is None else row["transient"] / n,
        adam_bytes=ADAM_BYTES_PER_PARAM * n,
    )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2-xl,llama-8b")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--overlap", action="store_true", help="overlap_grad_reduce")
    parser.add_argument("--aqsgd-samples", type=int, default=1024)
    parser.add_argument("--out", default="runs/bench-state-memory")
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"--models: unknown model {model!r} (choose from {sorted(MODELS)})")
    for method in args.methods.split(","):
        if method not in METHODS:
            parser.error(f"--methods: unknown method {method!r} (choose from {METHODS})")
    results = []
    for model in args.models.split(","):
        for method in args.methods.split(","):
            results.append(measure(method, model, args))
    gib = 1 / 2**30
    header = ["model", "method", "params", "persistent GiB", "B/param", "transient GiB"]
    header += ["B/param", "Adam GiB (12 B/param)"]
    rows = []
    for r in results:
        t = r["transient"]
        rows.append(
            [
                r["model"],
                r["method"],
                f"{r['num_params'] / 1e9:.2f}B",
                f"{r['persistent'] * gib:.2f}",
                f"{r['persistent_per_param']:.3f}",
                "-" if t is None else f"{t * gib:.2f}",
                "-" if t is None else f"{r['transient_per_param']:.3f}",
                f"{r['adam_bytes'] * gib:.2f}",
            ]
        )
    print(format_table(header, rows))
    path = write_results("state_memory", args, results, args.out)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
