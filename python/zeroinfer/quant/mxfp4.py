"""MXFP4 (e2m1 values + UE8M0 block scales) exactly as V4 checkpoints store the routed experts.

Byte layout, for a weight ``W`` of shape ``[..., N, K]`` (K a multiple of 32):

* ``packed`` uint8 ``[..., N, K // 2]``: byte ``j`` of a row holds element ``2j`` in its LOW nibble
  and element ``2j + 1`` in its HIGH nibble. A nibble is an e2m1 code: bit 3 = sign, bits 2..1 =
  exponent, bit 0 = mantissa; code -> value
  ``[0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]``.
* ``scale`` uint8 ``[..., N, K // 32]``: one UE8M0 byte per 32 consecutive elements along K,
  value ``2 ** (byte - 127)`` (byte 255 is NaN).
* ``W[..., n, k] = value(nibble(n, k)) * 2 ** (scale[..., n, k // 32] - 127)``.

Checkpoints store ``packed`` as I8 (or float4_e2m1fn_x2) and ``scale`` as float8_e8m0fnu; both
functions here accept those dtypes and treat them as raw bytes.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_GRID = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)  # magnitudes of codes 0..7
# Rounding of a scaled magnitude x in [0, 6]: code = number of midpoints passed. A tie sits between
# codes i and i+1; it goes to whichever of the two has mantissa bit 0 (even code), i.e. IEEE-style
# round-half-to-even on the e2m1 grid: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_MIDS = (_GRID[:-1] + _GRID[1:]) / 2
_TIE_UP = torch.tensor([(i + 1) % 2 == 0 for i in range(7)])


def _raw_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8 or t.dtype == getattr(torch, "float8_e8m0fnu", None) or \
            t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return t.view(torch.uint8)
    raise TypeError(f"{name} must be raw bytes (uint8, int8, float8_e8m0fnu), got {t.dtype}")


def ue8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 2^(byte-127) exactly (byte 0 -> 2^-127, a subnormal; 255 -> NaN)."""
    s = _raw_bytes(scale, "scale").to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    val = bits.view(torch.float32)
    return torch.where(s == 255, torch.full_like(val, float("nan")), val)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` ``[..., N, K]`` (float, K a multiple of 32) to ``(packed, scale)``.

    Per group of 32 consecutive elements along K the scale is ``2 ** ceil(log2(amax / 6))``, the
    smallest power of two that brings the group's largest magnitude within the e2m1 range 6,
    clamped to UE8M0's finite range [2^-127, 2^127] (an all-zero group gets byte 127, scale 1).
    Each element is rounded to the nearest e2m1 value; ties go to the neighbour with an even
    code (mantissa bit 0), and magnitudes beyond 6 (only possible when the scale is clamped)
    saturate to 6. The sign of every element is kept, so negative values that round to zero
    become -0 (nibble 8). NaN/inf inputs are not supported; a value within a rounding step of the
    float32 maximum may round up to 4 * 2^126 = 2^128, which float32 cannot hold.

    Returns uint8 ``packed`` ``[..., N, K // 2]`` and uint8 ``scale`` ``[..., N, K // 32]`` in the
    checkpoint layout described in the module docstring.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize_mxfp4: w must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise TypeError(f"quantize_mxfp4: w must be a float tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % 32 != 0:
        raise ValueError(f"quantize_mxfp4: w's last dim K must be a multiple of 32, got shape "
                         f"{tuple(w.shape)}")
    k = w.shape[-1]
    g = w.to(torch.float64).reshape(*w.shape[:-1], k // 32, 32)
    amax = g.abs().amax(dim=-1)
    # ceil(log2(amax / 6)) exactly: frexp gives amax/6 = m * 2^ex with m in [0.5, 1).
    mant, ex = torch.frexp(amax / 6.0)
    e = torch.where(mant == 0.5, ex - 1, ex)
    e = torch.where(amax == 0, torch.zeros_like(e), e).clamp(-127, 127)
    scale = (e + 127).to(torch.uint8)
    x = g.abs() / torch.pow(2.0, e.to(torch.float64)).unsqueeze(-1)  # exact: power-of-two divide
    mids = _MIDS.to(device=w.device, dtype=torch.float64)
    tie_up = _TIE_UP.to(w.device)
    passed = (x.unsqueeze(-1) > mids) | ((x.unsqueeze(-1) == mids) & tie_up)
    code = passed.sum(dim=-1).to(torch.uint8)  # 0..7, values > 6 saturate at 7
    code = code | (torch.signbit(g).to(torch.uint8) << 3)
    code = code.reshape(*w.shape[:-1], k)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), scale.contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: ``packed`` ``[..., N, K // 2]`` and ``scale``
    ``[..., N, K // 32]`` (raw bytes: uint8/int8/float8_e8m0fnu) -> float32 ``[..., N, K]``."""
    p = _raw_bytes(packed, "packed")
    s = _raw_bytes(scale, "scale")
    kh = p.shape[-1]
    if kh % 16 != 0 or tuple(s.shape) != (*p.shape[:-1], kh // 16):
        raise ValueError(f"dequantize_mxfp4: packed {tuple(p.shape)} and scale {tuple(s.shape)} "
                         "must be [..., N, K/2] and [..., N, K/32] with K a multiple of 32")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=p.device)
    # 256-entry table byte -> (value of low nibble, value of high nibble): one gather per byte.
    pairs = torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1)  # [256, 2]
    vals = pairs.index_select(0, p.reshape(-1).to(torch.int32))  # [numel, 2] = elements 2j, 2j+1
    vals = vals.reshape(*p.shape[:-1], kh // 16, 32)
    out = vals * ue8m0_to_float32(s).unsqueeze(-1)
    return out.reshape(*p.shape[:-1], kh * 2)
