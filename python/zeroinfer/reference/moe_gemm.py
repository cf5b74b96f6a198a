"""Float64 reference for zeroinfer.ops.mxfp4_grouped_gemm (the MXFP4 grouped expert GEMM).

Decodes the checkpoint bytes itself (no kernel or quant-helper code): byte j of a weight row holds
element 2j in the low nibble and 2j+1 in the high nibble; nibble -> e2m1 value through the table
below; one UE8M0 scale byte 2^(b-127) per 32 elements along K. Float8 activations (W4A8) use the
weights with the scale folded into e4m3 per 128-k block (dequantize_expert_w4a8_f64; the rule is
in zeroinfer/moe_gemm.h).
"""

from __future__ import annotations

import torch

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _e2m1_f64(w: torch.Tensor) -> torch.Tensor:
    wb = _bytes(w).to(torch.int64)
    lo, hi = wb & 0xF, wb >> 4
    # element 2j = low nibble of byte j, element 2j+1 = high nibble
    nib = torch.stack([lo, hi], dim=-1).reshape(*wb.shape[:-1], wb.shape[-1] * 2)
    return torch.tensor(_E2M1, dtype=torch.float64, device=w.device)[nib]


def _ue8m0_f64(b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 255, torch.full_like(b, float("nan")), torch.exp2(b - 127.0))


def dequantize_expert_f64(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``w`` ``[..., N, K/2]`` packed bytes, ``w_scale`` ``[..., N, K/32]`` UE8M0 -> float64
    ``[..., N, K]``."""
    sb = _bytes(w_scale).to(torch.float64)
    return _e2m1_f64(w) * _ue8m0_f64(sb).repeat_interleave(32, dim=-1)


def dequantize_expert_w4a8_f64(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The weights as W4A8 uses them (zeroinfer/moe_gemm.h): per (row, 128-k block) base b = max
    of its four scale bytes, q = e2m1 * 2^(s-b+6) rounded to e4m3 (below 2^-6: half-to-even to a
    multiple of 2^-9), W = q * 2^(b-133); b = 255 -> the block is NaN. K % 128 == 0."""
    sb = _bytes(w_scale).to(torch.float64)
    blocks = sb.reshape(*sb.shape[:-1], -1, 4)
    b = blocks.amax(dim=-1, keepdim=True)
    shift = (blocks - b + 6).reshape(sb.shape).repeat_interleave(32, dim=-1)
    x = _e2m1_f64(w) * torch.exp2(shift)
    q = torch.where(x.abs() < 2.0**-6, torch.round(x * 512) / 512, x)
    base = _ue8m0_f64(b.squeeze(-1)) * 2.0**-6
    return q * base.repeat_interleave(128, dim=-1)


def _act_f64(a: torch.Tensor, a_scale: torch.Tensor | None) -> torch.Tensor:
    x = a.to(torch.float64)
    if a_scale is not None:
        x = x * a_scale.to(torch.float64).repeat_interleave(128, dim=-1)
    return x


def _epilogue(y: torch.Tensor, fuse_swiglu: bool, swiglu_limit: float | None) -> torch.Tensor:
    if not fuse_swiglu:
        return y
    h = y.shape[-1] // 2
    g, u = y[..., :h], y[..., h:]
    if swiglu_limit is not None:
        g = torch.clamp(g, max=swiglu_limit)                 # gate: one-sided
        u = torch.clamp(u, min=-swiglu_limit, max=swiglu_limit)  # up: two-sided
    return g * torch.sigmoid(g) * u


def mxfp4_grouped_gemm_ref(a, w, w_scale, *, expert_offsets=None, expert_counts=None,
                           masked_m=None, topk_ids=None, a_scale=None, fuse_swiglu=False,
                           swiglu_limit=None, initial=None) -> torch.Tensor:
    """Same arguments as the op (no validation). Returns float64 ``[M, N_out]`` (contiguous),
    ``[E, cap, N_out]`` (masked) or ``[T*k, N_out]`` (routed). Rows the op does not write hold
    ``initial`` (converted to float64) when given, else NaN."""
    n = w.shape[1]
    n_out = n // 2 if fuse_swiglu else n
    x = _act_f64(a, a_scale)
    if topk_ids is not None:  # routed: output row i = t*k + j, one expert per row
        ids = topk_ids.reshape(-1).tolist()
        div = topk_ids.shape[1] if x.shape[0] != len(ids) else 1
        out = (initial.to(torch.float64).clone() if initial is not None else
               torch.full((len(ids), n_out), float("nan"), dtype=torch.float64, device=a.device))
        deq = (dequantize_expert_w4a8_f64 if a.dtype == torch.float8_e4m3fn
               else dequantize_expert_f64)
        for e in sorted({e for e in ids if e >= 0}):
            wd = deq(w[e], w_scale[e])
            for i in (i for i, v in enumerate(ids) if v == e):
                out[i] = _epilogue(x[i // div] @ wd.T, fuse_swiglu, swiglu_limit)
        return out
    shape = (*x.shape[:-1], n_out)
    if initial is not None:
        out = initial.to(torch.float64).clone()
    else:
        out = torch.full(shape, float("nan"), dtype=torch.float64, device=a.device)
    num_experts = w.shape[0]
    for e in range(num_experts):
        if masked_m is not None:
            rows = x[e, : int(masked_m[e])]
            dst = out[e]
            start = 0
        else:
            start = int(expert_offsets[e])
            cnt = (int(expert_counts[e]) if expert_counts is not None
                   else int(expert_offsets[e + 1]) - start)
            rows = x[start:start + cnt]
            dst = out
        if rows.shape[0] == 0:
            continue
        wd = (dequantize_expert_w4a8_f64 if a.dtype == torch.float8_e4m3fn
              else dequantize_expert_f64)(w[e], w_scale[e])
        dst[start:start + rows.shape[0]] = _epilogue(rows @ wd.T, fuse_swiglu, swiglu_limit)
    return out
