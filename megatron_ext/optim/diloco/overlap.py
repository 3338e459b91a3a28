"""Outer exchanges in flight: the handles a delayed outer step waits on, and the exchange thread.

What it does:
    :class:`PendingAverage` wraps an asynchronous all-reduce (the dense exchange's
    ``start``) or a finished mean; :class:`ThreadedAverage` an exchange running on
    :class:`ExchangeWorker`'s thread (the compressed exchanges, several dependent
    collectives and their codec); both give the mean by ``wait()``.
    :func:`_blocking_average` runs an exchange at once and returns the same kind of handle,
    so the hook treats a delayed and an immediate exchange alike.

Why:
    Streaming DiLoCo's overlap (``--outer-delay``) runs a fragment's exchange while the next
    inner steps compute; the hook holds a handle per fragment in flight and applies the
    outer step once it has landed.

Constraints:
    torch only; never imports Megatron. One worker thread per hook runs its exchanges one at
    a time in submission order (the same order on every rank), and the main thread never
    uses the outer group while the worker exists. A handle's ``wait()`` is idempotent and
    raises what the exchange raised.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Protocol, TypeVar, Union

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter
from megatron_ext.protocols import NonFiniteError, PseudoGradientExchange

__all__ = ["PendingAverage", "ThreadedAverage", "ExchangeWorker"]

T = TypeVar("T")


class PendingAverage:
    """An outer exchange in flight: ``wait()`` returns the mean (idempotent).

    Args:
        out: the tensor being reduced in place (or the finished mean).
        work: the asynchronous collective's handle (None: finished).
        divide_by: the sum's divisor once it has landed (gloo has no AVG).
    """

    def __init__(self, out: torch.Tensor, *, work: Any = None, divide_by: int = 1):
        self._out = out
        self._work = work
        self._divide_by = divide_by

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._divide_by != 1:
                self._out.div_(self._divide_by)
        return self._out

    def in_flight(self) -> bool:
        """Not yet waited for."""
        return self._work is not None


class Averaging(Protocol):
    """What :class:`ExchangeWorker` runs: a
    :class:`~megatron_ext.protocols.PseudoGradientExchange`, or one outer step's use of one."""

    def average(self, flat: torch.Tensor) -> torch.Tensor: ...


class ThreadedAverage:
    """A compressed outer exchange running on :class:`ExchangeWorker`'s thread: ``wait()``
    returns its mean (idempotent) or raises what the exchange raised (a NaN, a peer gone).
    The hook reads the bytes from its exchange's ``wire_bytes()`` once it has landed."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Optional[torch.Tensor] = None
        self._error: Optional[BaseException] = None
        self._waited = False

    def _finish(self, result: Optional[torch.Tensor], error: Optional[BaseException]) -> None:
        self._result, self._error = result, error
        self._done.set()

    def wait(self) -> torch.Tensor:
        self._done.wait()
        self._waited = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def in_flight(self) -> bool:
        """Not yet waited for."""
        return not self._waited


class ExchangeWorker:
    """One daemon thread that runs a hook's compressed outer exchanges (``--outer-delay``
    with ``--outer-compression`` other than ``none``), one at a time, in submission order.

    Every rank submits the same exchanges in the same order (the schedule is by iteration),
    so the collectives on the outer group happen in the same order everywhere; the main
    thread never uses the outer group while the worker exists (every exchange of the hook
    goes through it). The worker tags its collectives ``outer`` (the traffic meter's tag is
    thread-local) and, on CUDA, binds the rank's device first.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="megatron-ext-outer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            exchange, flat, handle = item
            try:
                with ProcessGroupTrafficMeter.tagged("outer", force=True):
                    out = exchange.average(flat)  # ends with a host read of its isfinite
                handle._finish(out, None)
            except BaseException as exc:  # raised to the main thread by wait()
                handle._finish(None, exc)

    def submit(self, exchange: Averaging, flat: torch.Tensor) -> ThreadedAverage:
        """Queue ``exchange.average(flat)``; ``flat`` must not be modified until it lands."""
        handle = ThreadedAverage()
        self._queue.put((exchange, flat, handle))
        return handle

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the thread after the queued exchanges (another collective on the
        outer group, in the same order on every rank) and return its result."""
        handle = ThreadedAverage()
        self._queue.put((_Call(fn), None, handle))
        return handle.wait()

    def close(self) -> None:
        """Stop the thread once the queued exchanges have run."""
        self._queue.put(None)
        self._thread.join()


class _Call:
    """A function queued on :class:`ExchangeWorker` (its ``average`` ignores the input)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def average(self, _flat: None) -> Any:
        return self.fn()


def _blocking_average(
    exchange: PseudoGradientExchange, flat: torch.Tensor
) -> Union[PendingAverage, ThreadedAverage]:
    """``exchange.average(flat)`` as a finished handle; a compressed exchange that finds a
    non-finite input (on any rank) gives a handle whose ``wait()`` raises it, as a threaded
    one does."""
    try:
        return PendingAverage(exchange.average(flat))
    except NonFiniteError as exc:
        handle = ThreadedAverage()
        handle._finish(None, exc)
        return handle
