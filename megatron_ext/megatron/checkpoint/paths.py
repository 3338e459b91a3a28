"""Where checkpoints live: Megatron-LM's ``iter_XXXXXXX`` directories and latest marker.

What it does:
    :func:`checkpoint_dir` names ``<root>/iter_XXXXXXX``; :func:`latest_iteration` reads
    ``<root>/latest_checkpointed_iteration.txt``; :func:`resolve_load` turns ``--load`` into
    the iteration directory to read, with Megatron-LM's resume semantics (a directory or one
    ``iter_XXXXXXX`` of it; a directory without a checkpoint is refused unless it is also
    ``--save``, so a typo never trains from scratch over the checkpoints it meant to resume).

Why apart:
    The driver resolves ``--load`` before training (a refusal costs no model build), and the
    save, the free-space check and the failure report all need the same layout.

Constraints:
    Nothing here reads a checkpoint's contents: a directory is a checkpoint when it holds
    dist_checkpointing's ``metadata.json``. The marker is written last by a save (see
    :mod:`.save`), so it always names a complete checkpoint.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from megatron_ext.megatron.checkpoint.errors import CheckpointError

_TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    """``<root>/iter_XXXXXXX`` (Megatron-LM's naming)."""
    return os.path.join(root, f"iter_{iteration:07d}")


_ITER_DIR = re.compile(r"^iter_(\d+)$")


def latest_iteration(root: str) -> Optional[int]:
    """Iteration in ``<root>/latest_checkpointed_iteration.txt``, or None without one.

    Raises:
        CheckpointError: the tracker is unreadable or does not hold an iteration number
            (naming the file).
    """
    path = os.path.join(root, _TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
        text = raw.decode("ascii").strip()
        iteration = int(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot read the latest iteration from {path}: {raw[:32]!r} is not an iteration "
            f"number ({type(exc).__name__}); write the number of an iter_XXXXXXX directory "
            "there, or pass that directory as --load"
        ) from None
    if iteration < 0:
        raise CheckpointError(f"{path} holds a negative iteration ({iteration})")
    return iteration


def _is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` is a dist_checkpointing checkpoint (it has metadata.json)."""
    return os.path.isfile(os.path.join(directory, "metadata.json"))


def resolve_load(load: str, *, save: Optional[str] = None) -> Optional[Tuple[str, int]]:
    """The checkpoint ``--load`` names: ``(iteration directory, iteration)``.

    * ``--load DIR/iter_XXXXXXX``: that iteration;
    * ``--load DIR``: the iteration in ``DIR/latest_checkpointed_iteration.txt``;
    * ``--load DIR`` that does not exist or holds no checkpoint: None (start from scratch)
      only when ``DIR`` is also ``--save`` (Megatron-LM's auto-resume convention: an empty
      or absent save directory means a first run); otherwise refused, so a typo never
      trains from scratch and overwrites the checkpoints it was meant to resume.

    Raises:
        CheckpointError: naming the path (see above; also an unreadable tracker, or a
            tracker naming an iteration whose directory is missing).
    """
    path = os.path.normpath(load)
    match = _ITER_DIR.match(os.path.basename(path))
    if match and os.path.isdir(path):
        if not _is_checkpoint(path):
            raise CheckpointError(f"{path} holds no checkpoint (no metadata.json)")
        return path, int(match.group(1))
    iteration = latest_iteration(path) if os.path.isdir(path) else None
    if iteration is not None:
        directory = checkpoint_dir(path, iteration)
        if not _is_checkpoint(directory):
            raise CheckpointError(
                f"{os.path.join(path, _TRACKER)} names iteration {iteration}, but {directory} "
                "holds no checkpoint"
            )
        return directory, iteration
    if save is not None and os.path.abspath(path) == os.path.abspath(os.path.normpath(save)):
        return None
    if not os.path.exists(path):
        problem = f"{path} does not exist"
    else:
        names = os.listdir(path) if os.path.isdir(path) else []
        found = sorted(n for n in names if _ITER_DIR.match(n))
        problem = f"{path} holds no checkpoint (no {_TRACKER})" + (
            f"; it has {', '.join(found)}: pass one of them as --load" if found else ""
        )
    raise CheckpointError(
        f"{problem}. To start from scratch drop --load; --load equal to --save resumes when "
        "that directory holds a checkpoint and starts from scratch when it does not"
    )
