"""rope_rotate against its float64 reference and the torch form the model had (HF's roundings:
it must give those bits), its invariants and its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from zeroinfer.ops import rope_rotate, rope_rotate_ref
from zeroinfer.testing.torch_forms import torch_rope


def tables(gen, tokens, half, dtype):
    """cos / sin of random positions and frequencies, as RopeTables.cos_sin makes them."""
    pos = torch.randint(0, 1 << 16, (tokens,), generator=gen).float()
    freqs = pos[:, None] * (1e4 ** -(torch.arange(half, dtype=torch.float32) / half))[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


CASES = [((1, 64), 32), ((5, 3, 512), 32), ((37, 8, 128), 64), ((16, 96), 48), ((3, 2, 2, 8), 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,half", CASES)
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_reference_and_the_torch_form(gen, dtype, shape, half, inverse):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    cos, sin = tables(gen, shape[0], half, dtype)
    got = rope_rotate(x, cos, sin, inverse=inverse,
                      out=torch.full(shape, float("nan"), dtype=dtype))
    assert not got.isnan().any(), "unwritten (poisoned) elements"
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=8e-3)
    torch.testing.assert_close(got.double(), rope_rotate_ref(x, cos, sin, inverse=inverse), **tol)
    assert torch.equal(got, torch_rope(x, cos, -sin if inverse else sin))
    d = shape[-1]
    assert torch.equal(got[..., : d - 2 * half], x[..., : d - 2 * half])  # copied, not rotated


def test_inverse_undoes_the_rotation(gen):
    x = torch.randn(20, 4, 64, generator=gen, dtype=torch.float64).float()
    cos, sin = tables(gen, 20, 16, torch.float32)
    back = rope_rotate(rope_rotate(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_rotation_keeps_pair_norms(gen):
    x = torch.randn(9, 2, 32, generator=gen)
    cos, sin = tables(gen, 9, 16, torch.float32)
    y = rope_rotate(x, cos, sin)
    norm = lambda t: t.unflatten(-1, (16, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norm(y), norm(x), atol=1e-5, rtol=1e-5)
    # A quarter turn maps (a, b) to (-b, a).
    q = rope_rotate(x, torch.zeros(9, 16), torch.ones(9, 16))
    assert torch.equal(q[..., 0::2], -x[..., 1::2]) and torch.equal(q[..., 1::2], x[..., 0::2])
    assert math.isclose(float(q.norm()), float(x.norm()), rel_tol=1e-6)


def test_each_token_is_independent_of_the_batch(gen):
    x = torch.randn(50, 4, 128, generator=gen).bfloat16()
    cos, sin = tables(gen, 50, 32, torch.bfloat16)
    full = rope_rotate(x, cos, sin)
    for lo, hi in ((0, 1), (7, 8), (10, 33), (49, 50)):
        assert torch.equal(rope_rotate(x[lo:hi], cos[lo:hi], sin[lo:hi]), full[lo:hi])


def test_no_tokens():
    out = rope_rotate(torch.empty(0, 4, 64), torch.empty(0, 8), torch.empty(0, 8))
    assert out.shape == (0, 4, 64)


def test_bad_arguments_name_what_was_expected(gen):
    x = torch.randn(6, 4, 64, generator=gen)
    cos, sin = tables(gen, 6, 16, torch.float32)
    cases = [
        (dict(x=x.half()), TypeError, "x must have dtype float32 or bfloat16"),
        (dict(x=x[0, 0]), ValueError, r"x must be \[T, ..., d\]"),
        (dict(x=x.transpose(0, 1)), ValueError, "x must be contiguous"),
        (dict(cos=cos.bfloat16()), TypeError, "sin must have dtype bfloat16"),
        (dict(sin=sin[:, :8]), ValueError, r"sin must have shape \[6, 16\]"),
        (dict(cos=cos[:5], sin=sin[:5]), ValueError, r"cos must have shape \[6, \*\]"),
        (dict(cos=torch.ones(6, 40), sin=torch.ones(6, 40)), ValueError, "need an even d"),
        (dict(x=torch.randn(6, 4, 63)), ValueError, "need an even d"),
        (dict(inverse=1), TypeError, "inverse must be a bool"),
    ]
    for change, exc, msg in cases:
        args = dict(x=x, cos=cos, sin=sin) | change
        with pytest.raises(exc, match=msg):
            rope_rotate(**args)
    with pytest.raises(ValueError, match="output out must not alias input x"):
        rope_rotate(x, cos, sin, out=x)
    with pytest.raises(ValueError, match=r"out must have shape \[6, 4, 64\]"):
        rope_rotate(x, cos, sin, out=x[:, :2].clone())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,half", [((1, 64, 512), 32), ((300, 8, 128), 64), ((4096, 512), 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_cuda_gives_the_cpu_bits(gen, dtype, shape, half, inverse):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    cos, sin = tables(gen, shape[0], half, dtype)
    got = rope_rotate(x.cuda(), cos.cuda(), sin.cuda(), inverse=inverse,
                      out=torch.full(shape, float("nan"), dtype=dtype, device="cuda"))
    assert got.is_cuda
    assert torch.equal(got.cpu(), rope_rotate(x, cos, sin, inverse=inverse))
    assert torch.equal(got, torch_rope(x.cuda(), cos.cuda(), (-sin if inverse else sin).cuda()))
