"""mxfp4_grouped_gemm: the routed-expert GEMM of DeepSeek-V4 with MXFP4 weights.

CPU tensors run the C++ twin (zeroinfer._C.mxfp4_grouped_gemm_cpu). CUDA tensors run an INTERIM
torch path (dequantize + matmul per expert) until the Hopper kernel lands.
"""

from __future__ import annotations

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, use_cuda
from zeroinfer.ops._checks import check_float, check_no_alias, check_tensor

_OP = "mxfp4_grouped_gemm"
_FP8 = torch.float8_e4m3fn
_ACT_DTYPES = (torch.float32, torch.bfloat16, _FP8)
_OUT_DTYPES = (torch.float32, torch.bfloat16)
_W_DTYPES = (torch.uint8, torch.int8)
_SCALE_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d)


def _name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def mxfp4_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    fuse_swiglu: bool = False,
    swiglu_limit: float | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    check: bool | None = None,
) -> torch.Tensor:
    """Grouped GEMM ``Y_e = A_e @ W_eᵀ`` over experts with MXFP4 weights, float32 accumulation.

    Args:
        a: activations, float32 / bfloat16 / float8_e4m3fn (W4A8). Contiguous layout ``[M, K]``
            (rows sorted by expert) or masked layout ``[E, cap, K]``. K must be a multiple of 32
            (of 128 for float8).
        w: packed e2m1 weights ``[E, N, K/2]`` uint8 or int8 (raw bytes; byte j holds element 2j in
            its low nibble, 2j+1 in its high nibble).
        w_scale: UE8M0 scales ``[E, N, K/32]`` uint8 or float8_e8m0fnu (raw bytes).
        expert_offsets: contiguous layout: int32 ``[E+1]``, nondecreasing, ``offsets[E] <= M``.
        expert_counts: contiguous layout, optional int32 ``[E]``: expert e owns rows
            ``[offsets[e], offsets[e] + counts[e])`` (default: the whole segment).
        masked_m: masked layout: int32 ``[E]`` in ``[0, cap]``: expert e owns rows
            ``[0, masked_m[e])`` of ``a[e]``.
        a_scale: float8 activations only: float32 per-token scales ``[M, K/128]`` /
            ``[E, cap, K/128]``; ``a_real = a * a_scale[row, k // 128]``.
        fuse_swiglu: ``w`` is gate ‖ up along N (N even); output column ``c < N/2`` is
            ``silu(min(g_c, λ)) * clamp(u_c, -λ, λ)`` (``silu(g_c) * u_c`` without a limit).
        swiglu_limit: λ (finite, > 0), only with ``fuse_swiglu``.
        out_dtype: float32 or bfloat16; default float32 for float32 ``a``, else bfloat16.
        out: optional preallocated output of exactly the result's shape and dtype.
        check: validate the values of offsets / counts / masked_m. CPU tensors are always
            validated; CUDA tensors only with ``check=True`` (it costs a host sync).

    Returns:
        ``[M, N_out]`` (contiguous) or ``[E, cap, N_out]`` (masked), ``N_out = N/2`` with
        ``fuse_swiglu`` else ``N``. Rows owned by no expert are NOT written (in a fresh output they
        are uninitialised).
    """
    op = _OP
    check_tensor(op, "a", a, dtypes=_ACT_DTYPES, contiguous=False)
    device = a.device
    if device.type != "cuda":
        use_cuda(device, op)  # raises for anything but cpu / cuda

    if (expert_offsets is None) == (masked_m is None):
        raise ValueError(f"{op}: pass exactly one of expert_offsets (contiguous layout, a [M, K]) "
                         "or masked_m (masked layout, a [E, cap, K]); got "
                         + ("both" if masked_m is not None else "neither"))
    masked = masked_m is not None
    if masked and expert_counts is not None:
        raise ValueError(f"{op}: expert_counts is only for the contiguous layout (expert_offsets), "
                         "not with masked_m")

    check_tensor(op, "a", a, dtypes=_ACT_DTYPES, ndim=3 if masked else 2, device=device)
    k = a.shape[-1]
    if k <= 0 or k % 32 != 0:
        raise ValueError(f"{op}: K = a.shape[-1] = {k} must be a positive multiple of 32 "
                         "(one MXFP4 scale covers 32 values along K)")

    check_tensor(op, "w", w, dtypes=_W_DTYPES, ndim=3, device=device, contiguous=False)
    num_experts, n = w.shape[0], w.shape[1]
    if num_experts < 1 or n < 1:
        raise ValueError(f"{op}: w must be [E, N, K/2] with E >= 1 and N >= 1, got "
                         f"{tuple(w.shape)}")
    if w.shape[2] != k // 2:
        raise ValueError(f"{op}: w must have shape [E, N, K/2] = [{num_experts}, {n}, {k // 2}] "
                         f"for K = {k} (a's last dim), got {tuple(w.shape)}")
    check_tensor(op, "w", w, dtypes=_W_DTYPES, shape=(num_experts, n, k // 2), device=device)
    check_tensor(op, "w_scale", w_scale, dtypes=_SCALE_DTYPES, shape=(num_experts, n, k // 32),
                 device=device)

    if masked:
        check_tensor(op, "masked_m", masked_m, dtypes=(torch.int32,), shape=(num_experts,),
                     device=device)
        if a.shape[0] != num_experts:
            raise ValueError(f"{op}: a must have shape [E, cap, K] with E = {num_experts} "
                             f"(w.shape[0]) in the masked layout, got {tuple(a.shape)}")
        m_rows, cap = 0, a.shape[1]
    else:
        check_tensor(op, "expert_offsets", expert_offsets, dtypes=(torch.int32,),
                     shape=(num_experts + 1,), device=device)
        if expert_counts is not None:
            check_tensor(op, "expert_counts", expert_counts, dtypes=(torch.int32,),
                         shape=(num_experts,), device=device)
        m_rows, cap = a.shape[0], 0

    if a.dtype == _FP8:
        if a_scale is None:
            raise ValueError(f"{op}: a_scale (float32 per-token scales [..., K/128]) is required "
                             "when a is float8_e4m3fn")
        if k % 128 != 0:
            raise ValueError(f"{op}: K = a.shape[-1] = {k} must be a multiple of 128 for "
                             "float8_e4m3fn a (a_scale covers 128 values along K)")
        check_tensor(op, "a_scale", a_scale, dtypes=(torch.float32,),
                     shape=(*a.shape[:-1], k // 128), device=device)
    elif a_scale is not None:
        raise ValueError(f"{op}: a_scale must be None for {_name(a.dtype)} a (it is only the "
                         "per-token scale of float8_e4m3fn activations)")

    if not isinstance(fuse_swiglu, bool):
        raise TypeError(f"{op}: fuse_swiglu must be a bool, got {type(fuse_swiglu).__name__}")
    if fuse_swiglu and n % 2 != 0:
        raise ValueError(f"{op}: fuse_swiglu needs an even N = w.shape[1] (gate rows then up "
                         f"rows), got N = {n}")
    if swiglu_limit is not None:
        if not fuse_swiglu:
            raise ValueError(f"{op}: swiglu_limit is only meaningful with fuse_swiglu=True")
        swiglu_limit = check_float(op, "swiglu_limit", swiglu_limit, positive=True)
    n_out = n // 2 if fuse_swiglu else n

    if out_dtype is None:
        out_dtype = torch.float32 if a.dtype == torch.float32 else torch.bfloat16
    elif not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{op}: out_dtype must be a torch.dtype (float32 or bfloat16), got "
                        f"{type(out_dtype).__name__}")
    elif out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32 or bfloat16, got {_name(out_dtype)}")

    out_shape = (num_experts, cap, n_out) if masked else (m_rows, n_out)
    if out is not None:
        check_tensor(op, "out", out, dtypes=(out_dtype,), shape=out_shape, device=device)
        if out.numel() > 0:
            inputs = {"a": a, "w": w, "w_scale": w_scale, "expert_offsets": expert_offsets,
                      "expert_counts": expert_counts, "masked_m": masked_m, "a_scale": a_scale}
            check_no_alias(op, {"out": out},
                           {k_: v for k_, v in inputs.items() if v is not None and v.numel() > 0})
    else:
        out = torch.empty(out_shape, dtype=out_dtype, device=device)

    if check is not None and not isinstance(check, bool):
        raise TypeError(f"{op}: check must be a bool or None, got {type(check).__name__}")
    on_cuda = device.type == "cuda"
    if not on_cuda or check:
        _check_values(num_experts, m_rows, cap, expert_offsets, expert_counts, masked_m)

    if a.numel() == 0:
        return out  # no rows: nothing to write
    if on_cuda:
        _interim_cuda(a, w, w_scale, expert_offsets, expert_counts, masked_m, a_scale,
                      fuse_swiglu, swiglu_limit, out)
        return out

    _C.mxfp4_grouped_gemm_cpu(
        ptr(a), dtype_code(a), ptr(a_scale), ptr(w), ptr(w_scale), ptr(expert_offsets),
        ptr(expert_counts), ptr(masked_m), ptr(out), dtype_code(out), num_experts, m_rows, cap,
        n, k, fuse_swiglu, swiglu_limit)
    return out


def _first_bad(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_values(num_experts: int, m_rows: int, cap: int, offsets: torch.Tensor | None,
                  counts: torch.Tensor | None, masked_m: torch.Tensor | None) -> None:
    """Range checks of the routing tensors' VALUES (a host sync for CUDA tensors)."""
    op = _OP
    if masked_m is not None:
        mm = masked_m.cpu().to(torch.int64)
        bad = (mm < 0) | (mm > cap)
        if bool(bad.any()):
            i = _first_bad(bad)
            raise ValueError(f"{op}: masked_m values must be in [0, cap = a.shape[1] = {cap}], "
                             f"got masked_m[{i}] = {int(mm[i])}")
        return
    off = offsets.cpu().to(torch.int64)
    if int(off[0]) < 0:
        raise ValueError(f"{op}: expert_offsets[0] must be >= 0, got {int(off[0])}")
    seg = off[1:] - off[:-1]
    if bool((seg < 0).any()):
        i = _first_bad(seg < 0)
        raise ValueError(f"{op}: expert_offsets must be nondecreasing, got expert_offsets[{i}] = "
                         f"{int(off[i])} > expert_offsets[{i + 1}] = {int(off[i + 1])}")
    if int(off[-1]) > m_rows:
        raise ValueError(f"{op}: expert_offsets[E] = {int(off[-1])} must be <= M = a.shape[0] = "
                         f"{m_rows}")
    if counts is not None:
        c = counts.cpu().to(torch.int64)
        bad = (c < 0) | (c > seg)
        if bool(bad.any()):
            i = _first_bad(bad)
            raise ValueError(f"{op}: expert_counts[{i}] = {int(c[i])} must be in [0, "
                             f"expert_offsets[{i + 1}] - expert_offsets[{i}] = {int(seg[i])}]")


# --------------------------------------------------------------------------------------------
# INTERIM CUDA PATH: plain torch, until the Hopper MXFP4 kernel lands (a later issue). It
# dequantizes each needed expert to float32, multiplies in float32 (float32 accumulation like the
# kernel, and the SwiGLU sees unrounded float32 values) and writes only the owned rows.
#   * contiguous layout: no host sync either (see _interim_cuda), at E times the FLOPs;
#   * masked layout: no host sync: experts are processed in fixed-size chunks with a batched
#     matmul, and rows >= masked_m[e] keep their old contents through torch.where.
# --------------------------------------------------------------------------------------------
_PAIR_LUT: dict[torch.device, torch.Tensor] = {}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequant_torch(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] packed + [..., N, K/32] UE8M0 -> float32 [..., N, K] (torch ops only)."""
    lut = _PAIR_LUT.get(w.device)
    if lut is None:
        v = torch.tensor(_E2M1, dtype=torch.float32)
        lut = torch.stack([v.repeat(16), v.repeat_interleave(16)], dim=-1)  # [256, 2]
        if w.device.type == "cuda":  # pinned + non_blocking: no host sync in a launch path
            lut = lut.pin_memory()
        lut = lut.to(w.device, non_blocking=True)
        _PAIR_LUT[w.device] = lut
    wb = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    sb = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    vals = lut.index_select(0, wb.reshape(-1).to(torch.int32))  # [numel, 2]: elements 2j, 2j+1
    vals = vals.reshape(*wb.shape[:-1], wb.shape[-1] // 16, 32)
    s = sb.to(torch.int32)
    scale = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23).view(torch.float32)
    scale = torch.where(s == 255, torch.full_like(scale, float("nan")), scale)
    return (vals * scale.unsqueeze(-1)).reshape(*wb.shape[:-1], wb.shape[-1] * 2)


def _act_f32(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    y = x.to(torch.float32)
    if x_scale is not None:
        y = y * x_scale.repeat_interleave(128, dim=-1)
    return y


def _swiglu(y: torch.Tensor, fuse: bool, limit: float | None) -> torch.Tensor:
    if not fuse:
        return y
    h = y.shape[-1] // 2
    g, u = y[..., :h], y[..., h:]
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(g) * u


def _interim_cuda(a, w, w_scale, offsets, counts, masked_m, a_scale, fuse, limit, out) -> None:
    if masked_m is not None:
        num_experts, cap, k = a.shape
        n = w.shape[1]
        # Bound the float32 weight copy of a chunk to ~1 GiB.
        chunk = max(1, min(num_experts, (1 << 30) // (n * k * 4)))
        rows = torch.arange(cap, device=a.device)
        for e0 in range(0, num_experts, chunk):
            e1 = min(num_experts, e0 + chunk)
            wd = _dequant_torch(w[e0:e1], w_scale[e0:e1])
            x = _act_f32(a[e0:e1], None if a_scale is None else a_scale[e0:e1])
            y = _swiglu(torch.bmm(x, wd.transpose(1, 2)), fuse, limit)
            keep = (rows[None, :] < masked_m[e0:e1, None])[..., None]
            out[e0:e1] = torch.where(keep, y.to(out.dtype), out[e0:e1])
        return
    # Contiguous layout without a host sync (the engine launches rounds without waiting): every
    # expert multiplies all M rows and torch.where keeps the rows it owns. E times the FLOPs of
    # the real kernel: fine for the small models the interim path serves, not for V4-Flash.
    m_rows = a.shape[0]
    rows = torch.arange(m_rows, device=a.device)
    start = offsets[:-1]
    end = start + (counts if counts is not None else offsets[1:] - offsets[:-1])
    x = _act_f32(a, a_scale)
    for e in range(w.shape[0]):
        own = ((rows >= start[e]) & (rows < end[e]))[:, None]
        y = _swiglu(x @ _dequant_torch(w[e], w_scale[e]).T, fuse, limit)
        out.copy_(torch.where(own, y.to(out.dtype), out))
