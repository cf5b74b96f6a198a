"""Float64 reference for zeroinfer.ops.sparse_mla_attention (DeepSeek-V4 sparse MLA).

Decodes every cache format itself (the FP8 layout bit by bit), shares no code with the kernel
or with zeroinfer.quant, and does the softmax with its sink in float64:

    s_hj  = softmax_scale * (q_h . k_j)            j over the valid slots of both index lists
    out_h = sum_j exp(s_hj) k_j / (sum_j exp(s_hj) + exp(sink_h))
    lse_h = log(sum_j exp(s_hj))                   (no sink); no valid key: out 0, lse -inf
"""

from __future__ import annotations

import torch


def _e4m3_to_f64(b: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes -> float64 from the bit fields: sign, 4-bit exponent (bias 7),
    3-bit mantissa; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN."""
    b = b.to(torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).to(torch.float64)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float64)
    normal = (1.0 + man / 8.0) * torch.pow(2.0, (exp - 7).to(torch.float64))
    subnormal = (man / 8.0) * 2.0**-6
    v = sign * torch.where(exp == 0, subnormal, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(v, float("nan")), v)


def _bf16_bytes_to_f64(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Little-endian bfloat16 byte pairs -> float64 (bf16 is the top half of a float32)."""
    bits = (hi.to(torch.int32) << 24) | (lo.to(torch.int32) << 16)
    return bits.view(torch.float32).to(torch.float64)


def _decode_cache(cache: torch.Tensor) -> torch.Tensor:
    """Any supported cache -> float64 [num_slots, 512], slot = block * block_size + offset."""
    if cache.dtype in (torch.float32, torch.bfloat16):
        return cache.to(torch.float64).reshape(-1, 512)
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.shape[1] % 584 == 0
    nb, bs = cache.shape[0], cache.shape[1] // 584
    data = cache[:, : bs * 576].reshape(nb, bs, 576)
    scale_bytes = cache[:, bs * 576 :].reshape(nb, bs, 8)[..., :7]
    scales = torch.pow(2.0, scale_bytes.to(torch.float64) - 127.0)  # UE8M0
    scales = torch.where(scale_bytes == 255, torch.full_like(scales, float("nan")), scales)
    nope = _e4m3_to_f64(data[..., :448]) * scales.repeat_interleave(64, dim=-1)
    rope_bytes = data[..., 448:576]
    rope = _bf16_bytes_to_f64(rope_bytes[..., 0::2], rope_bytes[..., 1::2])
    return torch.cat([nope, rope], dim=-1).reshape(nb * bs, 512)


def sparse_mla_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out float64 [T, H, 512], lse float64 [T, H]). Same arguments as the op."""
    T, H, _ = q.shape
    q64 = q.to(torch.float64)
    key_list, valid_list = [], []
    pairs = [(kv_cache, indices)]
    if extra_kv_cache is not None:
        pairs.append((extra_kv_cache, extra_indices))
    for cache, idx in pairs:
        rows = _decode_cache(cache)
        idx = idx.to(torch.int64)
        valid = idx >= 0
        safe = torch.where(valid, idx, torch.zeros_like(idx))
        if rows.shape[0] > 0:
            keys = rows[safe]
        else:  # a cache without slots: every index is -1
            keys = torch.zeros(*idx.shape, 512, dtype=torch.float64, device=q.device)
        key_list.append(keys)  # [T, K, 512]
        valid_list.append(valid)
    keys = torch.cat(key_list, dim=1)
    valid = torch.cat(valid_list, dim=1)  # [T, Ktot]

    scores = softmax_scale * torch.einsum("thd,tkd->thk", q64, keys)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    any_valid = valid.any(dim=1)[:, None].expand(T, H)  # [T, H]
    if scores.shape[-1] > 0:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = torch.full((T, H), float("-inf"), dtype=torch.float64, device=q.device)
    denom_log = lse
    if attn_sink is not None:
        sink = attn_sink.to(torch.float64)[None, :].expand(T, H)
        denom_log = torch.logaddexp(lse, sink)
    safe_denom = torch.where(any_valid, denom_log, torch.zeros_like(denom_log))
    probs = torch.exp(scores - safe_denom[..., None])  # masked keys: exp(-inf) = 0
    out = torch.einsum("thk,tkd->thd", probs, keys)
    out = torch.where(any_valid[..., None], out, torch.zeros_like(out))
    lse = torch.where(any_valid, lse, torch.full_like(lse, float("-inf")))
    return out, lse
