"""Build a cache directory exactly once, however many processes ask for it at the same time.

What it does:
    :func:`build_once` makes ``<parent>/<name>/`` appear complete or not at all. The first
    process takes an exclusive ``fcntl`` lock on ``<parent>/.<name>.lock``, builds into a
    private temporary directory next to the target, writes a marker file into it and renames
    it onto the target; processes that arrive meanwhile block on the lock and then find the
    finished directory. A finished directory (one with the marker) is reused without locking.

Why:
    Every torchrun rank, and every parallel pytest worker, prepares the same tokenizer and
    tokenized corpus. Without the lock they would all train and write them concurrently;
    without the rename a reader could see half-written files after a crash.

Constraints:
    * POSIX only (``fcntl``). On network file systems the lock is as good as the file
      system's ``flock``; the rename alone still prevents anyone from reading partial data.
    * A build that raises leaves nothing behind. Temporary directories of builds that were
      killed are removed by the next build of the same name (under the lock).
    * Pure Python: no torch, no Megatron.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import socket
import time
import uuid
from typing import Any, Callable, Dict, Iterator, Optional

__all__ = ["MARKER_NAME", "build_once", "read_marker", "is_built"]

MARKER_NAME: str = "COMPLETE.json"
"""File written last into a cache directory; its presence means the directory is complete.
It holds who built the directory, when, and what the build function returned."""


@contextlib.contextmanager
def exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created if missing) for the block:
    other processes, of this job or another, wait for it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        # Closing the descriptor releases the flock.
        os.close(fd)


def is_built(target_dir: str) -> bool:
    """Whether ``target_dir`` is a complete cache directory."""
    return os.path.isfile(os.path.join(target_dir, MARKER_NAME))


def read_marker(target_dir: str) -> Dict[str, Any]:
    """The marker of a complete cache directory (see :data:`MARKER_NAME`)."""
    with open(os.path.join(target_dir, MARKER_NAME), "r", encoding="utf-8") as f:
        return json.load(f)


def build_once(target_dir: str, build: Callable[[str], Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    """Make sure ``target_dir`` exists and is complete, building it at most once.

    Args:
        target_dir: the cache directory to create.
        build: called as ``build(tmp_dir)`` by the one process that builds; writes the
            directory's files into ``tmp_dir`` and may return a JSON-serializable dict of
            facts (counts, timings) that is stored in the marker.

    Returns:
        The marker dict: ``built_by_pid``, ``built_on_host``, ``built_at`` (seconds since
        the epoch), ``build_seconds``, ``info`` (what ``build`` returned) and ``built_here``
        (whether this call did the build; not stored).
    """
    target_dir = os.path.abspath(target_dir)
    if is_built(target_dir):
        return {**read_marker(target_dir), "built_here": False}
    parent, name = os.path.split(target_dir)
    os.makedirs(parent, exist_ok=True)
    with exclusive_lock(os.path.join(parent, f".{name}.lock")):
        if is_built(target_dir):
            return {**read_marker(target_dir), "built_here": False}
        # Under the lock nobody else builds this name, so leftovers are from killed builds.
        for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.lexists(target_dir):
            # A directory without marker was not made by build_once; it cannot be trusted.
            shutil.rmtree(target_dir)
        # os.mkdir honours the umask (tempfile.mkdtemp would make the cache owner-only).
        tmp_dir = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp_dir)
        try:
            start = time.time()
            info = build(tmp_dir)
            marker = {
                "built_by_pid": os.getpid(),
                "built_on_host": socket.gethostname(),
                "built_at": time.time(),
                "build_seconds": round(time.time() - start, 3),
                "info": info or {},
            }
            with open(os.path.join(tmp_dir, MARKER_NAME), "w", encoding="utf-8") as f:
                json.dump(marker, f, indent=2, sort_keys=True)
            try:
                os.rename(tmp_dir, target_dir)
            except OSError:
                # Only possible where the lock did not exclude another host: keep its result.
                if not is_built(target_dir):
                    raise
                shutil.rmtree(tmp_dir, ignore_errors=True)
                return {**read_marker(target_dir), "built_here": False}
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return {**marker, "built_here": True}
