"""The compressed exchange of DiLoCo's pseudo-gradient across sites, with error feedback.

What it does:
    :class:`OuterExchange` averages one flat fp32 pseudo-gradient (a fragment's
    ``last synchronized parameters - current parameters``) over the group that joins the
    sites, once per outer synchronization, through the data-parallel compressors that
    already exist. It binds the method's gradient reducer to one flat fp32 "bucket" (the
    way ``tests/helpers/reducers.py`` binds reducers outside Megatron), reduces it with
    ``ReduceOp.AVG`` and closes every call as an applied step, so the reducers' error
    feedback carries over from one outer sync to the next. The dense exchange (``none``) is
    not one of them: it is DiLoCo's ``DenseOuterExchange``
    (``megatron_ext/optim/diloco/exchange.py``), a plain all-reduce with no state. The
    compressed ones:

    * ``quantized`` (:class:`~megatron_ext.options.quantized.QuantizedConfig`): the k-bit
      exchange of ``collectives/quantized.py`` (4 bits by default, as Streaming DiLoCo;
      rows of 256 values with one fp16 scale): all-to-all of the rank's quantized
      partitions, server reduction and re-quantization, all-gather; worker and server
      errors fed back.
    * ``radius`` (:class:`~megatron_ext.options.radius.RadiusConfig`): top-k with error
      feedback as SparseLoCo, implemented here (:class:`_TopKExchange`), not the Radius
      reducer: Radius selects its indices from the inner AdamW's moments and shares one
      selection between ranks for T steps, flushing the residual with a dense step at every
      reselection. The pseudo-gradient has no Adam moments of its own, the sites' inner
      optimizers differ, and a dense flush every T outer syncs would cost a full exchange.
      So each rank keeps the ``k`` largest ``|delta + e|`` of every chunk of 4096 values
      (``k = ceil(density * 4096)``), its error ``e`` becomes what it did not send, and the
      ranks all-gather (value fp32, index int16) pairs; every rank sums the W sparse vectors
      rank by rank (no atomics, so replicas agree bit for bit) and divides by W.
      ``--radius-density`` sets the density, ``--radius-dense-steps`` the number of first
      outer syncs exchanged densely; ``--radius-interval`` has no meaning here (indices are
      chosen afresh at every outer sync, as SparseLoCo does) and is not read. SparseLoCo's
      error-feedback decay and 2-bit values are not implemented: the error is kept whole
      (decay 1), the values travel in fp32.
    * ``separate`` (:class:`~megatron_ext.options.separate.SeparateConfig`): the common
      random projection of ``collectives/separate.py`` (ratio 16, blocks of 256); one
      all-reduce of the projections. Its error feedback is SEPARATE's moving average
      ``e <- (1 - beta) e + beta (h - local estimate)`` (beta = 1/ratio, reset to zero
      every ``--separate-reset-interval`` outer syncs, including the first): by design it
      does not keep the whole error, unlike the other methods.
    * ``powersgd`` (:class:`~megatron_ext.options.powersgd.PowerSGDConfig`): PyTorch's
      PowerSGD of ``collectives/powersgd.py`` (rank-r factors, two all-reduces, warm start,
      error feedback) on each weight matrix of the fragment (``shapes``), 1-D parameters
      dense; without ``shapes`` the flat buffer is viewed as one near-square matrix
      (zero-padded).

    The reducers' step is the outer sync count (0, 1, ...): PowerSGD's dense start, the
    dense warm-up of the top-k exchange, SEPARATE's projection draws and resets all count
    outer syncs. :func:`outer_defaults` gives the options for an exchange compressed from
    the first outer sync (PowerSGD ``start_step`` 0, top-k ``dense_steps`` 0 and density
    1/64); options passed explicitly are used as given.

Units and the error-feedback invariant:
    Each rank passes its own (unscaled) pseudo-gradient and gets the reconstructed mean.
    :meth:`OuterExchange.residual` gives this rank's residual in the units of its input,
    such that the mean over ranks of the residuals is the global residual. For every method
    but SEPARATE, after ``T`` calls:
    ``sum_t average_t + mean_r residual_r == sum_t mean_r delta_r,t`` (up to fp32
    rounding; tests/distributed/test_outer_exchange.py).

Sum mode and changing groups (``reduce="sum"``, DiLoCo over torchft,
``megatron_ext/optim/diloco_ft.py``):
    Each rank passes its share already scaled (``w / sum(w) * delta``) and gets the sum; a
    rank's residual is in the units of the result and the ranks' residuals add up to the
    global one for any group size. :meth:`OuterExchange.average` with ``commit=False``
    stages the new residuals until :meth:`OuterExchange.end` says whether the step was
    applied (a failed step leaves them as they were). :meth:`OuterExchange.regroup` carries
    the state to a group of another size (the quantized exchange's server error is added
    into the owner's worker error first: the sum is unchanged);
    :meth:`OuterExchange.shared_state_dict` is what a joining rank takes from a peer (the
    residuals zeroed). The group may be a ``ProcessGroup`` torch.distributed did not
    register (torchft's): ranks and sizes are read from the group itself then
    (``collectives/grad_reducer.py``: ``group_rank``, ``group_size``).

State (rank-local; keys carry the exchange's ``name``, e.g. ``outer/<fragment>``, as the
parameter name): the reducer's state (``worker_error/``, ``server_error/``, ``error/``,
``q/``, ``residual/`` + name) and ``syncs``, the outer syncs done.

Non-finite input:
    A NaN or Inf in some rank's input (or residual) makes :meth:`OuterExchange.average`
    raise on every rank, with the staged state dropped (one host synchronization per
    outer sync).

Accounting:
    :meth:`OuterExchange.wire_bytes` is what this rank sent in the last call, under the ring
    convention of ``megatron_ext.accounting.collective_wire_bytes``. The reducers tag their
    collectives ``dp-grad`` for ``ProcessGroupTrafficMeter``; the caller accounts the outer
    category from ``wire_bytes``.

Constraints:
    torch.distributed only; never imports Megatron. Synchronous (the caller may run it on
    a side thread or stream to overlap inner steps).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple

import torch

from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.collectives.grad_reducer import (
    BucketGroupSpec,
    GradReducer,
    ParamSlice,
    all_gather_flat,
    check_state_keys,
    group_size,
)
from megatron_ext.compressors.topk import num_selected
from megatron_ext.options.outer import OUTER_EXCHANGE_OPTIONS, OUTER_EXCHANGES
from megatron_ext.protocols import NonFiniteError

__all__ = ["METHODS", "OuterExchange", "outer_defaults", "TOPK_CHUNK", "RESIDUAL_ROLES"]

#: The compressed exchange methods (the data-parallel method whose compression each one
#: reuses): every ``--outer-compression`` but ``none``.
METHODS: Tuple[str, ...] = tuple(m for m in OUTER_EXCHANGES if m != "none")

#: Values per top-k chunk (SparseLoCo's chunks of 4096): indices fit in int16.
TOPK_CHUNK = 4096

#: The top-k density of :func:`outer_defaults` (SparseLoCo keeps 1-3% of the entries).
TOPK_DENSITY = 1.0 / 64

#: The roles of the state keys that hold a rank's own residual (error feedback); the other
#: keys (``syncs``, PowerSGD's warm-start ``q/``, SEPARATE's adaptive ``ratio/`` and
#: ``beta_scale/``) are the same on every rank of the group.
RESIDUAL_ROLES: Tuple[str, ...] = ("worker_error", "server_error", "error", "residual")


def _check_method(method: str) -> None:
    if method == "none":
        raise ValueError(
            "outer exchange: 'none' is the dense all-reduce (DiLoCo's DenseOuterExchange); "
            f"this exchange compresses: choose one of {', '.join(METHODS)}"
        )
    if method not in METHODS:
        raise ValueError(
            f"outer exchange: unknown method {method!r}; choose one of {', '.join(METHODS)}"
        )


def outer_defaults(method: str) -> Any:
    """The options of ``method`` for an exchange compressed from the first outer sync.

    ``quantized``: 4 bits, rows of 256, error feedback (the DP defaults). ``radius``:
    density 1/64, no dense outer syncs. ``separate``: the DP defaults (ratio 16). ``powersgd``:
    ``start_step`` 0 (the DP default 10 would exchange the first 10 outer syncs densely),
    rank 4.
    """
    _check_method(method)
    cls = OUTER_EXCHANGE_OPTIONS[method]
    if method == "radius":
        return cls(density=TOPK_DENSITY, dense_steps=0)
    if method == "powersgd":
        return cls(start_step=0)
    return cls()


def _near_square(numel: int) -> Tuple[int, int]:
    cols = max(1, math.isqrt(max(numel - 1, 0)) + 1) if numel > 1 else 1
    return -(-numel // cols), cols


class OuterExchange:
    """Average a flat fp32 pseudo-gradient over ``group`` with method ``method``.

    Args:
        method: one of :data:`METHODS`.
        options: the config dataclass of that data-parallel method
            (``QuantizedConfig``, ``RadiusConfig``, ``SeparateConfig``, ``PowerSGDConfig``),
            or None for :func:`outer_defaults`.
        numel: elements of the pseudo-gradient.
        group: the process group joining the sites (one rank per site in the outer group).
        device: where the buffers live.
        name: stable name of the flat buffer (e.g. ``outer/<fragment>``): the parameter
            name in state keys.
        shapes: ``(name, shape)`` of the parameters laid out back to back in the buffer;
            PowerSGD compresses each matrix separately, SEPARATE and PowerSGD send 1-D ones
            densely. None: the buffer is one near-square matrix (padded with zeros).
        reduce: ``"mean"`` (the mean over the group, residuals in the units of the input, the
            one-world path) or ``"sum"`` (the sum: each rank passes its share already scaled,
            its residual is in the units of the result and the ranks' residuals add up to the
            global one whatever the group's size; :meth:`regroup` needs it).

    A :class:`~megatron_ext.protocols.StagedPseudoGradientExchange` with several dependent
    collectives and its codec: an overlapped one runs on DiLoCo's exchange thread.
    """

    asynchronous: ClassVar[bool] = False

    def __init__(
        self,
        method: str,
        options: Any,
        numel: int,
        group: Any,
        device: Any,
        *,
        name: str = "outer",
        shapes: Optional[Sequence[Tuple[str, Sequence[int]]]] = None,
        reduce: str = "mean",
    ):
        _check_method(method)
        if reduce not in ("mean", "sum"):
            raise ValueError(f"outer exchange: reduce must be 'mean' or 'sum', got {reduce!r}")
        cls = OUTER_EXCHANGE_OPTIONS[method]
        if options is None:
            options = outer_defaults(method)
        elif not isinstance(options, cls):
            raise TypeError(
                f"outer exchange {method!r}: options must be a {cls.__name__}, got "
                f"{type(options).__name__}"
            )
        if numel <= 0:
            raise ValueError(f"outer exchange: numel must be positive, got {numel}")
        self.method = method
        self.options = options
        self.numel = int(numel)
        self.group = group
        self.device = torch.device(device)
        self.name = name
        self.reduce = reduce
        self.shapes = None if shapes is None else [(f, tuple(sh)) for f, sh in shapes]
        self.size = group_size(group)
        self.syncs = 0
        self._open = False  # an average(commit=False) waiting for end()
        self._wire = 0
        self._meter = CommMeter()

        if shapes is None:
            # PowerSGD: one near-square matrix (zero padding past numel); SEPARATE packs
            # rows of its block size whatever the shape (a matrix: compressed); the others
            # read the flat buffer.
            if method == "powersgd":
                rows, cols = _near_square(self.numel)
                shape: Tuple[int, ...] = (rows, cols)
            else:
                shape = (1, self.numel) if method == "separate" else (self.numel,)
            self.slices = (ParamSlice(name, 0, math.prod(shape), shape),)
        else:
            slices, pos = [], 0
            for fqn, shape in shapes:
                n = math.prod(shape)
                slices.append(ParamSlice(f"{name}/{fqn}", pos, pos + n, tuple(shape)))
                pos += n
            if pos != self.numel:
                raise ValueError(
                    f"outer exchange {name}: the shapes cover {pos} elements, numel is "
                    f"{self.numel}"
                )
            self.slices = tuple(slices)
        padded = self.slices[-1].end
        self.buffer = torch.zeros(padded, dtype=torch.float32, device=self.device)

        if method == "radius":
            self.reducer: Optional[GradReducer] = None
            self._topk = _TopKExchange(
                options, self.numel, name, group, self.device, mean=reduce == "mean"
            )
            self.bound = None
            return
        self._topk = None
        self.reducer = _make_reducer(method, options)
        spec = BucketGroupSpec.create(
            [(self.buffer, self.slices, name)],
            group,
            op=(
                torch.distributed.ReduceOp.AVG
                if reduce == "mean"
                else torch.distributed.ReduceOp.SUM
            ),
            meter=self._meter,
        )
        self.bound = self.reducer.bind(spec)

    # -- the exchange -----------------------------------------------------------------------

    def average(self, flat: torch.Tensor, *, commit: bool = True) -> torch.Tensor:
        """The mean (``reduce="sum"``: the sum) over the group of every rank's ``flat`` as
        the method reconstructs it.

        Args:
            flat: this rank's fp32 pseudo-gradient, ``(numel,)``; not modified.
            commit: close the call as an applied step (the new residuals kept, ``syncs``
                counted). False: the new residuals stay staged until :meth:`end` says
                whether the step is applied (a caller whose participants vote on the step
                after the exchange, e.g. torchft's ``should_commit``).

        Returns:
            A new ``(numel,)`` fp32 tensor, identical on every rank.

        Raises:
            NonFiniteError: (a RuntimeError) some rank's input plus residual held a NaN or
                Inf (the residuals stay as before the call).
        """
        if self._open:
            raise RuntimeError(f"outer exchange {self.name}: the previous call was not ended")
        if flat.shape != (self.numel,) or flat.dtype != torch.float32:
            raise ValueError(
                f"outer exchange {self.name}: expected a ({self.numel},) float32 tensor, got "
                f"{tuple(flat.shape)} {flat.dtype}"
            )
        self._meter.end_step()  # forget the previous call's counts
        if self._topk is not None:
            out = self._topk.average(flat.to(self.device), self.syncs, self._meter)
        else:
            self.buffer.zero_()
            self.buffer[: self.numel].copy_(flat)
            handle = self.bound.launch(self.syncs)
            if handle is not None:
                handle.wait()
            out = self.buffer[: self.numel].clone()
        if not bool(torch.isfinite(out).all()):
            self._end(applied=False)
            raise NonFiniteError(
                f"megatron-ext: NaN or Inf in the outer exchange '{self.method}' of "
                f"{self.name} at outer sync {self.syncs} (a site's pseudo-gradient plus its "
                "error-feedback residual)"
            )
        self._wire = sum(t.sent for t in self._meter.current_step().values())
        if commit:
            self._end(applied=True)
            self.syncs += 1
        else:
            self._open = True
        return out

    def end(self, applied: bool) -> None:
        """Close an ``average(..., commit=False)``: keep its new residuals and count the sync
        (``applied``) or drop them, leaving the state as it was before the call. A no-op
        when no call is open (one that raised NonFiniteError has already dropped them)."""
        if not self._open:
            return
        self._open = False
        self._end(applied)
        if applied:
            self.syncs += 1

    def _end(self, applied: bool) -> None:
        if self._topk is not None:
            self._topk.end_step(applied)
        else:
            self.reducer.end_step(applied)

    def wire_bytes(self) -> int:
        """Bytes this rank sent in the last call (ring convention)."""
        return self._wire

    def dense_wire_bytes(self) -> int:
        """Bytes a dense fp32 all-reduce of the pseudo-gradient would send per rank."""
        return collective_wire_bytes("all_reduce", 4 * self.numel, self.size)

    # -- error feedback ---------------------------------------------------------------------

    def residual(self) -> torch.Tensor:
        """This rank's error-feedback residual, ``(numel,)`` fp32 in the units of its input:
        the mean over the group's ranks is the global residual (see module docstring)."""
        if self._topk is not None:
            return self._topk.error[: self.numel].clone()
        state = self.reducer.state_dict()
        out = torch.zeros(self.buffer.numel(), dtype=torch.float32, device=self.device)
        for s in self.slices:
            part = out[s.start : s.end]
            for key, weight in (
                (f"worker_error/{s.fqn}", 1.0),
                # held by one owner: x W under AVG
                (f"server_error/{s.fqn}", float(self.size) if self.reduce == "mean" else 1.0),
                (f"error/{s.fqn}", 1.0),
                (f"residual/{s.fqn}", 1.0),
            ):
                if key in state:
                    part.add_(state[key].reshape(-1).to(out), alpha=weight)
        return out[: self.numel]

    # -- another group ----------------------------------------------------------------------

    def regroup(self, group: Any) -> "OuterExchange":
        """This exchange over ``group`` (the sites present changed: another size, another
        position of this rank): a new exchange that carries this one's state. Under
        ``reduce="sum"`` a rank's residual is in the units of the result and the ranks'
        residuals add up to the global one for any group size, so it carries as it is; the
        quantized exchange's server error (the re-quantization error of the partition this
        rank owned, a layout of the old size) is added into this rank's worker error first,
        which leaves the sum unchanged. Raises RuntimeError under ``"mean"`` (a residual
        there is in units of the old size's mean) or with a call open."""
        if self.reduce != "sum":
            raise RuntimeError(f"outer exchange {self.name}: regroup needs reduce='sum'")
        if self._open:
            raise RuntimeError(f"outer exchange {self.name}: regroup with a call open")
        state = self.state_dict()
        for key in [k for k in state if k.startswith("server_error/")]:
            fqn = key[len("server_error/") :]
            state[f"worker_error/{fqn}"] = state[f"worker_error/{fqn}"] + state[key]
            state[key] = torch.zeros_like(state[key])
        new = OuterExchange(
            self.method,
            self.options,
            self.numel,
            group,
            self.device,
            name=self.name,
            shapes=self.shapes,
            reduce=self.reduce,
        )
        new.load_state_dict(state)
        return new

    # -- state ------------------------------------------------------------------------------

    def shared_state_dict(self) -> Dict[str, Any]:
        """:meth:`state_dict` with this rank's residuals zeroed (roles
        :data:`RESIDUAL_ROLES`): the state every rank of the group holds alike, which a rank
        joining the group takes from a peer (it owes nothing of what was sent before)."""
        out = self.state_dict()
        for key, value in out.items():
            if key.split("/", 1)[0] in RESIDUAL_ROLES and torch.is_tensor(value):
                out[key] = torch.zeros_like(value)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Rank-local state: ``syncs`` and the compressor's (tensors cloned)."""
        out: Dict[str, Any] = {"syncs": self.syncs}
        inner = self._topk.state_dict() if self._topk is not None else self.reducer.state_dict()
        out.update(inner)
        return out

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError on missing / unexpected keys."""
        check_state_keys(self.state_dict(), sd, f"outer exchange {self.name}")
        inner = {k: v for k, v in sd.items() if k != "syncs"}
        if self._topk is not None:
            self._topk.load_state_dict(inner)
        else:
            self.reducer.load_state_dict(
                {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inner.items()}
            )
        self.syncs = int(sd["syncs"])


def _make_reducer(method: str, options: Any) -> GradReducer:
    if method == "quantized":
        from megatron_ext.collectives.quantized import QuantizedReducer

        return QuantizedReducer(options)
    if method == "separate":
        from megatron_ext.collectives.separate import SeparateReducer

        return SeparateReducer(options)
    from megatron_ext.collectives.powersgd import PowerSGDReducer

    return PowerSGDReducer(options)


class _TopKExchange:
    """Top-k of ``delta + e`` per chunk with error feedback, all-gathered (module docstring)."""

    def __init__(
        self, cfg: Any, numel: int, name: str, group: Any, device: torch.device, mean: bool
    ):
        self.cfg = cfg
        self.name = name
        self.group = group
        self.mean = mean
        self.size = group_size(group)
        self.chunk = min(TOPK_CHUNK, numel)
        self.chunks = -(-numel // self.chunk)
        self.k = num_selected(self.chunk, cfg.density)
        self.numel = numel
        self.error = torch.zeros(self.chunks * self.chunk, dtype=torch.float32, device=device)
        self._staged: Optional[torch.Tensor] = None

    def average(self, flat: torch.Tensor, sync: int, meter: CommMeter) -> torch.Tensor:
        self._staged = None
        size, group = self.size, self.group
        if sync < self.cfg.dense_steps:
            # Dense warm-up: the exact mean (sum); the residual stays as it is (zero).
            out = flat.clone()
            op = torch.distributed.ReduceOp.AVG if self.mean else torch.distributed.ReduceOp.SUM
            with ProcessGroupTrafficMeter.tagged("dp-grad"):
                torch.distributed.all_reduce(out, op, group)
            wire = collective_wire_bytes("all_reduce", 4 * self.numel, size)
            meter.record("dp-grad", sent=wire, recv=wire)
            return out
        h = self.error.clone()
        h[: self.numel].add_(flat)
        rows = h.view(self.chunks, self.chunk)
        idx = torch.topk(rows.abs(), self.k, dim=1, sorted=False).indices
        values = rows.gather(1, idx)
        residual = h.clone()
        residual.view(self.chunks, self.chunk).scatter_(1, idx, 0.0)
        self._staged = residual
        flag = torch.isfinite(h).logical_not().any().to(torch.float32).reshape(1)
        count = self.chunks * self.k
        mine = torch.cat(
            [
                values.reshape(-1).view(torch.uint8),
                idx.to(torch.int16).reshape(-1).view(torch.uint8),
                flag.view(torch.uint8),
            ]
        )
        gathered = torch.empty(size * mine.numel(), dtype=torch.uint8, device=h.device)
        with ProcessGroupTrafficMeter.tagged("dp-grad"):
            all_gather_flat(gathered, mine, group)
        wire = collective_wire_bytes("all_gather", gathered.numel(), size)
        meter.record(
            "dp-grad",
            sent=wire,
            recv=wire,
            dense_sent=collective_wire_bytes("all_reduce", 4 * self.numel, size),
        )
        per_rank = gathered.view(size, -1)
        total = torch.zeros_like(rows)
        for r in range(size):  # rank by rank: no duplicate index within one scatter_add
            raw = per_rank[r]
            vals = raw[: 4 * count].clone().view(torch.float32).view(self.chunks, self.k)
            where = raw[4 * count : 6 * count].clone().view(torch.int16).view(self.chunks, self.k)
            bad = raw[6 * count :].clone().view(torch.float32)
            total.scatter_add_(1, where.long(), vals)
            total.view(-1)[:1].add_(torch.where(bad > 0, float("inf"), 0.0))
        total = total.view(-1)[: self.numel]
        return (total / size if self.mean else total).contiguous()

    def end_step(self, applied: bool) -> None:
        staged, self._staged = self._staged, None
        if applied and staged is not None:
            self.error = staged

    def state_dict(self) -> Dict[str, Any]:
        return {f"residual/{self.name}": self.error[: self.numel].clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.error.zero_()
        self.error[: self.numel].copy_(state[f"residual/{self.name}"])
