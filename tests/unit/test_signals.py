"""``ExitSignalHandler`` without a process group: it records the first signal, keeps
recording (a second SIGTERM must not kill a saving rank), catches SIGUSR1 (Slurm's usual
``--signal``), shields the child processes started while it is installed (they ignore the
same signals: megatron-core's checkpoint writer must outlive them) and restores the old
handlers and the shield when it is removed."""

import os
import signal

from megatron_ext import child_processes
from megatron_ext.signals import ExitSignalHandler


def test_records_the_first_signal_and_restores_handlers():
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in signals}
    with ExitSignalHandler() as handler:
        assert set(child_processes._shielded) == set(signals)
        assert handler.stop_requested() is None
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        # Still alive after all three: the process was not interrupted or terminated.
        assert handler.stop_requested() == signal.SIGINT
        assert handler.received == signal.SIGINT
    assert {s: signal.getsignal(s) for s in before} == before
    assert child_processes._shielded == ()


def test_sigusr1_alone_stops():
    with ExitSignalHandler() as handler:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.stop_requested() == signal.SIGUSR1
