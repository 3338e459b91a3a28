"""``ExitSignalHandler`` without a process group: it records the first signal, keeps
recording (a second SIGTERM must not kill a saving rank) and restores the old handlers."""

import os
import signal

from megatron_ext.signals import ExitSignalHandler


def test_records_the_first_signal_and_restores_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with ExitSignalHandler() as handler:
        assert handler.stop_requested() is None
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        # Still alive after both: the process was not interrupted or terminated.
        assert handler.stop_requested() == signal.SIGINT
        assert handler.received == signal.SIGINT
    assert {s: signal.getsignal(s) for s in before} == before
