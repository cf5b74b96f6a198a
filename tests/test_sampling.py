"""SamplingParams validation and zeroinfer.sampling.sample: filters, distribution, determinism,
batch invariance, log-probabilities and the absence of host synchronisation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from zeroinfer.sampling import SamplingBatch, random_bits, sample, uniforms
from zeroinfer.sampling_params import SamplingParams

M64 = (1 << 64) - 1


# ------------------------------------------------------------------------------- references
def splitmix_mix(x: int) -> int:
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def ref_bits(seed: int, position: int, i: int) -> int:
    """The documented stream, in plain unsigned Python integers."""
    g = 0x9E3779B97F4A7C15
    key = splitmix_mix(splitmix_mix(seed + g) ^ position)
    return splitmix_mix(key + (i + 1) * g)


def scaled(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = (logits - max) / T as the sampler defines it (float32)."""
    t = torch.tensor(temperature, dtype=torch.float32)
    return (row - row.max()) / t + 0.0


def ref_filter(row: torch.Tensor, p: SamplingParams, tol: float = 1e-9):
    """(sure_keep, may_keep) bool lists over the vocabulary for one non-greedy row, computed
    in float64 with Python sorting; tokens within `tol` of a top-p / min-p boundary are
    ambiguous (kept in may_keep only)."""
    z = scaled(row, p.temperature).double().tolist()
    V = len(z)
    order = sorted(range(V), key=lambda i: (-z[i], i))  # descending, ties -> lower id first
    k = p.top_k if p.top_k > 0 else V
    in_k = order[:k]
    w = [math.exp(z[i]) for i in in_k]
    total = math.fsum(w)
    sure = [False] * V
    may = [False] * V
    before = 0.0
    for r, i in enumerate(in_k):
        frac = before / total
        if p.top_p >= 1.0 or r == 0:
            s, m = True, True
        else:
            s, m = frac < p.top_p - tol, frac < p.top_p + tol
        ratio = math.exp(z[i])  # p_i / p_max
        if p.min_p > 0:
            s, m = s and ratio >= p.min_p * (1 + tol), m and ratio >= p.min_p * (1 - tol)
        if z[i] == -math.inf:
            s = m = False
        sure[i], may[i] = s, m
        before = math.fsum([before, w[r]])
    return sure, may


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    sure, may = ref_filter(row, p)
    assert sure == may, "ambiguous filter boundary in a distribution test input"
    z = scaled(row, p.temperature).double()
    z = torch.where(torch.tensor(sure), z, -math.inf)
    return torch.softmax(z, dim=0)


def batch_of(params, seeds, positions, device="cpu"):
    return SamplingBatch.build(params, list(seeds), list(positions), device)


def rand_seed(gen) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=gen)) * 2 + int(
        torch.randint(0, 2, (1,), generator=gen))


# ---------------------------------------------------------------------- SamplingParams
BAD = [
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature="1"), TypeError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.0), TypeError, "top_k"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_p=-float("inf")), ValueError, "top_p"),
    (dict(min_p=1.0), ValueError, "min_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(min_p=float("nan")), ValueError, "min_p"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=3.0), TypeError, "max_tokens"),
    (dict(max_tokens=False), TypeError, "max_tokens"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop=""), ValueError, "stop"),
    (dict(stop=["a", 3]), TypeError, "stop"),
    (dict(stop=7), TypeError, "stop"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    (dict(stop_token_ids=[True]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    (dict(ignore_eos=1), TypeError, "ignore_eos"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**63), ValueError, "seed"),
    (dict(seed=True), TypeError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(logprobs=21), ValueError, "logprobs"),
    (dict(logprobs=True), TypeError, "logprobs"),
]


@pytest.mark.parametrize("kwargs,exc,field", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_params_reject(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        SamplingParams(**kwargs)


def test_params_range_in_message():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=2.0)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\)"):
        SamplingParams(min_p=2.0)
    with pytest.raises(ValueError, match=r"logprobs must be None or in \[0, 20\]"):
        SamplingParams(logprobs=50)


def test_params_normalise():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (1.0, 0, 1.0, 0.0, 16)
    assert p.stop == () and p.stop_token_ids == () and p.seed is None and p.logprobs is None
    p = SamplingParams(temperature=0, top_k=-1, stop="END", stop_token_ids=[3, np.int64(7)],
                       seed=2**63 - 1, logprobs=0, top_p=1, min_p=0)
    assert p.temperature == 0.0 and type(p.temperature) is float and p.greedy
    assert p.top_k == 0 and p.stop == ("END",) and p.stop_token_ids == (3, 7)
    assert all(type(i) is int for i in p.stop_token_ids)
    assert p.seed == 2**63 - 1 and p.logprobs == 0 and type(p.top_p) is float
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(top_k=np.int32(5)).top_k == 5
    assert SamplingParams(logprobs=20).logprobs == 20
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen


def test_build(gen):
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=4, logprobs=3),
              SamplingParams(top_p=0.5, logprobs=7), SamplingParams(min_p=0.1)]
    b = batch_of(params, [0, 1, 2**63 - 1, 5], [0, 9, 2**40, 3])
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int32
    assert b.top_p.dtype == torch.float32 and b.min_p.dtype == torch.float32
    assert b.seed.dtype == torch.int64 and b.position.dtype == torch.int64
    assert b.top_k.tolist() == [0, 4, 0, 0] and b.seed[2].item() == 2**63 - 1
    assert b.max_logprobs == 7 and b.needs_sort and b.any_sampled and len(b) == 4
    b = batch_of([SamplingParams(temperature=0.0, top_k=3), SamplingParams(min_p=0.2)],
                 [1, 2], [3, 4])
    assert b.max_logprobs == -1 and not b.needs_sort and b.any_sampled
    b = batch_of([SamplingParams(temperature=0.0, top_p=0.3)], [1], [3])
    assert not b.needs_sort and not b.any_sampled
    with pytest.raises(ValueError, match="lengths"):
        batch_of([SamplingParams()], [1, 2], [0])
    with pytest.raises(ValueError, match="seeds"):
        batch_of([SamplingParams()], [2**63], [0])
    with pytest.raises(ValueError, match="positions"):
        batch_of([SamplingParams()], [1], [-1])
    with pytest.raises(TypeError, match="SamplingParams"):
        batch_of([dict(temperature=1.0)], [1], [0])


# ---------------------------------------------------------------------- random stream
def test_random_bits_match_reference(gen):
    seeds = [0, 1, 2**63 - 1, rand_seed(gen), rand_seed(gen)]
    positions = [0, 2**62 + 5, 17, int(torch.randint(0, 2**31, (1,), generator=gen)), 1]
    V = 37
    bits = random_bits(torch.tensor(seeds), torch.tensor(positions), V)
    u = uniforms(torch.tensor(seeds), torch.tensor(positions), V)
    for r, (s, q) in enumerate(zip(seeds, positions)):
        want = [ref_bits(s, q, i) for i in range(V)]
        got = [b & M64 for b in bits[r].tolist()]
        assert got == want
        assert u[r].tolist() == [(2 * (w >> 12) + 1) * 2.0**-53 for w in want]


def test_uniforms_look_uniform(gen):
    R, V = 64, 4096
    seed = torch.full((R,), rand_seed(gen), dtype=torch.int64)
    pos = torch.randint(0, 2**40, (1,), generator=gen) + torch.arange(R)
    u = uniforms(seed, pos, V)
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    n = R * V
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / n)
    # every bit of the raw stream is set about half of the time
    bits = random_bits(seed, pos, V)
    ones = torch.stack([((bits >> b) & 1).sum() for b in range(64)]).double() / n
    assert bool(((ones - 0.5).abs() < 6 * 0.5 / math.sqrt(n)).all())
    # 16 equal-width bins hold about n / 16 each (chi-square, 15 dof)
    counts = torch.bincount((u * 16).long().flatten(), minlength=16).double()
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum()
    assert chi2_sf(chi2.item(), 15) > 1e-6


def chi2_sf(x: float, dof: int) -> float:
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(x / 2, dtype=torch.float64)).item()


# ---------------------------------------------------------------------- greedy
def test_greedy_is_argmax(gen):
    R, V = 12, 300
    logits = torch.randn(R, V, generator=gen)
    # ties: rows 0-3 have their maximum twice or more; the lowest id wins
    for r in range(4):
        ids = torch.randperm(V, generator=gen)[: r + 2]
        logits[r, ids] = logits[r].max() + 1.0
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5)] * R
    out = sample(logits, batch_of(params, range(R), range(R)))
    want = [max(range(V), key=lambda i: (logits[r, i].item(), -i)) for r in range(R)]
    assert out.tokens.tolist() == want and out.tokens.dtype == torch.int64
    # the same rows inside a sampled batch (any_sampled / needs_sort paths) stay greedy
    mixed = params + [SamplingParams(top_k=5, top_p=0.7)] * 3
    logits2 = torch.cat([logits, torch.randn(3, V, generator=gen)])
    out2 = sample(logits2, batch_of(mixed, range(R + 3), range(R + 3)))
    assert out2.tokens[:R].tolist() == want


def test_tiny_temperature_is_argmax(gen):
    R, V = 8, 500
    logits = torch.randn(R, V, generator=gen)
    out = sample(logits, batch_of([SamplingParams(temperature=1e-30)] * R,
                                  [rand_seed(gen) for _ in range(R)], range(R)))
    assert torch.equal(out.tokens, logits.argmax(-1))


# ---------------------------------------------------------------------- filters (property)
@st.composite
def row_params(draw):
    return SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0, 1.7, 30.0])),
        top_k=draw(st.sampled_from([0, -1, 1, 2, 3, 5, 17, 100])),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0), st.sampled_from([0.25, 0.5]))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.99), st.sampled_from([0.5]))),
    )


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data_seed=st.integers(0, 2**31 - 1), V=st.integers(1, 80),
       params=st.lists(row_params(), min_size=1, max_size=5),
       kind=st.sampled_from(["normal", "ties", "masked"]), draws=st.integers(1, 40))
def test_filtered_tokens_never_sampled(gen, data_seed, V, params, kind, draws):
    g = torch.Generator().manual_seed(data_seed ^ int(torch.randint(0, 2**31, (1,), generator=gen)))
    n = len(params)
    logits = torch.randn(n, V, generator=g) * 3
    if kind == "ties":  # few distinct values: many exact ties at every boundary
        logits = torch.randint(-2, 3, (n, V), generator=g).float()
    elif kind == "masked":  # -inf vocabulary padding, at least one finite logit per row
        mask = torch.rand(n, V, generator=g) < 0.5
        mask[:, 0] = False
        logits = logits.masked_fill(mask, -math.inf)
    # every row repeated over `draws` (seed, position) pairs
    rows = [r for r in range(n) for _ in range(draws)]
    seeds = [rand_seed(g) for _ in rows]
    positions = torch.randint(0, 2**40, (len(rows),), generator=g).tolist()
    out = sample(logits[rows], batch_of([params[r] for r in rows], seeds, positions))
    for j, r in enumerate(rows):
        tok = out.tokens[j].item()
        assert 0 <= tok < V and math.isfinite(logits[r, tok].item())
        if params[r].temperature == 0:
            assert tok == int(logits[r].argmax())
        else:
            _, may = ref_filter(logits[r], params[r])
            assert may[tok], (params[r], logits[r].tolist(), tok)


# ---------------------------------------------------------------------- distribution
DIST = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=12),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("p", DIST, ids=["plain", "top_k", "top_p", "min_p", "all"])
def test_distribution_matches_filtered_softmax(gen, p):
    V, N = 40, 20000
    row = torch.randn(V, generator=gen)
    want = ref_probs(row, p)
    seed = rand_seed(gen)
    start = int(torch.randint(0, 2**40, (1,), generator=gen))
    positions = [start + 7 * i for i in range(N)]
    out = sample(row.expand(N, V).contiguous(), batch_of([p] * N, [seed] * N, positions))
    counts = torch.bincount(out.tokens, minlength=V).double()
    assert bool((counts[want == 0] == 0).all()), "a filtered-out token was sampled"
    expected = want * N
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert len(exp) >= 3, "degenerate test input"
    chi2 = ((obs - exp) ** 2 / exp).sum().item()
    assert chi2_sf(chi2, len(exp) - 1) > 1e-6, (chi2, len(exp))
    tv = 0.5 * (counts / N - want).abs().sum().item()
    assert tv < 0.03


# ---------------------------------------------------------------------- determinism etc.
def mixed_batch(gen, R, V):
    choices = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(min_p=0.1),
               SamplingParams(temperature=0.6, top_k=50), SamplingParams(top_p=0.9),
               SamplingParams(temperature=1.4, top_k=200, top_p=0.95, min_p=0.01, logprobs=5)]
    params = choices[:R] + [choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
                            for _ in range(R - len(choices))]
    params = [params[i] for i in torch.randperm(R, generator=gen).tolist()]  # each kind once+
    logits = torch.randn(R, V, generator=gen) * 2
    seeds = [rand_seed(gen) for _ in range(R)]
    positions = torch.randint(0, 2**32, (R,), generator=gen).tolist()
    return logits, params, seeds, positions


def test_deterministic(gen):
    logits, params, seeds, positions = mixed_batch(gen, 16, 3000)
    a = sample(logits, batch_of(params, seeds, positions))
    b = sample(logits.clone(), batch_of(params, seeds, positions))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprob, b.logprob)


def test_batch_invariance(gen):
    V = 2000
    logits, params, seeds, positions = mixed_batch(gen, 10, V)
    # one row at a time, and with only plain rows so the sort/greedy-only paths are skipped
    alone = [sample(logits[r:r + 1], batch_of(params[r:r + 1], seeds[r:r + 1],
                                              positions[r:r + 1])) for r in range(10)]
    plain = [r for r in range(10) if params[r].top_k == 0 and params[r].top_p == 1.0]
    full = sample(logits, batch_of(params, seeds, positions))
    # permuted, interleaved with unrelated rows of other parameters (some sharing seeds)
    xl, xp, xs, xq = mixed_batch(gen, 7, V)
    xs[0] = seeds[0]
    order = torch.randperm(17, generator=gen).tolist()
    all_l = torch.cat([logits, xl])
    all_p, all_s, all_q = params + xp, seeds + xs, positions + xq
    big = sample(all_l[order], batch_of([all_p[i] for i in order], [all_s[i] for i in order],
                                        [all_q[i] for i in order]))
    where = {i: j for j, i in enumerate(order)}
    for r in range(10):
        tok = alone[r].tokens[0]
        assert full.tokens[r] == tok and big.tokens[where[r]] == tok
        assert torch.allclose(big.logprob[where[r]], alone[r].logprob[0], rtol=0, atol=1e-6)
    if plain:
        sub = sample(logits[plain], batch_of([params[r] for r in plain],
                                             [seeds[r] for r in plain],
                                             [positions[r] for r in plain]))
        assert sub.tokens.tolist() == [alone[r].tokens[0].item() for r in plain]


def test_positions_and_seeds_change_draws(gen):
    V, N = 1000, 256
    row = torch.zeros(V)  # uniform: every draw is a fresh uniform pick
    seed = rand_seed(gen)
    start = int(torch.randint(0, 2**40, (1,), generator=gen))
    by_pos = sample(row.expand(N, V), batch_of([SamplingParams()] * N, [seed] * N,
                                               range(start, start + N))).tokens
    by_seed = sample(row.expand(N, V), batch_of([SamplingParams()] * N,
                                                [seed + i for i in range(N)], [start] * N)).tokens
    # expected distinct values ~ V * (1 - exp(-N / V)) = 226
    assert len(set(by_pos.tolist())) > 190 and len(set(by_seed.tolist())) > 190
    # the uniforms of neighbouring positions / seeds share no value
    u = uniforms(torch.tensor([seed, seed, seed + 1]), torch.tensor([start, start + 1, start]), V)
    assert not bool((u[0] == u[1]).any()) and not bool((u[0] == u[2]).any())


# ---------------------------------------------------------------------- log-probabilities
def test_logprobs(gen):
    R, V = 24, 1500
    logits, params, seeds, positions = mixed_batch(gen, R, V)
    params[0] = SamplingParams(temperature=0.0, logprobs=20)
    logits[1, :] = -math.inf
    logits[1, :3] = torch.randn(3, generator=gen)  # only three finite tokens
    out = sample(logits, batch_of(params, seeds, positions))
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprob.dtype == torch.float32 and out.top_ids.dtype == torch.int64
    assert out.top_ids.shape == (R, 20) and out.top_logprobs.dtype == torch.float32
    assert torch.allclose(out.logprob.double(), ref.gather(1, out.tokens[:, None]).squeeze(1),
                          rtol=0, atol=2e-5)
    assert torch.allclose(out.top_logprobs.double(), ref.gather(1, out.top_ids),
                          rtol=0, atol=2e-5)
    # the top ids are the most likely tokens, most likely first
    ref_top = ref.sort(dim=-1, descending=True).values[:, :20]
    assert torch.allclose(out.top_logprobs.double(), ref_top, rtol=0, atol=2e-5)
    assert bool((out.top_logprobs[:, 1:] <= out.top_logprobs[:, :-1]).all())
    assert set(out.top_ids[1, :3].tolist()) == {0, 1, 2} and out.tokens[1].item() < 3


def test_logprobs_absent_and_zero(gen):
    logits = torch.randn(3, 50, generator=gen)
    out = sample(logits, batch_of([SamplingParams()] * 3, [1, 2, 3], [0, 0, 0]))
    assert out.top_ids is None and out.top_logprobs is None
    out = sample(logits, batch_of([SamplingParams(logprobs=0), SamplingParams()] * 1 +
                                  [SamplingParams()], [1, 2, 3], [0, 0, 0]))
    assert out.top_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)


def test_empty_batch_and_bf16(gen):
    out = sample(torch.empty(0, 10), batch_of([], [], []))
    assert out.tokens.shape == (0,) and out.logprob.shape == (0,)
    logits = torch.randn(4, 64, generator=gen)
    b = batch_of([SamplingParams(top_k=8)] * 4, [9] * 4, [1, 2, 3, 4])
    assert torch.equal(sample(logits.bfloat16(), b).tokens,
                       sample(logits.bfloat16().float(), b).tokens)
    with pytest.raises(ValueError, match="shape"):
        sample(torch.randn(3, 64), b)


# ---------------------------------------------------------------------- no host sync
FORBIDDEN = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select",
             "unique", "unique_consecutive", "__bool__", "__int__", "__float__", "__index__",
             "__len__", "__iter__", "bincount", "repeat_interleave"}


class NoHostSync(TorchFunctionMode):
    """Records every torch call that would copy tensor data to the host or give an output
    whose shape depends on tensor values."""

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in FORBIDDEN:
            self.bad.append(name)
        if name in ("__getitem__", "__setitem__", "index_put", "index_put_"):
            idx = args[1] if len(args) > 1 else None
            idxs = idx if isinstance(idx, (tuple, list)) else (idx,)
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in idxs):
                self.bad.append(name + "[bool mask]")
        if name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
            self.bad.append("to(cpu)")
        return func(*args, **kwargs)


def test_no_host_sync_function_mode(gen):
    """On CPU: no call in `sample` reads tensor data on the host (values → Python) or makes a
    data-dependent shape."""
    logits, params, seeds, positions = mixed_batch(gen, 12, 700)
    b = batch_of(params, seeds, positions)
    assert b.needs_sort and b.any_sampled and b.max_logprobs >= 0
    with NoHostSync() as mode:
        out = sample(logits, b)
    assert mode.bad == []
    with NoHostSync() as probe:  # the guard does see such calls
        bool(out.tokens[0] > 0)
        out.tokens.tolist()
        logits[logits > 0]
    assert probe.bad == ["__bool__", "tolist", "__getitem__[bool mask]"]


def test_no_host_sync_meta_device():
    """On the data-less meta device, any value read (.item(), bool(), nonzero, mask indexing)
    raises; `sample` runs end to end there with every path enabled."""
    R, V = 5, 129280
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_k=4),
              SamplingParams(top_p=0.5, min_p=0.1, logprobs=7), SamplingParams(),
              SamplingParams(min_p=0.3)]
    b = SamplingBatch.build(params, [1, 2, 3, 4, 5], [10, 20, 30, 40, 50], "meta")
    logits = torch.empty(R, V, device="meta")
    out = sample(logits, b)
    assert out.tokens.device.type == "meta" and out.tokens.shape == (R,)
    assert out.tokens.dtype == torch.int64 and out.logprob.dtype == torch.float32
    assert out.top_ids.shape == (R, 7) and out.top_logprobs.shape == (R, 7)
    t = torch.empty(3, device="meta")
    for read in (lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: t.nonzero(),
                 lambda: t[t > 0]):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.gpu
def test_no_host_sync_cuda_and_device_invariance(gen):
    """On CUDA: `sample` runs with sync debug mode "error", and gives the CPU's tokens."""
    logits, params, seeds, positions = mixed_batch(gen, 32, 129280)
    cpu = sample(logits, batch_of(params, seeds, positions))
    b = batch_of(params, seeds, positions, "cuda")
    x = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(x, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(random_bits(b.seed, b.position, 1000).cpu(),
                       random_bits(b.seed.cpu(), b.position.cpu(), 1000))
    assert torch.equal(out.tokens.cpu(), cpu.tokens)
    assert torch.allclose(out.logprob.cpu(), cpu.logprob, rtol=0, atol=1e-5)
