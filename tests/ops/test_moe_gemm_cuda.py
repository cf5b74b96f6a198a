"""The sm_90a MXFP4 grouped GEMM (csrc/cuda/moe_gemm.cu) and its weight repack.

CPU part (always runs): mxfp4_prepack / mxfp4_unpack round trips, and an EMULATION of the
kernel's per-lane weight decode: it takes the packed bytes, applies the kernel's exact bit
operations (the same constants as decode_bf16_raw / bf16_multipliers, and decode_e4m3_lut with
its byte tables for W4A8), places the results by the PTX mma fragment layouts and maps the MMA's
k back to the real k through the activation fragment the kernel loads. Agreement with the
dequantized checkpoint (W4A8: with the folded-scale rule) proves the layout, the decode and the k
permutation agree with each other (only the hardware itself is left).

GPU part (`gpu` marker): every path against the float64 reference on fresh random inputs, with
poisoned outputs (owned rows all written, others untouched), every tile shape (which must agree
bitwise), batch invariance, determinism and no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_moe_gemm import E8M0, FP8, assert_matches_ref, clamp_inputs, make_contiguous, poisoned
from test_moe_gemm import rand_act, rand_counts, scale_layouts
from test_moe_gemm import rand_weights as narrow_weights

import zeroinfer.ops.moe_gemm as mg
from zeroinfer import _C
from zeroinfer.ops import Mxfp4PackedWeights, mxfp4_grouped_gemm, mxfp4_prepack, mxfp4_unpack
from zeroinfer.reference.moe_gemm import (dequantize_expert_f64, dequantize_expert_w4a8_f64,
                                          mxfp4_grouped_gemm_ref)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def rand_weights(gen, E, N, K, lo=110, hi=140):
    """Every nibble value; scales spread over 2^-17 .. 2^13 (wide scales included)."""
    return narrow_weights(gen, E, N, K, lo, hi)


def narrow_some_groups(gen, s, fuse, frac, lo=110, hi=140):
    """Scale bytes s with the rows of a random `frac` of the packed 64-row groups (the rows of
    one float8 warpgroup: where W4A8 row bases apply) redrawn within 11 of a per-row top in
    [lo, hi], so that such groups take the kernel's row-base path and the others (uniform
    bytes over [lo, hi], spread > 11) the per-stage one."""
    s = s.clone()
    E, N, nk = s.shape
    _, src = mg._packed_rows(N, fuse, torch.device("cpu"))
    for e in range(E):
        for g0 in range(0, len(src), 64):
            rows = src[g0:g0 + 64]
            rows = rows[rows >= 0]
            if float(torch.rand(1, generator=gen)) >= frac or not len(rows):
                continue
            top = torch.randint(min(lo + 11, hi), hi + 1, (len(rows), 1), generator=gen)
            off = torch.randint(0, 12, (len(rows), nk), generator=gen)
            s[e, rows] = (top - off).clamp(min=lo).to(torch.uint8)
    return s


# =========================================================================== CPU: the repack
@pytest.mark.parametrize("act", [torch.bfloat16, FP8])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("E,N,K", [(1, 32, 32), (3, 96, 256), (2, 34, 1056), (2, 256, 128),
                                   (1, 4096, 256)])
def test_prepack_roundtrip(gen, E, N, K, fuse, act):
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=act)
    assert isinstance(pw, Mxfp4PackedWeights) and pw.act_dtype == act
    assert pw.data.dtype == torch.uint8 and pw.data.is_contiguous()
    assert pw.n_pad % _C.MXFP4_PACK_ROWS == 0 and pw.k_pad % _C.MXFP4_PACK_K == 0
    assert pw.k_pad - K < _C.MXFP4_PACK_K and pw.data.shape[-1] == _C.MXFP4_BLOCK_BYTES
    assert (pw.num_experts, pw.n, pw.k, pw.fuse_swiglu) == (E, N, K, fuse)
    assert pw.wide_scales == bool((s > 128).any())
    w2, s2 = mxfp4_unpack(pw)
    assert torch.equal(w2, w) and torch.equal(s2, s)
    # checkpoint dtypes (int8 / float8_e8m0fnu) are the same bytes
    pw2 = mxfp4_prepack(w.view(torch.int8), s.view(E8M0) if E8M0 is not None else s,
                        fuse_swiglu=fuse, act_dtype=act)
    assert torch.equal(pw2.data, pw.data)


@pytest.mark.parametrize("fuse", [False, True])
def test_prepack_stores_each_groups_stage_contiguously(gen, fuse):
    """The byte address the CUDA kernels compute for strip s's 128-k stage t of an expert
    (moe_gemm.cu strip_stages: the strip's 64-row group start, + (s % 4) strips' stages, + t
    group stages; a group is 4 strips x k_pad / 64 blocks) holds that strip's blocks 2t, 2t + 1."""
    E, N, K = 2, 136, 384  # n_pad 256: 4 groups; k_pad 384: 3 stages
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse)
    blocks, flat = pw.blocks(), pw.data.flatten()
    nb, kb, bb = blocks.shape[1], blocks.shape[2], _C.MXFP4_BLOCK_BYTES
    assert (nb, kb) == (pw.n_pad // 16, pw.k_pad // 64)
    for e in range(E):
        for strip in range(nb):
            for t in range(kb // 2):
                at = (e * nb + (strip & ~3)) * kb * bb + (strip & 3) * 2 * bb + t * 4 * 2 * bb
                want = blocks[e, strip, 2 * t:2 * t + 2].flatten()
                assert torch.equal(flat[at:at + 2 * bb], want)


def test_prepack_padding_and_interleave():
    """Padding rows / k hold zero values with scale 127; the interleave puts gate row 8b+i at
    packed row 16b+i and up row N/2+8b+i at 16b+8+i (read back through the bit map)."""
    E, N, K = 1, 20, 96  # H = 10: packed 2 * 64 rows, k padded to 128
    w = torch.randint(1, 256, (E, N, K // 2), dtype=torch.uint8)
    s = torch.arange(N, dtype=torch.uint8).repeat_interleave(K // 32).reshape(1, N, K // 32) + 100
    for act in (torch.bfloat16, FP8):
        for fuse in (False, True):
            pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=act)
            bit_map, sc_map = mg._block_maps(torch.device("cpu"), act)
            d = pw.blocks()[0]
            pb = ((d[..., :512, None] >> torch.arange(8, dtype=torch.uint8)) & 1)
            pb = pb.reshape(*d.shape[:2], 4096)
            bits = torch.empty_like(pb).index_copy_(-1, bit_map, pb).reshape(*d.shape[:2], 1024, 4)
            blocks = bits[..., 0] | bits[..., 1] << 1 | bits[..., 2] << 2 | bits[..., 3] << 3
            nib = blocks.reshape(d.shape[0], d.shape[1], 16, 64).permute(0, 2, 1, 3).reshape(
                pw.n_pad, pw.k_pad)
            sb = torch.empty_like(d[..., 512:]).index_copy_(-1, sc_map, d[..., 512:].contiguous())
            sc = sb.reshape(d.shape[0], d.shape[1], 16, 2).permute(0, 2, 1, 3).reshape(pw.n_pad, -1)
            assert bool((nib[:, K:] == 0).all()) and bool((sc[:, K // 32:] == 127).all())
            if fuse:
                for p in range(pw.n_pad):
                    b, q = divmod(p, 16)
                    h = 8 * b + q % 8
                    want = (h if q < 8 else N // 2 + h) if h < N // 2 else None
                    if want is None:
                        assert bool((nib[p] == 0).all()) and bool((sc[p] == 127).all())
                    else:
                        assert int(sc[p, 0]) == 100 + want
            else:
                assert [int(v) for v in sc[:N, 0]] == list(range(100, 100 + N))
                assert bool((nib[N:] == 0).all()) and bool((sc[N:] == 127).all())


# ================================================ CPU: emulation of the kernel's weight decode
def _u32_words(pw):
    """Packed blocks as int64 words [E, nb, kb, 32 lanes, 4 words] (little-endian u32) and the
    scale words [E, nb, kb, 8 lane groups] (bytes (g,s0), (g,s1), (g+8,s0), (g+8,s1))."""
    d = pw.blocks().to(torch.int64)
    body = d[..., :512].reshape(*d.shape[:3], 32, 4, 4)
    words = body[..., 0] | body[..., 1] << 8 | body[..., 2] << 16 | body[..., 3] << 24
    sc = d[..., 512:].reshape(*d.shape[:3], 8, 4)
    return words, sc


def _bf16_bits_to_f64(bits):
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def _e4m3_bits_to_f64(bits):
    return bits.to(torch.uint8).view(FP8).double()


def emulate_bf16_weights(pw):
    """W [E, n_pad, k_pad] float64 as the bf16 path's mma consumes it, mapped to real k."""
    words, sc = _u32_words(pw)
    E, nb, kb = words.shape[:3]
    W = torch.full((E, nb * 16, kb * 64), float("nan"), dtype=torch.float64)
    M = 0xFFFFFFFF
    for lane in range(32):
        g, t = divmod(lane, 4)
        scw = sc[:, :, :, g, :]  # [E, nb, kb, 4]
        # bf16_multipliers: narrow m1 = 2^(s-1) as bf16 bits (s+126) << 7; wide: two factors
        if pw.wide_scales:
            lo = torch.minimum(scw, torch.tensor(128)) + 126
            hi = torch.maximum(scw, torch.tensor(128)) - 1
            m1 = _bf16_bits_to_f64(lo << 7)
            m2 = torch.where(scw == 255, torch.tensor(float("nan"), dtype=torch.float64),
                             _bf16_bits_to_f64(hi << 7))
        else:
            assert bool((scw <= 128).all())
            m1 = _bf16_bits_to_f64((scw + 126) << 7)
            m2 = torch.ones_like(m1)
        mult = m1 * m2  # exact powers of two
        def rotr(x, n):
            return ((x >> n) | (x << (32 - n))) & M

        for word in range(4):
            s, h = divmod(word, 2)
            q0, q1 = words[:, :, :, lane, 2 * s], words[:, :, :, lane, 2 * s + 1]
            q = q1 if h else q0
            z = (q0 & 0x60306030) | (rotr(q1, 2) & ~0x60306030 & M)  # decode_bf16_raw
            a = [q & 0x81C081C0, rotr(q, 4) & 0x81C081C0, rotr(q, 10) & 0x81C081C0,
                 rotr(z, 12 if h else 6) & 0x81C081C0]
            # PTX m16n8k16 A fragment: a0 (g; 2t, 2t+1) a1 (g+8; 2t, 2t+1) a2 (g; 2t+8, 2t+9)
            # a3 (g+8; 2t+8, 2t+9). Scales: a0, a2 by row g's group s, a1, a3 by row g+8's.
            for p, (row, kl0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                            (g + 8, 2 * t + 8))):
                ms = mult[..., s] if row == g else mult[..., 2 + s]
                for half in range(2):
                    kl = kl0 + half
                    # the kernel's B fragment of lane t' holds real k 16h + 4t' + (0,1 | 2,3)
                    # as logical (2t', 2t'+1 | 2t'+8, 2t'+9)
                    tq, i = divmod(kl % 8, 2)
                    real = 32 * s + 16 * h + 4 * tq + (2 if kl >= 8 else 0) + i
                    raw = _bf16_bits_to_f64((a[p] >> (16 * half)) & 0xFFFF)
                    blk_rows = torch.arange(nb) * 16 + row
                    blk_k = torch.arange(kb) * 64 + real
                    W[:, blk_rows[:, None], blk_k[None, :]] = raw * ms
    return W


_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_lut_byte(d, mag):
    """The kernel's byte table (e4m3_lut_init), entry d = b - s: e4m3 bits of mags[mag] *
    2^(6 - d), rounded to nearest even by the float8 cast (all zero from d = 20)."""
    v = torch.tensor([_E2M1_MAGS[mag] * 2.0 ** (6 - d)], dtype=torch.float32)
    return int(v.to(FP8).view(torch.uint8))


def emulate_e4m3_weights(pw, row_base=None):
    """W [E, n_pad, k_pad] float64 as the W4A8 path consumes it: per row and 128-k stage (two
    packed blocks) base b = max of its four scale bytes; each value -> the e4m3 byte of table
    entry b - s (prmt by its code bits, then its sign bit); W = e4m3 value * 2^(b - 133).
    row_base ([E, n_pad], nonzero entries): the row-base path, b = the row's base at every
    stage (the kernel's accumulators carry 2^(133 - b) until one multiply at the end)."""
    words, sc = _u32_words(pw)
    E, nb, kb = words.shape[:3]
    lut = torch.tensor([[_e4m3_lut_byte(d, m) for m in range(8)] for d in range(256)])
    W = torch.full((E, nb * 16, kb * 64), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(2):  # row g (scale bytes 0, 1), row g + 8 (bytes 2, 3)
            s_blk = sc[:, :, :, g, 2 * r:2 * r + 2]                    # [E, nb, kb, 2 groups]
            stage = s_blk.reshape(E, nb, kb // 2, 4)                   # two packed blocks
            base = stage.amax(-1).repeat_interleave(2, dim=-1)         # [E, nb, kb]
            if row_base is not None:
                rb = row_base.reshape(E, nb, 16)[:, :, g + 8 * r, None].to(torch.int64)
                base = torch.where(rb != 0, rb, base)
            factor = torch.where(base == 255, torch.tensor(float("nan"), dtype=torch.float64),
                                 torch.exp2(base.double() - 133))
            for word in range(4):
                grp, h = divmod(word, 2)
                idx = base - s_blk[..., grp]
                q = words[:, :, :, lane, word]
                for j in range(4):  # prmt by the code bits, then the sign bit ORed in
                    code = (q >> (4 * (4 * r + j))) & 7
                    sign = (q >> (8 * j + (7 if r == 0 else 3))) & 1
                    byte = lut[idx, code] | (sign << 7)
                    val = _e4m3_bits_to_f64(byte) * factor
                    real = 32 * grp + 16 * h + 4 * t + j
                    W[:, torch.arange(nb)[:, None] * 16 + g + 8 * r,
                      torch.arange(kb)[None, :] * 64 + real] = val
    return W


def _packed_reference(pw, w, s, dequantize=dequantize_expert_f64):
    """Dequantized checkpoint weights placed in packed row order, padded like the packing."""
    n_pad, src = mg._packed_rows(pw.n, pw.fuse_swiglu, torch.device("cpu"))
    deq = dequantize(w, s)  # [E, N, K]
    ref = torch.zeros(w.shape[0], n_pad, pw.k_pad, dtype=torch.float64)
    keep = src >= 0
    ref[:, keep, :pw.k] = deq[:, src[keep]]
    return ref


def _same(got, ref):
    both_nan = torch.isnan(got) & torch.isnan(ref)
    return bool(((got == ref) | both_nan).all())


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("scales", ["narrow", "wide"])
def test_emulated_bf16_decode_is_exact(gen, fuse, scales):
    E, N, K = 2, 48, 192
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    lo, hi = (90, 128) if scales == "narrow" else (0, 255)
    s = torch.randint(lo, hi + 1, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=torch.bfloat16)
    assert pw.wide_scales == (scales == "wide")
    got = emulate_bf16_weights(pw)
    ref = _packed_reference(pw, w, s)
    # bf16 holds every product exactly except 6 * 2^126 and 6 * 2^127 style overflows (scale
    # bytes 253 / 254 with large codes), which become inf in the kernel: excluded here.
    fin = torch.isfinite(got) | torch.isnan(ref)
    if scales == "wide":
        over = ~fin
        assert bool((ref[over].abs() >= 2.0**127).all())
    assert _same(got[fin], ref[fin])


def test_emulated_bf16_wide_and_narrow_agree(gen):
    """The two-multiply (wide) decode gives bitwise the same weights as the one-multiply one."""
    w = torch.randint(0, 256, (1, 32, 64), dtype=torch.uint8, generator=gen)
    s = torch.randint(60, 129, (1, 32, 4), dtype=torch.uint8, generator=gen)
    narrow = mxfp4_prepack(w, s)
    wide = Mxfp4PackedWeights(narrow.data, narrow.n, narrow.k, False, torch.bfloat16, True)
    assert torch.equal(emulate_bf16_weights(narrow), emulate_bf16_weights(wide))


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 2048)])
def test_kslot_order_matches_the_fragment_k_map(gen, shape):
    """The wgmma tile reads tokens as B from shared memory in the MMA's logical k order, so the
    op layer hands it the activations in that order (mg._kslot_order): logical k kl of every
    16-k group must hold the real k that the emulated decode above maps kl to."""
    a = torch.randn(*shape, generator=gen).bfloat16()
    got = mg._kslot_order(a)
    assert got.shape == a.shape and got.is_contiguous()
    real = []
    for kl in range(16):
        tq, i = divmod(kl % 8, 2)
        real.append(4 * tq + (2 if kl >= 8 else 0) + i)
    k = shape[-1]
    src = (torch.arange(k // 16)[:, None] * 16 + torch.tensor(real)[None, :]).reshape(-1)
    assert torch.equal(got, a[..., src])


def test_cuda_plan():
    """How the kernel covers the experts (one rule, in C++, used by the op layer and the
    launcher): a tuple of launches (tile, from_rows). The base tile from the average rows per
    expert (tiny below 4; masked: the capacity alone), then one launch per higher tier that some
    expert can reach and whose work pays for a launch: small (1) from 9 rows (64 rows in all),
    wgmma (4) from 33 bf16 / 32 float8 rows (256 in all), wide (2) from 65 bf16 (512 in all) /
    129 float8 rows (1024 in all); a requested tile runs all."""
    def plan(fp8=False, masked=False, m=0, cap=0, requested=0, E=256):
        return tuple(tuple(t) for t in _C.mxfp4_cuda_plan(
            fp8=fp8, masked=masked, m=m, num_experts=E, cap=cap, requested=requested))
    assert plan(m=6) == ((3, 0),)                               # 1 token of top-6
    assert plan(m=63) == ((3, 0),)                              # too few rows to split
    assert plan(m=64) == ((3, 0), (1, 9))                       # skewed decode: small tiles
    assert plan(m=255) == ((3, 0), (1, 9))
    assert plan(m=256) == ((3, 0), (1, 9), (4, 33))             # + wgmma for skewed experts
    assert plan(m=511) == ((3, 0), (1, 9), (4, 33))
    assert plan(m=512) == ((3, 0), (1, 9), (4, 33), (2, 65))    # + wide
    assert plan(m=4 * 256) == ((1, 0), (4, 33), (2, 65))        # small + wgmma + wide
    assert plan(m=32 * 256) == ((1, 0), (4, 33), (2, 65))
    assert plan(m=33 * 256) == ((4, 0), (2, 65))                # every expert on wgmma
    assert plan(m=65 * 256) == ((2, 0),)                        # every expert on wide tiles
    assert plan(m=10**6) == ((2, 0),)
    assert plan(fp8=True, m=255) == ((3, 0), (1, 9))
    assert plan(fp8=True, m=1000) == ((3, 0), (1, 9), (4, 32))
    assert plan(fp8=True, m=4096) == ((1, 0), (4, 32), (2, 129))  # float8: from 32 rows
    assert plan(fp8=True, m=31 * 256) == ((1, 0), (4, 32), (2, 129))
    assert plan(fp8=True, m=32 * 256) == ((4, 0), (2, 129))
    assert plan(fp8=True, m=129 * 256) == ((2, 0),)                # every expert on wide tiles
    assert plan(fp8=True, m=512 * 256) == ((2, 0),)
    assert plan(fp8=True, m=3000, E=1000) == ((3, 0), (1, 9), (4, 32), (2, 129))
    assert plan(masked=True, cap=8, E=8) == ((3, 0),)
    assert plan(masked=True, cap=32, E=8) == ((1, 0),)
    assert plan(masked=True, cap=33, E=8) == ((4, 0),)
    assert plan(masked=True, cap=64, E=8) == ((4, 0),)
    assert plan(masked=True, cap=65, E=8) == ((2, 0),)
    assert plan(masked=True, cap=5000, E=8) == ((2, 0),)
    assert plan(fp8=True, masked=True, cap=9, E=8) == ((1, 0),)
    assert plan(fp8=True, masked=True, cap=32, E=8) == ((4, 0),)
    assert plan(fp8=True, masked=True, cap=128, E=8) == ((4, 0),)
    assert plan(fp8=True, masked=True, cap=129, E=8) == ((2, 0),)
    assert plan(m=10, requested=2) == ((2, 0),)
    assert plan(m=100000, requested=1) == ((1, 0),)


@pytest.mark.parametrize("fuse", [False, True])
def test_emulated_e4m3_decode_is_exact(gen, fuse):
    E, N, K = 2, 48, 256
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=FP8)
    # (the padding rows: zero values under scale byte 127 fold to zero, as the reference's)
    assert _same(emulate_e4m3_weights(pw), _packed_reference(pw, w, s, dequantize_expert_w4a8_f64))


def _checkpoint_row(p, N, fuse):
    """Checkpoint row of packed row p, None for padding: with fuse_swiglu, 16-row block
    b = p // 16 holds gate rows 8b .. 8b + 7, then up rows N/2 + 8b .. N/2 + 8b + 7; else p."""
    if not fuse:
        return p if p < N else None
    b, q = divmod(p, 16)
    h = 8 * b + q % 8
    return (h if q < 8 else N // 2 + h) if h < N // 2 else None


def _row_bases_by_hand(s, fuse, n_pad):
    """The W4A8 row-base rule written out row by row: a packed row's base B is its largest
    scale byte (padding rows: bytes 127); a 64-row group keeps its rows' B iff every row has all
    bytes >= B - 11 and 101 <= B <= 165, else it is all 0."""
    E, N, nk = s.shape
    out = torch.zeros(E, n_pad, dtype=torch.uint8)
    for e in range(E):
        for g0 in range(0, n_pad, 64):
            bases = []
            for p in range(g0, g0 + 64):
                row = _checkpoint_row(p, N, fuse)
                byts = [127] * nk if row is None else s[e, row].tolist()
                top = max(byts)
                bases.append(top if min(byts) >= top - 11 and 101 <= top <= 165 else None)
            if None not in bases:
                out[e, g0:g0 + 64] = torch.tensor(bases, dtype=torch.uint8)
    return out


@pytest.mark.parametrize("fuse", [False, True])
def test_prepack_w4a8_row_bases(gen, fuse):
    """mxfp4_prepack's row bases (float8 only) against the rule written out row by row, on
    rows within 11 of their top except for one planted row in each of some 64-row groups: a
    spread of 12, a NaN byte (255), a top just outside the window (100, 166), or rows at its
    edges (101, 165, spread exactly 11: the group stays on row bases); padding rows (N not a
    multiple of 64, or of 32 per half) included, several experts."""
    E, N, K = 3, 200, 512
    nk = K // 32
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    top = torch.randint(110, 140, (E, N, 1), generator=gen)
    s = (top - torch.randint(0, 12, (E, N, nk), generator=gen)).to(torch.uint8)
    n_pad = -(-(N // 2) // 64) * 128 if fuse else -(-N // 128) * 128
    groups = [(e, g0) for e in range(E) for g0 in range(0, n_pad, 64)]
    plants = [(12, 120), (0, 255), (0, 100), (0, 166), (11, 101), (11, 165)]
    for i, (spread, t) in zip(torch.randperm(len(groups), generator=gen).tolist(), plants):
        e, g0 = groups[i]
        rows = [r for p in range(g0, g0 + 64) if (r := _checkpoint_row(p, N, fuse)) is not None]
        n = rows[int(torch.randint(0, len(rows), (1,), generator=gen))]
        s[e, n] = t - torch.randint(0, spread + 1, (nk,), generator=gen)
        j = torch.randperm(nk, generator=gen)[:2]
        s[e, n, j[0]], s[e, n, j[1]] = t, t - spread
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=FP8)
    rb = pw.row_base
    assert rb.dtype == torch.uint8 and rb.shape == (E, n_pad) and rb.is_contiguous()
    want = _row_bases_by_hand(s, fuse, n_pad)
    assert torch.equal(rb, want)
    zero_groups = int((want.reshape(E, -1, 64)[..., 0] == 0).sum())
    assert zero_groups == 4 and want.max() == 165 and (want[want > 0].min() == 101), want
    assert mxfp4_prepack(w, s, fuse_swiglu=fuse).row_base is None  # bf16: none
    moved = pw.to("meta")
    assert moved.row_base.device.type == "meta" and moved.row_base.shape == rb.shape


@pytest.mark.parametrize("fuse", [False, True])
def test_emulated_e4m3_row_base_decode_is_exact(gen, fuse):
    """The row-base path folds every weight relative to its row's base B (table entry B - s)
    and promotes without the per-stage factor: weight for weight, e4m3 value * 2^(B - 133) is
    exactly what the per-stage bases give (and the dequantized checkpoint), on rows whose bytes
    stay within 11 of their top; rows of other groups keep the per-stage path."""
    E, N, K = 2, 160, 512
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = narrow_some_groups(gen, rand_weights(gen, E, N, K)[1], fuse, 0.5, 101, 165)
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=FP8)
    assert bool((pw.row_base != 0).any())
    got = emulate_e4m3_weights(pw, pw.row_base)
    assert _same(got, emulate_e4m3_weights(pw))
    assert _same(got, _packed_reference(pw, w, s, dequantize_expert_w4a8_f64))


# ======================================================= CPU: packed weights through the op
@pytest.mark.parametrize("fuse", [False, True])
def test_packed_weights_on_cpu(gen, fuse):
    E, N, K = 3, 64, 128
    w, s = rand_weights(gen, E, N, K)
    a = torch.randn(10, K, generator=gen)
    off = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    lim = 4.0 if fuse else None
    want = mxfp4_grouped_gemm(a, w, s, expert_offsets=off, fuse_swiglu=fuse, swiglu_limit=lim)
    for act in (torch.bfloat16, FP8):  # float32 activations: any layout (unpacked on CPU)
        got = mxfp4_grouped_gemm(a, mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=act), None,
                                 expert_offsets=off, fuse_swiglu=fuse, swiglu_limit=lim)
        assert torch.equal(got, want)


def test_packed_weights_bad_arguments(gen):
    w, s = rand_weights(gen, 3, 64, 128)
    a = torch.randn(6, 128, generator=gen)
    off = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    pw = mxfp4_prepack(w, s)
    with pytest.raises(ValueError, match=r"w_scale must be None when w is Mxfp4PackedWeights"):
        mxfp4_grouped_gemm(a, pw, s, expert_offsets=off)
    with pytest.raises(ValueError, match=r"packed with fuse_swiglu=False .* fuse_swiglu=True"):
        mxfp4_grouped_gemm(a, pw, None, expert_offsets=off, fuse_swiglu=True)
    with pytest.raises(ValueError, match=r"packed with fuse_swiglu=True"):
        mxfp4_grouped_gemm(a, mxfp4_prepack(w, s, fuse_swiglu=True), None, expert_offsets=off)
    with pytest.raises(ValueError, match=r"w was packed for K = 128, but a's last dim is K = 64"):
        mxfp4_grouped_gemm(torch.randn(6, 64), pw, None, expert_offsets=off)
    on_meta = Mxfp4PackedWeights(pw.data.to("meta"), pw.n, pw.k, pw.fuse_swiglu, pw.act_dtype,
                                 pw.wide_scales)
    with pytest.raises(ValueError, match=r"w \(Mxfp4PackedWeights\) must be on cpu"):
        mxfp4_grouped_gemm(a, on_meta, None, expert_offsets=off)
    bad = Mxfp4PackedWeights(pw.data[:, :1].contiguous(), pw.n, pw.k, False, torch.bfloat16,
                             True)
    with pytest.raises(ValueError, match=r"does not match n=64, k=128"):
        mxfp4_grouped_gemm(a, bad, None, expert_offsets=off)
    with pytest.raises(ValueError, match=r"w was packed for bfloat16 activations but a is "
                       r"float8_e4m3fn; prepack with act_dtype=torch.float8_e4m3fn"):
        mxfp4_grouped_gemm(a.to(FP8), pw, None, expert_offsets=off, a_scale=torch.ones(6, 1))
    with pytest.raises(TypeError, match=r"act_dtype must be bfloat16 or float8_e4m3fn"):
        mxfp4_prepack(w, s, act_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"fuse_swiglu needs an even N"):
        mxfp4_prepack(w[:, :33].contiguous(), s[:, :33].contiguous(), fuse_swiglu=True)
    with pytest.raises(TypeError, match=r"w_scale must have dtype"):
        mxfp4_prepack(w, s.int())
    with pytest.raises(TypeError, match=r"mxfp4_unpack: expected Mxfp4PackedWeights"):
        mxfp4_unpack(w)


def test_packed_row_base_bad_arguments(gen):
    """The op validates the packed weights' W4A8 row bases like any argument (the kernel trusts
    them)."""
    w, s = rand_weights(gen, 3, 64, 128)
    a = torch.randn(6, 128, generator=gen)
    off = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    pw = mxfp4_prepack(w, s, act_dtype=FP8)
    rb = pw.row_base

    def call(row_base, packed=pw):
        mxfp4_grouped_gemm(a, dataclasses.replace(packed, row_base=row_base), None,
                           expert_offsets=off)

    call(None)  # the per-stage path: always valid
    with pytest.raises(TypeError, match=r"w.row_base \(Mxfp4PackedWeights\) must have dtype "
                       r"uint8, got int32"):
        call(rb.int())
    with pytest.raises(ValueError, match=r"w.row_base \(Mxfp4PackedWeights\) must have shape "
                       r"\[3, 128\], got \(3, 64\)"):
        call(rb[:, :64].contiguous())
    with pytest.raises(ValueError, match=r"w.row_base \(Mxfp4PackedWeights\) must be contiguous"):
        call(rb.t().contiguous().t())
    with pytest.raises(ValueError, match=r"w.row_base \(Mxfp4PackedWeights\) must be on cpu"):
        call(rb.to("meta"))
    with pytest.raises(ValueError, match=r"row_base is only for weights packed for "
                       r"float8_e4m3fn activations, got act_dtype bfloat16"):
        call(rb, mxfp4_prepack(w, s))


# ==================================================================================== GPU
DEV = torch.device("cuda")


@pytest.fixture
def tile(request):
    """Run the kernel with a forced tile shape (1 small-M, 2 wide, 3 tiny-M, 4 wgmma),
    restoring auto after."""
    old = mg._FORCE_TILE
    yield lambda v: setattr(mg, "_FORCE_TILE", v)
    mg._FORCE_TILE = old


@pytest.fixture
def tiny_loop(request):
    """Force the float8 tiny tile's stage loop (1 plain, 2 skewed), restoring the device's
    choice after."""
    old = mg._FORCE_FP8_TINY_LOOP
    yield lambda v: setattr(mg, "_FORCE_FP8_TINY_LOOP", v)
    mg._FORCE_FP8_TINY_LOOP = old


def _tiles(dtype):
    """Every tile shape (each runs both activation types)."""
    return (1, 2, 3, 4)


def _to(x):
    return None if x is None else x.to(DEV)


def make_case(gen, *, E, N, K, dtype, masked, counts=None, cap=None, pad_max=3, mode="plain",
              wlo=110, whi=140, narrow=0.5):
    """Weights, activations and a layout. Returns dict with everything on the CPU. A `narrow`
    fraction of the packed 64-row groups has each row's scale bytes within 11 of its top
    (narrow_some_groups): W4A8 runs those on row bases, the others on per-stage bases."""
    fuse = mode != "plain"
    w, s = rand_weights(gen, E, N, K, wlo, whi)
    s = narrow_some_groups(gen, s, fuse, narrow, wlo, whi)
    if counts is None:
        counts = rand_counts(gen, E, int(torch.randint(0, 12 * E + 1, (1,), generator=gen)),
                             empty=min(2, E - 1))
    if masked:
        cap = max(counts + [1]) if cap is None else cap
        layout = {"masked_m": torch.tensor(counts, dtype=torch.int32)}
        a, a_scale = rand_act(gen, (E, cap, K), dtype)
        rows = (E, cap)
    else:
        offsets, cnt, total = make_contiguous(gen, counts, pad_max)
        layout = {"expert_offsets": offsets, "expert_counts": cnt}
        a, a_scale = rand_act(gen, (total + 2, K), dtype)  # 2 trailing rows nobody owns
        rows = (total + 2,)
    lim = None
    if mode == "swiglu_limit" and sum(counts) > 0:
        a, a_scale, lim = clamp_inputs(gen, a, a_scale, w, s, **layout)
    return dict(w=w, s=s, a=a, a_scale=a_scale, layout=layout, rows=rows, fuse=fuse, lim=lim)


def run_cuda(c, *, out_dtype, packed=True, check=True, a_scale_dev=None):
    """The op on the case's inputs; packed: prepack the weights first (or these
    Mxfp4PackedWeights, on the GPU), else raw weights; a_scale_dev: the case's a_scale as
    given (on the GPU, any layout) instead of a copy of c["a_scale"]."""
    n_out = c["w"].shape[1] // 2 if c["fuse"] else c["w"].shape[1]
    out = poisoned((*c["rows"], n_out), out_dtype).to(DEV)
    w, s = c["w"].to(DEV), c["s"].to(DEV)
    if isinstance(packed, Mxfp4PackedWeights):
        w, s = packed, None
    elif packed:
        act = c["a"].dtype if c["a"].dtype in (torch.bfloat16, FP8) else torch.bfloat16
        w, s = mxfp4_prepack(w, s, fuse_swiglu=c["fuse"], act_dtype=act), None
    a_scale = _to(c["a_scale"]) if a_scale_dev is None else a_scale_dev
    got = mxfp4_grouped_gemm(c["a"].to(DEV), w, s, a_scale=a_scale,
                             fuse_swiglu=c["fuse"], swiglu_limit=c["lim"], out=out,
                             out_dtype=out_dtype, check=check,
                             **{k: v.to(DEV) for k, v in c["layout"].items()})
    assert got is out
    torch.cuda.synchronize()
    return out.cpu()


def _fp8_chain_bound(c):
    """Absolute error bound of W4A8 on Hopper, per output element. The float8 tensor cores keep
    ~14 bits when they add up a k32 group and the chained accumulator (DeepGEMM's measurement),
    so the kernel's error is relative to the magnitudes summed, not to the result: with four
    chained k32 groups a 128-k block, |error| <= 4 * 2^-14 * sum_k |a_k W_k| (M below, from the
    reference on |a| and |W|), taken with 4x margin: 2^-10 * M. Through the SwiGLU:
    |dF| <= |dF/dg| |dg| + |dF/du| |du| <= 1.1 |u| |dg| + |silu(g)| |du|."""
    a = c["a"].view(torch.uint8) & 0x7F  # |a| (float8: clear the sign bit)
    w = c["w"] & 0x77                     # |W| (clear both nibbles' sign bits)
    mag = mxfp4_grouped_gemm_ref(a.view(FP8), w, c["s"], a_scale=c["a_scale"].abs(),
                                 **c["layout"]) * 2.0**-10
    if not c["fuse"]:
        return mag
    pre = mxfp4_grouped_gemm_ref(c["a"], c["w"], c["s"], a_scale=c["a_scale"], **c["layout"])
    h = pre.shape[-1] // 2
    gt, up = pre[..., :h], pre[..., h:]
    if c["lim"] is not None:
        gt, up = gt.clamp(max=c["lim"]), up.clamp(-c["lim"], c["lim"])
    return 1.1 * up.abs() * mag[..., :h] + (gt * torch.sigmoid(gt)).abs() * mag[..., h:]


def check_vs_ref(got, c, out_dtype, what):
    """Element-wise tolerance of the CPU tests for bf16 outputs (rtol 1e-2), float32 outputs
    rtol 1e-3 / atol 1e-4 * max; e4m3 activations (either output): rtol 1e-2 plus the float8
    tensor cores' accumulation bound (_fp8_chain_bound). Plus the contract on which rows are
    written, plus the relative Frobenius error < 1e-2."""
    initial = poisoned(got.shape, torch.float64)
    ref = mxfp4_grouped_gemm_ref(c["a"], c["w"], c["s"], a_scale=c["a_scale"],
                                 fuse_swiglu=c["fuse"], swiglu_limit=c["lim"], initial=initial,
                                 **c["layout"])
    nan_ref = torch.isnan(ref)
    nan_got = torch.isnan(got.double())
    bad_rows = (nan_ref != nan_got).reshape(-1, got.shape[-1]).any(-1).nonzero().flatten()
    assert not len(bad_rows), (f"{what}: rows written/unwritten differ from the contract at "
                               f"flattened rows {bad_rows[:10].tolist()} (of {len(bad_rows)})")
    if bool(nan_ref.all()):
        return
    g, r = got.double()[~nan_ref], ref[~nan_ref]
    rel = float((g - r).norm() / max(float(r.norm()), 1e-300))
    assert rel < 1e-2, f"{what}: relative error {rel:.3g} (norm of ref {float(r.norm()):.3g})"
    assert got.dtype == out_dtype
    if out_dtype == torch.float32 or c["a"].dtype == FP8:
        diff = (g - r).abs()
        if c["a"].dtype == FP8:  # (rtol 1e-2 covers a bf16 output's rounding, 2^-9)
            bound = 1e-2 * r.abs() + _fp8_chain_bound(c)[~nan_ref]
        else:
            bound = 1e-3 * r.abs() + 1e-4 * float(r.abs().max())
        worst = int(torch.argmax(diff - bound))
        assert bool((diff <= bound).all()), (f"{what}: error {float(diff[worst]):.3g} over the "
                                             f"bound {float(bound[worst]):.3g}: got "
                                             f"{float(g[worst])} ref {float(r[worst])}")
    else:
        assert_matches_ref(got, c["a"], c["w"], c["s"], out_dtype=out_dtype,
                           fuse_swiglu=c["fuse"], swiglu_limit=c["lim"], initial=initial,
                           a_scale=c["a_scale"], **c["layout"])


@pytest.mark.gpu
@pytest.mark.parametrize("tile_shape", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["plain", "swiglu", "swiglu_limit"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_cuda_matches_reference(gen, tile, dtype, masked, mode, out_dtype, tile_shape):
    tile(tile_shape)
    c = make_case(gen, E=6, N=192, K=384, dtype=dtype, masked=masked, mode=mode)
    got = run_cuda(c, out_dtype=out_dtype)
    check_vs_ref(got, c, out_dtype, f"{dtype} masked={masked} {mode} tile={tile_shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("N,K,fuse", [(256, 512, False), (4096, 256, False), (2 * 2048, 256, True),
                                      (96, 1056, True), (32, 32, False), (2 * 40, 160, True),
                                      (100, 256, False), (2 * 36, 256, True)])
def test_cuda_shapes(gen, tile, dtype, N, K, fuse):
    """Odd N (padding rows / halves not a multiple of 16), K not a multiple of the 128 stage;
    outputs not a multiple of 8 wide (100, 36) take the float8 wide tile's pair stores instead of
    its 16-byte groups."""
    if dtype == FP8 and K % 128:
        K = 128 * (K // 128 + 1)
    for t in _tiles(dtype):
        tile(t)
        c = make_case(gen, E=4, N=N, K=K, dtype=dtype, masked=False,
                      mode="swiglu_limit" if fuse else "plain")
        check_vs_ref(run_cuda(c, out_dtype=torch.bfloat16), c, torch.bfloat16,
                     f"N={N} K={K} fuse={fuse} tile={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("routing", ["one_expert", "single_token", "empty", "all_empty", "many"])
def test_cuda_routing(gen, tile, dtype, masked, routing):
    E = 8
    counts = [0] * E
    if routing == "one_expert":  # skewed: every row on one expert (several M tiles)
        counts[int(torch.randint(0, E, (1,), generator=gen))] = 300
    elif routing == "single_token":
        counts[int(torch.randint(0, E, (1,), generator=gen))] = 1
    elif routing == "empty":
        counts = rand_counts(gen, E, 50, empty=5)
    elif routing == "many":
        counts = [int(v) for v in torch.randint(100, 200, (E,), generator=gen)]
    for t in (0, *_tiles(dtype)):
        tile(t)
        c = make_case(gen, E=E, N=128, K=256, dtype=dtype, masked=masked, counts=counts,
                      cap=max(counts + [1]) + 3, mode="swiglu")
        check_vs_ref(run_cuda(c, out_dtype=torch.bfloat16), c, torch.bfloat16,
                     f"{routing} tile={t}")


def _planned_vs_one_tile(c, tile, one_tile, what):
    """The op under its own plan (tile 0): right against the reference, and bitwise what
    `one_tile` forced for every expert writes."""
    tile(0)
    got = run_cuda(c, out_dtype=torch.float32)
    check_vs_ref(got, c, torch.float32, what)
    tile(one_tile)
    one = run_cuda(c, out_dtype=torch.float32, check=False)
    assert torch.equal(got.view(torch.int32), one.view(torch.int32)), f"{what} vs tile {one_tile}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_split_plan(gen, tile, masked, dtype):
    """Skewed routing under the shape-only plan: experts with >= 33 (bf16) / 32 (float8) rows run
    the wgmma tile, the others the small tile (two launches, each skipping the other's experts on
    the device; too few rows in all for a wide launch). Every row is written once, right, and
    bitwise as a single tile writes it."""
    E = 16
    thr = 33 if dtype == torch.bfloat16 else 32
    counts = [300, 2, 0, 60, thr - 1, thr, 5, 1] + [0] * 8
    if masked:  # the capacity decides alone: every expert on the wgmma tile
        counts = [49, 3, 0, 47] + [0] * 12
    c = make_case(gen, E=E, N=128, K=384, dtype=dtype, masked=masked, counts=counts,
                  cap=max(counts) + 2, mode="swiglu_limit")
    m = sum(counts) if not masked else 0
    plan = tuple(tuple(t) for t in _C.mxfp4_cuda_plan(dtype == FP8, masked, m, E,
                                                      max(counts) + 2, 0))
    assert plan == (((4, 0),) if masked else ((1, 0), (4, thr))), plan
    _planned_vs_one_tile(c, tile, 1, "split plan")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_cuda_every_tier(gen, tile, dtype):
    """A routing that reaches every tier of the plan at once (tiny, small, wgmma, wide: four
    launches over 600 experts, each computing only its own experts and skipping the others on the
    device), with tier boundaries hit exactly (8 / 9, 32 / 33 or 31 / 32, 64 / 65 or 128 / 129
    rows): right against the reference, and bitwise what one tile gives."""
    E = 600  # (fewer than 4 rows an expert on average: the tiny tile is the base)
    thr, wide = (33, 65) if dtype == torch.bfloat16 else (32, 129)
    counts = [0] * E
    for e, n in zip((0, 3, 50, 51, 100, 101, 200, 201, 300, 599, 7),
                    (1, 8, 9, 20, thr - 1, thr, 100, wide - 1, wide, 700, 3)):
        counts[e] = n
    c = make_case(gen, E=E, N=64, K=256, dtype=dtype, masked=False, counts=counts, pad_max=1,
                  mode="swiglu_limit")
    m = sum(counts)
    plan = tuple(tuple(t) for t in _C.mxfp4_cuda_plan(dtype == FP8, False, m, E, 0, 0))
    want = ((3, 0), (1, 9), (4, thr), (2, wide))
    assert plan == want, plan
    _planned_vs_one_tile(c, tile, 4, "every tier")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_cuda_tiles_and_batches_bitwise_equal(gen, tile, dtype):
    """Batch invariance: both tile shapes, and the same rows with different neighbours (another
    expert's rows added, rows moved), give bitwise the same outputs; repeated calls too."""
    E, N, K = 5, 256, 512
    c = make_case(gen, E=E, N=N, K=K, dtype=dtype, masked=False, counts=[37, 0, 5, 130, 1],
                  pad_max=0, mode="swiglu_limit")
    outs = []
    for t in (1, 2, 3, 1):
        tile(t)
        outs.append(run_cuda(c, out_dtype=torch.float32, check=False))
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), "tile 1 vs tile 2"
    assert torch.equal(outs[0].view(torch.int32), outs[2].view(torch.int32)), "tile 1 vs tile 3"
    assert torch.equal(outs[0].view(torch.int32), outs[3].view(torch.int32)), "not deterministic"
    tile(4)  # the wgmma tile: the same k16 / k32 steps, promoted in the same order
    wg = run_cuda(c, out_dtype=torch.float32, check=False)
    assert torch.equal(outs[0].view(torch.int32), wg.view(torch.int32)), "tile 1 vs tile 4"
    # expert 3's rows alone (everything else empty), at a different row offset
    off = c["layout"]["expert_offsets"]
    lo, hi = int(off[3]), int(off[4])
    c2 = dict(c)
    pad = 11
    c2["a"] = torch.cat([torch.zeros(pad, K, dtype=c["a"].dtype), c["a"][lo:hi]])
    if c["a_scale"] is not None:
        c2["a_scale"] = torch.cat([torch.ones(pad, K // 128), c["a_scale"][lo:hi]])
    c2["layout"] = {"expert_offsets": torch.tensor([0, 0, 0, pad, pad + hi - lo, pad + hi - lo],
                                                   dtype=torch.int32)}
    c2["rows"] = (pad + hi - lo,)
    tile(0)
    alone = run_cuda(c2, out_dtype=torch.float32)
    assert torch.equal(alone[pad:].view(torch.int32), outs[0][lo:hi].view(torch.int32)), \
        "a row's output depends on the other rows of the batch"


@pytest.mark.gpu
@pytest.mark.parametrize("tile_shape", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scales", ["v4", "mixed", "low", "high"])
def test_cuda_w4a8_row_base_bitwise(gen, tile, tile_shape, masked, scales):
    """W4A8 row bases change no bit: every float8 tile (and the plan) gives bitwise the outputs
    of the per-stage bases (the same packed weights with row_base=None), and both are right
    against the reference. Realistic token scales (2^-8 .. 2^-4); scale bytes of V4-like weights
    (112..130, every group on row bases), half the groups on per-stage bases (110..140), and
    every group on row bases near the window's ends (tops up to 115 / 165: accumulators ~2^18
    above / 2^32 below the per-stage ones). Contiguous plain and masked SwiGLU layouts; experts
    of 0 .. 300 rows (several token tiles a tile shape)."""
    tile(tile_shape)
    wlo, whi, frac = {"v4": (112, 130, 1.0), "mixed": (110, 140, 0.5), "low": (101, 115, 1.0),
                      "high": (151, 165, 1.0)}[scales]
    counts = [0, 1, 8, 9, 40, 300]
    c = make_case(gen, E=6, N=320, K=512, dtype=FP8, masked=masked, counts=counts,
                  mode="swiglu_limit" if masked else "plain", wlo=wlo, whi=whi, narrow=frac)
    pw = mxfp4_prepack(c["w"].to(DEV), c["s"].to(DEV), fuse_swiglu=c["fuse"], act_dtype=FP8)
    on_row_base = (pw.row_base.cpu().reshape(6, -1, 64) != 0).all(-1)
    assert bool(on_row_base.all()) if frac == 1 else \
        bool(on_row_base.any()) and not bool(on_row_base.all()), on_row_base
    check_row_bases_bitwise(c, pw, f"{scales} masked={masked} tile={tile_shape}")


def check_row_bases_bitwise(c, pw, what):
    """The float8 op on W4A8-packed weights pw: bitwise the result of the same weights on
    per-stage bases (row_base=None), and right against the reference. Returns the result."""
    got = run_cuda(c, out_dtype=torch.float32, packed=pw)
    per_stage = run_cuda(c, out_dtype=torch.float32, packed=dataclasses.replace(pw, row_base=None))
    assert torch.equal(got.view(torch.int32), per_stage.view(torch.int32)), \
        f"{what}: row bases changed the result"
    check_vs_ref(got, c, torch.float32, what)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("K", [128, 256])
@pytest.mark.parametrize("mode", ["plain", "swiglu_limit"])
@pytest.mark.parametrize("scales", ["v4", "mixed"])
def test_cuda_wide_tile_many_items_short_k(gen, tile, K, mode, scales):
    """The float8 wide tile streams a CTA's items through one ring of stages, and a row-based
    item's last stage carries the row factors its epilogue reads before that decoded buffer is
    released: with one or two stages an item (K = 128 / 256) and two or three items a CTA
    (320 items: 10 token tiles x 32 weight tiles), row bases give bitwise the per-stage results,
    and both match the reference."""
    tile(2)
    wlo, whi, frac = {"v4": (112, 130, 1.0), "mixed": (110, 140, 0.5)}[scales]
    c = make_case(gen, E=3, N=4096, K=K, dtype=FP8, masked=False, counts=[600, 700, 800],
                  mode=mode, wlo=wlo, whi=whi, narrow=frac)
    pw = mxfp4_prepack(c["w"].to(DEV), c["s"].to(DEV), fuse_swiglu=c["fuse"], act_dtype=FP8)
    check_row_bases_bitwise(c, pw, f"{scales} {mode} K={K}")


@pytest.mark.gpu
@pytest.mark.parametrize("loop", [1, 2], ids=["plain", "skewed"])
@pytest.mark.parametrize("scales", ["v4", "mixed"])
def test_cuda_fp8_tiny_tile_many_items_bitwise(gen, tile, tiny_loop, scales, loop):
    """The float8 tiny tile runs either stage loop through one ring across a CTA's items:
    96 experts of 1..8 rows x 20 weight tiles = 1920 items (over twice the resident CTAs of a
    132-SM Hopper at 7 an SM, so ~2-3 items a CTA) give bitwise the rows of each expert run alone
    (20 items, one a CTA at most: a fresh ring), row bases bitwise the per-stage bases, bitwise
    the other loop's result, and the result matches the reference. K = 768: 6 stages, so the
    4-slot ring wraps and each item's tail runs with fewer stages ahead."""
    tile(3)
    tiny_loop(loop)
    E, N, K = 96, 1280, 768
    wlo, whi, frac = {"v4": (112, 130, 1.0), "mixed": (110, 140, 0.5)}[scales]
    counts = torch.randint(1, 9, (E,), generator=gen).tolist()
    c = make_case(gen, E=E, N=N, K=K, dtype=FP8, masked=False, counts=counts, pad_max=1,
                  wlo=wlo, whi=whi, narrow=frac)
    pw = mxfp4_prepack(c["w"].to(DEV), c["s"].to(DEV), act_dtype=FP8)
    many = check_row_bases_bitwise(c, pw, f"many items, {scales}")
    off = c["layout"]["expert_offsets"]
    for e in torch.randperm(E, generator=gen)[:3].tolist():  # an expert alone: one item a CTA
        lo, hi = int(off[e]), int(off[e]) + counts[e]
        c1 = dict(c, a=c["a"][lo:hi], a_scale=c["a_scale"][lo:hi], rows=(hi - lo,))
        c1["layout"] = {"expert_offsets": torch.tensor([0] * (e + 1) + [hi - lo] * (E - e),
                                                       dtype=torch.int32)}
        alone = run_cuda(c1, out_dtype=torch.float32, packed=pw)
        assert torch.equal(alone.view(torch.int32), many[lo:hi].view(torch.int32)), \
            f"expert {e}: its rows alone and among 1920 items differ ({scales})"
    tiny_loop(3 - loop)
    other = run_cuda(c, out_dtype=torch.float32, packed=pw)
    assert torch.equal(other.view(torch.int32), many.view(torch.int32)), \
        f"the plain and the skewed loop differ ({scales})"


@pytest.mark.gpu
def test_cuda_fp8_tiny_loop_choice():
    """1 / 2 force the plain / skewed loop; 0 asks the device (a bool, the same every call)."""
    assert _C.mxfp4_fp8_tiny_plain_loop(1) is True
    assert _C.mxfp4_fp8_tiny_plain_loop(2) is False
    assert _C.mxfp4_fp8_tiny_plain_loop(0) in (True, False)
    assert _C.mxfp4_fp8_tiny_plain_loop(0) == _C.mxfp4_fp8_tiny_plain_loop()


@pytest.mark.gpu
@pytest.mark.parametrize("tile_shape", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_a_scale_layouts_bitwise(gen, tile, tile_shape, masked):
    """Every float8 tile reads a_scale through its strides: token-contiguous scales (the
    prefill tile's fast layout), a strided view into a wider buffer and (masked) a per-expert
    transpose (copied by the op) give bitwise the row-major result, which matches the
    reference. Experts of 0 .. 300 rows: several token tiles of the wide tile."""
    tile(tile_shape)
    c = make_case(gen, E=5, N=256, K=512, dtype=FP8, masked=masked, counts=[0, 3, 40, 300, 129],
                  mode="swiglu_limit")
    pw = mxfp4_prepack(c["w"].to(DEV), c["s"].to(DEV), fuse_swiglu=c["fuse"], act_dtype=FP8)
    want = run_cuda(c, out_dtype=torch.float32, packed=pw)
    check_vs_ref(want, c, torch.float32, f"row-major masked={masked} tile={tile_shape}")
    sc = c["a_scale"].to(DEV)
    for name, s_dev in scale_layouts(sc).items():
        assert not s_dev.is_contiguous() and torch.equal(s_dev, sc), name
        got = run_cuda(c, out_dtype=torch.float32, packed=pw, a_scale_dev=s_dev)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"{name} masked={masked} tile={tile_shape}: a_scale layout changed the result"


@pytest.mark.gpu
def test_cuda_raw_weights_match_packed(gen, tile):
    """Raw CUDA weights are repacked on the fly (wide-scale decode): same bits as prepacked
    narrow-scale weights."""
    c = make_case(gen, E=4, N=128, K=256, dtype=torch.bfloat16, masked=False, mode="swiglu",
                  wlo=100, whi=128)
    packed = run_cuda(c, out_dtype=torch.float32, packed=True)
    raw = run_cuda(c, out_dtype=torch.float32, packed=False)
    assert torch.equal(packed.view(torch.int32), raw.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_cuda_extreme_scales(gen, tile, dtype):
    """Scale bytes over nearly the whole UE8M0 range (2^-127 .. 2^125): one-hot activation rows
    read single weights back (exact products; bf16 / float32 subnormals included)."""
    E, N, K = 2, 128, 128
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 253, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    if dtype == FP8:
        a = torch.zeros(K, K).fill_diagonal_(1.0).to(FP8)
        a_scale = torch.ones(K, 1)
    else:
        a = torch.zeros(K, K).fill_diagonal_(1.0).to(torch.bfloat16)
        a_scale = None
    off = torch.tensor([0, K // 2, K], dtype=torch.int32)
    pw = mxfp4_prepack(w.to(DEV), s.to(DEV), act_dtype=dtype)
    out = mxfp4_grouped_gemm(a.to(DEV), pw, None, a_scale=_to(a_scale), expert_offsets=off.to(DEV),
                             out_dtype=torch.float32).cpu().double()
    ref = mxfp4_grouped_gemm_ref(a, w, s, a_scale=a_scale, expert_offsets=off)
    # float32 holds every product (6 * 2^125 < 2^128); tiny ones may be flushed by the tensor
    # cores: allow an absolute 2^-120 there, exact elsewhere.
    diff = (out - ref).abs()
    ok = (diff == 0) | (diff <= 2.0**-120)
    bad = (~ok).nonzero()
    assert not len(bad), (f"{len(bad)} wrong, first at {bad[0].tolist()}: got "
                          f"{float(out[tuple(bad[0])])}, ref {float(ref[tuple(bad[0])])}")


@pytest.mark.gpu
def test_cuda_no_host_sync(gen):
    """Prepacked weights: the launch path never synchronises with the device."""
    c = make_case(gen, E=8, N=128, K=256, dtype=torch.bfloat16, masked=False, mode="swiglu")
    pw = mxfp4_prepack(c["w"].to(DEV), c["s"].to(DEV), fuse_swiglu=True)
    # The prepack is load-time work (it may look at the scales once); the launches below are the
    # per-step path that must not wait for the device.
    pw2 = mxfp4_prepack(c["w"][:, :, :32].contiguous().to(DEV),
                        c["s"][:, :, :2].contiguous().to(DEV), check_scales=False)
    a = c["a"].to(DEV)
    lay = {k: v.to(DEV) for k, v in c["layout"].items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = mxfp4_grouped_gemm(a, pw, None, fuse_swiglu=True, **lay)
        y = mxfp4_grouped_gemm(y[:, :64].contiguous(), pw2, None, **lay)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert y.shape == (a.shape[0], 128)


def _quant_fp8_rows(h):
    """float8 rows with float32 scales per 128 columns (what a caller feeding W4A8 down does)."""
    m, k = h.shape
    x = h.float().view(m, k // 128, 128)
    scale = (x.abs().amax(-1) / 448).clamp(min=2.0**-100)
    return (x / scale[..., None]).to(FP8).view(m, k), scale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_cuda_chained_gemms_and_graph_replay(gen, dtype):
    """The model's chain, gate/up (fused clipped SwiGLU) then down on its output, over a routing
    that splits each call into all four tier launches: launched back to back (programmatic
    launches may start under the one before and must wait for it themselves), and captured in a
    CUDA graph replayed in place on new activations, the outputs are bitwise those of the same
    calls with the device synchronised after each launch; bf16's down also against the float64
    reference on the h it was given."""
    E, K1, inter = 600, 256, 128
    thr, wide = (33, 65) if dtype == torch.bfloat16 else (32, 129)
    counts = [0] * E
    for e, n in zip((0, 3, 50, 51, 100, 101, 200, 201, 300, 599, 7),
                    (1, 8, 9, 20, thr - 1, thr, 100, wide - 1, wide, 700, 3)):
        counts[e] = n
    m = sum(counts)
    off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32).to(DEV)
    assert len(_C.mxfp4_cuda_plan(dtype == FP8, False, m, E, 0, 0)) == 4
    w1, s1 = rand_weights(gen, E, 2 * inter, K1)
    w2, s2 = rand_weights(gen, E, K1, inter)
    p1 = mxfp4_prepack(w1.to(DEV), s1.to(DEV), fuse_swiglu=True, act_dtype=dtype)
    p2 = mxfp4_prepack(w2.to(DEV), s2.to(DEV), act_dtype=dtype)
    lim = 3.0

    def chain(a, a_scale, sync):
        def done(x):
            if sync:
                torch.cuda.synchronize()
            return x
        h = done(mxfp4_grouped_gemm(a, p1, None, a_scale=a_scale, expert_offsets=off,
                                    fuse_swiglu=True, swiglu_limit=lim))
        hq, hs = (h, None) if dtype == torch.bfloat16 else done(_quant_fp8_rows(h))
        return h, hq, done(mxfp4_grouped_gemm(hq, p2, None, a_scale=hs, expert_offsets=off))

    def fresh():
        a, a_scale = rand_act(gen, (m, K1), dtype)
        return a.to(DEV), _to(a_scale)

    a, a_scale = fresh()
    _, _, want = chain(a, a_scale, sync=True)
    _, _, got = chain(a, a_scale, sync=False)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "back to back"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_h, g_hq, g_out = chain(a, a_scale, sync=False)
    new_a, new_scale = fresh()
    a.copy_(new_a)
    if a_scale is not None:
        a_scale.copy_(new_scale)
    g_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    h, hq, want = chain(a, a_scale, sync=True)
    assert torch.equal(g_h.view(torch.int16), h.view(torch.int16)), "graph replay: h"
    assert torch.equal(g_out.view(torch.int16), want.view(torch.int16)), "graph replay: out"
    if dtype == torch.bfloat16:
        assert_matches_ref(g_out.cpu(), g_hq.cpu(), w2, s2, out_dtype=torch.bfloat16,
                           expert_offsets=off.cpu())


@pytest.mark.gpu
def test_cuda_float32_activations_use_interim_path(gen):
    c = make_case(gen, E=3, N=64, K=128, dtype=torch.float32, masked=False, mode="swiglu")
    check_vs_ref(run_cuda(c, out_dtype=torch.float32), c, torch.float32, "float32 interim")


@pytest.mark.gpu
def test_cuda_large_problem_smoke(gen):
    """V4-Flash down-GEMM shapes with 16 experts: a quick relative-error check on many tiles."""
    E, N, K = 16, 4096, 2048
    counts = [int(v) for v in torch.randint(0, 40, (E,), generator=gen)]
    c = make_case(gen, E=E, N=N, K=K, dtype=torch.bfloat16, masked=False, counts=counts,
                  pad_max=0)
    got = run_cuda(c, out_dtype=torch.bfloat16, check=False).double()
    ref = mxfp4_grouped_gemm_ref(c["a"], c["w"], c["s"], **c["layout"])
    own = ~torch.isnan(ref)
    rel = float((got[own] - ref[own]).norm() / ref[own].norm())
    assert rel < 1e-2 and not math.isnan(rel), f"relative error {rel:.3g}"


# ============================================================ the routed layout (topk_ids)
def test_cuda_plan_routed():
    """The routed layout runs the decode tiles alone: tiny below 4 rows an expert on average,
    with a small-tile launch for experts of >= 9 rows from 64 rows in all; small as the base
    above; a requested tile (1 or 3) runs all."""
    def plan(m, E=256, requested=0):
        return tuple(tuple(t) for t in _C.mxfp4_cuda_plan(
            fp8=False, masked=False, m=m, num_experts=E, cap=0, requested=requested, routed=True))
    assert plan(6) == ((3, 0),)
    assert plan(63) == ((3, 0),)
    assert plan(64) == ((3, 0), (1, 9))
    assert plan(256) == ((3, 0), (1, 9))   # the wgmma tier of the dispatch path is not used
    assert plan(256, E=8) == ((1, 0),)
    assert plan(30, requested=1) == ((1, 0),)
    assert _C.MXFP4_ROUTED_MAX_ROWS == 256


def make_routed_case(gen, *, T, k, E, N, K, mode, per_slot=False, ids=None):
    """A case dict like make_case's for the routed layout (bf16: the CUDA kernel's dtype)."""
    fuse = mode != "plain"
    w, s = rand_weights(gen, E, N, K)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        ids = torch.where(torch.rand(T, k, generator=gen) < 0.1, -1, ids).to(torch.int32)
    layout = {"topk_ids": ids}
    a, _ = rand_act(gen, (T * k if per_slot else T, K), torch.bfloat16)
    lim = None
    if mode == "swiglu_limit" and bool((ids >= 0).any()):
        a, _, lim = clamp_inputs(gen, a, None, w, s, **layout)
    return dict(w=w, s=s, a=a, a_scale=None, layout=layout, rows=(T * k,), fuse=fuse, lim=lim)


def _dispatch_rows(c):
    """The same GEMM through moe_dispatch and the contiguous layout on the GPU, its rows put back
    in (token, slot) order (unrouted slots NaN): what the routed layout must write, bitwise."""
    from zeroinfer.ops import moe_dispatch

    ids = c["layout"]["topk_ids"]
    T, k = ids.shape
    assert c["a"].shape[0] == T, "per-token activations (dispatch gathers a token's row)"
    d = moe_dispatch(c["a"].to(DEV), ids.to(DEV), c["w"].shape[0])
    pw = mxfp4_prepack(c["w"].to(DEV), c["s"].to(DEV), fuse_swiglu=c["fuse"])
    y = mxfp4_grouped_gemm(d.sorted_x, pw, None, expert_offsets=d.expert_offsets,
                           expert_counts=d.expert_counts, fuse_swiglu=c["fuse"],
                           swiglu_limit=c["lim"], out_dtype=torch.float32)
    rows = d.token_row.reshape(-1).long()
    out = torch.full((T * k, y.shape[1]), float("nan"), device=DEV)
    live = rows >= 0
    out[live] = y[rows[live]]
    return out.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("tile_shape", [0, 1, 3])
@pytest.mark.parametrize("mode", ["plain", "swiglu", "swiglu_limit"])
@pytest.mark.parametrize("per_slot", [False, True])
def test_cuda_routed_matches_reference(gen, tile, tile_shape, mode, per_slot):
    """Random decode batches (1-42 tokens of top-6 over 64 experts, some slots -1): right against
    the float64 reference with unrouted rows left poisoned, for each decode tile and the plan,
    and (per-token activations) bitwise what dispatch + the contiguous layout give."""
    tile(tile_shape)
    T = int(torch.randint(1, 43, (1,), generator=gen))
    c = make_routed_case(gen, T=T, k=6, E=64, N=256, K=384, mode=mode, per_slot=per_slot)
    what = f"T={T} {mode} per_slot={per_slot} tile={tile_shape}"
    got = run_cuda(c, out_dtype=torch.float32)
    check_vs_ref(got, c, torch.float32, what)
    check_vs_ref(run_cuda(c, out_dtype=torch.bfloat16), c, torch.bfloat16, what)
    if not per_slot:
        tile(0)
        want = _dispatch_rows(c)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), what


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["skewed", "single_token", "unrouted", "max_rows",
                                     "few_experts"])
def test_cuda_routed_routing(gen, tile, routing):
    """Skewed (slot j of every token on expert j: 42 rows an expert, over the small tile's 32),
    one token, every slot -1 (nothing written), the largest m (256 rows), and few experts (the
    small tile as the base): right, and bitwise across the tiles."""
    E, k = 32, 6
    T = {"skewed": 42, "single_token": 1, "unrouted": 9, "max_rows": 42, "few_experts": 40}[routing]
    ids = None
    if routing == "skewed":
        ids = torch.arange(k, dtype=torch.int32).repeat(T, 1)
    elif routing == "unrouted":
        ids = torch.full((T, k), -1, dtype=torch.int32)
    elif routing == "max_rows":
        T, k = 64, 4  # 256 rows
    elif routing == "few_experts":
        E = 8
    c = make_routed_case(gen, T=T, k=k, E=E, N=128, K=256, mode="swiglu_limit", ids=ids)
    outs = []
    for t in (0, 1, 3):
        tile(t)
        got = run_cuda(c, out_dtype=torch.float32)
        check_vs_ref(got, c, torch.float32, f"{routing} tile={t}")
        outs.append(got.view(torch.int32))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), routing
    if routing == "unrouted":
        assert bool(torch.isnan(outs[0].view(torch.float32)).all())


@pytest.mark.gpu
def test_cuda_routed_refuses_what_it_does_not_run(gen):
    """float8 activations and more than MXFP4_ROUTED_MAX_ROWS rows: a clear error naming the
    dispatch path."""
    w, s = rand_weights(gen, 8, 64, 128)
    ids = torch.zeros(2, 3, dtype=torch.int32, device=DEV)
    a8 = torch.randn(2, 128, device=DEV).to(FP8)
    pw8 = mxfp4_prepack(w.to(DEV), s.to(DEV), act_dtype=FP8)
    with pytest.raises(ValueError, match=r"routed layout .* bfloat16 .*moe_dispatch"):
        mxfp4_grouped_gemm(a8, pw8, None, a_scale=torch.ones(2, 1, device=DEV), topk_ids=ids)
    big = torch.zeros(86, 3, dtype=torch.int32, device=DEV)  # 258 rows
    pw = mxfp4_prepack(w.to(DEV), s.to(DEV))
    with pytest.raises(ValueError, match=r"T\*k <= 256 rows .*T\*k = 258"):
        mxfp4_grouped_gemm(torch.randn(86, 128, device=DEV, dtype=torch.bfloat16), pw, None,
                           topk_ids=big)


@pytest.mark.gpu
def test_cuda_routed_layer_and_graph_replay(gen):
    """The model's decode MoE without dispatch: gate/up (SwiGLU) and down in the routed layout,
    then combine by topk_ids; back to back, and as a CUDA graph replayed on new ids and
    activations, bitwise the synchronised calls and the dispatch path; no host sync."""
    from zeroinfer.ops import moe_combine, moe_dispatch

    T, k, E, D, inter = 32, 6, 64, 256, 128
    w1, s1 = rand_weights(gen, E, 2 * inter, D)
    w2, s2 = rand_weights(gen, E, D, inter)
    p1 = mxfp4_prepack(w1.to(DEV), s1.to(DEV), fuse_swiglu=True)
    p2 = mxfp4_prepack(w2.to(DEV), s2.to(DEV))

    def fresh():
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
        x = rand_act(gen, (T, D), torch.bfloat16)[0]
        return ids.to(DEV), x.to(DEV), torch.rand(T, k, generator=gen).to(DEV)

    def routed(ids, x, wt, sync=False):
        def done(v):
            if sync:
                torch.cuda.synchronize()
            return v
        h = done(mxfp4_grouped_gemm(x, p1, None, topk_ids=ids, fuse_swiglu=True, swiglu_limit=3.0))
        o = done(mxfp4_grouped_gemm(h, p2, None, topk_ids=ids))
        return done(moe_combine(o, None, wt, topk_ids=ids))

    def dispatched(ids, x, wt):
        d = moe_dispatch(x, ids, E)
        seg = dict(expert_offsets=d.expert_offsets, expert_counts=d.expert_counts)
        h = mxfp4_grouped_gemm(d.sorted_x, p1, None, fuse_swiglu=True, swiglu_limit=3.0, **seg)
        return moe_combine(mxfp4_grouped_gemm(h, p2, None, **seg), d.token_row, wt)

    ids, x, wt = fresh()
    want = routed(ids, x, wt, sync=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = routed(ids, x, wt)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "back to back"
    assert torch.equal(dispatched(ids, x, wt).view(torch.int16), want.view(torch.int16)), \
        "routed vs dispatch"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = routed(ids, x, wt)
    for dst, src in zip((ids, x, wt), fresh()):
        dst.copy_(src)
    g_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out.view(torch.int16), dispatched(ids, x, wt).view(torch.int16)), \
        "graph replay"
