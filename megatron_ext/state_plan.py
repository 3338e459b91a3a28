"""Grass's and Protocol Models' method state per GPU, from the model shape, without torch.

What it does:
    :class:`ModelShape` is a GPT / LLaMA model as Megatron-LM builds it from its flags
    (layers, hidden, FFN, heads, query groups, vocabulary padded as Megatron-LM pads it,
    SwiGLU, biases, learned positions); :func:`model_params` lists megatron-core's
    parameter names and unsharded shapes. From these:

    * :func:`grass_plan`: every projected weight of one pipeline stage on one
      tensor-parallel rank, split into its parts as ``megatron_ext.megatron.grass`` splits
      it (Q, K, V of ``linear_qkv``; gate and up of a SwiGLU ``linear_fc1``; ``r`` rows or
      columns each, ``r / TP`` where the ranks hold disjoint ones), and what Grass keeps:
      the virtual parameters ``V`` with megatron's gradient and Adam state of them, the
      selection (``index``, ``rho``, unique rows, slot table, the fp32 ``base`` rows, the
      column-part helpers) and, at a selection step, the sketches ``G Omega`` and ``Omega``
      with the flat copy of the sketches that is all-reduced; against it, the gradient and Adam state the projected weights would have dense.
    * :func:`protocol_plan`: per pipeline stage, the basis ``U`` (``d x k`` fp32),
      ``T_fixed`` (padded vocabulary x ``d`` in the parameter dtype, on every stage) and
      the Grassmann accumulator ``A`` (``d x d`` fp32, kept, and the step's staged one) on
      the last stage when the subspace moves.

    ``megatron_ext.preflight`` prints these before a job starts and
    ``benchmarks/state_memory.py`` reports them beside its meta-tensor measurement of the
    real classes (``tests/unit/test_state_memory.py`` checks that the two agree).

Why:
    A run whose method state does not fit should say so before a job waits in a queue;
    one computation of it, so that the launch and the benchmark cannot disagree.

Constraints:
    Imports neither torch nor Megatron (the pre-flight runs on every node before torchrun,
    in about 0.1 s). Selection buffers are counted for distinct rows (Top-r, the rules
    without replacement, uniform with replacement drawing no duplicates); with
    replacement a duplicate row shrinks ``base`` and widens the slot table, so the figure
    is within a few int64 per slot. The parameter dtype decides megatron's bytes per
    element: bf16: 2 (parameter) + 4 (fp32 gradient, Megatron-LM accumulates bf16
    gradients in fp32) + 12 (fp32 main parameter and two moments); fp16: 2 + 2 + 12;
    fp32: 4 + 4 + 8. Layers are spread evenly over pipeline stages (no uneven first or
    last stage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "ModelShape",
    "model_params",
    "padded_vocab",
    "TOKENIZER_VOCAB",
    "GrassWeight",
    "GrassPlan",
    "grass_plan",
    "ProtocolPlan",
    "protocol_plan",
    "DTYPE_BYTES",
    "format_bytes",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257}
"""Vocabulary sizes known from ``--tokenizer-type`` alone (others load a model file)."""


def format_bytes(n: float) -> str:
    """``1.50 GB`` style (decimal units)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.2f} TB"


def padded_vocab(vocab: int, multiple: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron-LM's padded vocabulary: a multiple of ``--make-vocab-size-divisible-by``
    x TP."""
    m = multiple * tensor_parallel
    return -(-vocab // m) * m


@dataclass(frozen=True)
class ModelShape:
    """A GPT / LLaMA model as megatron-core builds it (unsharded)."""

    num_layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: Optional[int]
    """Padded vocabulary (None: unknown before the tokenizer loads)."""
    seq: int
    kv_heads: Optional[int] = None
    """Query groups (None: as many as heads)."""
    kv_channels: Optional[int] = None
    swiglu: bool = False
    bias: bool = True
    learned_positions: bool = True
    untied: bool = False

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def groups(self) -> int:
        return self.kv_heads or self.heads

    @property
    def qkv_rows(self) -> Tuple[int, int, int]:
        """Rows of Q, K and V in ``linear_qkv``."""
        return self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim


def model_params(shape: ModelShape) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(megatron-core FQN, unsharded shape)`` of every parameter, in model order."""
    h, f = shape.hidden, shape.ffn
    v = shape.vocab or 0
    bias = shape.bias
    qkv = sum(shape.qkv_rows)
    proj_in = shape.qkv_rows[0]
    fc1 = 2 * f if shape.swiglu else f
    norm = ("weight", "bias") if bias else ("weight",)
    out: List[Tuple[str, Tuple[int, ...]]] = [("embedding.word_embeddings.weight", (v, h))]

    def linear(name: str, rows: int, cols: int) -> None:
        """A linear layer's ``weight`` (``rows x cols``) and, with biases, its ``bias``."""
        out.append((name + ".weight", (rows, cols)))
        if bias:
            out.append((name + ".bias", (rows,)))

    if shape.learned_positions:
        out.append(("embedding.position_embeddings.weight", (shape.seq, h)))
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        out += [(p + f"self_attention.linear_qkv.layer_norm_{n}", (h,)) for n in norm]
        linear(p + "self_attention.linear_qkv", qkv, h)
        linear(p + "self_attention.linear_proj", h, proj_in)
        out += [(p + f"mlp.linear_fc1.layer_norm_{n}", (h,)) for n in norm]
        linear(p + "mlp.linear_fc1", fc1, h)
        linear(p + "mlp.linear_fc2", h, f)
    out += [(f"decoder.final_layernorm.{n}", (h,)) for n in norm]
    if shape.untied:
        out.append(("output_layer.weight", (v, h)))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _projected(m: int, n: int) -> str:
    """``autograd.grass.projected_dim``: 'row' if ``m <= n`` else 'col'."""
    return "row" if m <= n else "col"


# -- Grass -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrassWeight:
    """One projected weight on one tensor-parallel rank."""

    fqn: str
    local_shape: Tuple[int, int]
    mode: str
    parts: int
    rank: int
    """``r`` of each part on this rank."""
    units: int
    """Rows (row mode) or columns of the parts side by side (col mode) selected from."""
    part_rows: Optional[Tuple[Tuple[int, int], ...]] = None
    """Row mode with parts: each part's rows of the local weight (``(start, length)`` per
    query group block, flattened by :meth:`part_row_lists`)."""

    @property
    def virtual_shape(self) -> Tuple[int, int]:
        """``autograd.grass.virtual_shape``."""
        m, n = self.local_shape
        if self.mode == "row":
            return (self.parts * self.rank, n)
        return (m // self.parts, self.parts * self.rank)

    @property
    def other(self) -> int:
        """Length of a selected unit (a row of ``base``)."""
        m, n = self.local_shape
        return n if self.mode == "row" else m // self.parts


@dataclass(frozen=True)
class GrassPlan:
    """Grass's state of one GPU (the fullest pipeline stage): see :func:`grass_plan`."""

    weights: List[GrassWeight]
    virtual_elements: int
    projected_elements: int
    virtual_bytes: int
    """``V`` with megatron's gradient and Adam state (``bytes_per_virtual`` each)."""
    dense_bytes: int
    """The gradient and Adam state the projected weights would have dense."""
    selection_bytes: int
    """What the layers keep between selections (indices, scales, slot table, fp32 rows)."""
    sketch_bytes: int
    """At a selection step: every layer's sketch and ``Omega`` (fp32), kept until the
    selection after the backward."""
    sketch_reduce_bytes: int
    """At a selection step: the flat copy of every sketch that ``optim.grass`` all-reduces
    over data parallelism (the sketches' own storage is freed once it is made)."""
    bytes_per_virtual: int
    bytes_per_dense: int
    layers_per_stage: int

    @property
    def total(self) -> int:
        """Persistent bytes plus the selection step's sketches and their flat copy."""
        return (
            self.virtual_bytes + self.selection_bytes + self.sketch_bytes + self.sketch_reduce_bytes
        )

    @property
    def saved(self) -> int:
        """Dense gradient + Adam state of the projected weights minus Grass's state."""
        return self.dense_bytes - self.total


def _needs_sketch(method: str, rank: int, size: int) -> bool:
    """``autograd.grass.needs_sketch`` (kept equal by the agreement test)."""
    if method in ("uniform", "uniform-nr"):
        return False
    if rank >= size and method in ("topr", "norm-nr", "norm2-nr"):
        return False
    return True


def _grass_weight(shape: ModelShape, fqn: str, unsharded: Tuple[int, int], tp: int, r: int):
    """The parts of one weight as ``megatron.grass._plan`` splits them on a TP rank."""
    m, n = unsharded
    column = not fqn.endswith(("linear_proj", "linear_fc2"))
    local = (m // tp, n) if column else (m, n // tp)

    def local_rank(mode: str) -> int:
        split = column == (mode == "row")
        if split and tp > 1:
            if r % tp:
                raise ValueError(
                    f"--grass-rank {r} does not split over --tensor-model-parallel-size {tp} "
                    f"(the ranks hold disjoint {mode}s of {fqn})"
                )
            return r // tp
        return r

    if fqn.endswith("linear_qkv"):
        q, k, v = shape.qkv_rows
        if any(_projected(rows, n) != "row" for rows in (q, k, v)):
            raise ValueError(
                f"{fqn}: Q, K or V has more rows than columns; Grass does not split a fused "
                "QKV weight by columns (leave linear_qkv out of --grass-layers)"
            )
        groups = shape.groups // tp
        hn, qg = shape.head_dim, shape.heads // shape.groups * shape.head_dim
        stride = qg + 2 * hn
        blocks = (
            tuple((g * stride, qg) for g in range(groups)),
            tuple((g * stride + qg, hn) for g in range(groups)),
            tuple((g * stride + qg + hn, hn) for g in range(groups)),
        )
        rl = local_rank("row")
        return GrassWeight(fqn, local, "row", 3, rl, local[0], part_rows=blocks)
    if fqn.endswith("linear_fc1") and shape.swiglu:
        f = m // 2
        mode = _projected(f, n)
        rl = local_rank(mode)
        fl = f // tp
        if mode == "row":
            rows = (((0, fl),), ((fl, fl),))
            return GrassWeight(fqn, local, "row", 2, rl, local[0], part_rows=rows)
        return GrassWeight(fqn, local, "col", 2, rl, 2 * n)
    mode = _projected(m, n)
    rl = local_rank(mode)
    return GrassWeight(fqn, local, mode, 1, rl, local[0] if mode == "row" else local[1])


def _part_units(w: GrassWeight) -> List[int]:
    if w.mode == "row":
        if w.part_rows is None:
            return [w.local_shape[0]]
        return [sum(length for _, length in blocks) for blocks in w.part_rows]
    return [w.local_shape[1]] * w.parts


def grass_plan(
    shape: ModelShape,
    *,
    rank: int,
    method: str = "topr",
    sketch_size: int = 256,
    layers: str,
    params_dtype: str = "bf16",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> GrassPlan:
    """Grass's state on the GPU holding the most projected weights (module docstring).

    Args:
        shape: the model.
        rank: ``--grass-rank`` (per part, unsharded).
        method: ``--grass-method``.
        sketch_size: ``--grass-sketch-size``.
        layers: ``--grass-layers`` (a regular expression over module names).
        params_dtype: "bf16", "fp16" or "fp32" (``--bf16`` / ``--fp16``).
        tensor_parallel, pipeline_parallel: the parallel sizes.

    Raises:
        ValueError: a rank that exceeds a part's projected dimension or does not split over
            TP, or a layout Grass refuses (naming the flag).
    """
    tp, pp = tensor_parallel, pipeline_parallel
    per_stage = -(-shape.num_layers // pp)
    regex = re.compile(layers)
    weights: List[GrassWeight] = []
    projected = 0
    for name, pshape in model_params(shape):
        if not name.endswith(".weight") or len(pshape) != 2:
            continue
        module = name[: -len(".weight")]
        if not module.startswith("decoder.layers.") or not regex.search(module):
            continue
        if int(module.split(".")[2]) >= per_stage:  # the first stage stands for every stage
            continue
        w = _grass_weight(shape, module, pshape, tp, rank)
        for units in _part_units(w):
            if w.rank > units:
                raise ValueError(
                    f"--grass-rank {rank} exceeds the projected dimension of {module} "
                    f"({units * (tp if w.rank != rank else 1)} {w.mode}s in a part)"
                )
        weights.append(w)
        projected += _numel(w.local_shape)
    if not weights:
        raise ValueError(f"--grass-layers {layers!r} matches no linear layer of the model")
    item = DTYPE_BYTES[params_dtype]
    grad = 2 if params_dtype == "fp16" else 4
    adam = 8 if params_dtype == "fp32" else 12
    virtual = sum(_numel(w.virtual_shape) for w in weights)
    selection = sketch = flat = 0
    for w in weights:
        slots = w.parts * w.rank
        # index, unique, slots (int64), rho (fp32), base (fp32 rows)
        selection += slots * (8 + 8 + 8 + 4) + 4 * slots * w.other
        if w.mode == "col" and w.parts > 1:
            selection += 3 * 8 * slots  # slot column, unit block, unit column
        if _needs_sketch(method, w.rank, min(_part_units(w))):
            cols = w.other if sketch_size == 0 else sketch_size
            sketch += 4 * w.units * cols  # G Omega (or G)
            flat += 4 * w.units * cols
            if sketch_size:
                sketch += 4 * w.other * sketch_size  # Omega
    return GrassPlan(
        weights=weights,
        virtual_elements=virtual,
        projected_elements=projected,
        virtual_bytes=virtual * (item + grad + adam),
        dense_bytes=projected * (grad + adam),
        selection_bytes=selection,
        sketch_bytes=sketch,
        sketch_reduce_bytes=flat,
        bytes_per_virtual=item + grad + adam,
        bytes_per_dense=grad + adam,
        layers_per_stage=per_stage,
    )


# -- Protocol Models ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProtocolPlan:
    """Protocol Models' state per pipeline stage: see :func:`protocol_plan`."""

    k: int
    u_bytes: int
    """``U``: ``d x k`` fp32, every stage."""
    fixed_bytes: Optional[int]
    """``T_fixed``: padded vocabulary x ``d`` in the parameter dtype, every stage (None:
    vocabulary unknown)."""
    fixed_bytes_per_row: int
    accumulator_bytes: int
    """``A`` and the step's staged ``g^T g`` (``2 x d x d`` fp32) on the last stage when
    the subspace moves, else 0."""
    per_stage: List[int] = field(default_factory=list)
    """Bytes of each stage (``T_fixed`` counted as 0 when the vocabulary is unknown)."""

    @property
    def per_gpu_max(self) -> int:
        return max(self.per_stage)


def protocol_plan(
    shape: ModelShape,
    *,
    k: int,
    update_interval: int,
    params_dtype: str = "bf16",
    pipeline_parallel: int = 1,
) -> ProtocolPlan:
    """Protocol Models' state per stage (module docstring).

    Args:
        shape: the model (``vocab`` padded, None if unknown).
        k: the subspace rank (``SubspaceConfig.rank_for(hidden)``).
        update_interval: ``--subspace-update-interval`` (0: ``U`` never moves, no ``A``).
        params_dtype: "bf16", "fp16" or "fp32" (``T_fixed``'s dtype).
        pipeline_parallel: stages.
    """
    d = shape.hidden
    u = 4 * d * k
    row = DTYPE_BYTES[params_dtype] * d
    fixed = None if shape.vocab is None else shape.vocab * row
    acc = 2 * 4 * d * d if update_interval > 0 and pipeline_parallel > 1 else 0
    per_stage = [u + (fixed or 0)] * pipeline_parallel
    per_stage[-1] += acc
    return ProtocolPlan(
        k=k,
        u_bytes=u,
        fixed_bytes=fixed,
        fixed_bytes_per_row=row,
        accumulator_bytes=acc,
        per_stage=per_stage,
    )
