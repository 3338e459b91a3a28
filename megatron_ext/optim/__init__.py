"""Optimizer-side extensions (pure torch): hooks around the optimizer step."""
