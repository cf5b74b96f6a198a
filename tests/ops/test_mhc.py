"""mhc_mixes (a hyper-connection's pre / post / Sinkhorn comb in one kernel) against its float64
reference, its invariants, and its argument checks."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import MHC_MAX_STREAMS, MhcMixes, mhc_mixes, mhc_mixes_ref


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
    rows come close; pre > eps, post in (0, 2)."""
    z, scale, base = random_inputs(gen, 200, 4, spread=1.0)
    pre, post, comb = mhc_mixes(z, scale, base, streams=4, iters=20, eps=1e-6)
    torch.testing.assert_close(comb.sum(-2), torch.ones(200, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(200, 4), atol=2e-3, rtol=0)
    assert (pre > 1e-6).all() and (post > 0).all() and (post < 2).all()


def test_each_token_is_independent_of_the_batch(gen):
    """A token's mixes are bitwise the same alone, at any position, in any batch size."""
    z, scale, base = random_inputs(gen, 133, 4)
    full = mhc_mixes(z, scale, base, streams=4, iters=20, eps=1e-6)
    for lo, hi in ((0, 1), (5, 6), (17, 50), (132, 133)):
        part = mhc_mixes(z[lo:hi].contiguous(), scale, base, streams=4, iters=20, eps=1e-6)
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
@pytest.mark.parametrize("n", [1, 3, 4, 8])
@pytest.mark.parametrize("tokens", [1, 129, 4096])
def test_cuda_matches_reference_and_cpu(gen, n, tokens):
    z, scale, base = random_inputs(gen, tokens, n)
    kw = dict(streams=n, iters=20, eps=1e-6)
    got = mhc_mixes(z.cuda(), scale.cuda(), base.cuda(), **kw, out=poisoned(tokens, n, "cuda"))
    assert all(t.is_cuda for t in got)
    assert_close_to_ref(got, mhc_mixes_ref(z, scale, base, **kw))
    cpu = mhc_mixes(z, scale, base, **kw)
    for g, c in zip(got, cpu):  # expf and std::exp may differ by an ulp
        torch.testing.assert_close(g.cpu(), c, atol=1e-6, rtol=1e-6)
