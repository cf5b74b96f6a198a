"""The DeepSeek-V4 FP8 KV-cache layout (FlashMLA "MODEL1"): quantize / dequantize.

Each token's 512-dim K=V vector is 448 NoPE values + 64 RoPE values. One cache block of
`block_size` tokens is a row of `block_size * 584` bytes::

    byte 0                                                    block_size*576        block_size*584
    | tok 0: 576 B | tok 1: 576 B | ... | tok bs-1: 576 B     | tok 0: 8 B | ... | tok bs-1: 8 B |

    token row (576 B):  [0, 448)    448 NoPE values, float8_e4m3fn
                        [448, 576)  64 RoPE values, bfloat16 little-endian (2 B each)
    token scales (8 B): [0, 7)      7 UE8M0 scale bytes, scale = 2^(byte - 127);
                                    NoPE value i uses scale byte i // 64
                        7           pad (0)

    dequantized NoPE value i = e4m3(byte i) * 2^(scale[i // 64] - 127);  RoPE = bf16 as is.

The 576-byte token rows keep every row 16-byte aligned for the GPU kernels; the scales follow
all rows of the block.

Quantization picks, per token and 64-value group, the power-of-two scale
2^ceil(log2(amax / 448)) (448 = largest e4m3fn value), so x / scale lies in [-448, 448]; an
all-zero group gets scale 1. The byte order assumes a little-endian host (x86, ARM).
"""

from __future__ import annotations

import torch

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM  # 512
GROUP = 64
NUM_GROUPS = NOPE_DIM // GROUP  # 7
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8  # 7 UE8M0 bytes + 1 pad
BYTES_PER_TOKEN = ROW_BYTES + SCALE_BYTES  # 584
E4M3_MAX = 448.0


def quantize_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """kv [num_blocks, block_size, 512] float32/bfloat16 (finite) -> uint8
    [num_blocks, block_size*584] in the V4 FP8 layout described in this module's docstring."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"quantize_kv_fp8: kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quantize_kv_fp8: kv must be float32 or bfloat16, got {kv.dtype}")
    if kv.dim() != 3 or kv.shape[2] != HEAD_DIM:
        raise ValueError(f"quantize_kv_fp8: kv must have shape [*, *, 512], got {tuple(kv.shape)}")
    nb, bs, _ = kv.shape
    x = kv.float()
    nope = x[..., :NOPE_DIM].reshape(nb, bs, NUM_GROUPS, GROUP)
    amax = nope.abs().amax(dim=-1)  # [nb, bs, 7]
    # Exponent e = ceil(log2(amax / 448)); fix up log2 rounding so that amax / 2^e <= 448 holds
    # exactly and e is the smallest such (both checks are exact: scaling by 2^k is exact).
    e = torch.ceil(torch.log2(amax / E4M3_MAX))
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-127, 127)
    e = torch.where((amax * torch.exp2(-e) > E4M3_MAX) & (e < 127), e + 1, e)
    e = torch.where((amax * torch.exp2(1 - e) <= E4M3_MAX) & (e > -127) & (amax > 0), e - 1, e)
    scaled = (nope * torch.exp2(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    nope_bytes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(nb, bs, NOPE_DIM)
    rope_bytes = x[..., NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [nb,bs,128]
    scale_bytes = torch.zeros(nb, bs, SCALE_BYTES, dtype=torch.uint8, device=kv.device)
    scale_bytes[..., :NUM_GROUPS] = (e + 127).to(torch.uint8)
    rows = torch.cat([nope_bytes, rope_bytes], dim=-1).reshape(nb, bs * ROW_BYTES)
    return torch.cat([rows, scale_bytes.reshape(nb, bs * SCALE_BYTES)], dim=1).contiguous()


def fp8_cache_block_size(cache: torch.Tensor, name: str = "cache",
                         op: str = "dequantize_kv_fp8") -> int:
    """block_size of a uint8 [num_blocks, block_size*584] cache; raises if the shape is not one."""
    if cache.dim() != 2:
        raise ValueError(f"{op}: {name} (FP8 layout) must be 2-D [num_blocks, block_size*584], "
                         f"got shape {tuple(cache.shape)}")
    if cache.shape[1] == 0 or cache.shape[1] % BYTES_PER_TOKEN != 0:
        raise ValueError(f"{op}: {name} (FP8 layout) shape[1] must be block_size*584 with "
                         f"block_size >= 1, got {cache.shape[1]} (not a positive multiple of 584)")
    return cache.shape[1] // BYTES_PER_TOKEN


def split_fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a uint8 [nb, bs*584] cache: token rows [nb, bs, 576] and scales [nb, bs, 8]."""
    nb = cache.shape[0]
    bs = cache.shape[1] // BYTES_PER_TOKEN
    rows = cache[:, : bs * ROW_BYTES].unflatten(1, (bs, ROW_BYTES))
    scales = cache[:, bs * ROW_BYTES :].unflatten(1, (bs, SCALE_BYTES))
    assert rows.shape[0] == nb
    return rows, scales


def dequantize_rows(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Token rows [..., 576] uint8 + scales [..., 8] uint8 -> float32 [..., 512]."""
    nope = rows[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    rope = rows[..., NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    sb = scales[..., :NUM_GROUPS]
    scale = torch.exp2(sb.float() - 127.0)  # UE8M0 2^(byte - 127) ...
    scale = torch.where(sb == 255, float("nan"), scale)  # ... but 255 is NaN (exp2 gives inf)
    nope = (nope.unflatten(-1, (NUM_GROUPS, GROUP)) * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat([nope, rope], dim=-1)


def dequantize_kv_fp8(cache: torch.Tensor) -> torch.Tensor:
    """uint8 [num_blocks, block_size*584] (V4 FP8 layout) -> float32 [num_blocks, block_size, 512].
    """
    if not isinstance(cache, torch.Tensor):
        raise TypeError("dequantize_kv_fp8: cache must be a torch.Tensor, "
                        f"got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise TypeError(f"dequantize_kv_fp8: cache must be uint8, got {cache.dtype}")
    fp8_cache_block_size(cache)
    rows, scales = split_fp8_cache(cache)
    return dequantize_rows(rows, scales)
