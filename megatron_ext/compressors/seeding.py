"""Seeds that every rank and every restart derive identically, without communicating.

What it does:
    :func:`stable_seed` hashes any printable parts (a method name, the user's seed, the
    step, a parameter FQN) into a 63-bit seed; :func:`seeded_generator` returns a
    ``torch.Generator`` seeded with it (on the CPU unless a device is given). Methods draw
    their common random matrices (SEPARATE's projections, PowerSGD's initial ``Q``) from CPU
    generators and then move them, so the values do not depend on the device, the process
    or ``PYTHONHASHSEED``. Noise that only one side draws and that is as large as an
    activation (AQ-SGD's stochastic rounding) comes from a generator on the tensor's own
    device instead: CUDA kernels accept CUDA generators only, and drawing on the CPU would
    cost a host-to-device copy of the whole tensor.

Constraints:
    Pure Python/torch; no torch.distributed, no Megatron.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

__all__ = ["stable_seed", "seeded_generator"]


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    blob = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def seeded_generator(*parts: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` (default the CPU) seeded with :func:`stable_seed` of
    ``parts``. The same parts give the same draws on one device type; CPU and CUDA
    generators give different draws."""
    gen = torch.Generator(device=device)
    gen.manual_seed(stable_seed(*parts))
    return gen


def device_generator(device: Optional[torch.device], *parts: object) -> Optional[torch.Generator]:
    """A generator on ``device`` seeded with :func:`stable_seed` of ``parts``, so draws are
    made where they are used (a CUDA draw with a CPU generator raises; a CPU draw copied to
    the device costs a host-to-device copy and a synchronization each time).

    Ranks on the same kind of device draw the same numbers (CUDA's Philox is counter based);
    a CPU draw and a CUDA draw differ. ``meta``
    tensors hold no values: None (nothing to seed).
    """
    device = torch.device(device or "cpu")
    if device.type == "meta":
        return None
    return seeded_generator(*parts, device=device)
