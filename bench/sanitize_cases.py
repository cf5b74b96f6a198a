"""Small representative calls of every CUDA kernel, for compute-sanitizer (memcheck/racecheck):
  compute-sanitizer --tool memcheck python3 bench/sanitize_cases.py"""

import torch

from zeroinfer.ops import (correct_lengths, indexer_scores, mhc_collapse, mhc_mix, mhc_mixes,
                           moe_combine, moe_dispatch, moe_route, rms_norm, rope_rotate,
                           sparse_mla_attention)
from zeroinfer.quant.kv_fp8 import quantize_kv_fp8

gen = torch.Generator().manual_seed(1)
# All take the fused kernel (132 SMs): one block (T = 1: no count table, no grid barrier), copy
# ranges that start / end inside a token (300, 3000), and the int32 count table read in batches
# (6000 x 8 at E = 128: 368 entries and 8-9 table rows a thread).
for T, k, E, tile, D in [(1, 6, 256, 64, 4096), (300, 6, 256, 16, 4096), (77, 3, 5, 1, 13),
                        (3000, 6, 256, 64, 520), (6000, 8, 128, 16, 24)]:
    x = torch.randn(T, D, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.randint(-1, E, (T, k), generator=gen, dtype=torch.int32).cuda()
    d = moe_dispatch(x, ids, E, tile=tile)
    w = torch.rand(T, k, generator=gen).cuda()
    moe_combine(d.sorted_x, d.token_row, w)

R, S = 300, 4
i32 = dict(dtype=torch.int32, device="cuda")
cu = torch.arange(0, (R + 1) * S, S, **i32)
correct_lengths(torch.randperm(R, **i32), torch.randint(1, S + 1, (R,), **i32),
                torch.randint(0, 1000, (R, S), **i32), torch.full((R,), S, **i32),
                torch.full((R,), S, **i32), cu, torch.randint(S, 900, (R,), **i32),
                torch.randint(0, 900, (R * S,), **i32), torch.randint(0, 1000, (R * S,), **i32))

# Sparse MLA: split and unsplit plans, both cache formats, extra cache, -1 entries, ragged tails.
# FP8 at 16 heads runs the 16-head kernel on 64-entry tiles (50 tokens) and on 32-entry tiles at
# two CTAs an SM (200 tokens: over one wave), at 32 heads the 16-warp layout; 128 heads over many
# tiles (two 64-head CTAs a token); 64 heads over the bf16 cache (the wgmma kernel) split and not.
for T, H, K, K2, fmt in [(1, 64, 200, 77, "fp8"), (40, 16, 130, 0, "bf16"), (3, 128, 64, 9, "fp8"),
                         (200, 8, 65, 33, "bf16"), (50, 16, 200, 40, "fp8"),
                         (200, 16, 150, 20, "fp8"),
                         (20, 32, 130, 0, "fp8"), (30, 128, 300, 40, "fp8"),
                         (2, 64, 300, 45, "bf16"), (140, 64, 150, 9, "bf16")]:
    kv = torch.randn(8, 64, 512, generator=gen)
    kv2 = torch.randn(4, 16, 512, generator=gen)
    if fmt == "fp8":
        kv, kv2 = quantize_kv_fp8(kv), quantize_kv_fp8(kv2)
    else:
        kv, kv2 = kv.bfloat16(), kv2.bfloat16()
    idx = torch.randint(-1, 8 * 64, (T, K), generator=gen, dtype=torch.int32)
    extra = {}
    if K2:
        extra = dict(extra_kv_cache=kv2.cuda(),
                     extra_indices=torch.randint(-1, 64, (T, K2), generator=gen,
                                                 dtype=torch.int32).cuda())
    q = torch.randn(T, H, 512, generator=gen).to("cuda", torch.bfloat16)
    sparse_mla_attention(q, kv.cuda(), idx.cuda(), 0.05, attn_sink=torch.randn(H).cuda(), **extra)

# MXFP4 grouped GEMM: both activation types, both layouts, three tile shapes, fused SwiGLU, padding
# rows / k tails, an empty expert and rows owned by nobody.
import zeroinfer.ops.moe_gemm as _mg  # noqa: E402
from zeroinfer.ops import mxfp4_act_scale_mn_major, mxfp4_grouped_gemm, mxfp4_prepack  # noqa: E402

E, N, K = 5, 96, 288
w = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8).cuda()
ws = torch.randint(115, 135, (E, N, K // 32), generator=gen, dtype=torch.uint8).cuda()
packs = {f: mxfp4_prepack(w, ws, fuse_swiglu=f) for f in (False, True)}
off = torch.tensor([0, 3, 3, 40, 41, 150], dtype=torch.int32, device="cuda")
cnt = torch.tensor([2, 0, 37, 1, 100], dtype=torch.int32, device="cuda")
x16 = torch.randn(152, K, generator=gen).to("cuda", torch.bfloat16)
mm = torch.tensor([0, 7, 1, 20, 3], dtype=torch.int32, device="cuda")
x3 = torch.randn(E, 21, K, generator=gen).to("cuda", torch.bfloat16)
K8 = 256
w8 = torch.randint(0, 256, (E, N, K8 // 2), generator=gen, dtype=torch.uint8).cuda()
s8 = torch.randint(115, 135, (E, N, K8 // 32), generator=gen, dtype=torch.uint8).cuda()
p8 = mxfp4_prepack(w8, s8, fuse_swiglu=True, act_dtype=torch.float8_e4m3fn)
x8 = torch.randn(E, 21, K8, generator=gen).to("cuda", torch.float8_e4m3fn)
sc8 = torch.rand(E, 21, K8 // 128, generator=gen).cuda()
for tile in (1, 2, 4):  # small (mma.sync for bf16), wide and 64-token wgmma tiles
    _mg._FORCE_TILE = tile
    for f in (False, True):
        mxfp4_grouped_gemm(x16, packs[f], None, expert_offsets=off, expert_counts=cnt,
                           fuse_swiglu=f, swiglu_limit=7.0 if f else None)
    mxfp4_grouped_gemm(x3, packs[False], None, masked_m=mm, out_dtype=torch.float32)
    mxfp4_grouped_gemm(x8, p8, None, masked_m=mm, a_scale=sc8, fuse_swiglu=True)
    mxfp4_grouped_gemm(x8.reshape(E * 21, K8), p8, None, expert_offsets=torch.arange(
        0, 106, 21, dtype=torch.int32, device="cuda"), a_scale=sc8.reshape(E * 21, -1),
        fuse_swiglu=True)
# float8 without SwiGLU, float32 out: an expert of two 256-token tiles of the wide tile (the
# second 44 rows full), one of 5 rows, an empty one
p8n = mxfp4_prepack(w8, s8, act_dtype=torch.float8_e4m3fn)
x8n = torch.randn(310, K8, generator=gen).to("cuda", torch.float8_e4m3fn)
sc8n = torch.rand(310, K8 // 128, generator=gen).cuda()
off8 = torch.tensor([0, 300, 300, 305, 310, 310], dtype=torch.int32, device="cuda")
# (and with token-contiguous scales: the strided a_scale reads)
for tile in (2, 4):
    _mg._FORCE_TILE = tile
    mxfp4_grouped_gemm(x8n, p8n, None, expert_offsets=off8, a_scale=sc8n, out_dtype=torch.float32)
    mxfp4_grouped_gemm(x8n, p8n, None, expert_offsets=off8, a_scale=mxfp4_act_scale_mn_major(sc8n),
                       out_dtype=torch.float32)
# float8 wide tile, 192 items (3 experts x 2 token tiles x 32 weight tiles: two on some CTAs) of 3
# stages with per-stage bases: the ring's slots and decoded buffers are reused within a CTA (the
# producer's refills and factor stores after the consumers' empty / dfree releases), which no
# case above reaches (at most one item of at most two stages a CTA). Those releases were named
# barriers, which racecheck reported here (8 hazards); they are mbarriers since session 21 and it
# reports none (moe_gemm_NOTES.md).
wb = torch.randint(0, 256, (3, 4096, 384 // 2), generator=gen, dtype=torch.uint8).cuda()
sb = torch.randint(115, 135, (3, 4096, 384 // 32), generator=gen, dtype=torch.uint8).cuda()
pb = mxfp4_prepack(wb, sb, act_dtype=torch.float8_e4m3fn)
xb = torch.randn(700, 384, generator=gen).to("cuda", torch.float8_e4m3fn)
scb = torch.rand(700, 3, generator=gen).cuda()
offb = torch.tensor([0, 300, 600, 700], dtype=torch.int32, device="cuda")
_mg._FORCE_TILE = 2
for dt in (torch.bfloat16, torch.float32):
    mxfp4_grouped_gemm(xb, pb, None, expert_offsets=offb, a_scale=scb, out_dtype=dt)
_mg._FORCE_TILE = 0

# The routed layout (topk_ids, no dispatch): the plan (tiny + small tier at 252 rows with skewed
# experts), each decode tile forced, per-token and per-slot activations, -1 and out-of-range ids
# (rows not written: the kernel must skip them, not read past the schedule), then the routed
# combine.
for T, k, tiles in [(1, 6, (0, 1, 3)), (42, 6, (0, 1, 3)), (7, 3, (3,))]:
    ids = torch.randint(-1, E + 2, (T, k), generator=gen, dtype=torch.int32)
    if T == 42:
        ids[:30, :3] = torch.arange(3, dtype=torch.int32)  # 30+ rows on experts 0-2
    ids = ids.cuda()
    xr = torch.randn(T, K, generator=gen).to("cuda", torch.bfloat16)
    for tile in tiles:
        _mg._FORCE_TILE = tile
        mxfp4_grouped_gemm(xr, packs[True], None, topk_ids=ids, fuse_swiglu=True,
                           swiglu_limit=7.0)
        hs = torch.randn(T * k, K, generator=gen).to("cuda", torch.bfloat16)
        o = mxfp4_grouped_gemm(hs, packs[False], None, topk_ids=ids)
        moe_combine(o, None, torch.rand(T, k, generator=gen).cuda(), topk_ids=ids)
_mg._FORCE_TILE = 0


def offsets_of(counts):
    """Expert-sorted row offsets [E + 1] on the GPU for per-expert row counts."""
    return torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()]).cuda()


# The six-expert decode plan: the tiny base tile and the small tier (SmallCfg, experts of >= 9
# rows, which no forced tile above runs: a forced tile 1 is the small base tile), contiguous and
# routed.
E2 = 64
w2 = torch.randint(0, 256, (E2, N, K // 2), generator=gen, dtype=torch.uint8).cuda()
s2 = torch.randint(115, 135, (E2, N, K // 32), generator=gen, dtype=torch.uint8).cuda()
p2 = mxfp4_prepack(w2, s2, fuse_swiglu=True)
cnt2 = torch.zeros(E2, dtype=torch.int32)
cnt2[:7] = torch.tensor([32, 31, 17, 9, 40, 12, 2], dtype=torch.int32)
off2 = offsets_of(cnt2)
x2 = torch.randn(int(off2[-1]), K, generator=gen).to("cuda", torch.bfloat16)
mxfp4_grouped_gemm(x2, p2, None, expert_offsets=off2, fuse_swiglu=True, swiglu_limit=7.0)
ids2 = torch.arange(6, dtype=torch.int32).repeat(32, 1)  # 32 tokens on experts 0-5 (every 5th: 7)
ids2[::5, 5] = 7
ids2 = ids2.cuda()
x2r = torch.randn(32, K, generator=gen).to("cuda", torch.bfloat16)
mxfp4_grouped_gemm(x2r, p2, None, topk_ids=ids2, fuse_swiglu=True, swiglu_limit=7.0)

# The float8 tiny tile's two stage loops (plain, 3 stages ahead; skewed, 2 ahead), each forced:
# 2048 items (64 experts of 1..8 rows x 32 weight tiles: several a CTA, its ring slots reused
# across items) and, with only three experts' rows, one item a CTA at most.
E3, N3, K3 = 64, 2048, 512
w3 = torch.randint(0, 256, (E3, N3, K3 // 2), generator=gen, dtype=torch.uint8).cuda()
s3 = torch.randint(115, 135, (E3, N3, K3 // 32), generator=gen, dtype=torch.uint8).cuda()
p3 = mxfp4_prepack(w3, s3, act_dtype=torch.float8_e4m3fn)
cnt3 = torch.randint(1, 9, (E3,), generator=gen, dtype=torch.int32)
_mg._FORCE_TILE = 3
for loop in (1, 2):
    _mg._FORCE_FP8_TINY_LOOP = loop
    for c3 in (cnt3, torch.cat([cnt3[:3], torch.zeros(E3 - 3, dtype=torch.int32)])):
        off3 = offsets_of(c3)
        x3r = torch.randn(int(off3[-1]), K3, generator=gen).to("cuda", torch.float8_e4m3fn)
        sc3 = torch.rand(int(off3[-1]), K3 // 128, generator=gen).cuda()
        mxfp4_grouped_gemm(x3r, p3, None, expert_offsets=off3, a_scale=sc3)
_mg._FORCE_TILE = _mg._FORCE_FP8_TINY_LOOP = 0

# mHC mixes: one token, a ragged block tail, N = 4 (V4) and N = 8 (the largest).
for T, n in [(1, 4), (131, 4), (300, 8)]:
    w = (2 + n) * n
    mhc_mixes(torch.randn(T, w, generator=gen).cuda(), torch.rand(3, generator=gen).cuda(),
              torch.randn(w, generator=gen).cuda(), streams=n, iters=20, eps=1e-6)

# mHC collapse / mix and RoPE: a ragged last block (T * D not a multiple of 256), both dtypes.
# (D = 256: the 16-byte mix kernel for both dtypes; 300: float32's, and bf16's one-dim kernel.)
for dtype, D in ((torch.float32, 300), (torch.bfloat16, 300), (torch.bfloat16, 256)):
    T, n = 7, 4
    s = torch.randn(T, n, D, generator=gen).to("cuda", dtype)
    mhc_collapse(torch.rand(T, n, generator=gen).cuda(), s)
    mhc_mix(s, torch.randn(T, D, generator=gen).to("cuda", dtype),
            torch.rand(T, n, generator=gen).cuda(), torch.rand(T, n, n, generator=gen).cuda())
    x = torch.randn(T, 3, 130, generator=gen).to("cuda", dtype)
    rope_rotate(x, torch.rand(T, 32, generator=gen).to("cuda", dtype),
                torch.rand(T, 32, generator=gen).to("cuda", dtype), inverse=dtype == torch.float32)

# Indexer scores: a partial last tile, heads and channels off the 32-wide passes (the CUDA-core
# kernel: float32 keys, bf16 at d = 65) or off the 64-head groups and the 64-entry tiles (the
# tensor-core kernel: bf16 at d = 128, 48; q not bf16-exact: two MMAs), an unmapped block (NaN,
# nothing read) and a token that sees nothing.
for dtype, H, d in ((torch.float32, 33, 65), (torch.bfloat16, 33, 65), (torch.bfloat16, 100, 128),
                    (torch.bfloat16, 3, 48)):
    T, block = 5, 7
    keys = torch.randn(40, block, d, generator=gen).to("cuda", dtype)
    table = torch.randperm(40, generator=gen)[:3 * 13].view(3, 13).int()
    table[1, 2] = -1
    indexer_scores(torch.randn(T, H, d, generator=gen).cuda(),
                   torch.randn(T, H, generator=gen).cuda(), keys, table.cuda(),
                   torch.tensor([0, 1, 2, 1, 0]).cuda(),
                   torch.tensor([91, 30, 0, 7, 50]).cuda(), 91, scale=d**-0.5)
# Enough tiles (16 x 300) for the tensor-core kernel to stream ~5 a CTA through its 3-stage ring.
keys = torch.randn(1200, 64, 128, generator=gen).to("cuda", torch.bfloat16)
indexer_scores(torch.randn(16, 64, 128, generator=gen).bfloat16().float().cuda(),
               torch.randn(16, 64, generator=gen).cuda(), keys,
               torch.randperm(1200, generator=gen).view(4, 300).int().cuda(),
               torch.arange(16).remainder(4).cuda(),
               torch.tensor([19200, 19170, 5000, 1] * 4).cuda(), 19200, scale=128**-0.5)

# RMS norms: rows shorter than the 256 lanes, and longer with a ragged end; both dtypes; a warp a
# row up to 1024 (16-byte loads at D = 512; element by element at 7, 300), a CTA a row above.
for dtype, D in ((torch.float32, 7), (torch.bfloat16, 300), (torch.bfloat16, 512),
                 (torch.float32, 16384)):
    x = torch.randn(5, D, generator=gen).to("cuda", dtype)
    rms_norm(x, torch.rand(D, generator=gen).cuda(), 1e-6)
    rms_norm(x, None, 1e-6)

# MoE router: learned routing (V4's 256 experts, top-6; a partial last CTA of warps) and hash
# routing with a bad token id (its token marked, nothing read out of range).
logits = torch.randn(5, 256, generator=gen).to("cuda", torch.bfloat16)
moe_route(logits, 6, scale=1.5, bias=torch.randn(256, generator=gen).cuda())
moe_route(logits, 6, scale=1.5, hash_table=torch.randint(0, 256, (9, 6), generator=gen).cuda(),
          input_ids=torch.tensor([0, 8, 3, 99, 1]).cuda())

torch.cuda.synchronize()
print("sanitize cases done")
