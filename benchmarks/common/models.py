"""Model shapes for settings matched by bytes: GPT presets' weight matrices, PowerSGD's rank.

:func:`equal_bytes_rank` picks PowerSGD's rank so that it sends about as many bytes as a
projection at a given ratio; :func:`gpt_matrix_shapes` lists the weight matrices of a GPT
preset (:func:`load_model_preset`) for the model-wide version.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Tuple

from benchmarks.common.environment import REPO_ROOT

__all__ = [
    "equal_bytes_rank",
    "equal_bytes_rank_for_shapes",
    "squareish_shape",
    "load_model_preset",
    "gpt_matrix_shapes",
    "gpt_vector_numel",
]


def equal_bytes_rank(rows: int, cols: int, ratio: float) -> int:
    """PowerSGD rank sending about as many numbers as a ratio-``ratio`` projection.

    An ``n x m`` matrix at rank ``r`` sends ``P`` (``n x r``) and ``Q`` (``m x r``), so
    ``r = n m / (ratio (n + m))``, rounded to the nearest integer and at least 1.
    """
    if rows <= 0 or cols <= 0 or ratio <= 0:
        raise ValueError(f"need positive sizes and ratio, got {rows}, {cols}, {ratio}")
    return max(1, int(round(rows * cols / (ratio * (rows + cols)))))


def equal_bytes_rank_for_shapes(shapes: Iterable[Tuple[int, int]], ratio: float) -> int:
    """One PowerSGD rank for several matrices: ``sum(n m) / (ratio sum(n + m))``, rounded."""
    from megatron_ext.compressors.lowrank import equal_bytes_rank

    return equal_bytes_rank(shapes, ratio)


def squareish_shape(numel: int) -> Tuple[int, int]:
    """``(n, m)`` with ``n * m == numel`` and ``n <= m`` as close as possible to square."""
    if numel <= 0:
        raise ValueError(f"numel must be positive, got {numel}")
    n = int(math.isqrt(numel))
    while numel % n:
        n -= 1
    return n, numel // n


def load_model_preset(name: str = "gpt-tiny") -> Dict[str, Any]:
    """The YAML mapping of ``configs/models/<name>.yaml``."""
    import yaml

    path = REPO_ROOT / "configs" / "models" / f"{name}.yaml"
    with open(path) as f:
        return yaml.safe_load(f) or {}


def gpt_matrix_shapes(preset: Dict[str, Any]) -> List[Tuple[int, int]]:
    """Weight matrices (2-D parameters) of a GPT-2-style megatron-core model, as (rows, cols).

    Word and position embeddings, per layer QKV ``(3h, h)``, attention output ``(h, h)``,
    MLP ``(f, h)`` and ``(h, f)``, and the output layer when untied. GPT-2 style only
    (no GQA / SwiGLU); enough for the equal-bytes rank of the benchmarks' gpt-tiny.
    """
    h = int(preset["hidden_size"])
    f = int(preset.get("ffn_hidden_size") or 4 * h)
    v = int(preset["vocab_size"])
    s = int(preset.get("max_position_embeddings") or preset["seq_length"])
    shapes = [(v, h), (s, h)]
    for _ in range(int(preset["num_layers"])):
        shapes += [(3 * h, h), (h, h), (f, h), (h, f)]
    if preset.get("untie_embeddings_and_output_weights"):
        shapes.append((v, h))
    return shapes


def gpt_vector_numel(preset: Dict[str, Any]) -> int:
    """Entries of the 1-D parameters (biases, LayerNorms) of the same model."""
    h = int(preset["hidden_size"])
    f = int(preset.get("ffn_hidden_size") or 4 * h)
    # Per layer: 2 LayerNorms (2h each), QKV bias 3h, proj bias h, fc1 bias f, fc2 bias h.
    return int(preset["num_layers"]) * (2 * 2 * h + 3 * h + h + f + h) + 2 * h
