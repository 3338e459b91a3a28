"""Each method's steps, driven the way ``megatron_ext/megatron`` drives them, at any shape.

What it does:
    Harnesses that run one method's public classes as the runtime does, with the shapes, the
    dtype and the device as parameters:

    * :class:`DPReduction`: a gradient reducer (``tests.helpers.reducers``: the registry's
      construction path) bound to flat gradient buckets, ``launch`` / ``wait`` / ``end_step``
      per step, a Radius selection every K steps;
    * :class:`CodecBoundary`: the AQ-SGD or DirectQ codecs of one pipeline boundary (sender
      and receiver), microbatches of forward activations and backward gradients between
      ``begin_step`` and ``end_step``;
    * :func:`grass_steps` (layers from ``tests.helpers.grass``): forward and backward
      through ``grass_linear``, the optimizer hook around an Adam-like update of ``V``;
      :func:`dense_linear_steps`, the dense linear layers Grass replaces (its cost model's
      reference);
    * :func:`protocol_stage` / :func:`protocol_steps`: Protocol Models' two stages, their
      codecs and optimizer hooks;
    * :class:`DiLoCoView` / :func:`diloco_hook` / :func:`diloco_steps`: DiLoCo's outer hook
      around inner steps.

    Every harness runs its steps under a *mode*:

    * :class:`~tests.helpers.strict_device.StrictDeviceMode` on ``meta`` tensors: the
      strict-device tests (``tests/unit/test_strict_device.py``, tiny shapes: findings,
      collectives, launch budgets) and the cost model (``benchmarks/gpu_cost.py``, model
      shapes: launches and memory traffic);
    * :class:`HostTimer` on CPU tensors: the cost model's host time;
    * :data:`NO_MODE`: just run.

    ``mode.step(name, sync_ok=...)`` names each training step (``"steady"``; a declared step
    every K steps, see the strict-device tests) and ``mode.part(name)`` marks what the
    method itself does inside it: ``"reduce"`` (a DP reducer's launch, wait and commit),
    ``"begin"`` / ``"forward"`` / ``"backward"`` / ``"commit"`` (a codec's step
    announcement, its two directions, its commit), ``"hook"`` (an optimizer hook's
    ``pre_step`` / ``post_step``). The harness's scaffolding (drawing inputs, megatron's
    own optimizer update, the loss) runs outside every part, so a cost model charges a
    method for its parts only.

Constraints:
    Test helper; pure torch and megatron_ext (no Megatron). Collectives need a process group:
    the fake one of :func:`~tests.helpers.strict_device.run_ranks`, or the caller's.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_ext.protocols import OptimizerView
from tests.helpers.strict_device import DEVICE

__all__ = [
    "NO_MODE",
    "HostTimer",
    "to_cpu",
    "states_view",
    "PAD",
    "dp_phase",
    "radius_view",
    "DPReduction",
    "dp_body",
    "CodecBoundary",
    "grass_steps",
    "dense_linear_steps",
    "protocol_stage",
    "protocol_steps",
    "DiLoCoView",
    "diloco_hook",
    "diloco_steps",
]

Shape = Tuple[int, ...]
Params = Sequence[Tuple[str, Shape]]


# -- modes -------------------------------------------------------------------------------------


class _NoMode:
    """Runs the steps and records nothing."""

    def step(self, name: str = "steady", *, sync_ok: bool = False):
        return contextlib.nullcontext()

    def part(self, name: Optional[str]):
        return contextlib.nullcontext()


NO_MODE = _NoMode()
"""A mode that records nothing."""


class HostTimer:
    """Accumulates the wall time of each part (``time.perf_counter``), across steps.

    :meth:`take` returns and clears the seconds spent in each part since the last call: the
    cost model runs one training step, then takes its parts' time.
    """

    def __init__(self) -> None:
        self._spent: Dict[str, float] = defaultdict(float)
        self._part: Optional[str] = None

    def step(self, name: str = "steady", *, sync_ok: bool = False):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def part(self, name: Optional[str]) -> Iterator[None]:
        outer, self._part = self._part, name
        start = time.perf_counter()
        try:
            yield
        finally:
            if outer is None:  # nested parts count once, in the outermost
                self._spent[name] += time.perf_counter() - start
            self._part = outer

    def take(self) -> Dict[str, float]:
        """Seconds spent in each part since the last :meth:`take` (then cleared)."""
        spent, self._spent = dict(self._spent), defaultdict(float)
        return spent


# -- shared pieces -----------------------------------------------------------------------------


def to_cpu(state: Any) -> Any:
    """A state dict as ``torch.load(map_location="cpu")`` returns it: host tensors as they
    are, device tensors as host tensors of their shape (meta tensors hold no values)."""
    if isinstance(state, torch.Tensor):
        if state.device.type == "cpu":
            return state.clone()
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state


def states_view(states: Dict[str, Any]):
    """An OptimizerView over ``states`` (FQN -> ParamOptimState); the caller sets ``step``."""

    class View(OptimizerView):
        step = 0

        def fqns(self):
            return sorted(states)

        def param_state(self, fqn):
            return states.get(fqn)

    return View()


def _adam_state(p: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
        "step": torch.tensor(0.0),  # torch's Adam keeps a host step count
    }


_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


# -- data-parallel reducers ----------------------------------------------------------------------

PAD = 24
"""Zero padding after the parameters of a bucket (megatron pads buckets)."""


def dp_phase(method: str, options: Dict[str, Any], step: int) -> str:
    """The step's name: "steady", or what a step every K steps (or before the start) is."""
    if method == "radius":
        if step < options["dense_steps"]:
            return "dense"
        return "select" if (step - options["dense_steps"]) % options["interval"] == 0 else "steady"
    if method == "powersgd" and step < options.get("start_step", 10):
        return "dense"
    return "steady"


def radius_view(slices, step: int, device: Any = DEVICE):
    """An OptimizerView over device AdamW moments of every parameter (Radius's selection)."""
    from megatron_ext.protocols import ParamOptimState
    from tests.helpers.views import SlicesView

    def state(i, fqn, n):
        return ParamOptimState(
            fqn=fqn,
            model_param=torch.zeros(n, device=device),
            main_param=torch.zeros(n, device=device),
            state={
                "exp_avg": torch.randn(n, device=device),
                "exp_avg_sq": torch.ones(n, device=device),
                "step": torch.tensor(float(step + 1)),  # torch AdamW keeps a CPU step
            },
            group=dict(_ADAMW),
        )

    return SlicesView(slices, step, state)


class DPReduction:
    """A gradient reducer bound to ``buckets`` (one bucket group each, as megatron-core has
    without ``--ddp-num-buckets`` grouping): a flat gradient of ``dtype`` per bucket on
    ``device``, ``pad`` zeros after its parameters.

    Args:
        method: registered gradient method (``none``, ``separate``, ...).
        options: the method's options.
        buckets: per bucket, its ``(fqn, shape)`` in buffer order.
        device: where the gradients live.
        dtype: gradient buffer dtype.
        pad: zero elements after each bucket's parameters.
        reduce_scatter: the distributed optimizer's reduce-scatter.
        op: the reduction (default SUM).
    """

    def __init__(
        self,
        method: str,
        options: Dict[str, Any],
        buckets: Sequence[Params],
        *,
        device: Any = DEVICE,
        dtype: torch.dtype = torch.float32,
        pad: int = PAD,
        reduce_scatter: bool = False,
        op: Any = None,
    ):
        from tests.helpers.reducers import bind, make_reducer, param_slices

        self.method, self.options, self.device = method, dict(options), device
        self.reducer = make_reducer(method, **options)
        self.grads: List[Tuple[torch.Tensor, int]] = []
        self.bound = []
        self.slices = []
        for i, params in enumerate(buckets):
            slices, n = param_slices(params)
            grad = torch.zeros(n + pad, dtype=dtype, device=device)
            key = "bucket" if len(buckets) == 1 else f"bucket{i}"
            self.bound.append(
                bind(
                    self.reducer,
                    grad,
                    slices,
                    key=key,
                    async_op=True,
                    distributed_optimizer=reduce_scatter,
                    op=op,
                )
            )
            self.grads.append((grad, n))
            self.slices += slices

    def load(self, mode: Any, state: Dict[str, Any]) -> None:
        """Load a (CPU-mapped) state dict in a declared step."""
        with mode.step("load", sync_ok=True):
            self.reducer.load_state_dict(state)

    def steps(self, mode: Any, steps: int, first: int = 0) -> None:
        """Steps ``first .. first + steps - 1``: megatron's backward fills the gradients
        (outside the step), then every bucket is launched (as the backward reaches them),
        waited on, and the step committed as the optimizer hook does; a Radius selection
        step is declared."""
        for step in range(first, first + steps):
            name = dp_phase(self.method, self.options, step)
            for grad, n in self.grads:
                grad[:n].normal_()
            with mode.step(name, sync_ok=name == "select"), mode.part("reduce"):
                handles = [bound.launch(step) for bound in self.bound]
                for handle in handles:
                    if handle is not None:
                        handle.wait()
                if name == "select":
                    self.reducer.select(radius_view(self.slices, step, self.device))
                # The optimizer hook's commit of the step's staged state is part of it.
                self.reducer.end_step(True)


def dp_body(
    method: str,
    options: Dict[str, Any],
    steps: int,
    *,
    params: Params,
    resume_from: Optional[Tuple[Dict[str, Any], int]] = None,
    **kwargs: Any,
) -> Callable[[int, Any], Dict[str, Any]]:
    """A rank's run for :func:`~tests.helpers.strict_device.run_ranks`: one bucket of
    ``params`` (``kwargs`` as :class:`DPReduction`'s), optionally loaded from
    ``resume_from = (state, first step)``, then ``steps`` steps; returns the reducer's state
    as a CPU checkpoint holds it."""

    def body(rank, mode):
        run = DPReduction(method, options, [params], **kwargs)
        first = 0
        if resume_from is not None:
            state, first = resume_from
            run.load(mode, state)
        run.steps(mode, steps, first)
        return to_cpu(run.reducer.state_dict())

    return body


# -- AQ-SGD and DirectQ: one pipeline boundary -------------------------------------------------


class CodecBoundary:
    """The sender (stage 0) and receiver (stage 1) codecs of one boundary.

    Args:
        method: ``aqsgd`` or ``directq``.
        seq, micro_batch, hidden: activation ``[seq, micro_batch, hidden]``.
        num_microbatches: microbatches per step.
        num_samples: samples of the (fixed-sample) epoch; AQ-SGD keeps one buffer row each.
        device: where activations and buffers live.
        dtype: activation (and gradient) dtype; AQ-SGD's ``auto`` buffers take it too.
        options: :class:`~megatron_ext.options.aqsgd.AQSGDConfig` fields.
    """

    def __init__(
        self,
        method: str,
        *,
        seq: int,
        micro_batch: int,
        hidden: int,
        num_microbatches: int,
        num_samples: int,
        device: Any = DEVICE,
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ):
        from megatron_ext.collectives.aqsgd import AQSGDCodec, DirectQCodec
        from megatron_ext.methods.aqsgd import AQSGDConfig
        from tests.helpers.aqsgd_samples import fixed_samples

        self.shape = (seq, micro_batch, hidden)
        self.num_microbatches, self.num_samples = num_microbatches, num_samples
        self.device, self.dtype = device, dtype
        cfg = AQSGDConfig(**options)
        cls = AQSGDCodec if method == "aqsgd" else DirectQCodec
        self.sender, self.receiver = cls(cfg, None), cls(cfg, None)
        if method == "aqsgd":
            samples = fixed_samples(num_samples, micro_batch, num_microbatches, seq)
            for codec, stage in ((self.sender, 0), (self.receiver, 1)):
                codec.allocate(
                    samples,
                    seq,
                    hidden,
                    stage=stage,
                    num_stages=2,
                    device=device,
                    activation_dtype=dtype,
                )

    @property
    def steps_per_epoch(self) -> int:
        """Training steps until every sample was visited once."""
        return self.num_samples // (self.num_microbatches * self.shape[1])

    def steps(self, mode: Any, steps: int, first: int = 0) -> None:
        """``steps`` training steps: ``begin_step`` (declared ``sync_ok``: sample ids are
        host tensors, as the runtime computes them from ``consumed_samples``; the one place
        a step may copy them to the device, AQ-SGD: one copy per codec, and read the
        previous commit's per-sample flags on the host), microbatches of forward activations
        sender -> receiver and their gradients back (step ``"microbatch"``), then
        ``end_step`` (the commit, every step: not declared)."""
        from megatron_ext.collectives.p2p import P2PContext

        mbs = self.shape[1]
        for step in range(first, first + steps):
            base = (step * self.num_microbatches * mbs) % self.num_samples

            def ids_of(mb, base=base):
                return torch.arange(base + mb * mbs, base + (mb + 1) * mbs)

            with mode.step("begin_step", sync_ok=True), mode.part("begin"):
                self.sender.begin_step(ids_of)
                self.receiver.begin_step(ids_of)
            for mb in range(self.num_microbatches):
                x = torch.randn(self.shape, device=self.device, dtype=self.dtype)
                with mode.step("microbatch"):
                    fwd = P2PContext("forward", mb, ids_of(mb), step, False)
                    with mode.part("forward"):
                        self.receiver.payload_spec(self.shape, x.dtype, fwd)
                        payload = self.sender.encode(x, fwd)
                        y = self.receiver.decode(payload, fwd, self.shape, x.dtype)
                    bwd = P2PContext("backward", mb, ids_of(mb), step, False)
                    g = torch.randn_like(y)
                    with mode.part("backward"):
                        payload = self.receiver.encode(g, bwd)
                        self.sender.decode(payload, bwd, tuple(g.shape), g.dtype)
            with mode.step("end_step"), mode.part("commit"):
                self.sender.end_step()
                self.receiver.end_step()


# -- Grass -------------------------------------------------------------------------------------


def grass_steps(
    mode: Any,
    layers: Dict[str, Any],
    hook: Any,
    view: Any,
    steps: int,
    first: int = 0,
    *,
    microbatches: int = 2,
    tokens: int = 4,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Training steps: ``begin_step``, microbatches of forward and backward through
    ``grass_linear`` (each layer its own input ``[tokens, n]``, which needs a gradient as a
    layer's input does, and output gradient), ``pre_step``, an Adam-like update of ``V``
    (megatron's optimizer: no part), ``post_step``. Selection steps (every K) are declared
    ``sync_ok``. ``V``'s gradient is its ``main_grad`` where it has one (megatron's DDP
    buffer), else ``.grad``."""
    from megatron_ext.autograd.grass import grass_linear

    for step in range(first, first + steps):
        view.step = step
        selecting = hook.schedule.is_selection_step(step)
        with mode.step("select" if selecting else "steady", sync_ok=selecting):
            hook.begin_step(step)
            for _ in range(microbatches):
                for layer in layers.values():
                    m, n = layer.weight.shape
                    dt = dtype or layer.weight.dtype
                    x = torch.randn(tokens, n, device=layer.weight.device, dtype=dt)
                    x.requires_grad_(True)
                    dy = torch.randn(tokens, m, device=layer.weight.device, dtype=dt)
                    with mode.part("forward"):
                        y = grass_linear(x, layer.weight, None, layer)
                    with mode.part("backward"):
                        torch.autograd.backward(y, dy)
                    if hasattr(layer.param, "main_grad"):
                        # megatron's DDP hook drops the dummy gradient once Grass has added
                        # into main_grad: the next microbatch accumulates nothing into .grad.
                        layer.param.grad = None
            with mode.part("hook"):
                hook.pre_step(view)
            for state in view.states.values():
                p = state.main_param
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    state.state["exp_avg"].mul_(0.9).add_(g, alpha=0.1)
                    p.data.add_(state.state["exp_avg"], alpha=-1e-2)
                    p.grad = None
                    if hasattr(p, "main_grad"):
                        p.main_grad.zero_()
                state.state["step"] += 1
            with mode.part("hook"):
                hook.post_step(view, True)


def dense_linear_steps(
    mode: Any,
    shapes: Sequence[Tuple[int, int]],
    steps: int,
    *,
    microbatches: int,
    tokens: int,
    dtype: torch.dtype,
    device: Any = DEVICE,
) -> None:
    """The dense linear layers Grass replaces, as megatron-core runs them without fused
    weight-gradient accumulation: forward ``y = x W^T``, backward ``dx = dy W`` and
    ``dW = dy^T x``, added into the fp32 ``main_grad`` (megatron's DDP hook) in the
    backward part. Inputs and output gradients as :func:`grass_steps` draws them."""
    weights = []
    for m, n in shapes:
        w = torch.zeros(m, n, device=device, dtype=dtype, requires_grad=True)
        w.main_grad = torch.zeros(m, n, device=device, dtype=torch.float32)
        weights.append(w)
    for _ in range(steps):
        with mode.step("steady"):
            for _ in range(microbatches):
                for w in weights:
                    m, n = w.shape
                    x = torch.randn(tokens, n, device=device, dtype=dtype, requires_grad=True)
                    dy = torch.randn(tokens, m, device=device, dtype=dtype)
                    with mode.part("forward"):
                        y = torch.nn.functional.linear(x, w)
                    with mode.part("backward"):
                        torch.autograd.backward(y, dy)
                        w.main_grad.add_(w.grad)
                    w.grad = None


# -- Protocol Models ---------------------------------------------------------------------------


def protocol_stage(
    last: bool,
    *,
    accumulate: Optional[bool] = None,
    d: int,
    k: int,
    vocab: int,
    params: Sequence[Tuple[str, Shape, int]],
    update_interval: int,
    reproject_interval: int = 2,
    device: Any = DEVICE,
    dtype: torch.dtype = torch.float32,
):
    """One stage's subspace (on the device, as constrain_model leaves it), its codec and its
    optimizer hook over the constrained ``params`` (``(fqn, shape, axis of size d)``), with
    Adam state; ``update_basis`` is megatron_ext.megatron.subspace.basis_exchange's
    collective on WORLD (all-reduce ``A``, the Grassmann step on rank 0, broadcast).
    ``last``: the receiving (last) stage of the boundary, which accumulates the boundary
    gradients into ``A`` unless ``accumulate`` is False (a fixed subspace).

    Returns:
        ``(codec, hook, view, states)``.
    """
    from megatron_ext.collectives.subspace import SubspaceCodec
    from megatron_ext.compressors.subspace import Subspace, grassmann_step, project
    from megatron_ext.optim.subspace import SubspaceOptimizerHook
    from megatron_ext.protocols import ParamOptimState

    subspace = Subspace(d, k, seed=0)
    subspace.make_fixed(vocab, 0.02, dtype, device)
    subspace.on(device)
    accumulate = last if accumulate is None else accumulate
    codec = SubspaceCodec(subspace, sends_forward=not last, accumulate=accumulate)
    tensors = {}
    for fqn, shape, axis in params:
        p = torch.nn.Parameter(torch.randn(shape, device=device))
        with torch.no_grad():
            p.copy_(project(p, subspace.u, axis))
        tensors[fqn] = (p, axis)
    states = {
        fqn: ParamOptimState(
            fqn=fqn, model_param=p, main_param=p, state=_adam_state(p), group=dict(_ADAMW)
        )
        for fqn, (p, _) in tensors.items()
    }

    def update_basis():
        u = subspace.u
        new = torch.empty_like(u)
        if last:  # the owner: the last stage holds A
            a = subspace.a if subspace.a is not None else torch.zeros(d, d)
            a = a.to(u.device)
            dist.all_reduce(a)
            if dist.get_rank() == 0:
                new = grassmann_step(u, a, 0.5)
            dist.broadcast(new, src=0)
        return new

    hook = SubspaceOptimizerHook(
        subspace,
        {fqn: axis for fqn, (_, axis) in tensors.items()},
        update_interval=update_interval,
        reproject_interval=reproject_interval,
        update_basis=update_basis,
    )
    return codec, hook, states_view(states), states


def protocol_steps(
    mode: Any,
    first: Any,
    last: Any,
    steps: int,
    start: int = 0,
    *,
    microbatches: int = 2,
    shape: Shape = (8, 2, 32),
    vocab: int = 16,
    update_interval: int = 3,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Steps of both stages: token ids from the (device) batch, forward encode/decode
    (part ``"forward"``), the boundary gradient back, accumulated into ``A`` on the last
    stage (``"backward"``), the optimizer step with the hooks (``"hook"``) around Adam's
    own update (no part). The Grassmann update every ``update_interval`` steps is declared
    ``sync_ok`` (step ``"update"``)."""
    from megatron_ext.collectives.p2p import P2PContext

    device = first[1].subspace.u.device
    for step in range(start, start + steps):
        updating = update_interval > 0 and (step + 1) % update_interval == 0
        with mode.step("update" if updating else "steady", sync_ok=updating):
            with mode.part("forward"):
                for codec, *_ in (first, last):
                    codec.begin_step(None)
            for mb in range(microbatches):
                fwd = P2PContext("forward", mb, None, step, False)
                bwd = P2PContext("backward", mb, None, step, False)
                ids = torch.randint(vocab, shape[:2], device=device)
                x = torch.randn(shape, device=device, dtype=dtype)
                with mode.part("forward"):
                    first[0].push_token_ids(ids)
                    last[0].payload_spec(shape, x.dtype, fwd)
                    y = last[0].decode(first[0].encode(x, fwd), fwd, shape, x.dtype)
                g = torch.randn_like(y)
                with mode.part("backward"):
                    first[0].decode(last[0].encode(g, bwd), bwd, shape, g.dtype)
            for _, hook, view, states in (first, last):
                view.step = step
                for st in states.values():
                    st.model_param.grad = torch.randn_like(st.model_param)
                with mode.part("hook"):
                    hook.pre_step(view)
                for st in states.values():  # Adam's own update, on the device
                    p, s = st.main_param, st.state
                    s["step"] += 1
                    s["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                    s["exp_avg_sq"].mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                    p.data.addcdiv_(s["exp_avg"], s["exp_avg_sq"].sqrt().add_(1e-8), value=-1e-3)
                with mode.part("hook"):
                    hook.post_step(view, True)


# -- DiLoCo ------------------------------------------------------------------------------------


class DiLoCoView(OptimizerView):
    """An optimizer view over bf16 model parameters with fp32 main copies on ``device``
    (whole, or this rank's half of each parameter as a distributed optimizer's shard);
    counts the parameter gathers."""

    def __init__(self, shapes: Dict[str, Shape], sharded: bool, device: Any = DEVICE):
        from megatron_ext.protocols import ParamOptimState

        self.states = {}
        for fqn, shape in shapes.items():
            model = torch.randn(shape, device=device).bfloat16()
            n = model.numel()
            main = torch.randn((n // 2,) if sharded else shape, device=device)
            rng = (0, n // 2) if sharded else None
            self.states[fqn] = ParamOptimState(
                fqn=fqn, model_param=model, main_param=main, state={}, param_range=rng
            )
        self.current = 0
        self.gathers = 0

    def fqns(self):
        return sorted(self.states)

    def param_state(self, fqn):
        return self.states.get(fqn)

    @property
    def step(self):
        return self.current

    def param_numels(self):
        return {f: s.model_param.numel() for f, s in self.states.items()}

    def sync_params(self):
        self.gathers += 1


def diloco_hook(view: Any, *, interval: int, fragments: int = 1, **options: Any):
    """DiLoCo's hook over ``view`` on WORLD (the sites), set up in the caller's step."""
    from megatron_ext.optim.diloco import DiLoCoHook
    from megatron_ext.options.outer import OuterConfig

    o = OuterConfig(interval=interval, fragments=fragments, **options)
    hook = DiLoCoHook(o, dist.group.WORLD)
    hook.setup(view)
    return hook


def diloco_steps(mode: Any, hook: Any, view: Any, steps: int, first: int = 0) -> None:
    """Inner steps: the hook's ``pre_step``, a device update of the main parameters (the
    inner optimizer: no part), the hook's ``post_step``. Steps where a fragment is sent or
    applied are named "outer", the others "steady"; declared at an outer step are the outer
    update's non-finite check (one read per fragment applied, before anything is written), a
    compressed exchange's (one sync per exchange, on the worker thread when overlapped) and
    host-memory outer state moving, and the run's first step with
    ``--outer-state-device cpu`` (DiLoCoHook.anchor: the snapshots go to host memory)."""
    from megatron_ext.optim.diloco import fragment_due

    o = hook.options
    for step in range(first, first + steps):
        view.current = step
        t = step + 1
        outer = bool(fragment_due(t, o.interval, o.fragments)) or (
            o.delay and t > o.delay and bool(fragment_due(t - o.delay, o.interval, o.fragments))
        )
        declared = outer
        name = "outer" if outer else "steady"
        if step == 0 and o.state_device == "cpu":
            name, declared = "first", True
        with mode.step(name, sync_ok=declared):
            with mode.part("hook"):
                hook.pre_step(view)  # as megatron's step: before the inner update
            for s in view.states.values():
                s.main_param.add_(1e-3)
            with mode.part("hook"):
                hook.post_step(view, True)
