"""Stop a run cleanly on SIGTERM, SIGUSR1 or Ctrl-C: finish the step, save, exit 0.

What it does:
    :class:`ExitSignalHandler` replaces the handlers of SIGTERM, SIGINT and SIGUSR1 with one
    that only records that the signal came, and shields the rank's child processes from
    them (:func:`megatron_ext.child_processes.shield_children`: megatron-core's checkpoint
    writer processes, which get the same signal, live until the save is done). The training loop asks :meth:`ExitSignalHandler.
    stop_requested` between iterations; that call all-reduces the record (MAX) so every rank
    takes the same decision at the same iteration, even when the signal reached only some of
    them. The loop then saves and returns, and the process exits with status 0. This is
    Megatron-LM's ``--exit-signal-handler`` (``megatron/training/dist_signal_handler.py``,
    used by ``checkpoint_and_decide_exit`` in its ``training.py``, one signal chosen by its
    ``--exit-signal``), for the three signals at once.

Why:
    A Slurm preemption or time limit sends SIGTERM (``scancel``, ``KillWait``) or the
    signal of ``--signal`` (commonly SIGUSR1), and Ctrl-C in a terminal sends SIGINT to
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
    * torchrun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT; SIGUSR1 sent to torchrun
      kills it (and its ranks with it, :func:`megatron_ext.child_processes.
      die_with_launcher`) unless it runs with ``--signals-to-handle
      SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``. Slurm's ``--signal=B:USR1`` signals only
      the batch shell, which forwards SIGTERM (``scripts/slurm/pretrain_gpt_ext.sbatch``).
    * Signal handlers can only be installed from the main thread.
"""

from __future__ import annotations

import signal
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["ExitSignalHandler", "DEFAULT_EXIT_SIGNALS"]

DEFAULT_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""SIGTERM (Slurm, ``kill``, torchrun's forward), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's
usual ``--signal`` choice before the time limit)."""


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
        """Install the recording handler for every signal (main thread only); child
        processes started from now on ignore them."""
        from megatron_ext.child_processes import shield_children

        for sig in self.signals:
            self._original[sig] = signal.getsignal(sig)
            signal.signal(sig, self._record)
        shield_children(self.signals)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (children started later are no longer shielded)."""
        from megatron_ext.child_processes import shield_children

        for sig, handler in self._original.items():
            signal.signal(sig, handler)
        self._original.clear()
        shield_children(())

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
