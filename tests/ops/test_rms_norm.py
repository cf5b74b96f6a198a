"""rms_norm against its float64 reference and the torch forms the model had, its invariants (rows
independent of the batch, the unweighted factor cast to x's dtype) and its argument checks; on a
GPU, the CPU twin's bits."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import rms_norm, rms_norm_ref
from zeroinfer.testing.torch_forms import torch_rms_norm, torch_rms_norm_unweighted

# (.., D): warp rows (D <= 1024) and CTA rows (longer), these in whole batches of loads (16 a
# thread: 4096; 32: 16384) and with a tail past them (5000, 9000)
SHAPES = [(1, 64), (5, 3, 512), (37, 4096), (3, 300), (16, 1), (2, 16384), (4, 257), (3, 5000),
          (2, 9000)]


def inputs(gen, shape, dtype):
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    return x, torch.rand(shape[-1], generator=gen) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_matches_reference_and_the_torch_forms(gen, dtype, shape, weighted):
    x, w = inputs(gen, shape, dtype)
    w = w if weighted else None
    got = rms_norm(x, w, 1e-6, out=torch.full(shape, float("nan"), dtype=dtype))
    assert not got.isnan().any(), "unwritten (poisoned) elements"
    ref = rms_norm_ref(x, w, 1e-6)
    # float32: the sum's rounding; bf16: the output's (and, unweighted, the factor's) rounding
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.double(), ref, **tol)
    form = torch_rms_norm(x, w, 1e-6) if weighted else torch_rms_norm_unweighted(x, 1e-6)
    ulp = dict(atol=1e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)
    torch.testing.assert_close(got.float(), form.float(), **ulp)  # the same form to rounding


def test_unweighted_factor_is_cast_to_the_dtype(gen):
    """HF casts rsqrt(...) to x's dtype and multiplies there: every output is x times one bf16."""
    x = (torch.randn(6, 96, generator=gen) * 4).bfloat16()
    y = rms_norm(x, None, 1e-6)
    r = rms_norm_ref(x, None, 1e-6)[:, :1] / x[:, :1].double()  # the exact factor
    factor = r.float().bfloat16().float()
    torch.testing.assert_close(y.float(), (x.float() * factor).bfloat16().float(), atol=0,
                               rtol=8e-3)
    # one factor a row: y / x constant up to the product's rounding
    ratio = y.double() / x.double()
    assert ((ratio - ratio[:, :1]).abs() <= ratio[:, :1].abs() * 2**-7).all()


def test_rows_do_not_depend_on_the_batch(gen):
    x, w = inputs(gen, (40, 4096), torch.bfloat16)
    full = rms_norm(x, w, 1e-6)
    for lo, hi in ((0, 1), (7, 8), (10, 33), (39, 40)):
        assert torch.equal(rms_norm(x[lo:hi], w, 1e-6), full[lo:hi])
        assert torch.equal(rms_norm(x[lo:hi], None, 1e-6), rms_norm(x, None, 1e-6)[lo:hi])


def test_scale_invariance_and_eps(gen):
    x, w = inputs(gen, (8, 512), torch.float32)
    torch.testing.assert_close(rms_norm(x * 4, w, 0.0), rms_norm(x, w, 0.0), atol=0, rtol=1e-6)
    z = rms_norm(torch.zeros(2, 16), None, 1e-6)
    assert torch.equal(z, torch.zeros(2, 16))
    big = rms_norm(torch.full((1, 4), 1e-4), None, 1.0)  # eps dominates: ~x
    torch.testing.assert_close(big, torch.full((1, 4), 1e-4), atol=0, rtol=1e-6)


def test_no_rows():
    assert rms_norm(torch.empty(0, 8), None, 1e-6).shape == (0, 8)


def test_bad_arguments_name_what_was_expected(gen):
    x, w = inputs(gen, (4, 32), torch.float32)
    cases = [
        (dict(x=x.half()), TypeError, "x must have dtype float32 or bfloat16"),
        (dict(x=x.t()), ValueError, "x must be contiguous"),
        (dict(x=torch.empty(3, 0)), ValueError, r"x must be \[..., D\] with D >= 1"),
        (dict(weight=w.bfloat16()), TypeError, "weight must have dtype float32"),
        (dict(weight=w[:16]), ValueError, r"weight must have shape \[32\]"),
        (dict(eps=-1.0), ValueError, "eps must be >= 0"),
        (dict(eps=float("nan")), ValueError, "eps must be finite"),
    ]
    for change, exc, msg in cases:
        args = dict(x=x, weight=w, eps=1e-6) | change
        with pytest.raises(exc, match=msg):
            rms_norm(**args)
    with pytest.raises(ValueError, match="output out must not alias input x"):
        rms_norm(x, w, 1e-6, out=x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 4096)])
@pytest.mark.parametrize("weighted", [True, False])
def test_cuda_gives_the_cpu_bits(gen, dtype, shape, weighted):
    x, w = inputs(gen, shape, dtype)
    w = w if weighted else None
    got = rms_norm(x.cuda(), None if w is None else w.cuda(), 1e-6,
                   out=torch.full(shape, float("nan"), dtype=dtype, device="cuda"))
    assert got.is_cuda
    assert torch.equal(got.cpu(), rms_norm(x, w, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [512, 4096])
def test_cuda_unaligned_rows_give_the_cpu_bits(gen, dtype, dim):
    """Rows off 16-byte alignment (a contiguous view one element in) take the warp kernel's
    element-by-element loads: the same bits as the CPU twin, and as the aligned rows."""
    x, w = inputs(gen, (6, dim), dtype)
    buf = torch.empty(6 * dim + 1, dtype=dtype, device="cuda")
    xu = buf[1:].view(6, dim)
    xu.copy_(x)
    out = torch.full((6 * dim + 1,), float("nan"), dtype=dtype, device="cuda")[1:].view(6, dim)
    for weight in (w, None):
        wc = None if weight is None else weight.cuda()
        got = rms_norm(xu, wc, 1e-6, out=out)
        assert torch.equal(got.cpu(), rms_norm(x, weight, 1e-6))
        assert torch.equal(got, rms_norm(x.cuda(), wc, 1e-6))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,offset,width", [(512, 64, 1664), (300, 3, 700), (4096, 512, 8704)])
def test_row_strided_x_gives_its_contiguous_copys_bits(gen, device, dtype, dim, offset, width):
    """x a column slice of a wider matrix (rows evenly spaced, unit-stride: FusedLinears'
    outputs): the same bits as the slice made contiguous, and a contiguous result."""
    wide = (torch.randn(7, width, generator=gen) * 3).to(device, dtype)
    x = wide[:, offset:offset + dim]
    w = (torch.rand(dim, generator=gen) + 0.5).to(device)
    for weight in (w, None):
        got = rms_norm(x, weight, 1e-6)
        assert got.is_contiguous() and got.shape == x.shape
        assert torch.equal(got, rms_norm(x.contiguous(), weight, 1e-6))
