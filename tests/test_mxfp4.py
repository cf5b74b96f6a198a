"""quantize_mxfp4 / dequantize_mxfp4: byte layout, exact round trips, nearest rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroinfer.quant.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from zeroinfer.reference.moe_gemm import dequantize_expert_f64

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)
E8M0 = getattr(torch, "float8_e8m0fnu", None)


def on_grid(gen, shape, exp_lo=-20, exp_hi=20):
    """Values exactly representable in MXFP4: e2m1 values times one power of two per 32-group."""
    *lead, k = shape
    codes = torch.randint(0, 16, shape, generator=gen)
    e = torch.randint(exp_lo, exp_hi + 1, (*lead, k // 32), generator=gen).double()
    return (GRID[codes] * torch.exp2(e).repeat_interleave(32, dim=-1)).float()


def test_layout_by_hand():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 1.0, -2.0, 6.0, -0.5      # group 0: amax 6 -> scale 1
    w[0, 32], w[0, 33] = 0.5, -12.0                                # group 1: amax 12 -> scale 2
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    assert packed.shape == (1, 32) and scale.shape == (1, 2)
    assert scale.tolist() == [[127, 128]]
    # element 2j in the low nibble: byte 0 = code(1.0)=2 | code(-2.0)=0xC << 4
    assert packed[0, 0] == 0xC2
    assert packed[0, 1] == (0x7 | (0x9 << 4))                      # 6.0, -0.5
    # group 1 scaled by 1/2: 0.25 is a tie between 0 and 0.5 -> even code 0; -6 -> code 0xF
    assert packed[0, 16] == (0x0 | (0xF << 4))
    d = dequantize_mxfp4(packed, scale)
    assert d[0, :4].tolist() == [1.0, -2.0, 6.0, -0.5]
    assert d[0, 32:34].tolist() == [0.0, -12.0]


@pytest.mark.parametrize("shape", [(32,), (4, 64), (3, 8, 256)])
def test_grid_values_round_trip_exactly(gen, shape):
    w = on_grid(gen, shape)
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.shape == (*shape[:-1], shape[-1] // 32)
    assert torch.equal(dequantize_mxfp4(packed, scale), w)


def test_bytes_round_trip_through_values(gen):
    """Any checkpoint bytes: dequantize -> quantize -> dequantize reproduces the values (the bytes
    may differ only where a group's scale was larger than needed)."""
    packed = torch.randint(0, 256, (8, 128), dtype=torch.uint8, generator=gen)
    scale = torch.randint(100, 150, (8, 8), dtype=torch.uint8, generator=gen)
    w = dequantize_mxfp4(packed, scale)
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(p2, s2), w)


def test_dequantize_matches_independent_decode(gen):
    packed = torch.randint(0, 256, (5, 16, 64), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 255, (5, 16, 4), dtype=torch.uint8, generator=gen)  # 2^-127 .. 2^127
    got = dequantize_mxfp4(packed, scale)
    assert got.dtype == torch.float32 and got.shape == (5, 16, 128)
    assert torch.equal(got.double(), dequantize_expert_f64(packed, scale).float().double())
    assert torch.equal(dequantize_mxfp4(packed.view(torch.int8), scale), got)
    if E8M0 is not None:
        assert torch.equal(dequantize_mxfp4(packed, scale.view(E8M0)), got)
    nan = dequantize_mxfp4(packed[:1, :1], torch.full((1, 1, 4), 255, dtype=torch.uint8))
    assert bool(torch.isnan(nan).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nearest_rounding_and_error_bound(gen, dtype):
    w = (torch.randn(16, 256, generator=gen) * torch.exp2(torch.randint(-10, 10, (16, 1),
                                                                        generator=gen))).to(dtype)
    packed, scale = quantize_mxfp4(w)
    s = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=-1)
    wd = w.double()
    dq = dequantize_mxfp4(packed, scale).double()
    # scale: the smallest power of two with amax / scale <= 6
    amax = wd.reshape(16, 8, 32).abs().amax(-1)
    s_g = torch.exp2(scale.double() - 127)
    assert bool((amax / s_g <= 6).all()) and bool((amax / s_g > 3).all())
    # each element is a nearest grid point (brute force over all 16 codes)
    best = (wd.unsqueeze(-1) - GRID * s.unsqueeze(-1)).abs().min(-1).values
    assert torch.equal((dq - wd).abs(), best)
    # error bound: a quarter of the scale below 2*scale, a quarter of |w| above
    assert bool(((dq - wd).abs() <= torch.maximum(0.25 * s, 0.25 * wd.abs())).all())
    # signs are kept (negative values rounding to zero become -0)
    assert torch.equal(torch.signbit(dq), torch.signbit(wd))


def test_ties_go_to_even_code():
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24)
    packed, scale = quantize_mxfp4(x)
    assert scale.tolist() == [127]
    assert dequantize_mxfp4(packed, scale)[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert dequantize_mxfp4(*quantize_mxfp4(-x))[:8].tolist() == \
        [-6.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


def test_zero_and_extreme_groups():
    w = torch.zeros(3, 32)
    w[1, 5] = 1e-42             # below 6 * 2^-127: scale clamps at byte 0, rounds to zero
    w[2, 7] = 1.0e38            # near float32 max: finite scale
    packed, scale = quantize_mxfp4(w)
    assert scale[0, 0] == 127   # all-zero group: finite scale 1
    assert scale[1, 0] == 0
    assert 0 < int(scale[2, 0]) < 255
    d = dequantize_mxfp4(packed, scale)
    assert bool(torch.isfinite(d).all())
    assert float(d[0].abs().max()) == 0.0 and float(d[1].abs().max()) == 0.0
    assert abs(float(d[2, 7]) - 1.0e38) <= 0.25 * 1.0e38


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), groups=st.integers(1, 5),
       log_mag=st.integers(-60, 60))
def test_quantize_is_idempotent(seed, n, groups, log_mag):
    """quantize(dequantize(quantize(w))) == quantize(w) for any float input."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, groups * 32, generator=g) * 2.0 ** log_mag
    p, s = quantize_mxfp4(w)
    p2, s2 = quantize_mxfp4(dequantize_mxfp4(p, s))
    assert torch.equal(dequantize_mxfp4(p2, s2), dequantize_mxfp4(p, s))


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(TypeError, match="float tensor"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        quantize_mxfp4([1.0] * 32)
    with pytest.raises(ValueError, match=r"\[..., N, K/2\] and \[..., N, K/32\]"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8),
                         torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="raw bytes"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
