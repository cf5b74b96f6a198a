"""V4's RoPE in one launch: the last r channels of each d-vector rotated in interleaved pairs
(2i, 2i+1), as HF computes it - cos / sin and the channels widened to float32,

    even' = even * cos - odd * sin,    odd' = odd * cos + even * sin,

every product and difference rounded on its own (no fused multiply-adds), cast back to x's dtype;
the first d - r channels copied. `inverse` rotates by -angle (the attention output's
de-rotation), bitwise as passing -sin. The CPU twin and the CUDA kernel give the torch form's bits
(python/zeroinfer/model/rope.py had ~12 torch calls a use).
"""

from __future__ import annotations

import math

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_no_alias, check_tensor


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the trailing r = 2 * cos.shape[-1] channels of x [T, ..., d] (definition in the
    module doc); cos / sin [T, r / 2] broadcast over x's middle dims.

    x: float32 or bfloat16, contiguous, d even and >= r; cos and sin: one dtype, float32 or
    bfloat16, contiguous, on x's device. Returns a new tensor, or fills `out` (x's shape and
    dtype; it may not overlap the inputs).
    """
    op = "rope_rotate"
    floats = (torch.float32, torch.bfloat16)
    if not isinstance(inverse, bool):
        raise TypeError(f"{op}: inverse must be a bool, got {type(inverse).__name__}")
    check_tensor(op, "x", x, dtypes=floats)
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be [T, ..., d] (at least 2-D), got shape {tuple(x.shape)}")
    dev = x.device
    tokens, dim = x.shape[0], x.shape[-1]
    check_tensor(op, "cos", cos, dtypes=floats, ndim=2, device=dev)
    check_tensor(op, "sin", sin, dtypes=(cos.dtype,), shape=tuple(cos.shape), device=dev)
    half = cos.shape[1]
    if cos.shape[0] != tokens:
        raise ValueError(f"{op}: cos must have shape [{tokens}, *] (one row a token of x), got "
                         f"{tuple(cos.shape)}")
    if half < 1 or 2 * half > dim or dim % 2:
        raise ValueError(f"{op}: need an even d (x.shape[-1]) >= r = 2 * cos.shape[1] >= 2, got "
                         f"d = {dim}, r = {2 * half}")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor(op, "out", out, dtypes=(x.dtype,), shape=tuple(x.shape), device=dev)
        check_no_alias(op, {"out": out}, {"x": x, "cos": cos, "sin": sin})
    heads = math.prod(x.shape[1:-1])  # vectors a token
    _C.rope_rotate(use_cuda(dev, op), tokens, heads, dim, half, dtype_code(x), dtype_code(cos),
                   inverse, ptr(x), ptr(cos), ptr(sin), ptr(out), stream_of(dev))
    return out
