"""mxfp4_grouped_gemm: the routed-expert GEMM of DeepSeek-V4 with MXFP4 weights.

CPU tensors run the C++ twin (zeroinfer._C.mxfp4_grouped_gemm_cpu). CUDA tensors with bfloat16
(W4A16) or float8_e4m3fn (W4A8) activations run the sm_90a kernel (zeroinfer._C.
mxfp4_grouped_gemm_cuda, csrc/cuda/moe_gemm.cu), which reads the weights in a one-time repacked
layout: `mxfp4_prepack(w, w_scale) -> Mxfp4PackedWeights`, passed in place of `w` (with
`w_scale=None`). Float32 activations on CUDA keep the INTERIM torch path (dequantize + matmul).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_float, check_no_alias, check_tensor

_OP = "mxfp4_grouped_gemm"
_FP8 = torch.float8_e4m3fn
_ACT_DTYPES = (torch.float32, torch.bfloat16, _FP8)
_OUT_DTYPES = (torch.float32, torch.bfloat16)
_W_DTYPES = (torch.uint8, torch.int8)
_SCALE_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d)


def _name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


_INT32_LIMIT = 2**31
# The CUDA kernel's largest routed layout (topk_ids) in rows, T*k: larger batches go through
# moe_dispatch and the contiguous layout.
MXFP4_ROUTED_MAX_ROWS: int = _C.MXFP4_ROUTED_MAX_ROWS
# Tile shape of the CUDA kernel: 0 = planned from the shapes (_C.mxfp4_cuda_plan), 1 = small-M
# (32 tokens), 2 = wide (bf16: 128-token wgmma tile; float8: 256-token warp-specialised tile),
# 3 = tiny-M (decode, <= 8 rows per expert per tile), 4 = wgmma (64-token tile). Tests set it to
# run every shape on the same inputs (every shape gives bitwise the same result).
_FORCE_TILE = 0
# The float8 tiny tile's stage loop: 0 = chosen by the device (_C.mxfp4_fp8_tiny_plain_loop: the
# plain loop where HBM bandwidth per SM is high, as on the H200; the skewed loop on the H100),
# 1 = plain, 2 = skewed. Both give bitwise the same result; tests and A/B benchmarks force each.
_FORCE_FP8_TINY_LOOP = 0


def _kslot_order(a: torch.Tensor) -> torch.Tensor:
    """The activations with each 16-k group's bf16 pairs in the packed weights' k-slot order
    (slot pair q <- real pair 0,2,4,6,1,3,5,7), as the wgmma tile reads them: its token tiles
    then travel by plain 16-byte copies (one pass over ``a`` instead of a register shuffle in
    every CTA that reads the tile)."""
    k = a.shape[-1]
    return a.unflatten(-1, (k // 16, 4, 2, 2)).transpose(-3, -2).flatten(-4).contiguous()


# --------------------------------------------------------------------------------------------
# The CUDA kernel's weight layout (one-time repack; csrc/include/zeroinfer/moe_gemm.h).
#
#   data: uint8 [E, n_pad / 64, k_pad / 128, 4, 2, 544]
#
# i.e. the blocks [E, n_pad / 16, k_pad / 64, 544] (Mxfp4PackedWeights.blocks()) stored stage by
# stage per 64-row group: a group's 4 strips (16 rows each) x 2 blocks of one 128-k stage are one
# contiguous 4,352-byte run, which every kernel tile reads whole (1-6% faster on the decode tiles
# than strip by strip along k; moe_gemm_NOTES.md, session 24).
# A block covers 16 (packed) weight rows x 64 k. Bytes 0..511 hold its 1024 e2m1 values in mma
# fragment order: lane L = 4g + t (g = L // 4, t = L % 4) owns bytes 16L..16L+15 = four
# little-endian 32-bit words; word w = 2s + h (s: 32-group of the block, h: 16-half of it) holds
# the 8 values (r, j), r in {row g, row g + 8}, j in 0..3, at k = 32s + 16h + 4t + j. Where each
# value's 4 bits (m = mantissa, e0, e1 = exponent, sgn) sit in the word depends on the
# activation type the weights are packed for (each decodes with the fewest instructions):
#   float8: value (r, j)'s 3 code bits (m, e0, e1) are bits 4i..4i+2 with i = 4r + j, so the low
#     / high 16 bits masked with 0x7777 are a prmt selector of the row's 4 e4m3 bytes; its sign
#     bit is bit 8j + 7 (row g) or 8j + 3 (row g+8): the word masked with 0x80808080, or shifted
#     left by 4 and masked, is the sign of each byte.
#   bfloat16: words come in pairs (q0, q1) = the two 16-halves h of a 32-group; in the
#     kernel's decode (decode_bf16_raw in csrc/cuda/moe_gemm.cu) the A-fragment registers of half
#     h are: a0 = q_h & 0x81C081C0, a1 / a2 = q_h rotated right by 4 / 10 and masked alike, and a3
#     = z rotated right by 6 (h = 0) / 12 (h = 1) and masked, with z = (q0 & 0x60306030) |
#     (q1 rotated right by 2 & ~0x60306030): bf16 pairs (value * 2^-126, bits sgn 15 | e1 e0 m
#     8..6, low half the first value) with a0 = (g; j0, j1), a1 = (g+8; j0, j1), a2 = (g; j2, j3),
#     a3 = (g+8; j2, j3). _bf16_pair_bits derives the bit positions from exactly that routing.
# Bytes 512..543 hold the UE8M0 scales: byte 4g + c = (row g, group 0), (row g, group 1),
# (row g + 8, group 0), (row g + 8, group 1) for c = 0..3. Rows are padded to a multiple of
# MXFP4_PACK_ROWS and k to a multiple of MXFP4_PACK_K with zero values and scale byte 127.
# With fuse_swiglu the packed block b holds gate rows 8b..8b+7 (positions 0..7) and up rows
# N/2 + 8b..8b+7 (positions 8..15), so each thread owns the gate and up value of an output.
# --------------------------------------------------------------------------------------------
_FP8_BITS = {(r, j): (4 * (4 * r + j), 4 * (4 * r + j) + 1, 4 * (4 * r + j) + 2,
                     8 * j + (7 if r == 0 else 3)) for r in range(2) for j in range(4)}


def _bf16_pair_bits() -> dict[tuple[int, int, int], tuple[int, int, int, int]]:
    """(h, r, j) -> positions (0..63 over the word pair q0 | q1 << 32) of value (r, j)'s nibble
    bits (m, e0, e1, sgn) in half h, following the kernel's decode routing (comment above)."""
    pair_bits = (6, 7, 8, 15)   # output bits of m, e0, e1, sgn in the low bf16 (+16: high)
    left = 0x60306030
    out: dict[tuple[int, int, int], list[int]] = {}
    for h in range(2):
        for reg, (r, jp) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
            for half in range(2):
                key = (h, r, 2 * jp + half)
                out[key] = []
                for p in (b + 16 * half for b in pair_bits):
                    if reg < 3:  # rotation of q_h
                        pos = 32 * h + (p + (0, 4, 10)[reg]) % 32
                    else:        # rotation of z
                        zb = (p + (6, 12)[h]) % 32
                        pos = zb if (left >> zb) & 1 else 32 + (zb + 2) % 32
                    out[key].append(pos)
    return {k: tuple(v) for k, v in out.items()}


_BF16_PAIR_BITS = _bf16_pair_bits()
_ACT_DTYPES_CUDA = (torch.bfloat16, _FP8)
_BLOCK_MAPS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
_GROUP_ROWS = 16 * _C.MXFP4_GROUP_STRIPS  # packed rows of a 64-row group
_STAGE_K = 64 * _C.MXFP4_STAGE_BLOCKS     # k of a stage


def _pair_bits(act_dtype: torch.dtype) -> dict[tuple[int, int, int], tuple[int, int, int, int]]:
    """(h, r, j) -> positions over a 32-group's word pair (word h = bits 32h..32h+31) of value
    (r, j)'s nibble bits (m, e0, e1, sgn). Float8 words stand alone (the same bits each h)."""
    if act_dtype == _FP8:
        return {(h, r, j): tuple(32 * h + b for b in pos)
                for h in range(2) for (r, j), pos in _FP8_BITS.items()}
    return _BF16_PAIR_BITS


def _block_maps(device: torch.device,
                act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(bit map [4096], scale map [32]) of one packed block: packed bit (byte * 8 + bit) ->
    (row * 64 + k) * 4 + nibble bit, and scale byte -> row * 2 + group."""
    maps = _BLOCK_MAPS.get((device, act_dtype))
    if maps is None:
        bits = _pair_bits(act_dtype)
        bm = torch.full((4096,), -1, dtype=torch.long)
        for lane in range(32):
            g, t = divmod(lane, 4)
            for s in range(2):  # the lane's words 2s, 2s + 1: one pair
                for (h, r, j), pos in bits.items():
                    k = 32 * s + 16 * h + 4 * t + j
                    for b, q in enumerate(pos):
                        bm[lane * 128 + s * 64 + q] = ((g + 8 * r) * 64 + k) * 4 + b
        assert sorted(bm.tolist()) == list(range(4096))
        sc = torch.empty(32, dtype=torch.long)
        for g in range(8):
            for c, (dr, grp) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                sc[4 * g + c] = (g + dr) * 2 + grp
        maps = (bm.to(device), sc.to(device))
        _BLOCK_MAPS[(device, act_dtype)] = maps
    return maps


def _packed_rows(n: int, fuse_swiglu: bool, device: torch.device) -> tuple[int, torch.Tensor]:
    """(n_pad, src): packed row p holds checkpoint row src[p] (-1: a zero padding row)."""
    rt = _C.MXFP4_PACK_ROWS
    if fuse_swiglu:
        h = n // 2
        hp = -(-h // (rt // 2)) * (rt // 2)
        n_pad = 2 * hp
        p = torch.arange(n_pad, device=device)
        q = p % 16
        hh = 8 * (p // 16) + q % 8
        src = torch.where(q < 8, hh, h + hh)
        src = torch.where(hh < h, src, torch.full_like(src, -1))
    else:
        n_pad = -(-n // rt) * rt
        p = torch.arange(n_pad, device=device)
        src = torch.where(p < n, p, torch.full_like(p, -1))
    return n_pad, src


@dataclass(frozen=True, eq=False)
class Mxfp4PackedWeights:
    """MXFP4 expert weights repacked for the CUDA kernel (see ``mxfp4_prepack``).

    data: uint8 ``[E, n_pad/64, k_pad/128, 4, 2, 544]`` (the blocks of ``blocks()`` per 64-row
    group and 128-k stage, see the layout note above); n, k: the checkpoint's N and K; fuse_swiglu:
    gate/up rows interleaved (use only with ``fuse_swiglu=True`` calls); act_dtype: the
    activation dtype the bit layout is for (bfloat16 or float8_e4m3fn); wide_scales: some scale
    byte may exceed 128 (the bf16 path then scales in two exact steps).
    row_base: float8 only, uint8 ``[E, n_pad]`` (on data's device): the W4A8 row bases
    (``_w4a8_row_bases``; Mxfp4CudaGemmParams::row_base in zeroinfer/moe_gemm.h), which save the
    kernel a float32 multiply per output and 128-k stage, with bitwise the same results. None
    (e.g. ``dataclasses.replace(pw, row_base=None)``) runs every row on per-stage bases, the
    path the tests compare against."""

    data: torch.Tensor
    n: int
    k: int
    fuse_swiglu: bool
    act_dtype: torch.dtype
    wide_scales: bool
    row_base: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @property
    def n_pad(self) -> int:
        return self.data.shape[1] * _GROUP_ROWS

    @property
    def k_pad(self) -> int:
        return self.data.shape[2] * _STAGE_K

    def blocks(self) -> torch.Tensor:
        """The packed blocks in row-strip, k-block order: uint8 ``[E, n_pad/16, k_pad/64, 544]``
        (a copy; ``data`` stores them per 64-row group and stage)."""
        e, groups, stages = self.data.shape[:3]
        return self.data.permute(0, 1, 3, 2, 4, 5).reshape(
            e, groups * _C.MXFP4_GROUP_STRIPS, stages * _C.MXFP4_STAGE_BLOCKS, -1)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> Mxfp4PackedWeights:
        return Mxfp4PackedWeights(self.data.to(device), self.n, self.k, self.fuse_swiglu,
                                  self.act_dtype, self.wide_scales,
                                  None if self.row_base is None else self.row_base.to(device))


def _w4a8_row_bases(sc: torch.Tensor) -> torch.Tensor:
    """W4A8 row bases of packed scale bytes ``sc`` uint8 ``[E, n_pad, k_pad/32]`` (packed row
    order: every byte the kernel reads, padding rows' 127 included): uint8 ``[E, n_pad]``, each
    row's largest byte B where every row of its 64-row group (the rows of one float8
    warpgroup) folds exactly relative to its own B (every byte >= B - 11, so that no weight is an
    e4m3 subnormal) with B in the window [MXFP4_ROW_BASE_MIN, MXFP4_ROW_BASE_MAX] (which leaves
    out 255, NaN); 0 for the whole group
    otherwise (per-stage bases). The rule and why it changes no result: Mxfp4CudaGemmParams::
    row_base in zeroinfer/moe_gemm.h."""
    s = sc.to(torch.int16)
    hi, lo = s.amax(-1), s.amin(-1)
    ok = ((lo >= hi - _C.MXFP4_ROW_BASE_SPREAD) & (hi >= _C.MXFP4_ROW_BASE_MIN)
          & (hi <= _C.MXFP4_ROW_BASE_MAX))
    grp = _C.MXFP4_ROW_BASE_GROUP
    ok = ok.unflatten(1, (-1, grp)).all(-1, keepdim=True).expand(-1, -1, grp).flatten(1)
    return torch.where(ok, hi, 0).to(torch.uint8)


def mxfp4_prepack(w: torch.Tensor, w_scale: torch.Tensor, *, fuse_swiglu: bool = False,
                  act_dtype: torch.dtype = torch.bfloat16,
                  check_scales: bool = True) -> Mxfp4PackedWeights:
    """Repack checkpoint MXFP4 weights (``w`` ``[E, N, K/2]`` e2m1 pairs, ``w_scale``
    ``[E, N, K/32]`` UE8M0) into the CUDA kernel's layout, on their device, with torch ops.

    fuse_swiglu: interleave the gate (first N/2 rows) and up (last N/2 rows) halves for the
    fused gate/up GEMM; the result then only serves ``fuse_swiglu=True`` calls.
    act_dtype: bfloat16 (W4A16) or float8_e4m3fn (W4A8): the activations the weights will meet
    (the bit layout differs so that each path decodes with the fewest instructions).
    check_scales: look at the scale values once (a host sync) to enable the one-multiply bf16
    decode when every scale byte is <= 128 (all real checkpoints); False assumes the worst and
    never syncs. Do this once at load; it costs a few passes over the weights.
    Float8 weights also get their W4A8 row bases (``Mxfp4PackedWeights.row_base``; no sync).
    """
    op = "mxfp4_prepack"
    check_tensor(op, "w", w, dtypes=_W_DTYPES, ndim=3)
    dev = w.device
    num_experts, n, kh = w.shape
    k = 2 * kh
    if num_experts < 1 or n < 1 or k < 32 or k % 32 != 0:
        raise ValueError(f"{op}: w must be [E, N, K/2] with E, N >= 1 and K a positive multiple "
                         f"of 32, got {tuple(w.shape)}")
    check_tensor(op, "w_scale", w_scale, dtypes=_SCALE_DTYPES, shape=(num_experts, n, k // 32),
                 device=dev)
    if not isinstance(fuse_swiglu, bool):
        raise TypeError(f"{op}: fuse_swiglu must be a bool, got {type(fuse_swiglu).__name__}")
    if fuse_swiglu and n % 2 != 0:
        raise ValueError(f"{op}: fuse_swiglu needs an even N, got N = {n}")
    if act_dtype not in _ACT_DTYPES_CUDA:
        raise TypeError(f"{op}: act_dtype must be bfloat16 or float8_e4m3fn, got {act_dtype}")
    wb = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    sb = w_scale.view(torch.uint8) if w_scale.dtype != torch.uint8 else w_scale
    n_pad, src = _packed_rows(n, fuse_swiglu, dev)
    kq = _C.MXFP4_PACK_K
    k_pad = -(-k // kq) * kq
    valid = (src >= 0)[None, :, None]
    src = src.clamp(min=0)
    bit_map, sc_map = _block_maps(dev, act_dtype)
    nb, kb = n_pad // 16, k_pad // 64
    gs, sb_ = _C.MXFP4_GROUP_STRIPS, _C.MXFP4_STAGE_BLOCKS
    data = torch.empty(num_experts, nb // gs, kb // sb_, gs, sb_, _C.MXFP4_BLOCK_BYTES,
                       dtype=torch.uint8, device=dev)
    row_base = (torch.empty(num_experts, n_pad, dtype=torch.uint8, device=dev)
                if act_dtype == _FP8 else None)
    per = max(1, (1 << 26) // (n_pad * k_pad))  # bound the temporaries (~64 Mi values a chunk)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    for e0 in range(0, num_experts, per):
        e1 = min(num_experts, e0 + per)
        c = e1 - e0
        wc = torch.where(valid, wb[e0:e1].index_select(1, src), 0)
        sc = torch.where(valid, sb[e0:e1].index_select(1, src), 127)
        nib = torch.stack([wc & 15, wc >> 4], dim=-1).reshape(c, n_pad, k)
        del wc
        if k_pad > k:
            nib = torch.nn.functional.pad(nib, (0, k_pad - k))
            sc = torch.nn.functional.pad(sc, (0, (k_pad - k) // 32), value=127)
        blocks = nib.reshape(c, nb, 16, kb, 64).permute(0, 1, 3, 2, 4).reshape(c, nb, kb, 1024)
        del nib
        bits = torch.stack([(blocks >> b) & 1 for b in range(4)], dim=-1).reshape(c, nb, kb, 4096)
        del blocks
        pb = bits.index_select(-1, bit_map).reshape(c, nb, kb, 512, 8)
        del bits
        blk = torch.empty(c, nb, kb, _C.MXFP4_BLOCK_BYTES, dtype=torch.uint8, device=dev)
        blk[..., :512] = (pb << shifts).sum(-1, dtype=torch.uint8)
        del pb
        sblk = sc.reshape(c, nb, 16, kb, 2).permute(0, 1, 3, 2, 4).reshape(c, nb, kb, 32)
        blk[..., 512:] = sblk.index_select(-1, sc_map)
        # (strip 4 g + s, block 2 t + b) -> data[g, t, s, b]
        data[e0:e1] = blk.view(c, nb // gs, gs, kb // sb_, sb_, -1).permute(0, 1, 3, 2, 4, 5)
        del blk
        if row_base is not None:
            row_base[e0:e1] = _w4a8_row_bases(sc)
    wide = bool((sb > 128).any()) if check_scales else True
    return Mxfp4PackedWeights(data, n, k, fuse_swiglu, act_dtype, wide, row_base)


def _check_packed(op: str, pw: Mxfp4PackedWeights) -> None:
    """A packed-weights object is consistent (it may have been built by hand)."""
    d = pw.data
    check_tensor(op, "w.data", d, dtypes=(torch.uint8,), ndim=6)
    n_pad, _ = _packed_rows(pw.n, pw.fuse_swiglu, torch.device("cpu"))
    k_pad = -(-pw.k // _C.MXFP4_PACK_K) * _C.MXFP4_PACK_K
    if pw.act_dtype not in _ACT_DTYPES_CUDA:
        raise ValueError(f"{op}: w (Mxfp4PackedWeights) act_dtype must be bfloat16 or "
                         f"float8_e4m3fn, got {pw.act_dtype}")
    if (pw.n < 1 or pw.k < 32 or pw.k % 32 or (pw.fuse_swiglu and pw.n % 2)
            or tuple(d.shape[1:]) != (n_pad // _GROUP_ROWS, k_pad // _STAGE_K,
                                      _C.MXFP4_GROUP_STRIPS, _C.MXFP4_STAGE_BLOCKS,
                                      _C.MXFP4_BLOCK_BYTES)
            or d.shape[0] < 1):
        raise ValueError(f"{op}: w (Mxfp4PackedWeights) data of shape {tuple(d.shape)} does not "
                         f"match n={pw.n}, k={pw.k}, fuse_swiglu={pw.fuse_swiglu}; build it with "
                         "mxfp4_prepack")
    if d.data_ptr() % 16:
        raise ValueError(f"{op}: w (Mxfp4PackedWeights) data must be 16-byte aligned")
    if pw.row_base is not None:
        if pw.act_dtype != _FP8:
            raise ValueError(f"{op}: w (Mxfp4PackedWeights) row_base is only for weights packed "
                             f"for float8_e4m3fn activations, got act_dtype "
                             f"{_name(pw.act_dtype)}; set it to None")
        check_tensor(op, "w.row_base (Mxfp4PackedWeights)", pw.row_base, dtypes=(torch.uint8,),
                     shape=(d.shape[0], n_pad), device=d.device)


def mxfp4_unpack(pw: Mxfp4PackedWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``mxfp4_prepack``: the checkpoint layout ``(w [E, N, K/2], w_scale
    [E, N, K/32])`` as uint8, on the packed weights' device (torch ops, no host sync)."""
    if not isinstance(pw, Mxfp4PackedWeights):
        raise TypeError(f"mxfp4_unpack: expected Mxfp4PackedWeights, got {type(pw).__name__}")
    d = pw.blocks()
    dev = d.device
    num_experts, nb, kb, _ = d.shape
    bit_map, sc_map = _block_maps(dev, pw.act_dtype)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    pb = ((d[..., :512, None] >> shifts) & 1).reshape(num_experts, nb, kb, 4096)
    bits = torch.empty_like(pb).index_copy_(-1, bit_map, pb)
    bits = bits.reshape(num_experts, nb, kb, 1024, 4)
    blocks = bits[..., 0] | bits[..., 1] << 1 | bits[..., 2] << 2 | bits[..., 3] << 3
    nib = blocks.reshape(num_experts, nb, kb, 16, 64).permute(0, 1, 3, 2, 4)
    nib = nib.reshape(num_experts, nb * 16, kb * 64)
    sblk = torch.empty_like(d[..., 512:]).index_copy_(-1, sc_map, d[..., 512:].contiguous())
    sc = sblk.reshape(num_experts, nb, kb, 16, 2).permute(0, 1, 3, 2, 4)
    sc = sc.reshape(num_experts, nb * 16, kb * 2)
    n_pad, src = _packed_rows(pw.n, pw.fuse_swiglu, dev)
    pos = torch.empty(pw.n, dtype=torch.long, device=dev)
    keep = src >= 0
    pos[src[keep]] = torch.arange(n_pad, device=dev)[keep]
    nib = nib.index_select(1, pos)[:, :, :pw.k]
    w = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return w.contiguous(), sc.index_select(1, pos)[:, :, :pw.k // 32].contiguous()


def _a_scale_strides(a_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int]:
    """(a_scale, row stride, k-block stride) in elements, the kernel's flat-row addressing
    ``row * row_stride + kb * k_stride`` (masked: row = expert * cap + slot). A masked tensor
    whose expert stride is not ``cap`` row strides (or whose first two dims need distinct
    strides for another reason) is copied to row-major."""
    if a_scale is None:
        return None, -1, -1
    if a_scale.dim() == 3:
        e, cap, _ = a_scale.shape
        if e > 1 and cap > 0 and a_scale.stride(0) != cap * a_scale.stride(1):
            a_scale = a_scale.contiguous()
        return a_scale, a_scale.stride(1), a_scale.stride(2)
    return a_scale, a_scale.stride(0), a_scale.stride(1)


def mxfp4_act_scale_mn_major(a_scale: torch.Tensor) -> torch.Tensor:
    """The same per-token scales ``[M, K/128]`` (or masked ``[E, cap, K/128]``) stored
    token-contiguous: a view of a ``[K/128, rows]`` tensor (rows = M or E * cap, flat), the
    layout the CUDA W4A8 prefill tile reads fastest (a stage's scales of 256 consecutive rows
    in one coalesced read). Values and shape are unchanged."""
    kb = a_scale.shape[-1]
    return a_scale.reshape(-1, kb).t().contiguous().t().reshape(a_scale.shape)


def _launch_cuda(a, pw, a_scale, offsets, counts, masked_m, out, num_experts, m_rows, cap, k,
                 fuse, limit, route_ids=None, route_div=1) -> None:
    dev = a.device
    launches = _C.mxfp4_cuda_plan(a.dtype == _FP8, masked_m is not None, m_rows, num_experts,
                                  cap, _FORCE_TILE, route_ids is not None)
    # The bf16 wgmma tiles (4, 2) read their own copy of the activations in k-slot order
    # (contiguous, so 16-byte aligned rows); the e4m3 ones read `a` as it is.
    wgmma = any(tile in (2, 4) for tile, _ in launches)
    a_kslot = _kslot_order(a) if wgmma and a.dtype == torch.bfloat16 else None
    if a.data_ptr() % 16:  # the kernel copies activation rows in 16-byte pieces
        a = a.clone()
    a_scale, s_row, s_k = _a_scale_strides(a_scale)
    args = (ptr(a), dtype_code(a), ptr(a_scale), ptr(pw.data), ptr(pw.row_base), pw.n_pad,
            pw.k_pad, pw.fuse_swiglu, pw.act_dtype == _FP8, pw.wide_scales, ptr(offsets),
            ptr(counts), ptr(masked_m), ptr(out),
            dtype_code(out), num_experts, m_rows, cap, pw.n, k, fuse, limit, _FORCE_TILE,
            ptr(a_kslot), s_row, s_k)
    other = dev.index is not None and dev.index != torch.cuda.current_device()
    with torch.cuda.device(dev) if other else contextlib.nullcontext():
        _C.mxfp4_grouped_gemm_cuda(*args, stream_of(dev), ptr(route_ids), route_div,
                                   _FORCE_FP8_TINY_LOOP)


def mxfp4_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor | Mxfp4PackedWeights,
    w_scale: torch.Tensor | None,
    *,
    expert_offsets: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
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
            (rows sorted by expert), masked layout ``[E, cap, K]``, or routed layout ``[T, K]``
            (each token's row serves its k slots) or ``[T*k, K]`` (one row a slot). K must be a
            multiple of 32 (of 128 for float8).
        w: packed e2m1 weights ``[E, N, K/2]`` uint8 or int8 (raw bytes; byte j holds element 2j in
            its low nibble, 2j+1 in its high nibble) -- or an ``Mxfp4PackedWeights`` from
            ``mxfp4_prepack`` (then ``w_scale`` must be None). The CUDA kernel needs the packed
            form: raw CUDA weights are repacked on every call (correct, but an extra pass over the
            weights; prepack once at load instead). On CPU packed weights are unpacked per call.
        w_scale: UE8M0 scales ``[E, N, K/32]`` uint8 or float8_e8m0fnu (raw bytes); None with
            packed ``w``.
        expert_offsets: contiguous layout: int32 ``[E+1]``, nondecreasing, ``offsets[E] <= M``.
        expert_counts: contiguous layout, optional int32 ``[E]``: expert e owns rows
            ``[offsets[e], offsets[e] + counts[e])`` (default: the whole segment).
        masked_m: masked layout: int32 ``[E]`` in ``[0, cap]``: expert e owns rows
            ``[0, masked_m[e])`` of ``a[e]``.
        topk_ids: routed layout: the router's int32 ``[T, k]`` expert ids in ``[0, E)`` or -1
            (an expert elsewhere, e.g. on another rank). Output row ``t*k + j`` is expert
            ``topk_ids[t, j]`` applied to row t of a ``[T, K]`` (or row ``t*k + j`` of a
            ``[T*k, K]``); rows of -1 are not written. No ``moe_dispatch`` is needed: the CUDA
            kernel sorts the ids itself (each CTA, in shared memory) -- the decode path, for
            bfloat16 activations and ``T*k <= MXFP4_ROUTED_MAX_ROWS`` (256) on CUDA; any size
            and dtype on CPU. ``moe_combine(out, None, weights, topk_ids=topk_ids)`` sums it.
        a_scale: float8 activations only: float32 per-token scales ``[M, K/128]`` /
            ``[E, cap, K/128]``; ``a_real = a * a_scale[row, k // 128]``. Any strides: the
            CUDA prefill tile is fastest with token-contiguous ("MN-major") scales, i.e. the
            transposed view ``s.t()`` of a ``[K/128, M]`` tensor (``mxfp4_act_scale_mn_major``
            makes one; a masked ``[E, cap, K/128]`` is addressed by flat row ``e * cap + slot``
            and copied to row-major unless ``stride(0) == cap * stride(1)``). With float8
            activations the weights take part with their scale folded into e4m3 per (row, 128-k
            block) (exact unless a group's scale is > 14 binades under the block's largest; the
            rule is in zeroinfer/moe_gemm.h and ``dequantize_expert_w4a8_f64``).
        fuse_swiglu: ``w`` is gate ‖ up along N (N even); output column ``c < N/2`` is
            ``silu(min(g_c, λ)) * clamp(u_c, -λ, λ)`` (``silu(g_c) * u_c`` without a limit).
        swiglu_limit: λ (finite, > 0), only with ``fuse_swiglu``.
        out_dtype: float32 or bfloat16; default float32 for float32 ``a``, else bfloat16.
        out: optional preallocated output of exactly the result's shape and dtype.
        check: validate the values of offsets / counts / masked_m. CPU tensors are always
            validated; CUDA tensors only with ``check=True`` (it costs a host sync). Without it the
            CUDA kernel reads the row counts on the device and clamps them into range (memory
            safe, but bad routing gives meaningless rows).

    Returns:
        ``[M, N_out]`` (contiguous), ``[E, cap, N_out]`` (masked) or ``[T*k, N_out]`` (routed),
        ``N_out = N/2`` with ``fuse_swiglu`` else ``N``. Rows owned by no expert are NOT written
        (in a fresh output they are uninitialised).

    CUDA: bfloat16 / float8 activations run the sm_90a kernel with no host synchronisation
    (launchable back to back); float32 activations run the interim torch path (slow). The
    kernel's results are deterministic and batch-invariant (a row's output depends neither on the
    other rows nor on the tile shape the host picks).
    """
    op = _OP
    check_tensor(op, "a", a, dtypes=_ACT_DTYPES, contiguous=False)
    device = a.device
    if device.type != "cuda":
        use_cuda(device, op)  # raises for anything but cpu / cuda

    given = [name for name, v in (("expert_offsets", expert_offsets), ("masked_m", masked_m),
                                  ("topk_ids", topk_ids)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"{op}: pass exactly one of expert_offsets (contiguous layout, a [M, K]), "
                         "masked_m (masked layout, a [E, cap, K]) or topk_ids (routed layout, a "
                         "[T, K] or [T*k, K]); got " + (" and ".join(given) or "none"))
    masked, routed = masked_m is not None, topk_ids is not None
    route_div = 1  # routed layout: activation row = output row // route_div
    if expert_counts is not None and expert_offsets is None:
        raise ValueError(f"{op}: expert_counts is only for the contiguous layout (expert_offsets), "
                         f"not with {given[0]}")

    check_tensor(op, "a", a, dtypes=_ACT_DTYPES, ndim=3 if masked else 2, device=device)
    k = a.shape[-1]
    if k <= 0 or k % 32 != 0:
        raise ValueError(f"{op}: K = a.shape[-1] = {k} must be a positive multiple of 32 "
                         "(one MXFP4 scale covers 32 values along K)")

    packed = isinstance(w, Mxfp4PackedWeights)
    if packed:
        if w_scale is not None:
            raise ValueError(f"{op}: w_scale must be None when w is Mxfp4PackedWeights (the "
                             "scales are packed with the weights)")
        if w.data.device != device:
            raise ValueError(f"{op}: w (Mxfp4PackedWeights) must be on {device} like the other "
                             f"inputs, got {w.data.device}")
        _check_packed(op, w)
        num_experts, n = w.num_experts, w.n
        if w.k != k:
            raise ValueError(f"{op}: w was packed for K = {w.k}, but a's last dim is K = {k}")
    else:
        check_tensor(op, "w", w, dtypes=_W_DTYPES, ndim=3, device=device, contiguous=False)
        num_experts, n = w.shape[0], w.shape[1]
        if num_experts < 1 or n < 1:
            raise ValueError(f"{op}: w must be [E, N, K/2] with E >= 1 and N >= 1, got "
                             f"{tuple(w.shape)}")
        if w.shape[2] != k // 2:
            raise ValueError(f"{op}: w must have shape [E, N, K/2] = [{num_experts}, {n}, "
                             f"{k // 2}] for K = {k} (a's last dim), got {tuple(w.shape)}")
        check_tensor(op, "w", w, dtypes=_W_DTYPES, shape=(num_experts, n, k // 2), device=device)
        check_tensor(op, "w_scale", w_scale, dtypes=_SCALE_DTYPES,
                     shape=(num_experts, n, k // 32), device=device)

    if masked:
        check_tensor(op, "masked_m", masked_m, dtypes=(torch.int32,), shape=(num_experts,),
                     device=device)
        if a.shape[0] != num_experts:
            raise ValueError(f"{op}: a must have shape [E, cap, K] with E = {num_experts} "
                             f"(w.shape[0]) in the masked layout, got {tuple(a.shape)}")
        m_rows, cap = 0, a.shape[1]
    elif routed:
        check_tensor(op, "topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, device=device)
        num_tokens, topk = topk_ids.shape
        m_rows, cap = num_tokens * topk, 0
        if a.shape[0] not in (num_tokens, m_rows):
            raise ValueError(f"{op}: in the routed layout a must have one row per token "
                             f"([{num_tokens}, K]) or per slot ([{m_rows}, K]) of topk_ids "
                             f"{tuple(topk_ids.shape)}, got {tuple(a.shape)}")
        route_div = topk if a.shape[0] == num_tokens else 1
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
                     shape=(*a.shape[:-1], k // 128), device=device, contiguous=False)
    elif a_scale is not None:
        raise ValueError(f"{op}: a_scale must be None for {_name(a.dtype)} a (it is only the "
                         "per-token scale of float8_e4m3fn activations)")

    if not isinstance(fuse_swiglu, bool):
        raise TypeError(f"{op}: fuse_swiglu must be a bool, got {type(fuse_swiglu).__name__}")
    if fuse_swiglu and n % 2 != 0:
        raise ValueError(f"{op}: fuse_swiglu needs an even N = w.shape[1] (gate rows then up "
                         f"rows), got N = {n}")
    if packed and a.dtype in _ACT_DTYPES_CUDA and w.act_dtype != a.dtype:
        raise ValueError(f"{op}: w was packed for {_name(w.act_dtype)} activations but a is "
                         f"{_name(a.dtype)}; prepack with act_dtype=torch.{_name(a.dtype)}")
    if packed and w.fuse_swiglu != fuse_swiglu:
        raise ValueError(f"{op}: w was packed with fuse_swiglu={w.fuse_swiglu} (gate/up rows "
                         f"{'interleaved' if w.fuse_swiglu else 'in checkpoint order'}) but the "
                         f"call has fuse_swiglu={fuse_swiglu}; prepack with the same flag")
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
            inputs = {"a": a, "w": w.data if packed else w, "w_scale": w_scale,
                      "w.row_base": w.row_base if packed else None,
                      "expert_offsets": expert_offsets, "expert_counts": expert_counts,
                      "masked_m": masked_m, "topk_ids": topk_ids, "a_scale": a_scale}
            check_no_alias(op, {"out": out},
                           {k_: v for k_, v in inputs.items() if v is not None and v.numel() > 0})
    else:
        out = torch.empty(out_shape, dtype=out_dtype, device=device)

    if check is not None and not isinstance(check, bool):
        raise TypeError(f"{op}: check must be a bool or None, got {type(check).__name__}")
    on_cuda = device.type == "cuda"
    if routed:
        if (not on_cuda or check) and topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < -1 or hi >= num_experts:
                raise ValueError(f"{op}: topk_ids values must be in [0, E = {num_experts}) or -1, "
                                 f"got range [{lo}, {hi}]")
    elif not on_cuda or check:
        _check_values(num_experts, m_rows, cap, expert_offsets, expert_counts, masked_m)

    rows = num_experts * cap if masked else m_rows
    if on_cuda and rows >= _INT32_LIMIT:
        raise ValueError(f"{op}: the CUDA kernel indexes rows with int32; got {rows} rows")
    if a.numel() == 0 or out.numel() == 0:
        return out  # no rows (routed: T tokens with k = 0 slots): nothing to write
    if on_cuda:
        if a.dtype == torch.float32 or num_experts > _C.MXFP4_CUDA_MAX_EXPERTS:
            # Interim torch path: float32 activations (no float32 tensor-core kernel) or more
            # experts than the kernel's shared-memory schedule holds.
            wr, sr = mxfp4_unpack(w) if packed else (w, w_scale)
            if routed:
                _interim_routed_cuda(a, wr, sr, topk_ids, a_scale, fuse_swiglu, swiglu_limit, out)
            else:
                _interim_cuda(a, wr, sr, expert_offsets, expert_counts, masked_m, a_scale,
                              fuse_swiglu, swiglu_limit, out)
            return out
        if routed and (a.dtype != torch.bfloat16 or m_rows > _C.MXFP4_ROUTED_MAX_ROWS):
            raise ValueError(f"{op}: the CUDA kernel's routed layout (topk_ids) takes bfloat16 "
                             f"activations and T*k <= {_C.MXFP4_ROUTED_MAX_ROWS} rows (the "
                             f"decode path), got {_name(a.dtype)} and T*k = {m_rows}; use "
                             "moe_dispatch and the contiguous layout (expert_offsets)")
        pw = w if packed else mxfp4_prepack(w, w_scale, fuse_swiglu=fuse_swiglu,
                                            act_dtype=a.dtype, check_scales=False)
        _launch_cuda(a, pw, a_scale, expert_offsets, expert_counts, masked_m, out, num_experts,
                     m_rows, cap, k, fuse_swiglu, swiglu_limit, topk_ids, route_div)
        return out

    if packed:
        w, w_scale = mxfp4_unpack(w)
    if a_scale is not None:
        a_scale = a_scale.contiguous()  # the CPU kernel reads row-major scales
    _C.mxfp4_grouped_gemm_cpu(
        ptr(a), dtype_code(a), ptr(a_scale), ptr(w), ptr(w_scale), ptr(expert_offsets),
        ptr(expert_counts), ptr(masked_m), ptr(out), dtype_code(out), num_experts, m_rows, cap,
        n, k, fuse_swiglu, swiglu_limit, ptr(topk_ids), route_div)
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
#   * contiguous and routed layouts: no host sync either (_each_expert_where), at E times the
#     FLOPs;
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


def _each_expert_where(x, w, w_scale, owns, fuse, limit, out) -> None:
    """Without a host sync (the engine launches rounds without waiting): every expert multiplies
    all rows of x and torch.where keeps the output rows owns(e) marks (a bool [rows] mask). E
    times the FLOPs of the real kernel: fine for the small models the interim path serves, not
    for V4-Flash."""
    for e in range(w.shape[0]):
        y = _swiglu(x @ _dequant_torch(w[e], w_scale[e]).T, fuse, limit)
        out.copy_(torch.where(owns(e)[:, None], y.to(out.dtype), out))


def _interim_routed_cuda(a, w, w_scale, topk_ids, a_scale, fuse, limit, out) -> None:
    ids = topk_ids.reshape(-1)
    x = _act_f32(a, a_scale)
    if x.shape[0] != ids.shape[0]:  # a [T, K]: each token's row serves its k slots
        x = x.repeat_interleave(topk_ids.shape[1], dim=0)
    _each_expert_where(x, w, w_scale, lambda e: ids == e, fuse, limit, out)


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
    # Contiguous layout: expert e owns rows [start[e], end[e]).
    rows = torch.arange(a.shape[0], device=a.device)
    start = offsets[:-1]
    end = start + (counts if counts is not None else offsets[1:] - offsets[:-1])
    _each_expert_where(_act_f32(a, a_scale), w, w_scale,
                       lambda e: (rows >= start[e]) & (rows < end[e]), fuse, limit, out)
