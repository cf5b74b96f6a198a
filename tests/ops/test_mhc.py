"""The mHC ops against their float64 references, their invariants and their argument checks:
mhc_mixes (a hyper-connection's pre / post / Sinkhorn comb in one kernel), and mhc_collapse /
mhc_mix (applying them to the residual streams), which must also give the bits of the torch form
the model had (HF's roundings)."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import (MHC_MAX_STREAMS, MhcMixes, mhc_collapse, mhc_collapse_ref, mhc_mix,
                           mhc_mix_ref, mhc_mixes, mhc_mixes_ref)
from zeroinfer.testing.torch_forms import torch_collapse, torch_mix


def random_inputs(gen, tokens, n, *, spread=3.0):
    """z, scale, base as a V4 hyper-connection sees them: logits of a few units either way."""
    width = (2 + n) * n
    z = torch.randn(tokens, width, generator=gen) * spread
    scale = torch.rand(3, generator=gen) + 0.25
    base = torch.randn(width, generator=gen)
    return z, scale, base


def poisoned(tokens, n, device="cpu"):
    nan = float("nan")
    return MhcMixes(torch.full((tokens, n), nan, device=device),
                    torch.full((tokens, n), nan, device=device),
                    torch.full((tokens, n, n), nan, device=device))


def assert_close_to_ref(got, ref, atol=2e-6, rtol=2e-6):
    for name, g, r in zip(MhcMixes._fields, got, ref):
        assert not torch.isnan(g).any(), f"{name}: unwritten (poisoned) elements"
        torch.testing.assert_close(g.double().cpu(), r, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("n", range(1, MHC_MAX_STREAMS + 1))
@pytest.mark.parametrize("tokens,iters", [(1, 20), (37, 20), (300, 1), (64, 2), (5, 50)])
def test_matches_reference(gen, n, tokens, iters):
    z, scale, base = random_inputs(gen, tokens, n)
    eps = float(torch.rand(1, generator=gen)) * 1e-3
    got = mhc_mixes(z, scale, base, streams=n, iters=iters, eps=eps, out=poisoned(tokens, n))
    assert_close_to_ref(got, mhc_mixes_ref(z, scale, base, streams=n, iters=iters, eps=eps))


def test_no_tokens(gen):
    z, scale, base = random_inputs(gen, 0, 4)
    pre, post, comb = mhc_mixes(z, scale, base, streams=4, iters=20, eps=1e-6)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_comb_is_doubly_stochastic(gen):
    """After the Sinkhorn iterations (columns last) every column sums to 1 up to eps, and the
    rows sum to what the float64 reference's rows sum to: 20 iterations leave them off 1 by
    what the draw makes them (up to ~2e-2 on rare draws, the reference too), so 1 is no fixed
    bound; they are still near it. pre > eps, post in (0, 2)."""
    z, scale, base = random_inputs(gen, 200, 4, spread=1.0)
    pre, post, comb = mhc_mixes(z, scale, base, streams=4, iters=20, eps=1e-6)
    ref = mhc_mixes_ref(z.double(), scale.double(), base.double(), streams=4, iters=20,
                        eps=1e-6)[2]
    torch.testing.assert_close(comb.sum(-2), torch.ones(200, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1).double(), ref.sum(-1), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(200, 4), atol=0.1, rtol=0)
    assert (pre > 1e-6).all() and (post > 0).all() and (post < 2).all()


def test_each_token_is_independent_of_the_batch(gen):
    """A token's mixes are bitwise the same alone, at any position, in any batch size."""
    z, scale, base = random_inputs(gen, 133, 4)
    full = mhc_mixes(z, scale, base, streams=4, iters=20, eps=1e-6)
    for lo, hi in ((0, 1), (5, 6), (17, 50), (132, 133)):
        part = mhc_mixes(z[lo:hi].contiguous(), scale, base, streams=4, iters=20, eps=1e-6)
        for a, b in zip(part, full):
            assert torch.equal(a, b[lo:hi])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 6])
def test_cuda_token_is_independent_of_the_batch(gen, n):
    """On CUDA too: a token's bits do not depend on its lane group, warp or batch size."""
    z, scale, base = (t.cuda() for t in random_inputs(gen, 133, n))
    kw = dict(streams=n, iters=20, eps=1e-6)
    full = mhc_mixes(z, scale, base, **kw)
    for lo, hi in ((0, 1), (1, 2), (5, 6), (17, 50), (132, 133)):
        part = mhc_mixes(z[lo:hi].contiguous(), scale, base, **kw)
        for a, b in zip(part, full):
            assert torch.equal(a, b[lo:hi])


def test_inputs_are_not_modified(gen):
    args = random_inputs(gen, 40, 4)
    before = [t.clone() for t in args]
    mhc_mixes(*args, streams=4, iters=20, eps=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_bad_arguments_name_what_was_expected(gen):
    z, scale, base = random_inputs(gen, 8, 4)
    kw = dict(streams=4, iters=20, eps=1e-6)
    cases = [
        (dict(z=z.double()), TypeError, "z must have dtype float32"),
        (dict(z=z[:, :20]), ValueError, r"z must have shape \[\*, 24\]"),
        (dict(z=z.t().contiguous().t()), ValueError, "z must be contiguous"),
        (dict(scale=scale[:2]), ValueError, r"scale must have shape \[3\]"),
        (dict(base=base.bfloat16()), TypeError, "base must have dtype float32"),
        (dict(base=base[:-1]), ValueError, r"base must have shape \[24\]"),
        (dict(streams=0), ValueError, "streams must be >= 1"),
        (dict(streams=MHC_MAX_STREAMS + 1), ValueError, f"streams must be <= {MHC_MAX_STREAMS}"),
        (dict(streams=4.0), TypeError, "streams must be an int"),
        (dict(iters=0), ValueError, "iters must be >= 1"),
        (dict(eps=-1e-6), ValueError, "eps must be >= 0"),
        (dict(eps=float("nan")), ValueError, "eps must be finite"),
    ]
    for change, exc, msg in cases:
        args = dict(z=z, scale=scale, base=base, **kw) | change
        with pytest.raises(exc, match=msg):
            mhc_mixes(**args)
    out = poisoned(8, 4)
    with pytest.raises(ValueError, match=r"out.comb must have shape \[8, 4, 4\]"):
        mhc_mixes(z, scale, base, **kw, out=out._replace(comb=out.comb[:, :3]))
    with pytest.raises(ValueError, match="output out.pre must not alias input z"):
        mhc_mixes(z, scale, base, **kw, out=out._replace(pre=z.view(-1)[:32].view(8, 4)))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])  # 32 / 8 / 3 / 2 / 1 / 5 / 4 tokens a warp
@pytest.mark.parametrize("tokens", [1, 129, 4096])
def test_cuda_matches_reference_and_cpu(gen, n, tokens):
    """Both lane layouts of the CUDA kernel (an entry a lane for n <= 5, a row a lane above),
    warps with idle lanes (n = 3, 5, 6) and partial last warps."""
    z, scale, base = random_inputs(gen, tokens, n)
    kw = dict(streams=n, iters=20, eps=1e-6)
    got = mhc_mixes(z.cuda(), scale.cuda(), base.cuda(), **kw, out=poisoned(tokens, n, "cuda"))
    assert all(t.is_cuda for t in got)
    assert_close_to_ref(got, mhc_mixes_ref(z, scale, base, **kw))
    cpu = mhc_mixes(z, scale, base, **kw)
    for g, c in zip(got, cpu):  # expf and std::exp may differ by an ulp
        torch.testing.assert_close(g.cpu(), c, atol=1e-6, rtol=1e-6)


# ---- mhc_collapse / mhc_mix ---------------------------------------------------------------------


def apply_inputs(gen, tokens, n, dim, dtype, device="cpu"):
    """streams, a block output, and pre / post / comb from mhc_mixes on random logits (the
    magnitudes the model sees: pre ~ 0.5, post in (0, 2), comb doubly stochastic)."""
    streams = (torch.randn(tokens, n, dim, generator=gen) * 2).to(dtype)
    block = torch.randn(tokens, dim, generator=gen).to(dtype)
    z, scale, base = random_inputs(gen, tokens, n)
    pre, post, comb = mhc_mixes(z, scale, base, streams=n, iters=20, eps=1e-6)
    return [t.to(device) for t in (streams, block, pre, post, comb)]


def tolerance(dtype, n):
    # bf16: each of the n + 1 roundings of the mix is half an ulp (2^-9) of a partial sum.
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=0.05, rtol=(n + 1) * 4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 4, MHC_MAX_STREAMS])
@pytest.mark.parametrize("tokens,dim", [(1, 64), (37, 200), (130, 7)])
def test_collapse_and_mix_match_reference_and_the_torch_form(gen, dtype, n, tokens, dim):
    streams, block, pre, post, comb = apply_inputs(gen, tokens, n, dim, dtype)
    x = mhc_collapse(pre, streams, out=torch.full((tokens, dim), float("nan"), dtype=dtype))
    y = mhc_mix(streams, block, post, comb,
                out=torch.full((tokens, n, dim), float("nan"), dtype=dtype))
    assert not x.isnan().any() and not y.isnan().any(), "unwritten (poisoned) elements"
    torch.testing.assert_close(x.double(), mhc_collapse_ref(pre, streams), **tolerance(dtype, n))
    torch.testing.assert_close(y.double(), mhc_mix_ref(streams, block, post, comb),
                               **tolerance(dtype, n))
    # The model's outputs keep their bits: the same roundings as the torch ops.
    assert torch.equal(x, torch_collapse(pre, streams))
    assert torch.equal(y, torch_mix(streams, block, post, comb))


def test_mix_uses_comb_transposed(gen):
    """Output stream k takes input stream j through comb[j, k] (HF's C^T): with a permutation
    matrix and post = 0 the mix permutes the streams."""
    streams, block, _, post, _ = apply_inputs(gen, 3, 4, 16, torch.float32)
    perm = torch.tensor([2, 0, 3, 1])
    comb = torch.zeros(3, 4, 4)
    comb[:, perm, torch.arange(4)] = 1.0  # output k reads input perm[k]
    y = mhc_mix(streams, block, torch.zeros_like(post), comb)
    assert torch.equal(y, streams[:, perm])


def test_collapse_and_mix_are_independent_of_the_batch(gen):
    streams, block, pre, post, comb = apply_inputs(gen, 70, 4, 96, torch.bfloat16)
    x, y = mhc_collapse(pre, streams), mhc_mix(streams, block, post, comb)
    for lo, hi in ((0, 1), (9, 10), (13, 50), (69, 70)):
        assert torch.equal(mhc_collapse(pre[lo:hi], streams[lo:hi]), x[lo:hi])
        assert torch.equal(mhc_mix(streams[lo:hi], block[lo:hi], post[lo:hi], comb[lo:hi]),
                           y[lo:hi])


def test_collapse_and_mix_without_tokens():
    streams = torch.empty(0, 4, 8, dtype=torch.bfloat16)
    assert mhc_collapse(torch.empty(0, 4), streams).shape == (0, 8)
    y = mhc_mix(streams, torch.empty(0, 8, dtype=torch.bfloat16), torch.empty(0, 4),
                torch.empty(0, 4, 4))
    assert y.shape == (0, 4, 8)


def test_collapse_and_mix_bad_arguments(gen):
    streams, block, pre, post, comb = apply_inputs(gen, 6, 4, 32, torch.bfloat16)
    cases = [
        (mhc_collapse, dict(pre=pre, streams=streams.half()), TypeError,
         "mhc_collapse: streams must have dtype float32 or bfloat16"),
        (mhc_collapse, dict(pre=pre, streams=streams[:, 0]), ValueError, "streams must be 3-D"),
        (mhc_collapse, dict(pre=pre[:, :3], streams=streams), ValueError,
         r"pre must have shape \[6, 4\]"),
        (mhc_collapse, dict(pre=pre.double(), streams=streams), TypeError,
         "pre must have dtype float32"),
        (mhc_collapse, dict(pre=pre, streams=streams.transpose(0, 1).contiguous().transpose(0, 1)),
         ValueError, "streams must be contiguous"),
        (mhc_collapse, dict(pre=pre[:, :1].expand(6, 9).contiguous(),
                            streams=torch.zeros(6, 9, 32, dtype=torch.bfloat16)),
         ValueError, f"must have 1..{MHC_MAX_STREAMS} streams"),
        (mhc_mix, dict(streams=streams, block_out=block.float(), post=post, comb=comb), TypeError,
         "mhc_mix: block_out must have dtype bfloat16"),
        (mhc_mix, dict(streams=streams, block_out=block[:5], post=post, comb=comb), ValueError,
         r"block_out must have shape \[6, 32\]"),
        (mhc_mix, dict(streams=streams, block_out=block, post=post, comb=comb[:, :2]), ValueError,
         r"comb must have shape \[6, 4, 4\]"),
        (mhc_mix, dict(streams=streams, block_out=block, post=post.bfloat16(), comb=comb),
         TypeError, "post must have dtype float32"),
    ]
    for fn, kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn(**kwargs)
    with pytest.raises(ValueError, match="output out must not alias input streams"):
        mhc_mix(streams, block, post, comb, out=streams)
    with pytest.raises(ValueError, match=r"out must have shape \[6, 32\]"):
        mhc_collapse(pre, streams, out=block[:, :16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4, MHC_MAX_STREAMS])
@pytest.mark.parametrize("tokens,dim", [(1, 4096), (133, 200), (2048, 4096), (7, 130)])
def test_cuda_collapse_and_mix_are_the_cpu_bits(gen, dtype, n, tokens, dim):
    """Every product and sum rounded alike (no fused multiply-adds on either side): the CUDA
    kernels give the CPU twins' bits, and the torch form's on the GPU."""
    cpu = apply_inputs(gen, tokens, n, dim, dtype)
    streams, block, pre, post, comb = (t.cuda() for t in cpu)
    x = mhc_collapse(pre, streams,
                     out=torch.full((tokens, dim), float("nan"), dtype=dtype, device="cuda"))
    y = mhc_mix(streams, block, post, comb,
                out=torch.full((tokens, n, dim), float("nan"), dtype=dtype, device="cuda"))
    assert x.is_cuda and y.is_cuda
    assert torch.equal(x.cpu(), mhc_collapse(cpu[2], cpu[0]))
    assert torch.equal(y.cpu(), mhc_mix(cpu[0], cpu[1], cpu[3], cpu[4]))
    assert torch.equal(x, torch_collapse(pre, streams))
    assert torch.equal(y, torch_mix(streams, block, post, comb))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_collapse_and_mix_off_16_byte_alignment(gen, dtype):
    """Rows whose addresses are not 16-byte aligned take the one-dim-a-thread kernels instead of
    the 16-byte ones (dim 4096 would take them): the same bits either way."""
    tokens, n, dim = 9, 4, 4096
    cpu = apply_inputs(gen, tokens, n, dim, dtype)
    streams, block, pre, post, comb = (t.cuda() for t in cpu)
    size = tokens * n * dim
    shifted = torch.empty(size + 1, dtype=dtype, device="cuda")[1:].view(tokens, n, dim)
    shifted.copy_(streams)
    y_out = torch.full((size + 1,), float("nan"), dtype=dtype, device="cuda")[1:]
    y = mhc_mix(shifted, block, post, comb, out=y_out.view(tokens, n, dim))
    assert torch.equal(y.cpu(), mhc_mix(cpu[0], cpu[1], cpu[3], cpu[4]))
    assert torch.equal(y, mhc_mix(streams, block, post, comb))
    x_out = torch.full((tokens * dim + 1,), float("nan"), dtype=dtype, device="cuda")[1:]
    x = mhc_collapse(pre, shifted, out=x_out.view(tokens, dim))
    assert torch.equal(x.cpu(), mhc_collapse(cpu[2], cpu[0]))
    assert torch.equal(x, mhc_collapse(pre, streams))
