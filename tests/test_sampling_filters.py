"""zeroinfer.sampling.sample against independent float64 references: ties at the
top-k / top-p cuts, top_k past the vocabulary, top_p = 1, min-p, their combinations, and
logprobs of the raw distribution."""

from __future__ import annotations

import math

import pytest
import torch

from zeroinfer.sampling import SamplingBatch, sample
from zeroinfer.sampling_params import SamplingParams


def ref_probs64(row: torch.Tensor, p: SamplingParams) -> list[float]:
    """The documented distribution in float64 with Python sorting (no torch ops beyond the
    float32 z the sampler defines)."""
    t = torch.tensor(p.temperature, dtype=torch.float32)
    z = ((row - row.max()) / t + 0.0).double().tolist()
    V = len(z)
    order = sorted(range(V), key=lambda i: (-z[i], i))
    k = p.top_k if p.top_k > 0 else V
    ink = order[:k]
    w = [math.exp(z[i]) for i in ink]
    tot = math.fsum(w)
    keep = set()
    before = 0.0
    tp = float(torch.tensor(p.top_p, dtype=torch.float32))
    for r, i in enumerate(ink):
        if r == 0 or tp >= 1.0 or before < tp * tot:
            keep.add(i)
        before += w[r]
    mp = float(torch.tensor(p.min_p, dtype=torch.float32))
    keep = {i for i in keep if mp == 0 or z[i] >= math.log(mp)}
    s = math.fsum(math.exp(z[i]) for i in keep)
    return [math.exp(z[i]) / s if i in keep else 0.0 for i in range(V)]


def draw(row, p, N, gen):
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    start = int(torch.randint(0, 2**40, (1,), generator=gen))
    b = SamplingBatch.build([p] * N, [seed] * N, list(range(start, start + N)), "cpu")
    return sample(row.expand(N, -1).contiguous(), b).tokens


def check_dist(tokens, want, N):
    V = len(want)
    counts = torch.bincount(tokens, minlength=V).double()
    want = torch.tensor(want, dtype=torch.float64)
    assert bool((counts[want == 0] == 0).all()), (counts, want)
    # 6 sigma per cell: never flaky in practice
    sd = (N * want * (1 - want)).sqrt()
    assert bool(((counts - N * want).abs() <= 6 * sd + 1).all()), (counts.tolist(),
                                                                     (N * want).tolist())


CASES = [
    # ties at the top-k cut: ranks by lower id
    ("topk_ties", [2.0, 1.0, 1.0, 1.0, 0.0, 1.0], SamplingParams(top_k=2)),
    ("topk_ties3", [1.0, 1.0, 1.0, 1.0, 0.0, 1.0], SamplingParams(top_k=3, temperature=0.5)),
    ("topk_past_V", [0.3, -1.0, 2.0, 0.0], SamplingParams(top_k=50)),
    ("topp_1", [0.3, -1.0, 2.0, 0.0], SamplingParams(top_p=1.0, temperature=1.7)),
    ("topp_ties", [1.0, 1.0, 1.0, 1.0, -3.0], SamplingParams(top_p=0.6)),
    ("topp_small", [0.5, 0.4, 0.1, 0.6], SamplingParams(top_p=0.01)),
    ("minp", [0.0, -0.5, -1.0, -3.0, -5.0], SamplingParams(min_p=0.3, temperature=0.9)),
    ("all", [0.0, -0.2, -0.2, -0.4, -1.0, -2.0, -7.0, 0.1],
     SamplingParams(top_k=6, top_p=0.8, min_p=0.1, temperature=1.3)),
    ("masked", [-math.inf, 0.5, -math.inf, 0.2, 0.0], SamplingParams(top_k=4, top_p=0.9)),
]


@pytest.mark.parametrize("name,row,p", CASES, ids=[c[0] for c in CASES])
def test_distribution_at_cuts(gen, name, row, p):
    row = torch.tensor(row, dtype=torch.float32)
    N = 20000
    check_dist(draw(row, p, N, gen), ref_probs64(row, p), N)


def test_disabled_filters_give_the_same_tokens(gen):
    """top_p = 1, top_k >= V and top_k = 0 are the same draw (bit for bit), as are min_p = 0."""
    V, N = 37, 500
    row = torch.randn(V, generator=gen) * 2
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    pos = list(range(N))
    base = None
    for p in [SamplingParams(), SamplingParams(top_p=1.0), SamplingParams(top_k=V),
              SamplingParams(top_k=V + 5), SamplingParams(top_k=-1, min_p=0.0)]:
        t = sample(row.expand(N, V).contiguous(),
                   SamplingBatch.build([p] * N, [seed] * N, pos, "cpu")).tokens
        if base is None:
            base = t
        assert torch.equal(t, base), p


def test_logprobs_raw_under_filters_and_mask(gen):
    """logprob and the top list are of log_softmax(raw logits), whatever the temperature,
    filters and the structured mask."""
    from zeroinfer.structured_output import allowed_tokens  # noqa: F401

    R, V = 6, 70
    logits = torch.randn(R, V, generator=gen) * 3
    params = [SamplingParams(temperature=0.3, top_k=3, logprobs=5),
              SamplingParams(temperature=2.0, top_p=0.5, logprobs=20),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(min_p=0.5, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logprobs=7)]
    words = (V + 31) // 32
    allowed = torch.randint(-2**31, 2**31 - 1, (R, words), generator=gen, dtype=torch.int64
                            ).to(torch.int32)
    allowed[:, 0] |= 1  # token 0 always allowed
    b = SamplingBatch.build(params, list(range(R)), list(range(R)), "cpu", allowed)
    out = sample(logits, b)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(out.logprob.double(), ref.gather(1, out.tokens[:, None])[:, 0],
                          atol=1e-5, rtol=0)
    top = ref.sort(-1, descending=True).values[:, :20]
    assert torch.allclose(out.top_logprobs.double(), top, atol=1e-5, rtol=0)


@pytest.mark.parametrize("extra", [dict(), dict(top_k=2), dict(top_p=0.5), dict(min_p=0.5),
                                   dict(top_k=3, top_p=0.9)], ids=str)
def test_huge_temperature_never_samples_minus_inf(gen, extra):
    """A valid temperature past float32's range (inf on the device) must not turn -inf logits
    (vocabulary padding, a structured-output mask) into NaN that the filters then keep: the
    draw stays among the finite tokens, uniform in the limit."""
    V, N = 12, 400
    row = torch.randn(V, generator=gen)
    row[torch.randperm(V - 1, generator=gen)[:V // 2] + 1] = -math.inf
    row[0] = -math.inf  # (an all -inf score would give token 0)
    p = SamplingParams(temperature=1e39, **extra)
    tok = draw(row, p, N, gen)
    assert bool(torch.isfinite(row[tok]).all()), tok.tolist()
