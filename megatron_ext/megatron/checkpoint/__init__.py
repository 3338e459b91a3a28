"""Checkpoints of the ``megatron-ext train`` driver through megatron-core dist_checkpointing.

:func:`save_checkpoint` writes ``<save>/iter_XXXXXXX/`` (torch_dist format) and
``<save>/latest_checkpointed_iteration.txt``, Megatron-LM's layout: the model, the optimizer
(the distributed optimizer in ``dp_reshardable`` form, as Megatron-LM saves it), the LR
scheduler, the iteration and consumed samples, every rank's RNG states and megatron_ext's
per-rank state (:class:`~megatron_ext.state.ExtState`). :func:`load_checkpoint` restores all
of it so that a resumed run continues bit for bit, with Megatron-LM's resume semantics, and
checks what it reads.

One module per job:

* :mod:`.paths`: the ``iter_XXXXXXX`` directories and the latest marker; what ``--load``
  names (:func:`resolve_load`, :func:`latest_iteration`, :func:`checkpoint_dir`);
* :mod:`.errors`: :class:`CheckpointError` (``--load`` refused) and
  :class:`CheckpointSaveError` (a save that could not be written);
* :mod:`.state_dict`: the sharded state dict a save writes and a load reads;
* :mod:`.ext_state`: megatron_ext's per-rank state and its layout/settings check
  (:func:`sharded_state_object`, :func:`ext_meta`, :func:`decide_load`; shared with the
  Megatron-LM adapter);
* :mod:`.save`: :func:`save_checkpoint`; :mod:`.space`: the free-space check before it
  (:func:`check_free_space`); :mod:`.save_failure`: a failed save's clean-up and one-line
  reason;
* :mod:`.optimizer_state`: the distributed optimizer toggled (:func:`check_optimizer_kind`),
  torch Adam's step workaround, the dummy state a first load needs
  (:func:`init_optimizer_state_for_load`);
* :mod:`.schedule`: the LR schedule check (:func:`check_scheduler`) and the LR bounds
  (:func:`align_lr_bounds_for_load`, :func:`apply_lr_bounds`);
* :mod:`.reading`: a read failure names the file (:func:`load_common_state`,
  :func:`read_error`, :func:`unreadable_file`); :mod:`.finite`: every loaded value finite
  (:func:`check_finite`, :func:`sharded_leaves`; shared with the Megatron-LM adapter);
* :mod:`.topology` and :mod:`.reshard`: elastic resume on another data-parallel size (the
  record a save writes; the plan and the remap at load);
* :mod:`.load`: :func:`load_checkpoint`.

The names below are re-exported here, so ``megatron_ext.megatron.checkpoint.<name>`` keeps
working. A test that replaces a function for the code that calls it replaces it in the
module that looks it up (``checkpoint.save.check_free_space``, ``checkpoint.space.shutil``).

Why not Megatron-LM's checkpointing:
    The driver runs on megatron-core alone; Megatron-LM's checkpoint integration lives in
    the Megatron-LM adapter (:mod:`megatron_ext.megatron.lm.checkpoint`), which uses the
    shared pieces above.
"""

from megatron_ext.megatron.checkpoint.errors import CheckpointError, CheckpointSaveError
from megatron_ext.megatron.checkpoint.ext_state import (
    META_KEY,
    SHARDED_OBJECT_KEY,
    STATE_KEY,
    decide_load,
    ext_meta,
    sharded_state_object,
)
from megatron_ext.megatron.checkpoint.finite import check_finite, sharded_leaves
from megatron_ext.megatron.checkpoint.load import load_checkpoint
from megatron_ext.megatron.checkpoint.optimizer_state import (
    check_optimizer_kind,
    init_optimizer_state_for_load,
)
from megatron_ext.megatron.checkpoint.paths import checkpoint_dir, latest_iteration, resolve_load
from megatron_ext.megatron.checkpoint.reading import (
    LOAD_ERRORS,
    load_common_state,
    read_error,
    unreadable_file,
)
from megatron_ext.megatron.checkpoint.save import save_checkpoint
from megatron_ext.megatron.checkpoint.schedule import (
    align_lr_bounds_for_load,
    apply_lr_bounds,
    check_scheduler,
)
from megatron_ext.megatron.checkpoint.space import SPACE_MARGIN, check_free_space
from megatron_ext.megatron.checkpoint.topology import TOPOLOGY_KEY

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "check_free_space",
    "SPACE_MARGIN",
    "CheckpointSaveError",
    "resolve_load",
    "CheckpointError",
    "check_scheduler",
    "align_lr_bounds_for_load",
    "apply_lr_bounds",
    "check_optimizer_kind",
    "load_common_state",
    "read_error",
    "unreadable_file",
    "LOAD_ERRORS",
    "check_finite",
    "sharded_leaves",
    "latest_iteration",
    "checkpoint_dir",
    "ext_meta",
    "decide_load",
    "init_optimizer_state_for_load",
    "sharded_state_object",
    "META_KEY",
    "STATE_KEY",
    "SHARDED_OBJECT_KEY",
    "TOPOLOGY_KEY",
]
