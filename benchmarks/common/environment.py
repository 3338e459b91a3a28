"""What a benchmark's numbers depend on: versions, CPU, threads, commit, device, load.

:func:`environment` records torch and megatron-core versions, CPU model and core count, torch
threads, git commit (and whether the work tree had uncommitted changes), the device ("cpu
(no GPU lent)" or the CUDA device), load average and time. Imports torch lazily; never
imports megatron.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

__all__ = [
    "REPO_ROOT",
    "source_fingerprint",
    "device_description",
    "environment",
    "default_out_dir",
]


REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _memory_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _package_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def source_fingerprint() -> str:
    """sha256 (first 16 hex digits) of every ``megatron_ext/**/*.py`` file, path and content.

    The work tree may hold uncommitted changes; this names the exact code measured.
    """
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "megatron_ext").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_description() -> str:
    """``"cpu (no GPU lent)"`` or the CUDA device name."""
    try:
        import torch
    except ImportError:
        return "cpu (no GPU lent)"
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return "cpu (no GPU lent)"


def environment(num_threads: Optional[Any] = None) -> Dict[str, Any]:
    """What the measured numbers depend on.

    Args:
        num_threads: torch intra-op threads used by the measurement (an int, a list of ints
            or a description); default ``torch.get_num_threads()``.

    Returns:
        A JSON-serialisable dict.
    """
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": _package_version("megatron-core"),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "num_threads": torch.get_num_threads() if num_threads is None else num_threads,
        "device": device_description(),
        "cuda_available": torch.cuda.is_available(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "source_fingerprint": source_fingerprint(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(sys.argv),
    }


def default_out_dir(name: str) -> str:
    """``runs/bench-<name>-<YYYYmmdd-HHMMSS>`` (relative to the working directory)."""
    return os.path.join("runs", f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
