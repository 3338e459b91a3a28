"""Reversible attribute replacement, shared by every adapter that patches a module attribute.

The CPU execution (``cpu.py``), Megatron-LM's CPU redirections (``lm/cpu.py``) and the
Megatron-LM hooks (``lm/core_v0_16.py``) replace module attributes and must put back
exactly what was there, including deleting attributes that did not exist before. The two
CPU switches are process-wide: each keeps its one installation in an :class:`ActiveInstall`.
"""

from __future__ import annotations

from typing import Any, Generic, List, Optional, Tuple, TypeVar

__all__ = ["AttributePatches", "ActiveInstall"]

_Handle = TypeVar("_Handle")

_MISSING = object()


class AttributePatches:
    """A stack of ``setattr`` calls that :meth:`restore` undoes in reverse order."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering the previous value (or its absence)."""
        self._saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    @property
    def targets(self) -> List[Tuple[Any, str]]:
        """``(owner, name)`` of every replacement, in order."""
        return [(owner, name) for owner, name, _ in self._saved]

    def restore(self) -> None:
        """Put every replaced attribute back (delete the ones that did not exist)."""
        for owner, name, previous in reversed(self._saved):
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._saved.clear()


class ActiveInstall(Generic[_Handle]):
    """The one installation of a process-wide switch: ``enable_*`` keeps its handle in
    :attr:`handle`, ``disable_*`` calls :meth:`remove`."""

    def __init__(self) -> None:
        self.handle: Optional[_Handle] = None
        """The installed handle (it has a ``remove()``), or None when the switch is off."""

    def remove(self) -> None:
        """Remove the installed handle and forget it; nothing when none is installed."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
