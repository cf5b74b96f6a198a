"""Reference for rope_rotate in float64: the last r channels of each vector rotated in interleaved
pairs by the angle whose cos / sin are given (../shared/reference/deepseek-v4-architecture.md)."""

from __future__ import annotations

import torch


def rope_rotate_ref(x, cos, sin, *, inverse=False):
    """x [T, ..., d] rotated, float64 on the CPU."""
    x, cos, sin = (t.detach().cpu().double() for t in (x, cos, sin))
    if inverse:
        sin = -sin
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    pairs = x[..., x.shape[-1] - 2 * half:].unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., : x.shape[-1] - 2 * half], rotated], dim=-1)
