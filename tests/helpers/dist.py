"""Fresh-processes-per-test multi-rank runner on gloo (nanotron-style, without hard-coded
ports).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, sets the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a
free port), calls ``fn(rank, world_size, *args)`` in each and returns the list of per-rank
return values (they must be picklable). A rank's exception is re-raised in the test with its
traceback. If the port was taken between choosing and binding, the run is retried on a new
port.

The processes are forked from a ``forkserver`` that imported torch, megatron-core and
megatron-ext once (:data:`PRELOAD`) and has run nothing else: every test still gets ranks
that ran no other test's code, without paying those imports (about 5 s of CPU per rank) for
every run. A rank gets the test's environment variables and working directory as they are
when ``run_ranks`` is called, as a spawned one would. Where CUDA is available the ranks are
spawned (a forked process cannot use CUDA once its parent touched it);
``MEGATRON_EXT_TEST_START_METHOD=spawn|forkserver`` chooses either way.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port", "PRELOAD"]

PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron_ext.megatron",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
    "megatron_ext.train",
)
"""Modules the forkserver imports once (one that fails to import is skipped by
multiprocessing, and then imported by the rank that needs it, as before)."""

_ADDRESS_IN_USE = ("Address already in use", "EADDRINUSE")


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    import torch

    # Forked ranks cannot use CUDA once a parent touched it: on a GPU machine, spawn.
    default = "spawn" if torch.cuda.is_available() else "forkserver"
    method = os.environ.get("MEGATRON_EXT_TEST_START_METHOD", default)
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"MEGATRON_EXT_TEST_START_METHOD: forkserver or spawn, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (once)
    return ctx


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, env: dict
) -> None:
    # The forkserver's environment is the one of the test that started it; this test's is
    # the one to run with.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch

    # As in any megatron_ext process: importing the adapters package first registers the
    # triton stand-ins megatron-core 0.19 needs on machines without triton.
    import megatron_ext.megatron  # noqa: F401

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        # Plain pickle: torch's multiprocessing reducers would share tensor storage through
        # file descriptors that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:  # report everything to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; see module doc."""
    for attempt in range(3):
        ctx = _context()
        queue = ctx.SimpleQueue()
        port = free_port()
        env = dict(os.environ)
        procs = [
            ctx.Process(
                target=_entry, args=(r, world_size, port, fn, args, queue, env), daemon=False
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict = {}
        errors: dict = {}
        import time

        deadline = time.time() + timeout
        while len(results) + len(errors) < world_size:
            if not queue.empty():
                rank, status, payload = queue.get()
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                if errors:
                    break
                continue
            if time.time() > deadline:
                break
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    break
            time.sleep(0.05)
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            message = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            if any(m in message for m in _ADDRESS_IN_USE) and attempt < 2:
                continue
            raise AssertionError(f"rank(s) failed:\n{message}")
        if len(results) < world_size:
            codes = [p.exitcode for p in procs]
            raise AssertionError(
                f"ranks did not report (timeout {timeout}s or crash); exit codes {codes}"
            )
        return [results[r] for r in range(world_size)]
    raise AssertionError("could not find a free port")
