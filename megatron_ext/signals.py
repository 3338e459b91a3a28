"""Stop a run cleanly on SIGTERM or Ctrl-C: finish the step, save, exit 0.

What it does:
    :class:`ExitSignalHandler` replaces the handlers of SIGTERM and SIGINT with one that only
    records that the signal came. The training loop asks :meth:`ExitSignalHandler.
    stop_requested` between iterations; that call all-reduces the record (MAX) so every rank
    takes the same decision at the same iteration, even when the signal reached only some of
    them. The loop then saves and returns, and the process exits with status 0. This is
    Megatron-LM's ``--exit-signal-handler`` (``megatron/training/dist_signal_handler.py``,
    used by ``checkpoint_and_decide_exit`` in its ``training.py``), for both signals at once.

Why:
    A Slurm preemption or time limit sends SIGTERM, and Ctrl-C in a terminal sends SIGINT to
    torchrun, which forwards it to its workers. With Python's default handlers every rank
    dies inside whatever it was doing (a traceback per rank for SIGINT) and everything
    since the last save is lost.

Constraints:
    * :meth:`~ExitSignalHandler.stop_requested` is a collective over ``group`` (default:
      the world): call it on every rank at the same point of the loop.
    * The handler stays installed until :meth:`~ExitSignalHandler.restore`: a second
      SIGTERM (Slurm signals every process of a step, torchrun forwards its own copy) must
      not kill a rank in the middle of the save the first one asked for.
    * torchrun gives its workers ``--shutdown-timeout`` seconds (default 30) after it
      forwards a signal, then kills them; a save that takes longer needs a larger timeout.
      torchrun itself then exits with status 1 (torch re-raises the signal as
      ``SignalException`` after its workers stopped), whatever its workers returned.
    * Signal handlers can only be installed from the main thread.
"""

from __future__ import annotations

import signal
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["ExitSignalHandler", "DEFAULT_EXIT_SIGNALS"]

DEFAULT_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""SIGTERM (Slurm, ``kill``, torchrun's forward) and SIGINT (Ctrl-C)."""


class ExitSignalHandler:
    """Record exit signals; let all ranks agree to stop between iterations.

    Args:
        signals: the signals to catch (default :data:`DEFAULT_EXIT_SIGNALS`).
    """

    def __init__(self, signals: Sequence[signal.Signals] = DEFAULT_EXIT_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: Optional[signal.Signals] = None
        self._original: Dict[signal.Signals, Any] = {}

    def install(self) -> "ExitSignalHandler":
        """Install the recording handler for every signal (main thread only)."""
        for sig in self.signals:
            self._original[sig] = signal.getsignal(sig)
            signal.signal(sig, self._record)
        return self

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._original.items():
            signal.signal(sig, handler)
        self._original.clear()

    def __enter__(self) -> "ExitSignalHandler":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def _record(self, signum: int, frame: Any) -> None:
        # Keep the first signal: it names the reason in the exit message.
        if self.received is None:
            self.received = signal.Signals(signum)

    def stop_requested(self, group: Optional[Any] = None) -> Optional[signal.Signals]:
        """Whether any rank of ``group`` received a signal (collective).

        Args:
            group: process group to agree over (default: the world).

        Returns:
            The signal (the largest number any rank received), or None on every rank.
        """
        value = int(self.received or 0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            device = torch.device("cpu")
            if "nccl" in str(torch.distributed.get_backend(group)):
                device = torch.device("cuda", torch.cuda.current_device())
            flag = torch.tensor([value], dtype=torch.int32, device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            value = int(flag.item())
        return signal.Signals(value) if value else None
