"""sparse_mla_attention: DeepSeek-V4 sparse MLA attention over a paged (optionally FP8) KV cache.

Every query head attends to ONE shared K=V head of 512 dims (448 NoPE + 64 RoPE; here just a
512-vector), over a per-token list of cache slots, optionally plus a second "extra" cache with
its own list (V4: sliding-window cache + compressed-entries cache), with an optional per-head
attention sink (gpt-oss style, denominator only).
"""

from __future__ import annotations

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_float, check_no_alias, check_tensor
from zeroinfer.quant.kv_fp8 import (
    BYTES_PER_TOKEN,
    dequantize_rows,
    fp8_cache_block_size,
    split_fp8_cache,
)

OP = "sparse_mla_attention"
HEAD_DIM = 512
_Q_DTYPES = (torch.float32, torch.bfloat16)
_KV_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_indices: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention with one shared K=V head.

    Args:
        q: [T, H, 512] float32 or bfloat16, contiguous (T may be 0).
        kv_cache: paged cache, either float32/bfloat16 [num_blocks, block_size, 512], or uint8
            [num_blocks, block_size*584] in the V4 FP8 layout (see zeroinfer.quant.kv_fp8).
        indices: [T, K] int32; slot = block * block_size + offset, -1 = skip. Duplicates
            count twice.
        softmax_scale: finite float > 0; scores s_hj = softmax_scale * (q_h . k_j).
        attn_sink: optional [H] float32 logit per head, added to the softmax denominator only.
        extra_kv_cache, extra_indices: optional second cache (same format kind as kv_cache)
            and its [T, K2] int32 list; attention runs over the union. Both or neither.
        out, lse: optional preallocated outputs ([T, H, 512] q.dtype, [T, H] float32).
        check_indices: range-check the indices against the caches. Always done for CPU
            tensors; for CUDA tensors only if True (it synchronises with the host).

    Returns:
        (out [T, H, 512] in q.dtype, lse [T, H] float32): out_h = sum_j exp(s_hj) k_j /
        (sum_j exp(s_hj) + exp(sink_h)), lse_h = log(sum_j exp(s_hj)) (sink not included).
        A token with no valid slot gets out = 0 and lse = -inf.
    """
    check_tensor(OP, "q", q, dtypes=_Q_DTYPES, shape=(None, None, HEAD_DIM))
    device = q.device
    T, H, _ = q.shape
    if H < 1:
        raise ValueError(f"{OP}: q must have at least one head (shape[1] >= 1), "
                         f"got shape {tuple(q.shape)}")
    kv_block_size = _check_cache(kv_cache, "kv_cache", device)
    check_tensor(OP, "indices", indices, dtypes=(torch.int32,), shape=(T, None), device=device)
    softmax_scale = check_float(OP, "softmax_scale", softmax_scale, positive=True)
    if attn_sink is not None:
        check_tensor(OP, "attn_sink", attn_sink, dtypes=(torch.float32,), shape=(H,), device=device)
    if (extra_kv_cache is None) != (extra_indices is None):
        given, missing = (("extra_kv_cache", "extra_indices") if extra_indices is None
                          else ("extra_indices", "extra_kv_cache"))
        raise ValueError(f"{OP}: {given} was given without {missing}; pass both "
                         "extra_kv_cache and extra_indices, or neither")
    extra_block_size = 0
    if extra_kv_cache is not None:
        extra_block_size = _check_cache(extra_kv_cache, "extra_kv_cache", device)
        if extra_kv_cache.dtype != kv_cache.dtype:
            raise TypeError(f"{OP}: extra_kv_cache must have the same format as kv_cache "
                            f"(dtype {_name(kv_cache.dtype)}), got {_name(extra_kv_cache.dtype)}")
        check_tensor(OP, "extra_indices", extra_indices, dtypes=(torch.int32,), shape=(T, None),
                     device=device)
    if out is not None:
        check_tensor(OP, "out", out, dtypes=(q.dtype,), shape=(T, H, HEAD_DIM), device=device)
    if lse is not None:
        check_tensor(OP, "lse", lse, dtypes=(torch.float32,), shape=(T, H), device=device)
    if check_indices is not None and not isinstance(check_indices, bool):
        raise TypeError(f"{OP}: check_indices must be a bool or None, "
                        f"got {type(check_indices).__name__}")
    # Empty tensors are skipped: they own no memory (and may all report data pointer 0).
    inputs = {k: v for k, v in (("q", q), ("kv_cache", kv_cache), ("indices", indices),
                                ("attn_sink", attn_sink), ("extra_kv_cache", extra_kv_cache),
                                ("extra_indices", extra_indices))
              if v is not None and v.numel() > 0}
    outputs = {k: v for k, v in (("out", out), ("lse", lse)) if v is not None and v.numel() > 0}
    check_no_alias(OP, outputs, inputs)
    if len(outputs) == 2:
        check_no_alias(OP, {"lse": lse}, {"out": out})

    cuda = use_cuda(device, OP)
    if not cuda or check_indices:
        _check_index_range("indices", indices, _num_slots(kv_cache, kv_block_size))
        if extra_indices is not None:
            _check_index_range("extra_indices", extra_indices,
                               _num_slots(extra_kv_cache, extra_block_size))

    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=q.dtype, device=device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=device)
    if T == 0:
        return out, lse

    if cuda:
        if _kernel_supports(q, kv_cache, extra_kv_cache, out):
            _launch_cuda(q, kv_cache, kv_block_size, indices, softmax_scale, attn_sink,
                         extra_kv_cache, extra_block_size, extra_indices, out, lse)
        else:
            # float32 queries or caches: the float32 torch path (a debugging/reference mode;
            # the Hopper kernel is bf16 on the tensor cores).
            _sparse_mla_torch(q, kv_cache, indices, softmax_scale, attn_sink=attn_sink,
                              extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                              out=out, lse=lse)
        return out, lse

    _C.sparse_mla_attention_cpu(**_kernel_args(q, kv_cache, kv_block_size, indices, softmax_scale,
                                               attn_sink, extra_kv_cache, extra_block_size,
                                               extra_indices, out, lse))
    return out, lse


def _aligned16(t: torch.Tensor, *strides: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(st % (16 // t.element_size()) == 0 for st in strides)


def _kernel_supports(q, kv_cache, extra_kv_cache, out) -> bool:
    """Whether the CUDA kernel takes these tensors: bf16 q/out, bf16 or FP8-layout caches, rows
    16-byte aligned (anything else runs the torch path)."""
    if q.dtype != torch.bfloat16 or kv_cache.dtype not in (torch.bfloat16, torch.uint8):
        return False
    caches = [c for c in (kv_cache, extra_kv_cache) if c is not None and c.numel() > 0]
    return (_aligned16(q, q.stride(0), q.stride(1)) and _aligned16(out, out.stride(0), out.stride(1))
            and all(c.data_ptr() % 16 == 0 and (c.stride(0) * c.element_size()) % 16 == 0
                    for c in caches))


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _launch_cuda(q, kv_cache, kv_block_size, indices, softmax_scale, attn_sink, extra_kv_cache,
                 extra_block_size, extra_indices, out, lse, h16: int = -1) -> None:
    """The Hopper kernels (csrc/cuda/sparse_mla.cu). The split plan depends on shapes only, so
    nothing here waits for the device. h16 (tests): -1 lets the plan choose the 16-head FP8
    kernel and its tile, 0 / 32 / 64 force the choice (0: not that kernel)."""
    T, H, _ = q.shape
    total = indices.shape[1] + (extra_indices.shape[1] if extra_indices is not None else 0)
    num_splits, per_split, ws_floats, use_h16 = _C.sparse_mla_cuda_plan(
        T, H, total, _num_sms(q.device), fp8=kv_cache.dtype == torch.uint8, h16=h16)
    workspace = (torch.empty(ws_floats, dtype=torch.float32, device=q.device)
                 if ws_floats else None)
    _C.sparse_mla_attention_cuda(
        **_kernel_args(q, kv_cache, kv_block_size, indices, softmax_scale, attn_sink,
                       extra_kv_cache, extra_block_size, extra_indices, out, lse),
        num_splits=num_splits, tiles_per_split=per_split, workspace=ptr(workspace), h16=use_h16,
        stream=stream_of(q.device))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_cache(cache: object, name: str, device: torch.device) -> int:
    """Validates a cache argument; returns its block_size."""
    check_tensor(OP, name, cache, dtypes=_KV_DTYPES, device=device)
    if cache.dtype == torch.uint8:
        return fp8_cache_block_size(cache, name, OP)
    check_tensor(OP, name, cache, dtypes=_KV_DTYPES, shape=(None, None, HEAD_DIM))
    if cache.shape[1] < 1:
        raise ValueError(f"{OP}: {name} must have block_size (shape[1]) >= 1, "
                         f"got shape {tuple(cache.shape)}")
    return cache.shape[1]


def _num_slots(cache: torch.Tensor, block_size: int) -> int:
    return cache.shape[0] * block_size


def _check_index_range(name: str, idx: torch.Tensor, num_slots: int) -> None:
    """Every entry must be -1 or a slot of the cache (synchronises with the device)."""
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < -1 or hi >= num_slots:
        bad = ((idx < -1) | (idx >= num_slots)).nonzero()[0]
        pos = tuple(int(i) for i in bad)
        raise ValueError(f"{OP}: {name} must hold -1 or slots in [0, {num_slots}) "
                         f"(num_blocks * block_size), got {int(idx[pos])} at {pos}")


def _kernel_args(q, kv_cache, kv_block_size, indices, softmax_scale, attn_sink, extra_kv_cache,
                 extra_block_size, extra_indices, out, lse) -> dict:
    """The keyword arguments _C.sparse_mla_attention_cpu and _cuda share."""
    kw = dict(q=ptr(q), q_dtype=dtype_code(q), num_tokens=q.shape[0], num_heads=q.shape[1],
              q_stride_token=q.stride(0), q_stride_head=q.stride(1), attn_sink=ptr(attn_sink),
              softmax_scale=softmax_scale, out=ptr(out), out_stride_token=out.stride(0),
              out_stride_head=out.stride(1), lse=ptr(lse), lse_stride_token=lse.stride(0),
              **_cache_args(False, kv_cache, kv_block_size, indices))
    if extra_kv_cache is not None:
        kw.update(_cache_args(True, extra_kv_cache, extra_block_size, extra_indices))
    return kw


def _cache_args(extra: bool, cache: torch.Tensor, block_size: int, idx: torch.Tensor) -> dict:
    """Keyword arguments of _C.sparse_mla_attention_{cpu,cuda} for the main or the extra cache."""
    geometry = dict(dtype=dtype_code(cache), num_blocks=cache.shape[0], block_size=block_size,
                    block_stride_bytes=cache.stride(0) * cache.element_size())
    if not extra:
        return {"kv": ptr(cache), **{f"kv_{k}": v for k, v in geometry.items()},
                "indices": ptr(idx), "topk": idx.shape[1], "indices_stride": idx.stride(0)}
    return {"extra_kv": ptr(cache), "extra_kv_dtype": geometry.pop("dtype"),
            **{f"extra_{k}": v for k, v in geometry.items()},
            "extra_indices": ptr(idx), "extra_topk": idx.shape[1],
            "extra_indices_stride": idx.stride(0)}


def _gather_rows(cache: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 key rows [T, K, 512] for idx [T, K] (-1 gathers slot 0) and the valid mask."""
    valid = idx >= 0
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    if cache.dtype == torch.uint8:
        bs = cache.shape[1] // BYTES_PER_TOKEN
        rows, scales = split_fp8_cache(cache)  # [nb, bs, 576], [nb, bs, 8]
        if cache.shape[0] == 0:  # no slots: every index is -1
            return torch.zeros(*idx.shape, HEAD_DIM, device=cache.device), valid
        blk, off = safe // bs, safe % bs
        return dequantize_rows(rows[blk, off], scales[blk, off]), valid
    flat = cache.reshape(-1, HEAD_DIM)
    if flat.shape[0] == 0:
        return torch.zeros(*idx.shape, HEAD_DIM, device=cache.device), valid
    return flat[safe].float(), valid


def _sparse_mla_torch(q, kv_cache, indices, softmax_scale, *, attn_sink=None,
                      extra_kv_cache=None, extra_indices=None, out, lse) -> None:
    """INTERIM CUDA PATH (until the Hopper kernel lands), also the CPU benchmark's torch
    baseline: gather the selected rows (dequantizing FP8), float32 einsum, softmax with the
    sink, float32 accumulation, LSE. Arguments already validated; writes out and lse. No host
    synchronisation: every branch depends only on shapes."""
    keys, valid = _gather_rows(kv_cache, indices)
    if extra_kv_cache is not None:
        k2, v2 = _gather_rows(extra_kv_cache, extra_indices)
        keys, valid = torch.cat([keys, k2], dim=1), torch.cat([valid, v2], dim=1)
    T, H, _ = q.shape
    if keys.shape[1] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    s = torch.einsum("thd,tkd->thk", q.float(), keys) * softmax_scale  # [T, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no valid key
    p = torch.exp(s - m)
    l = p.sum(dim=-1)  # [T, H]
    denom = l
    if attn_sink is not None:
        denom = l + torch.exp(attn_sink[None, :] - m[..., 0])
    tiny = torch.finfo(torch.float32).tiny  # denom >= 1 wherever a key is valid
    o = torch.einsum("thk,tkd->thd", p, keys) / denom.clamp_min(tiny)[..., None]
    has_key = (l > 0)[..., None]
    out.copy_(torch.where(has_key, o, torch.zeros_like(o)))
    lse.copy_(torch.log(l) + m[..., 0])  # log(0) = -inf for rows with no valid key
