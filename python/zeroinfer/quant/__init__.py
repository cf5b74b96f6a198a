"""Packing helpers for the quantized formats of V4 checkpoints and caches."""
