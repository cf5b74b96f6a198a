"""The offline engine: the zero-overhead (async) pipeline against the synchronous loop, token
for token, over randomised workloads; block accounting; batch independence; bad input."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine, kv_bytes_per_token
from zeroinfer.model import load
from zeroinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load("dummy:tiny-yarn", seed=5)


def make_workload(rng: random.Random, n: int, vocab: int, *, sampled: bool):
    work = []
    for _ in range(n):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]) if sampled else 0.0,
            top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9]),
            max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5,
            stop_token_ids=[rng.randrange(2, vocab) for _ in range(rng.randint(0, 40))],
            seed=rng.choice([None, rng.randrange(2**31)]))
        abort_after = rng.choice([None] * 6 + [0, 1, 3])
        work.append((prompt, params, abort_after))
    return work


def run(model, work, *, async_scheduling: bool, kv_tokens: int, seed: int = 1, **kw):
    cfg = EngineConfig(max_num_seqs=kw.get("max_num_seqs", 24), max_model_len=64,
                       max_num_batched_tokens=kw.get("max_num_batched_tokens", 96),
                       kv_cache_bytes=int(kv_tokens * sum(kv_bytes_per_token(model).values())),
                       async_scheduling=async_scheduling,
                       decode_graphs=kw.get("decode_graphs"))
    eng = LLMEngine(model, cfg, seed=seed)
    if "graph_rows" in kw:
        eng.runner.graphs.max_rows = kw["graph_rows"]
    reqs = [eng.add_request(p, sp) for p, sp, _ in work]
    aborts = {r.request_id: a for r, (_, _, a) in zip(reqs, work) if a is not None}
    for r in reqs:
        if aborts.get(r.request_id) == 0:  # aborted while still queued
            eng.abort(r.request_id)
    while eng.has_work():
        eng.step()
        for r in reqs:  # abort once the request has committed `a` tokens: the same point in
            a = aborts.get(r.request_id)  # both modes, whatever is in flight
            if a is not None and not r.finished and len(r.output_ids) >= a:
                eng.abort(r.request_id)
    eng.finish()
    assert eng.blocks.all_free(), "KV blocks leaked"
    out = [(r.output_ids, r.finish_reason) for r in reqs]
    stats = dict(preemptions=eng.scheduler.num_preemptions, rounds=eng.rounds,
                 decode_classes=len(eng.runner.graphs.steps) if eng.runner.graphs else 0)
    eng.close()
    return out, stats


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
@pytest.mark.parametrize("kv_tokens", [4096, 160], ids=["roomy", "forced-preemption"])
def test_async_matches_sync(model, sampled, kv_tokens, seed):
    rng = random.Random(seed)
    work = make_workload(rng, 150, model.config.vocab_size, sampled=sampled)
    if kv_tokens == 160:  # a random workload alone may fit: eight long requests up front cannot
        vocab = model.config.vocab_size
        work = [([rng.randrange(2, vocab) for _ in range(40)],
                 SamplingParams(temperature=0.7 if sampled else 0.0, max_tokens=14,
                                ignore_eos=True, seed=rng.randrange(2**31)), None)
                for _ in range(8)] + work
    sync_out, sync_stats = run(model, work, async_scheduling=False, kv_tokens=kv_tokens)
    async_out, async_stats = run(model, work, async_scheduling=True, kv_tokens=kv_tokens)
    for i, (a, b) in enumerate(zip(sync_out, async_out)):
        assert a == b, f"request {i}: sync {a} != async {b} ({work[i][1]})"
    if kv_tokens == 160:
        assert sync_stats["preemptions"] > 0 and async_stats["preemptions"] > 0
    reasons = {r for _, r in sync_out}
    assert {"length", "abort"} <= reasons


def test_decode_graphs_match_eager(model, seed):
    """Decode rounds in fixed shapes (on the CPU, what a GPU captures as CUDA graphs), in the
    async pipeline with preemption, give the synchronous variable-shape loop's tokens."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    long = [([rng.randrange(2, vocab) for _ in range(40)],  # eight of these cannot all fit
             SamplingParams(temperature=0.7, max_tokens=14, ignore_eos=True,
                            seed=rng.randrange(2**31)), None) for _ in range(8)]
    work = long + make_workload(rng, 60, vocab, sampled=True)
    eager, _ = run(model, work, async_scheduling=False, kv_tokens=160, max_num_seqs=8,
                   decode_graphs=False)
    fixed, stats = run(model, work, async_scheduling=True, kv_tokens=160, max_num_seqs=8,
                       decode_graphs=True)
    assert fixed == eager
    # decode rounds past the largest row bucket run eagerly, mixed with the fixed-shape ones
    mixed, _ = run(model, work, async_scheduling=True, kv_tokens=160, max_num_seqs=8,
                   decode_graphs=True, graph_rows=3)
    assert mixed == eager
    assert stats["decode_classes"] > 0 and stats["preemptions"] > 0


def test_every_request_finishes_exactly_once(model, seed):
    rng = random.Random(seed)
    work = make_workload(rng, 60, model.config.vocab_size, sampled=True)
    out, _ = run(model, work, async_scheduling=True, kv_tokens=250, max_num_seqs=8,
                 max_num_batched_tokens=32)
    for (toks, reason), (_, params, abort_after) in zip(out, work):
        assert reason in ("stop", "length", "abort")
        assert len(toks) <= params.max_tokens
        if reason == "length":
            assert len(toks) == params.max_tokens
        if reason == "stop":
            assert toks[-1] in params.stop_token_ids or (not params.ignore_eos and toks[-1] in model.config.eos_token_id)


def test_results_independent_of_batch_composition(model, seed):
    rng = random.Random(seed)
    work = make_workload(rng, 30, model.config.vocab_size, sampled=True)
    work = [(p, sp, None) for p, sp, _ in work]
    probe = ([5, 6, 7, 8, 9] * 3, SamplingParams(temperature=0.9, max_tokens=12, seed=1234,
                                                ignore_eos=True), None)
    alone, _ = run(model, [probe], async_scheduling=True, kv_tokens=2048)
    crowd, _ = run(model, work[:17] + [probe] + work[17:], async_scheduling=True, kv_tokens=2048)
    assert crowd[17] == alone[0]


def test_prompt_logits_equal_teacher_forcing(model, gen):
    from zeroinfer.engine.engine import EngineConfig

    ids = torch.randint(2, model.config.vocab_size, (50,), generator=gen).tolist()
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)
    eng = LLMEngine(model, cfg)
    req = eng.add_request(ids, SamplingParams(max_tokens=1), prompt_logits=True)
    eng.drain()
    got = torch.cat(req.prompt_logits)
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()
    assert torch.equal(got, model.logits(ids))  # batch-invariant numerics: bitwise


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logits_survive_preemption(model, gen, async_scheduling):
    """A prompt-scoring request preempted between its chunks (a KV budget too small for it and
    two decoding requests) is prefilled again from the start: its logits are still one row a
    prompt token, teacher forcing's, and the decoding requests' tokens are greedy decoding's."""
    V = model.config.vocab_size
    cfg = EngineConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=8,
                       kv_cache_bytes=int(96 * sum(kv_bytes_per_token(model).values())),
                       async_scheduling=async_scheduling)
    eng = LLMEngine(model, cfg)
    # (the schedule, and so the preemption, follows the lengths alone: the ids are drawn fresh)
    prompts = [torch.randint(2, V, (20,), generator=gen).tolist() for _ in range(2)]
    decodes = [eng.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
               for p in prompts]
    ids = torch.randint(2, V, (40,), generator=gen).tolist()
    req = eng.add_request(ids, SamplingParams(max_tokens=1), prompt_logits=True)
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()
    assert req.num_preemptions > 0  # (the scenario under test)
    got = torch.cat(req.prompt_logits)
    assert got.shape[0] == len(ids) and req.finish_reason == "length"
    assert torch.equal(got, model.logits(ids))
    for r, p in zip(decodes, prompts):
        assert r.output_ids == model.greedy(p, 30)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_prompt_alone_equals_greedy(model, gen, async_scheduling):
    """One long prompt in chunks of a few tokens: its first rounds sample nothing, and must
    still fill the caches (they once skipped the forward)."""
    ids = torch.randint(2, model.config.vocab_size, (int(torch.randint(20, 45, (1,),
                        generator=gen)),), generator=gen).tolist()
    cfg = EngineConfig(max_num_seqs=2, max_model_len=64,
                       max_num_batched_tokens=int(torch.randint(3, 9, (1,), generator=gen)),
                       async_scheduling=async_scheduling)
    eng = LLMEngine(model, cfg)
    req = eng.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()
    assert req.output_ids == model.greedy(ids, 8)


def test_bad_requests_rejected_while_others_finish(model):
    cfg = EngineConfig(max_num_seqs=4, max_model_len=32, max_num_batched_tokens=32)
    eng = LLMEngine(model, cfg)
    good = [eng.add_request([3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)) for _ in range(3)]
    eng.step()
    V = model.config.vocab_size
    for prompt, params, match in [
        ([], SamplingParams(), "non-empty"),
        ([1, V], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([2] * 33, SamplingParams(), "max_model_len"),
        ([2, 3], "greedy", "SamplingParams"),
        ([2, 3], SamplingParams(stop=["x"]), "stop strings need a tokenizer"),  # (it has none)
        ([2, 3.0], SamplingParams(), "not an integer token id"),
        ([2, True], SamplingParams(), "not an integer token id"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            eng.add_request(prompt, params)
    eng.drain()
    eng.finish()
    assert all(len(r.output_ids) == 6 and r.finish_reason == "length" for r in good)
    assert eng.blocks.all_free()
    eng.close()


def test_release_forgets_finished_requests(model, gen):
    """release() drops finished requests (a long-lived engine would otherwise hold every one,
    prompt logits included) and frees their ids; it refuses a running or unknown one."""
    eng = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=32))
    n = int(torch.randint(2, 5, (1,), generator=gen))
    short = eng.add_request([3, 4], SamplingParams(max_tokens=1, ignore_eos=True), request_id="a")
    long_ = eng.add_request([5, 6], SamplingParams(max_tokens=n + 8, ignore_eos=True))
    while not short.finished:
        eng.step()
    with pytest.raises(ValueError, match="has not finished"):
        eng.release(["a", long_.request_id])
    assert set(eng.requests) == {"a", long_.request_id}  # (nothing released)
    with pytest.raises(KeyError, match="nowhere"):
        eng.release(["nowhere"])
    eng.release(["a"])
    assert list(eng.requests) == [long_.request_id]
    with pytest.raises(KeyError):
        eng.abort("a")
    again = eng.add_request([3, 4], SamplingParams(max_tokens=1), request_id="a")  # (free again)
    eng.drain()
    eng.finish()
    eng.release([again.request_id, long_.request_id])
    assert not eng.requests and eng.blocks.all_free() and len(long_.output_ids) == n + 8
    eng.close()


def test_own_ids_beside_caller_ids(model, gen):
    """Request ids a caller chose that look like the engine's own numbering ("0", "1", ...):
    the engine's ids skip them (it once gave a taken id and refused its own request)."""
    eng = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=32))
    taken = {str(int(i)) for i in torch.randint(0, 6, (3,), generator=gen)}
    for rid in taken:
        assert eng.add_request([3, 4], SamplingParams(max_tokens=1), request_id=rid).request_id == rid
    ids = [eng.add_request([3, 4], SamplingParams(max_tokens=1)).request_id for _ in range(6)]
    assert len(set(ids)) == 6 and not set(ids) & taken
    with pytest.raises(ValueError, match="already in use"):  # (a caller's own clash still is one)
        eng.add_request([3, 4], SamplingParams(), request_id=ids[0])
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()



def test_pipelined_speculative_rounds_keep_the_token_budget(model, gen):
    """Speculative rounds built from the device's state (pipelined) count their drafts in
    max_num_batched_tokens, as the rounds built on the host do: no round runs more tokens than
    the budget (a pipelined round once verified its D drafts a row whatever the budget), and
    the tokens are still those of plain synchronous decoding."""
    from zeroinfer.engine.speculative import SpeculativeConfig
    from zeroinfer.testing.drafts import draft_on_device_by_slot

    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    V, D, n = model.config.vocab_size, rint(2, 5), rint(2, 4)
    budget = rint(n, n * (1 + D) - 1)  # under what n rows of 1 + D tokens take
    prompts = [torch.randint(2, V, (rint(4, 12),), generator=gen).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rint(12, 24), ignore_eos=True)
              for _ in range(n)]
    plain = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64,
                                          async_scheduling=False))
    want = [plain.add_request(p, sp) for p, sp in zip(prompts, params)]
    plain.finish()
    plain.close()
    want = [r.output_ids for r in want]
    eng = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64,
                                        max_num_batched_tokens=budget, decode_graphs=True,
                                        speculative=SpeculativeConfig(D)))
    sizes = []
    launch = eng.runner.launch

    def spy(batch, *args, **kw):
        sizes.append(batch.num_tokens)
        return launch(batch, *args, **kw)

    eng.runner.launch = spy
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(r.slot is None for r in reqs):  # (the prompts, in chunks of the budget)
        eng.step()
    # every draft right: each row has its D drafts on offer
    draft_on_device_by_slot(eng, {r.slot: p + w for r, p, w in zip(reqs, prompts, want)}, 0.0)
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()
    assert [r.output_ids for r in reqs] == want
    assert eng.scheduler.num_pipelined > 0
    assert max(sizes) <= budget, (sizes, budget)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_request_that_exactly_fills_the_cache_is_served(model, gen, async_scheduling):
    """A request's cache holds its prompt and every output token but the last (sampled, never
    fed back), so a request of exactly the cache's size is served - the tokens of a run with
    a roomy cache, every block free after - and one a token longer is refused by name
    (check_request once counted the last output too, and refused requests that fit: a prompt
    of the cache's size for its logits, say)."""
    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    c, V = model.config, model.config.vocab_size
    per_token = sum(kv_bytes_per_token(model).values())
    cfg = EngineConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=rint(8, 32),
                       kv_cache_bytes=int(rint(40, 80) * per_token),
                       async_scheduling=async_scheduling)
    eng = LLMEngine(model, cfg)
    s = eng.spec  # the most tokens each pool holds positions / entries for
    cap = min(s.num_window_blocks * s.window_block_size,
              (s.num_csa_blocks * s.csa_block_size + 1) * c.csa_rate - 1,
              (s.num_hca_blocks * s.hca_block_size + 1) * c.hca_rate - 1)
    P = rint(cap - 12, cap)
    prompt = torch.randint(2, V, (P,), generator=gen).tolist()
    params = SamplingParams(temperature=0.8, max_tokens=cap - P + 1, ignore_eos=True,
                            seed=rint(0, 2**31))
    with pytest.raises(ValueError, match="cannot fit in the KV cache"):
        eng.add_request(prompt, dataclasses.replace(params, max_tokens=cap - P + 2))
    req = eng.add_request(prompt, params)
    eng.finish()
    assert eng.blocks.all_free()
    eng.close()
    roomy = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=128,
                                          async_scheduling=False))
    want = roomy.add_request(prompt, params)
    roomy.finish()
    roomy.close()
    assert req.output_ids == want.output_ids and len(req.output_ids) == params.max_tokens


def test_engine_config_refuses_bad_values_by_name(gen):
    """Every EngineConfig field out of its type or range is refused naming the field (a
    string or a non-finite KV budget once raised a bare TypeError or passed, to fail later in
    int(); a string for a flag passed as true)."""
    bytes_ok = float(torch.rand(1, generator=gen)) * 1e9 + 1
    assert EngineConfig(kv_cache_bytes=bytes_ok).kv_cache_bytes == bytes_ok
    for field, bad in [("kv_cache_bytes", str(int(bytes_ok))), ("kv_cache_bytes", float("nan")),
                       ("kv_cache_bytes", float("inf")), ("kv_cache_bytes", True),
                       ("kv_cache_bytes", -bytes_ok), ("async_scheduling", "false"),
                       ("async_scheduling", None), ("forbid_host_sync", 1)]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})
