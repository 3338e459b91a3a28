"""Protocol Models' subspace: the shared basis ``U``, projections, and the Grassmann step.

What it does:
    A :class:`Subspace` holds ``U`` (``d x k``, orthonormal columns, fp32) spanning
    ``S``, the frozen high-rank token embedding ``T_fixed`` (``vocab x d``), and the
    accumulator ``A = sum G^T G`` (``d x d``) of the gradients at the last compressed
    boundary (:meth:`Subspace.accumulate`), from which the energy those gradients have
    outside ``S`` is ``sum |G - G U U^T|^2 = tr(A) - tr(U^T A U)`` for any ``U``.

    (Accumulating ``A += R^T R`` with the residual ``R = G - G U U^T`` instead gives an
    ``A`` that annihilates the ``U`` it was accumulated under, ``A U = 0``, and the
    Euclidean gradient ``-2 A U`` vanishes. The paper's closed form, section 6, expands ``|G - G U U^T|^2``
    with the symmetric accumulation of the gradients themselves, which is what we keep.)

    :func:`project` maps a tensor onto ``S`` along its ``d`` axis (``U U^T W`` for a
    writer's ``d x n`` weight, ``W U U^T`` for an embedding's ``vocab x d`` table);
    :func:`coordinates` gives the ``k`` coordinates (``U^T W``, ``W U``) and
    :func:`from_coordinates` writes a tensor back from them in place, so that the optimizer
    keeps ``k / d`` of a weight instead of a copy of it (the ``vocab x d`` embedding
    included) and projects in place.

    :func:`grassmann_step` moves ``U`` along the Grassmann manifold to reduce
    ``f(U) = tr(A) - tr(U^T A U)``, the boundary-gradient energy the subspace misses:
    Euclidean gradient ``-2 A U``, Riemannian gradient ``(I - U U^T)(-2 A U)``, a step of
    size ``lr``, then the QR retraction (column signs fixed so that ``R`` has a positive
    diagonal: the retraction is continuous in the step). ``A`` is normalized by its largest
    eigenvalue first, so ``lr`` does not depend on the gradients' scale and ``lr = 0.5`` is
    close to one step of subspace iteration towards ``A``'s top-``k`` eigenvectors
    (the paper leaves the scale open; this is our choice: docs/methods/protocol.md, "Step
    size").

Why seeds:
    Every stage and data-parallel replica must hold the same ``U`` and ``T_fixed`` without
    sending them: both are generated from ``--subspace-seed`` (``T_fixed`` with a derived
    seed), so any rank reproduces them bit-identically; only updated ``U`` travel. ``U``
    (``d x k``) comes from the CPU generator. ``T_fixed`` (``vocab x d``: 1 GiB in bf16 at
    128k x 4096) is drawn directly on the model's device in the model's dtype, by that
    device's generator (Philox on CUDA), so no fp32 or host copy of it is ever made; ranks
    agree as long as they build their models on the same kind of device, which megatron's
    ``--use-cpu-initialization`` (one flag for every rank) ensures.

Constraints:
    Pure torch; never imports Megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Mapping, Optional

import torch

from megatron_ext.protocols import RESET, SAME, TOTAL

__all__ = [
    "Subspace",
    "SubspaceUser",
    "orthonormal_basis",
    "fixed_embedding",
    "project",
    "project_",
    "coordinates",
    "from_coordinates",
    "residual_energy",
    "grassmann_step",
]

_FIXED_SEED_OFFSET = 7919
"""Added to the subspace seed for the generator of ``T_fixed`` (independent of ``U``'s)."""


def orthonormal_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """``d x k`` fp32 matrix with orthonormal columns: the Q of a seeded Gaussian (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32).contiguous()


def fixed_embedding(
    rows: int,
    d: int,
    std: float,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
) -> torch.Tensor:
    """The frozen token embedding ``T_fixed``: ``rows x d`` Gaussian of ``std``, drawn in
    ``dtype`` on ``device`` by that device's generator (module docstring)."""
    device = torch.device(device)
    gen = None  # meta tensors hold no values: nothing to seed
    if device.type != "meta":
        gen = torch.Generator(device=device).manual_seed(seed + _FIXED_SEED_OFFSET)
    out = torch.randn(rows, d, generator=gen, dtype=dtype, device=device)
    return out.mul_(std)


def project(t: torch.Tensor, u: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` projected onto ``span(u)`` along dimension ``axis`` (computed in fp32; returned
    in ``t``'s dtype). ``axis`` is the dimension of size ``d``."""
    x = t.float().movedim(axis, -1)
    x = (x @ u) @ u.t()
    return x.movedim(-1, axis).to(t.dtype)


def coordinates(t: torch.Tensor, u: torch.Tensor, axis: int) -> torch.Tensor:
    """The coordinates of ``t`` in ``span(u)`` along ``axis`` (fp32): ``t U`` when ``axis``
    is the last dimension (``vocab x d`` -> ``vocab x k``; a bias ``d`` -> ``k``), ``U^T t``
    when it is the first (``d x n`` -> ``k x n``)."""
    x = t.float()
    if t.dim() == 1 and axis == 0:
        # matmul's own path for a vector (mm, then an in-place squeeze, which the cost model
        # would count as a launch): the same product
        return x.unsqueeze(0).mm(u).squeeze(0)
    if axis == t.dim() - 1:
        return x @ u
    if axis == 0:
        return u.t() @ x
    raise ValueError(f"the subspace axis must be the first or last dimension, got {axis}")


def from_coordinates(c: torch.Tensor, u: torch.Tensor, axis: int, out: torch.Tensor) -> None:
    """Write the tensor with coordinates ``c`` (:func:`coordinates`) into ``out`` in place:
    ``C U^T`` or ``U C``. An fp32 ``out`` takes the product directly (no temporary of its
    size); another dtype takes it through one fp32 temporary."""
    if out.dim() == 1:  # a bias: U c (matmul's out= would reshape a vector-matrix product)
        a, b = u, c
    elif axis == out.dim() - 1:
        a, b = c, u.t()
    elif axis == 0:
        a, b = u, c
    else:
        raise ValueError(f"the subspace axis must be the first or last dimension, got {axis}")
    if out.dtype == torch.float32 and out.is_contiguous():
        torch.matmul(a, b, out=out)
    else:
        out.copy_(a @ b)


def project_(t: torch.Tensor, u: torch.Tensor, axis: int) -> torch.Tensor:
    """:func:`project` in place (through the ``k`` coordinates); returns ``t``."""
    from_coordinates(coordinates(t, u, axis), u, axis, t)
    return t


def residual_energy(a: torch.Tensor, u: torch.Tensor) -> float:
    """``f(U) = tr(A) - tr(U^T A U)``: the energy of the accumulated gradients outside
    ``span(U)`` (``A = sum G^T G``)."""
    return float(torch.trace(a) - torch.trace(u.t() @ a @ u))


def grassmann_step(u: torch.Tensor, a: torch.Tensor, lr: float) -> torch.Tensor:
    """One Riemannian gradient step on ``f(U)`` with QR retraction (module docstring).

    Args:
        u: current basis, ``d x k`` orthonormal (fp32).
        a: accumulated ``sum G^T G`` (``d x d``, symmetric positive semi-definite).
        lr: step size on the objective normalized by ``A``'s largest eigenvalue.

    Returns:
        The new basis (fp32, orthonormal columns). ``u`` itself when ``A`` is zero.
    """
    a = a.double()
    scale = float(torch.linalg.eigvalsh(a)[-1]) if a.abs().sum() > 0 else 0.0
    if not scale > 0:
        return u.clone()
    a = a / scale
    u64 = u.double()
    egrad = -2.0 * (a @ u64)
    rgrad = egrad - u64 @ (u64.t() @ egrad)
    q, r = torch.linalg.qr(u64 - lr * rgrad)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32).contiguous()


class Subspace:
    """The shared subspace of one run (see module docstring).

    Args:
        hidden_size: ``d``.
        rank: ``k`` (< ``d``).
        seed: seed of the initial ``U`` and of ``T_fixed``.
    """

    elastic_rules: ClassVar[Mapping[str, str]] = {
        "u": SAME,
        "seed": SAME,
        "rank": SAME,
        "updates": SAME,
        "a": TOTAL,
        "accumulated": RESET,
    }

    def __init__(self, hidden_size: int, rank: int, seed: int):
        if not 0 < rank < hidden_size:
            raise ValueError(f"subspace rank must be in [1, {hidden_size - 1}], got {rank}")
        self.d = hidden_size
        self.k = rank
        self.seed = seed
        self.u = orthonormal_basis(hidden_size, rank, seed)
        self.a: Optional[torch.Tensor] = None
        self.accumulated = 0
        """Boundary gradients (microbatches) accumulated into ``A`` since the last update."""
        self._pending_a: Optional[torch.Tensor] = None
        self._pending = 0
        self.updates = 0
        """Grassmann updates taken."""
        self.fixed: Optional[torch.Tensor] = None

    # -- tensors on the model's device ---------------------------------------------------

    def to(self, device: Any) -> "Subspace":
        """Move ``U`` (and ``A``, ``T_fixed``) to ``device``."""
        self.u = self.u.to(device)
        if self.a is not None:
            self.a = self.a.to(device)
        if self.fixed is not None:
            self.fixed = self.fixed.to(device)
        return self

    def on(self, device: Any) -> "Subspace":
        """Make sure the tensors are on ``device`` (moves them at most once per device)."""
        if self.u.device != torch.device(device):
            self.to(device)
        return self

    def make_fixed(self, rows: int, std: float, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """Create (once) and return ``T_fixed`` of ``rows`` rows in ``dtype`` on ``device``."""
        if self.fixed is None:
            self.fixed = fixed_embedding(rows, self.d, std, self.seed, dtype=dtype, device=device)
        elif self.fixed.shape[0] != rows:
            raise ValueError(f"T_fixed has {self.fixed.shape[0]} rows, asked for {rows}")
        return self.fixed

    def set_basis(self, u: torch.Tensor) -> None:
        """Replace ``U`` (after a Grassmann update) and clear ``A``."""
        self.u = u.to(device=self.u.device, dtype=torch.float32).contiguous()
        if self.a is not None:
            self.a.zero_()
        self.accumulated = 0
        self.updates += 1

    # -- the boundary gradient -----------------------------------------------------------

    def accumulate(self, g: torch.Tensor) -> None:
        """``A += g^T g`` for boundary gradients ``g`` (``... x d``), staged until
        :meth:`end_step`: a step the optimizer skips (an fp16 overflow, whose gradients may
        be infinite) must not enter ``A``."""
        g = g.reshape(-1, self.d).float()
        if self._pending_a is None:
            self._pending_a = torch.zeros(self.d, self.d, dtype=torch.float32, device=g.device)
        self._pending_a.addmm_(g.t(), g)
        self._pending += 1

    def end_step(self, applied: bool) -> None:
        """Add the step's staged ``g^T g`` to ``A`` if the optimizer applied the step, else
        drop it (called first by the optimizer hook's ``post_step``, before an update)."""
        pending, self._pending_a = self._pending_a, None
        count, self._pending = self._pending, 0
        if pending is None or not applied:
            return
        if self.a is None:
            self.a = pending
        else:
            self.a.add_(pending)
        self.accumulated += count

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "u": self.u.detach().cpu().clone(),
            "seed": self.seed,
            "rank": self.k,
            "updates": self.updates,
            "accumulated": self.accumulated,
        }
        if self.a is not None:
            out["a"] = self.a.detach().cpu().clone()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        known = {"u", "seed", "rank", "updates", "accumulated", "a"}
        unexpected = set(state) - known
        missing = {"u", "seed", "rank", "updates", "accumulated"} - set(state)
        if missing or unexpected:
            raise ValueError(
                f"subspace state: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        if int(state["rank"]) != self.k or int(state["seed"]) != self.seed:
            raise ValueError(
                f"subspace state has rank {state['rank']} seed {state['seed']}, this run "
                f"rank {self.k} seed {self.seed}"
            )
        self.u = state["u"].to(device=self.u.device, dtype=torch.float32).contiguous()
        self.updates = int(state["updates"])
        self.accumulated = int(state["accumulated"])
        if "a" in state:
            self.a = state["a"].to(device=self.u.device, dtype=torch.float32).clone()
        elif self.a is not None:
            self.a.zero_()


class SubspaceUser:
    """Base of the objects that work in a run's :class:`Subspace` (the pipeline codec, the
    optimizer correction): the method builds them before the model exists and its model
    transform, which knows the hidden size, sets ``subspace``."""

    def __init__(self, subspace: Optional[Subspace] = None):
        self._subspace = subspace

    @property
    def subspace(self) -> Subspace:
        """The run's subspace (a clear error if used before the model transform set it)."""
        if self._subspace is None:
            raise RuntimeError(
                f"megatron-ext: {type(self).__name__} used before the model transform of "
                "Protocol Models set its subspace"
            )
        return self._subspace

    @subspace.setter
    def subspace(self, subspace: Subspace) -> None:
        self._subspace = subspace
