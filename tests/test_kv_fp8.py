"""quantize_kv_fp8 / dequantize_kv_fp8: the V4 FP8 KV layout, round trips and byte positions."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.quant.kv_fp8 import dequantize_kv_fp8, quantize_kv_fp8
from zeroinfer.reference.sparse_mla import _decode_cache


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3fn values around |v| (3 mantissa bits; subnormal below 2^-6)."""
    a = v.abs().double()
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6)))
    return torch.exp2(e - 3) / 2


def random_kv(gen, nb, bs, dtype=torch.float32):
    # token magnitudes over many octaves, plus some groups with a single large outlier
    mag = torch.exp2(torch.randint(-20, 20, (nb, bs, 1), generator=gen).float())
    kv = torch.randn(nb, bs, 512, generator=gen) * mag
    outlier = torch.rand(nb, bs, 512, generator=gen) < 0.01
    kv = torch.where(outlier, kv * 1000, kv)
    return kv.to(dtype)


def scales_of(cache: torch.Tensor) -> torch.Tensor:
    nb, bs = cache.shape[0], cache.shape[1] // 584
    return cache[:, bs * 576:].reshape(nb, bs, 8)


@pytest.mark.parametrize("nb,bs", [(1, 1), (3, 16), (2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bound(gen, nb, bs, dtype):
    kv = random_kv(gen, nb, bs, dtype)
    cache = quantize_kv_fp8(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (nb, bs * 584) and cache.is_contiguous()
    deq = dequantize_kv_fp8(cache)
    assert deq.dtype == torch.float32 and deq.shape == (nb, bs, 512)
    x = kv.double()
    sc = scales_of(cache)
    assert (sc[..., 7] == 0).all()  # pad byte
    scale = torch.exp2(sc[..., :7].double() - 127).repeat_interleave(64, dim=-1)  # [nb, bs, 448]
    nope = x[..., :448]
    err = (deq[..., :448].double() - nope).abs()
    assert (err <= e4m3_half_ulp(nope / scale) * scale).all()
    # the scale is the smallest power of two that brings the group's amax within 448
    amax = nope.abs().reshape(nb, bs, 7, 64).amax(-1)
    s7 = torch.exp2(sc[..., :7].double() - 127)
    assert (amax / s7 <= 448).all() and (amax / s7 > 224).all()
    # RoPE values are stored as bf16
    assert torch.equal(deq[..., 448:], kv[..., 448:].bfloat16().float())


def test_exact_on_grid(gen):
    """Values already of the form e4m3 * 2^k, with a group amax of 448 * 2^k, round-trip exactly."""
    nb, bs = 2, 8
    codes = torch.randint(0, 126, (nb, bs, 7, 64), generator=gen, dtype=torch.int32)  # no NaN
    sign = torch.where(torch.rand(nb, bs, 7, 64, generator=gen) < 0.5, 0x80, 0)
    grid = (codes | sign).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid[..., 0] = 448.0 * torch.where(torch.rand(nb, bs, 7, generator=gen) < 0.5, 1.0, -1.0)
    k = torch.randint(-30, 30, (nb, bs, 7, 1), generator=gen).float()
    nope = (grid * torch.exp2(k)).reshape(nb, bs, 448)
    rope = torch.randn(nb, bs, 64, generator=gen).bfloat16().float()
    kv = torch.cat([nope, rope], dim=-1)
    cache = quantize_kv_fp8(kv)
    assert torch.equal(dequantize_kv_fp8(cache), kv)
    assert torch.equal(scales_of(cache)[..., :7].float(), (k[..., 0] + 127))


def test_scale_boundaries():
    """amax exactly 448 * 2^k uses 2^k; a hair above uses 2^(k+1); an all-zero group is finite."""
    kv = torch.zeros(1, 3, 512)
    kv[0, 0, :64] = 448.0 * 2.0**-5
    kv[0, 1, :64] = 448.0 * 2.0**-5 * (1 + 2.0**-20)
    kv[0, 2, 64:128] = 1.0
    cache = quantize_kv_fp8(kv)
    sc = scales_of(cache)
    assert sc[0, 0, 0] == 127 - 5 and sc[0, 1, 0] == 127 - 4
    assert (sc[0, 2, [0, 2, 3, 4, 5, 6]] < 255).all()  # zero groups: a finite scale byte
    deq = dequantize_kv_fp8(cache)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[0, 0], kv[0, 0]) and torch.equal(deq[0, 2], kv[0, 2])


def test_byte_layout(gen):
    """Token t of a block: NoPE e4m3 at [t*576, +448), RoPE bf16 LE at [t*576+448, +128),
    7 scale bytes + pad at [bs*576 + t*8, +8)."""
    nb, bs = 2, 4
    kv = random_kv(gen, nb, bs)
    cache = quantize_kv_fp8(kv)
    b, t = 1, 2
    row = cache[b, t * 576:(t + 1) * 576]
    sc = cache[b, bs * 576 + t * 8: bs * 576 + t * 8 + 8]
    scale = torch.exp2(sc[:7].float() - 127).repeat_interleave(64)
    nope = row[:448].view(torch.float8_e4m3fn).float() * scale
    assert torch.equal(nope, dequantize_kv_fp8(cache)[b, t, :448])
    bits = kv[b, t, 448:].bfloat16().view(torch.int16).int() & 0xFFFF
    assert torch.equal(row[448::2].int(), bits & 0xFF) and torch.equal(row[449::2].int(), bits >> 8)
    assert sc[7] == 0


def test_matches_reference_decoder_on_raw_bytes(gen):
    """Two independent decoders (the quant helper and the float64 reference) agree on arbitrary
    bytes, including subnormal e4m3 codes, tiny and large scales and NaN codes."""
    nb, bs = 3, 16
    cache = torch.randint(0, 256, (nb, bs * 584), generator=gen, dtype=torch.int32).to(torch.uint8)
    sc = cache[:, bs * 576:].view(nb, bs, 8)
    # scales 2^-127 .. 2^72: every product stays a finite float32 (subnormals included)
    sc[..., :7] = torch.randint(0, 200, (nb, bs, 7), generator=gen).to(torch.uint8)
    ours = dequantize_kv_fp8(cache).double().reshape(-1, 512)
    ref = _decode_cache(cache)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def test_bad_inputs():
    with pytest.raises(TypeError, match="kv"):
        quantize_kv_fp8(torch.zeros(1, 1, 512, dtype=torch.float64))
    with pytest.raises(ValueError, match="kv"):
        quantize_kv_fp8(torch.zeros(1, 512))
    with pytest.raises(TypeError, match="cache"):
        dequantize_kv_fp8(torch.zeros(1, 584))
    with pytest.raises(ValueError, match="584"):
        dequantize_kv_fp8(torch.zeros(1, 583, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cache"):
        dequantize_kv_fp8(torch.zeros(1, 1, 584, dtype=torch.uint8))


def test_scale_byte_255_is_nan(gen):
    """UE8M0 byte 255 is NaN (OCP MX): every NoPE value of its group dequantizes to NaN, as the
    reference decoder and the kernels read it (2^(255-127) = inf gave +-inf, and NaN only for the
    zero codes); the other groups and the RoPE part are untouched."""
    nb, bs = 2, 8
    cache = quantize_kv_fp8(torch.randn(nb, bs, 512, generator=gen))
    sc = cache[:, bs * 576:].view(nb, bs, 8)
    nan_group = torch.rand(nb, bs, 7, generator=gen) < 0.3
    sc[..., :7] = torch.where(nan_group, 255, sc[..., :7])
    ours = dequantize_kv_fp8(cache)
    torch.testing.assert_close(ours.double().reshape(-1, 512), _decode_cache(cache), rtol=0,
                               atol=0, equal_nan=True)
    per_value = nan_group.repeat_interleave(64, dim=-1)
    assert torch.equal(ours[..., :448].isnan(), per_value)
    assert ours[..., 448:].isfinite().all()
