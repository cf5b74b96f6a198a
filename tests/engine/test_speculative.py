"""Speculative decoding (engine/speculative.py): a verification row's accepted drafts and bonus
token are what decoding without drafts samples at those positions, so an engine with drafts
must give the plain engine's tokens and logprobs - greedy and seeded sampling, any drafts,
stops and length limits inside accepted drafts, preemption, fixed-shape rounds - in fewer
rounds when the drafts are good. The oracle is the plain zero-overhead engine."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine, kv_bytes_per_token
from zeroinfer.engine.spec_state import SpeculativeState
from zeroinfer.engine.speculative import NgramIndex, SpeculativeConfig
from zeroinfer.model import load
from zeroinfer.sampling_params import SamplingParams
from zeroinfer.testing.drafts import (FutureDrafter, draft_on_device_by_slot, draft_on_device_from,
                                      speculative_workload)


@pytest.fixture(scope="module")
def model():
    return load("dummy:tiny-yarn", seed=11)


def _brute_propose(tokens, k, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n - 1, -1, -1):  # latest first, with a continuation
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_index_matches_brute_force(gen):
    for _ in range(20):
        vocab = int(torch.randint(2, 6, (1,), generator=gen))
        min_n = int(torch.randint(1, 3, (1,), generator=gen))
        max_n = min_n + int(torch.randint(0, 3, (1,), generator=gen))
        seq = torch.randint(0, vocab, (60,), generator=gen).tolist()
        idx = NgramIndex(seq[:5], min_n, max_n)
        for t in range(5, 60):
            k = int(torch.randint(0, 6, (1,), generator=gen))
            assert idx.propose(k) == _brute_propose(seq[:t], k, min_n, max_n), (seq[:t], k)
            idx.extend(seq[t:t + 1])


def test_device_drafter_matches_ngram_index(gen):
    """The pipelined rounds' drafter (SpeculativeState.propose, vectorised over the rows and the
    history on the device) proposes what the host's NgramIndex does, at every length."""
    for _ in range(10):
        vocab = int(torch.randint(2, 6, (1,), generator=gen))
        min_n = int(torch.randint(1, 3, (1,), generator=gen))
        max_n = min_n + int(torch.randint(0, 3, (1,), generator=gen))
        D = int(torch.randint(1, 6, (1,), generator=gen))
        st = SpeculativeState(4, 80, SpeculativeConfig(D, min_n, max_n), torch.device("cpu"))
        seqs = torch.randint(0, vocab, (3, 60), generator=gen)
        slots = torch.tensor([2, 0, 3])
        st.hist[slots, :60] = seqs
        for length in range(1, 61):
            got, count = st.propose(slots, torch.full((3,), length))
            for r in range(3):
                want = NgramIndex(seqs[r, :length].tolist(), min_n, max_n).propose(D)
                assert got[r, :count[r]].tolist() == want, (length, r)
                assert not got[r, count[r]:].any()


def _advance_rounds(gen, device: str) -> None:
    """Random epilogues over a few slots, each once unpadded and once in fixed shapes (padded
    to the row class on the scratch slot; a CUDA graph a class on a GPU): the two states and
    the kept counts must be equal, so padding rows touch no real slot."""
    D = int(torch.randint(1, 6, (1,), generator=gen))
    spec = SpeculativeConfig(D, 1, int(torch.randint(1, 4, (1,), generator=gen)))
    slots, max_len = 6, 48
    plain = SpeculativeState(slots, max_len, spec, torch.device(device))
    fixed = SpeculativeState(slots, max_len, spec, torch.device(device), fixed_shapes=True)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    for st in (plain, fixed):  # the same random state (a small vocabulary: n-gram matches)
        g = torch.Generator().manual_seed(seed)
        st.hist.copy_(torch.randint(0, 3, st.hist.shape, generator=g))
        st.length.copy_(torch.randint(1, max_len, st.length.shape, generator=g))
    for _ in range(30):  # (two row lengths: classes recur with fewer rows than before)
        R = int(torch.randint(1, slots + 1, (1,), generator=gen))  # classes 1, 2, 4, 8
        q = 1 if torch.rand(1, generator=gen) < 0.3 else D + 1
        sl = torch.randperm(slots, generator=gen)[:R]
        ctx = torch.randint(0, max_len, (R,), generator=gen)
        drafts = torch.randint(0, q, (R,), generator=gen)
        ids = torch.randint(0, 3, (R, q), generator=gen)
        draws = torch.where(torch.rand(R, q, generator=gen) < 0.7,
                            torch.cat([ids[:, 1:], ids[:, :1]], 1),
                            torch.randint(0, 3, (R, q), generator=gen))  # drafts often right
        args = [t.to(device) for t in (sl, ctx, ids, drafts, draws)]
        want = plain.advance(*args)
        got = fixed.advance(*args)
        assert torch.equal(got, want)
        # (hist's junk column is left out: a round's writes that must land nowhere all go
        # there, several a row with different tokens, and a GPU keeps any one of them; the
        # lookup never reads it)
        assert torch.equal(plain.hist[:slots, :plain.junk], fixed.hist[:slots, :fixed.junk])
        for name in ("length", "next_ids", "drafts"):
            a, b = getattr(plain, name)[:slots], getattr(fixed, name)[:slots]
            assert torch.equal(a, b), name
    assert len(fixed.classes) > 1


def test_fixed_shape_epilogue_matches_unpadded(gen):
    for _ in range(3):
        _advance_rounds(gen, "cpu")


@pytest.mark.gpu
def test_cuda_epilogue_graphs_match_eager(gen):
    for _ in range(3):
        _advance_rounds(gen, "cuda")


def test_device_oracle_drafter_refilled_in_place(model, gen):
    """draft_on_device_by_slot (the benchmark's device drafter) called again on an engine with
    new sequences of the same longest length keeps its proposer - so the epilogue graphs
    captured with it stay - and drafts the new sequences; a different error rate installs a
    new one."""
    D, V = 3, model.config.vocab_size
    eng = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64, decode_graphs=True,
                                        speculative=SpeculativeConfig(D)), seed=0)
    st = eng.runner.spec_state
    slots, length = torch.tensor([0, 1]), torch.tensor([5, 9])

    def seqs():
        return {s: torch.randint(2, V, (20,), generator=gen).tolist() for s in (0, 1)}

    draft_on_device_by_slot(eng, seqs(), 0.0)
    first = st.propose
    again = seqs()
    draft_on_device_by_slot(eng, again, 0.0)
    assert st.propose is first
    drafts, count = st.propose(slots, length)
    assert drafts.tolist() == [again[0][5:8], again[1][9:12]] and count.tolist() == [D, D]
    draft_on_device_by_slot(eng, seqs(), 0.5)
    assert st.propose is not first
    eng.close()


@pytest.mark.parametrize("drafter", ["oracle", "none"])
def test_pipelined_draft_count_after_prompts_and_idle(model, gen, drafter):
    """A pipelined round verifies as many drafts a row as the rows of the last committed round
    offered (Scheduler.recent_drafts), counting only requests that go on; a prompt row counts
    the drafts the device found for its next row, and an idle engine starts again from the
    configured D. So with every draft right ("oracle"), each batch of requests run on the same
    engine verifies D drafts from its first pipelined round on, the same rounds every time - no
    plain round after the prompts, nor fewer drafts left from the last batch's end; and where
    the lookup finds nothing ("none": prompts without a repeated token, their first output token
    not among them), the round after the first is plain."""
    D, V = 4, model.config.vocab_size
    params = SamplingParams(max_tokens=int(torch.randint(12, 30, (1,), generator=gen)),
                            ignore_eos=True, temperature=0.0)
    plain = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64), seed=0)
    for _ in range(20):
        prompts = [(torch.randperm(V - 2, generator=gen)[:10] + 2).tolist() for _ in range(2)]
        plain_reqs = [plain.add_request(p, params) for p in prompts]
        plain.finish()
        outs = [r.output_ids for r in plain_reqs]
        # The lookup after the prompts sees prompt + first output token: with that token in its
        # prompt (~2% a request at this vocabulary) the 1-gram finds a draft there.
        if drafter == "oracle" or all(o[0] not in p for p, o in zip(prompts, outs)):
            break
    else:
        pytest.fail("no prompts without a draft after the first token in 20 draws")
    eng = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64, decode_graphs=True,
                                        speculative=SpeculativeConfig(D)), seed=0)
    seqs = [p + o for p, o in zip(prompts, outs)]
    if drafter == "oracle":  # (in before the first prompts' lookup; refilled by slot below)
        draft_on_device_by_slot(eng, dict(enumerate(seqs)), 0.0)
    rounds: list[list[int]] = []
    schedule = eng.scheduler.schedule_pipelined

    def spy(prev, max_rows):
        batch = schedule(prev, max_rows)
        if batch is not None:
            rounds[-1].append(batch.rows[0].num_tokens)
        return batch

    eng.scheduler.schedule_pipelined = spy
    for _ in range(3):
        rounds.append([])
        reqs = [eng.add_request(p, params) for p in prompts]
        eng.step()  # the prompts (their slots are known now)
        if drafter == "oracle":
            draft_on_device_by_slot(eng, {r.slot: s for r, s in zip(reqs, seqs)}, 0.0)
        eng.finish()
        assert [r.output_ids for r in reqs] == outs
        assert eng.scheduler.recent_drafts == D
        # (the first round is scheduled before the prompts' commit: the configured D)
        assert rounds[-1][:2] == ([1 + D, 1 + D] if drafter == "oracle" else [1 + D, 1])
    assert rounds[1] == rounds[2], rounds
    eng.close()
    plain.close()


def _workload(rng: random.Random, n: int, vocab: int):
    return speculative_workload(rng, n, vocab, repetitive=True)


def _run(model, work, *, speculative=None, drafter=None, kv_tokens=2000, graphs=False,
         futures=None, rng=None, forbid_sync=False):
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=64,
                       kv_cache_bytes=int(kv_tokens * sum(kv_bytes_per_token(model).values())),
                       decode_graphs=graphs, speculative=speculative,
                       forbid_host_sync=forbid_sync)
    eng = LLMEngine(model, cfg, seed=3)
    reqs = [eng.add_request(p, sp) for p, sp in work]
    if drafter == "future":  # (the host's drafter, and the device's of pipelined rounds)
        for r, f in zip(reqs, futures):
            r.drafter = FutureDrafter(f, rng, 0.3, model.config.vocab_size)
        if eng.spec_pipelined:
            draft_on_device_from(eng, reqs, futures, rng, 0.3)
    eng.drain()
    eng.finish()
    assert eng.blocks.all_free(), "KV blocks leaked"
    out = [(r.output_ids, r.finish_reason, [lp for lp, _ in r.output_logprobs]) for r in reqs]
    return out, eng


def _host_would_draft(work, plain, spec: SpeculativeConfig) -> bool:
    """Whether the host's n-gram drafter proposes anything at some decode step of the plain
    run's sequences, with room for a draft (two more tokens to go): a random model's outputs
    rarely repeat the prompts, so some workloads draft nothing."""
    for (prompt, params), (out, _, _) in zip(work, plain):
        for k in range(1, len(out) - 1):
            hist = prompt + out[:k]
            if NgramIndex(hist, spec.min_ngram, spec.max_ngram).propose(1):
                return True
    return False


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("drafter", ["ngram", "future"])
def test_speculative_tokens_equal_plain_decoding(model, gen, graphs, drafter):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    work = _workload(rng, 12, model.config.vocab_size)
    plain, plain_eng = _run(model, work)
    spec = SpeculativeConfig(num_draft_tokens=rng.randint(2, 5))
    got, eng = _run(model, work, speculative=spec, drafter=drafter, graphs=graphs,
                    futures=[o for o, _, _ in plain], rng=rng)
    for (a, ra, la), (b, rb, lb) in zip(plain, got):
        assert a == b and ra == rb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-4, atol=1e-4)
    s = eng.scheduler
    assert 0 <= s.num_accepted <= s.num_drafted
    if drafter == "future":  # good drafts: accepted, and fewer rounds than one a token
        assert 0 < s.num_accepted < s.num_drafted
        assert eng.rounds < plain_eng.rounds
    elif not graphs and _host_would_draft(work, plain, spec):
        assert s.num_drafted > 0  # a synchronous row verifies what NgramIndex proposes
    if graphs:  # zero-overhead: rounds launched before the one before them is committed
        assert eng.spec_pipelined and s.num_pipelined > 0
    if graphs and drafter == "future":  # (n-gram drafts may all come in mixed rounds)
        steps = eng.runner.graphs.steps
        assert any(k[1] > 1 for k in steps), "no verification round ran in fixed shapes"


@pytest.mark.parametrize("graphs", [False, True], ids=["sync", "pipelined"])
def test_speculation_under_preemption(model, gen, graphs):
    """A KV budget that forces preemptions: the verification rows' reserved blocks are
    released and retaken (pipelined: a round that would need a preemption is a barrier), and
    the tokens still equal plain decoding's."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    # every request runs its full length (30 + 40 tokens), and the budget's CSA blocks hold
    # two such requests at a time
    work = [((p * 40)[:30], dataclasses.replace(sp, max_tokens=40, ignore_eos=True,
                                                 stop_token_ids=()))
            for p, sp in _workload(rng, 10, model.config.vocab_size)]
    plain, _ = _run(model, work, kv_tokens=200)
    got, eng = _run(model, work, kv_tokens=200, speculative=SpeculativeConfig(4),
                    drafter="future", futures=[o for o, _, _ in plain], rng=rng, graphs=graphs)
    assert [(a, r) for a, r, _ in plain] == [(a, r) for a, r, _ in got]
    assert eng.scheduler.num_preemptions > 0
    assert eng.scheduler.num_accepted > 0


def test_speculative_config_errors(model):
    with pytest.raises(ValueError, match="num_draft_tokens must be a positive int"):
        SpeculativeConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculativeConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="speculative must be None or a SpeculativeConfig"):
        EngineConfig(speculative=4)
    cfg = EngineConfig(speculative=SpeculativeConfig(3))
    assert not cfg.pipelined and cfg.num_draft_tokens == 3
    eng = LLMEngine(model, EngineConfig(max_model_len=64, speculative=SpeculativeConfig(3)))
    assert all(s.size == s.rate * (2 if s.overlap else 1) + 3
               for c in eng.runner.caches for s in c.state.values())


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["future", "ngram"])
def test_cuda_speculation_in_decode_graphs(gen, drafter):
    """On CUDA (float32): verification rounds replay CUDA graphs of rows of 1 + d tokens,
    pipelined (launched before the round before is committed), and give plain decoding's
    tokens. With the device's own n-gram drafter the launch path makes no host sync (torch's
    sync debug mode would raise)."""
    model = load("dummy:tiny-yarn", dtype=torch.float32, device="cuda", seed=11)
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    work = _workload(rng, 16, model.config.vocab_size)
    plain, _ = _run(model, work, graphs=None)
    got, eng = _run(model, work, speculative=SpeculativeConfig(4), drafter=drafter,
                    graphs=None, futures=[o for o, _, _ in plain], rng=rng,
                    forbid_sync=drafter == "ngram")
    assert [(a, r) for a, r, _ in plain] == [(a, r) for a, r, _ in got]
    assert eng.spec_pipelined and eng.scheduler.num_pipelined > 0
    if drafter == "future":
        assert eng.scheduler.num_accepted > 0
    steps = eng.runner.graphs.steps
    assert any(k[1] > 1 and s.graph is not None for k, s in steps.items())


def test_abort_before_the_device_runs_the_round(model, gen):
    """Pipelined rounds: aborts of running requests while the round in flight has not yet run
    on the device (the CPU's emulated device held back by a gate; on a GPU the host runs ahead
    of the device the same way). The
    aborted request's slot is released on the host at once; the round must still run with the
    slots it was launched with, and every other request gives the tokens of a run without the
    aborts."""
    import threading

    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    work = [(p, dataclasses.replace(sp, max_tokens=rng.randint(4, 24)))
            for p, sp in _workload(rng, 10, model.config.vocab_size)]
    plain, _ = _run(model, work)
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=64,
                       decode_graphs=True, speculative=SpeculativeConfig(3))
    eng = LLMEngine(model, cfg, seed=3)
    assert eng.spec_pipelined  # (a synchronous step waits for its round: the gate would hang)
    reqs = [eng.add_request(p, sp) for p, sp in work]
    aborted = set()
    while eng.has_work():
        gate = threading.Event()
        eng.runner.emulated.submit(gate.wait)  # the round this step launches waits behind it
        eng.step()
        running = [i for i, r in enumerate(reqs) if r.status.value == "running"]
        # (the first round, of prompts, is built on the host; the later ones mostly on the device)
        if running and (not aborted or rng.random() < 0.3):
            i = rng.choice(running)
            eng.abort(reqs[i].request_id)
            aborted.add(i)
        gate.set()
    eng.finish()
    assert eng.blocks.all_free(), "KV blocks leaked"
    assert aborted
    for i, (r, (out, reason, _)) in enumerate(zip(reqs, plain)):
        if i in aborted:
            assert r.finish_reason == "abort" and r.output_ids == out[:len(r.output_ids)]
        else:
            assert (r.output_ids, r.finish_reason) == (out, reason), i
    eng.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["sync", "pipelined"])
def test_acceptance_counts_are_the_drafts_that_became_tokens(model, gen, graphs):
    """Every draft right (the host's drafter, and the device's for pipelined rounds, both
    drafting from plain decoding's continuation, full rows): each request's counts are the
    rounds' arithmetic - its first token from the prompt round, then rows of 1 + D tokens
    until its end - so num_accepted is the tokens that took no round of their own. Drafts
    verified past max_tokens (a pipelined row has D whatever the request has left) or past a
    stop token inside the accepted drafts are no tokens, and must not be counted as kept."""
    V = model.config.vocab_size
    D = int(torch.randint(2, 5, (1,), generator=gen))
    prompts = [torch.randint(2, V, (int(torch.randint(3, 16, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(3)]
    plain = LLMEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64), seed=0)
    long = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    outs = [r.output_ids for r in [plain.add_request(p, long) for p in prompts]]
    plain.finish()
    plain.close()
    params = []
    for i, o in enumerate(outs):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        # the first request stops at a draft with drafts after it in its row (1 + D tokens a
        # row from its second token on), where a stop token it had not drawn before is
        at = [s for s in range(1, 12) if (s - 1) % (1 + D) < D - 1 and o[s] not in o[:s]]
        stops = ()
        if at and (i == 0 or torch.rand(1, generator=gen) < 0.5):
            s = at[int(torch.randint(0, len(at), (1,), generator=gen))]
            stops, n = (o[s],), 16  # the stop token ends it at s + 1, not max_tokens
        params.append(SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                                     stop_token_ids=stops))
    eng = LLMEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64, decode_graphs=graphs,
                                        speculative=SpeculativeConfig(D)), seed=0)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    if graphs:
        assert eng.spec_pipelined
        # (the requests take slots 0, 1, 2 in order when admitted)
        draft_on_device_by_slot(eng, {i: p + o for i, (p, o) in enumerate(zip(prompts, outs))},
                                0.0)
    else:
        rng = random.Random(0)
        for r, o in zip(reqs, outs):
            r.drafter = FutureDrafter(o, rng, 0.0, V, full=True)
    eng.finish()
    assert eng.blocks.all_free()
    for r, o, sp in zip(reqs, outs, params):
        n = len(r.output_ids)
        assert r.output_ids == o[:n] and (n == sp.max_tokens or r.finish_reason == "stop")
        rounds = -(-(n - 1) // (1 + D))  # the verification rows after the prompt's
        assert r.num_accepted == n - 1 - rounds, (D, n, r.num_drafted, r.num_accepted)
        assert r.num_accepted <= r.num_drafted
        if not sp.stop_token_ids:  # (else drafts past the stop were verified too)
            assert r.num_drafted == r.num_accepted
    s = eng.scheduler
    assert s.num_accepted == sum(r.num_accepted for r in reqs)
    assert s.num_drafted == sum(r.num_drafted for r in reqs)
    eng.close()


def test_prompt_logits_request_verifies_no_drafts(model, gen):
    """A prompt-scoring request (add_request(..., prompt_logits=True)) samples nothing: its
    logits are one row a prompt token, as without speculation, also where its last prompt
    chunk is a single token that the drafter could continue (a repeated prompt)."""
    V = model.config.vocab_size
    chunk = int(torch.randint(4, 12, (1,), generator=gen))
    motif = torch.randint(2, V, (int(torch.randint(1, 4, (1,), generator=gen)),),
                          generator=gen).tolist()
    prompt = (motif * 20)[:chunk * int(torch.randint(1, 3, (1,), generator=gen)) + 1]
    got = {}
    for spec in (None, SpeculativeConfig(int(torch.randint(1, 5, (1,), generator=gen)))):
        eng = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64,
                                            max_num_batched_tokens=chunk, speculative=spec))
        req = eng.add_request(prompt, SamplingParams(max_tokens=16), prompt_logits=True)
        eng.finish()
        assert eng.blocks.all_free() and req.finish_reason == "length" and not req.output_ids
        got[spec is None] = torch.cat(req.prompt_logits)
        eng.close()
    assert got[True].shape == (len(prompt), V)
    torch.testing.assert_close(got[False], got[True], rtol=1e-5, atol=1e-5)
