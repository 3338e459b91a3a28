"""Seeds that every rank and every restart derive identically, without communicating.

What it does:
    :func:`stable_seed` hashes any printable parts (a method name, the user's seed, the
    step, a parameter FQN) into a 63-bit seed; :func:`seeded_generator` returns a CPU
    ``torch.Generator`` seeded with it. Methods draw their common random matrices (SEPARATE's
    projections, PowerSGD's initial ``Q``) from such generators on the CPU and then move
    them, so the values do not depend on the device, the process or ``PYTHONHASHSEED``.

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


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded with :func:`stable_seed` of ``parts``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(stable_seed(*parts))
    return gen


def device_generator(device: Optional[torch.device], *parts: object) -> Optional[torch.Generator]:
    """A generator on ``device`` seeded with :func:`stable_seed` of ``parts``, so draws are
    made where they are used (a CUDA draw with a CPU generator raises; a CPU draw copied to
    the device costs a host-to-device copy and a synchronization each time).

    Ranks on the same kind of device draw the same numbers (CUDA's Philox is counter based);
    a CPU draw and a CUDA draw differ. On CPU this is :func:`seeded_generator`. ``meta``
    tensors hold no values: None (nothing to seed).
    """
    device = torch.device(device or "cpu")
    if device.type == "cpu":
        return seeded_generator(*parts)
    if device.type == "meta":
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(stable_seed(*parts))
    return gen
