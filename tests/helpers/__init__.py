"""Shared test helpers (rank spawning, small megatron-core runs)."""
