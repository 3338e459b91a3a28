"""megatron_ext's own checkpointed state: a registry of stateful objects, versioned.

What it does:
    Every stateful piece megatron_ext installs (the gradient reducer with its residuals,
    the pipeline codec with its buffers, optimizer hooks) registers here under a stable
    name; its class must declare its elastic-resume rules
    (:class:`~megatron_ext.protocols.ElasticStateful`), checked at registration. :meth:`ExtState.state_dict` returns one dict per rank: a format version, a
    fingerprint of the settings that shape the state, the parallel layout, and each
    object's ``state_dict()``. :meth:`ExtState.load_state_dict` checks all three and that
    the object key sets match exactly, and raises ``ValueError`` naming what differs.

Format versions:
    :data:`FORMAT_VERSION` numbers the layout of the saved dict. A state saved at an older
    version is brought to the current one before anything reads it (:meth:`ExtState.upgrade`):
    the names first (here), then each object's own state, by the objects whose class has an
    ``upgrade_state`` (:class:`~megatron_ext.protocols.VersionedState`). Back-compat code hangs
    on the saved version there, never on a key being absent from a current-version state.

Why per rank:
    Error-feedback residuals and similar state differ across data-parallel ranks, so they
    cannot be deduplicated the way replicated model state is (style notes, fact 6). The
    Megatron adapters store this dict once per global rank (dist_checkpointing
    ``ShardedObject`` with the rank as offset, or one file per rank).

Constraints:
    Pure Python/torch. Values are tensors and primitives only.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Protocol, Sequence

from megatron_ext.protocols import ElasticStateful, VersionedState, elastic_rules_of

__all__ = ["Stateful", "ExtState", "StateMismatch", "StepClock", "FORMAT_VERSION", "fingerprint"]

FORMAT_VERSION = 2
"""Layout of :meth:`ExtState.state_dict`. History:

1. Optimizer hooks named by their position among the run's hooks,
   ``optimizer_hook.<i>.<name>``. Objects may lack keys added while version 1 was current
   (DiLoCo's ``pending``, ``view``, ``anchored``; Grass's per-slot ``since``).
2. Optimizer hooks named by their stable name, ``optimizer_hook.<name>``; every object's keys
   complete.
"""

_POSITIONAL_HOOK = re.compile(r"optimizer_hook\.\d+\.(.+)")


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``."""

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


@dataclass
class StepClock:
    """The training iteration, shared by every seam (set by the training loop)."""

    step: int = 0
    """0-based iteration currently being computed."""

    dense_before_step: int = 0
    """Iterations before this one are a warm-up without compression (AQ-SGD's
    ``--aqsgd-warmup-epochs``): every seam sends full precision then. Set at install by
    the method that asks for it; the runtime hands it to the gradient reducer
    (:attr:`~megatron_ext.collectives.grad_reducer.GradReducer.dense_before_step`)."""

    @property
    def warming_up(self) -> bool:
        """The current iteration is in the uncompressed warm-up."""
        return self.step < self.dense_before_step


class StateMismatch(ValueError):
    """A checkpoint's megatron_ext state does not fit this run (layout or settings)."""


def fingerprint(settings: Mapping[str, Any]) -> str:
    """Short stable hash of JSON-able settings."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class ExtState:
    """Registry of megatron_ext stateful objects for one rank.

    Args:
        settings: the settings that shape the state (e.g. compression config), hashed into
            the fingerprint.
        layout: parallel layout and this rank's coordinates, e.g. ``{"tp": 1, "pp": 2,
            "dp": 2, "rank": 3}``.
        run_only: names of settings that do not shape the state (not in ``settings``); a
            checkpoint saved with them in its settings still fits when it differs in them
            only.
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        layout: Mapping[str, int],
        run_only: Sequence[str] = (),
    ):
        self._objects: Dict[str, ElasticStateful] = {}
        self.settings = dict(settings)
        self.layout = dict(layout)
        self.run_only = frozenset(run_only)

    def register(self, name: str, obj: ElasticStateful) -> None:
        """Add ``obj`` under ``name`` (names are unique).

        Raises:
            ValueError: ``name`` is taken.
            TypeError: ``obj``'s class declares no elastic-resume rules.
        """
        if name in self._objects:
            raise ValueError(f"megatron_ext state {name!r} registered twice")
        elastic_rules_of(obj)
        self._objects[name] = obj

    @property
    def names(self):
        """Registered names."""
        return sorted(self._objects)

    @property
    def objects(self) -> Dict[str, ElasticStateful]:
        """The registered objects by name (a copy of the registry)."""
        return dict(self._objects)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's state."""
        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint(self.settings),
            "settings": dict(self.settings),
            "layout": dict(self.layout),
            "objects": {name: obj.state_dict() for name, obj in self._objects.items()},
        }

    def upgrade(self, state: Mapping[str, Any]) -> Dict[str, Any]:
        """``state`` in the current format (itself when saved at :data:`FORMAT_VERSION`).

        From format 1: ``optimizer_hook.<i>.<name>`` becomes ``optimizer_hook.<name>``, then
        every object of this registry whose class is a
        :class:`~megatron_ext.protocols.VersionedState` upgrades its own state.

        Raises:
            StateMismatch: an unknown or newer format, or two format-1 hooks of one name.
        """
        version = state.get("format_version")
        if version == FORMAT_VERSION:
            return dict(state)
        if version != 1:
            raise StateMismatch(
                f"megatron_ext state format {version} cannot be read by format {FORMAT_VERSION}"
            )
        objects: Dict[str, Any] = {}
        for name, value in state.get("objects", {}).items():
            positional = _POSITIONAL_HOOK.fullmatch(name)
            stable = f"optimizer_hook.{positional.group(1)}" if positional else name
            if stable in objects:
                raise StateMismatch(
                    f"megatron_ext state format 1 holds two objects named {stable!r}"
                )
            obj = self._objects.get(stable)
            if isinstance(obj, VersionedState):
                value = obj.upgrade_state(dict(value), version)
            objects[stable] = value
        return {**state, "format_version": FORMAT_VERSION, "objects": objects}

    def settings_diff(self, saved: Mapping[str, Any]) -> Dict[str, Any]:
        """``{setting: (saved, now)}`` of the settings that shape the state and differ between
        ``saved`` (a state or checkpoint record holding ``fingerprint`` and ``settings``) and
        this run; empty when the state fits (the run-only settings are not compared)."""
        if saved.get("fingerprint") == fingerprint(self.settings):
            return {}
        old = saved.get("settings", {})
        return {
            k: (old.get(k), self.settings.get(k))
            for k in sorted(set(old) | set(self.settings))
            if old.get(k) != self.settings.get(k) and k not in self.run_only
        }

    def check_compatible(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`StateMismatch` if ``state`` was saved by an incompatible run."""
        state = self.upgrade(state)
        saved_layout = dict(state.get("layout", {}))
        if saved_layout != self.layout:
            raise StateMismatch(
                f"megatron_ext state was saved with layout {saved_layout}, this rank has "
                f"{self.layout}"
            )
        diff = self.settings_diff(state)
        if diff:
            raise StateMismatch(
                f"megatron_ext state was saved with other settings (saved, now): {diff}"
            )
        names = set(state.get("objects", {}))
        if names != set(self._objects):
            missing = sorted(set(self._objects) - names)
            unexpected = sorted(names - set(self._objects))
            raise StateMismatch(
                f"megatron_ext state objects differ: missing {missing}, unexpected {unexpected}"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore every registered object (``state`` of any readable format); raises
        :class:`StateMismatch` / ValueError."""
        state = self.upgrade(state)
        self.check_compatible(state)
        for name, obj in self._objects.items():
            obj.load_state_dict(state["objects"][name])
