"""Autograd-level hooks: custom forward/backward of linear layers (pure torch)."""
