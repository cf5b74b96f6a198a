"""Speculative decoding against plain decoding with every sampling filter, top-N
logprobs, stop tokens placed inside accepted drafts and length limits; seeded requests alone
and in a crowd, async and sync."""

from __future__ import annotations

import random

import pytest
import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine
from zeroinfer.engine.speculative import SpeculativeConfig
from zeroinfer.model import load
from zeroinfer.sampling_params import SamplingParams
from zeroinfer.testing.drafts import FutureDrafter, draft_on_device_from


@pytest.fixture(scope="module")
def model():
    return load("dummy:tiny-yarn", seed=11)


def _params(rng, **kw):
    base = dict(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_k=rng.choice([0, 1, 5, 600]),
                top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.05, 0.4]),
                max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5,
                logprobs=rng.choice([None, 0, 3, 20]), seed=rng.randrange(2**63))
    base.update(kw)
    return SamplingParams(**base)


def _run(model, work, *, spec=None, graphs=False, async_=True, futures=None, rng=None,
         max_seqs=8):
    eng = LLMEngine(model, EngineConfig(max_num_seqs=max_seqs, max_model_len=96,
                                        max_num_batched_tokens=64, decode_graphs=graphs,
                                        speculative=spec, async_scheduling=async_), seed=5)
    reqs = [eng.add_request(p, sp) for p, sp in work]
    if futures is not None:
        for r, f in zip(reqs, futures):
            r.drafter = FutureDrafter(f, rng, 0.0, model.config.vocab_size, full=True)
        if eng.spec_pipelined:
            draft_on_device_from(eng, reqs, futures, rng, 0.0)
    eng.finish()
    out = [(r.output_ids, r.finish_reason, r.output_logprobs) for r in reqs]
    eng.close()
    return out, eng


def _same(a, b):
    for (ta, ra, la), (tb, rb, lb) in zip(a, b):
        assert ta == tb and ra == rb, (ta, tb, ra, rb)
        assert len(la) == len(lb)
        for (pa, topa), (pb, topb) in zip(la, lb):
            assert abs(pa - pb) < 1e-4
            assert [i for i, _ in topa] == [i for i, _ in topb]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(topa, topb))


@pytest.mark.parametrize("graphs", [False, True], ids=["sync", "pipelined"])
def test_spec_equals_plain_all_filters_and_stops_in_drafts(model, gen, graphs):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    V = model.config.vocab_size
    work = [([rng.randrange(2, V) for _ in range(rng.randint(1, 30))],
             _params(rng, max_tokens=rng.randint(8, 24), ignore_eos=True)) for _ in range(8)]
    plain, _ = _run(model, work)
    # stop tokens that plain decoding emits mid-output (each request's own token at a random
    # index >= 1), so that with every draft right the stop falls inside accepted drafts
    work2 = []
    for (p, sp), (out, _, _) in zip(work, plain):
        j = rng.randrange(1, len(out))
        work2.append((p, SamplingParams(**{**sp.__dict__, "stop_token_ids": [out[j]]})))
    plain2, _ = _run(model, work2)
    for (out, reason, _), (p, sp) in zip(plain2, work2):
        assert reason == "stop" and out[-1] in sp.stop_token_ids
        assert len(out) <= sp.max_tokens
    got, eng = _run(model, work2, spec=SpeculativeConfig(4), graphs=graphs,
                    futures=[o for o, _, _ in plain], rng=rng)
    _same(plain2, got)
    assert eng.scheduler.num_accepted > 0
    got, _ = _run(model, work, spec=SpeculativeConfig(3), graphs=graphs,
                  futures=[o for o, _, _ in plain], rng=rng)
    _same(plain, got)
    for (out, _, _), (_, sp) in zip(got, work):
        assert len(out) == sp.max_tokens


@pytest.mark.parametrize("graphs", [False, True], ids=["sync", "pipelined"])
def test_spec_ngram_equals_plain(model, gen, graphs):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    V = model.config.vocab_size
    work = []
    for _ in range(8):
        motif = [rng.randrange(2, V) for _ in range(rng.randint(1, 3))]
        work.append(((motif * 20)[:rng.randint(2, 40)], _params(rng)))
    plain, _ = _run(model, work)
    got, _ = _run(model, work, spec=SpeculativeConfig(rng.randint(1, 5)), graphs=graphs)
    _same(plain, got)


def test_seeded_tokens_independent_of_batch_and_mode(model, gen):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    V = model.config.vocab_size
    work = [([rng.randrange(2, V) for _ in range(rng.randint(1, 30))],
             _params(rng, temperature=rng.choice([0.7, 1.0, 1.5]), ignore_eos=True))
            for _ in range(6)]
    crowd, _ = _run(model, work)
    for i, w in enumerate(work):
        alone, _ = _run(model, [w], async_=(i % 2 == 0))
        _same([crowd[i]], alone)
    sync, _ = _run(model, list(reversed(work)), async_=False, max_seqs=3)
    _same(crowd, list(reversed(sync)))
