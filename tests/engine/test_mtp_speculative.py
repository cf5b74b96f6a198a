"""Speculative decoding with the model's MTP module as the drafter (engine/mtp_drafter.py).
Two oracles: the plain engine's tokens and logprobs (verification keeps exactly what plain
decoding samples, whatever the drafts), and the drafts themselves - every verification row's
drafts must be the module's greedy chain from the committed sequence, recomputed here one
sequence at a time through PagedRunner.step / mtp_step (the paged, chained execution that
tests/model/test_mtp.py checks against HF's modules)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from zeroinfer.engine.engine import EngineConfig, LLMEngine, kv_bytes_per_token
from zeroinfer.engine.speculative import SpeculativeConfig
from zeroinfer.model import load
from zeroinfer.testing.drafts import speculative_workload


@pytest.fixture(scope="module")
def model():
    return load("dummy:tiny-yarn", seed=5, mtp=True)


def _workload(rng: random.Random, n: int, vocab: int):
    return speculative_workload(rng, n, vocab, repetitive=False, max_stops=4)


def _run(model, work, *, spec=None, graphs=False, chunk=64, record=None, forbid_sync=False,
         kv_tokens=2000):
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=chunk,
                       kv_cache_bytes=int(kv_tokens * sum(kv_bytes_per_token(model, mtp=True)
                                                          .values())),
                       decode_graphs=graphs, speculative=spec, forbid_host_sync=forbid_sync)
    eng = LLMEngine(model, cfg, seed=3)
    reqs = [eng.add_request(p, sp) for p, sp in work]
    if record is not None:  # every verification row the rounds commit: (request, start, ids)
        commit = eng.scheduler.commit

        def spy(batch, result, on_token):
            for i in batch.sample_rows:
                r = batch.rows[i]
                if r.device and i in result.rows:
                    start, ids, n, _ = result.rows[i]
                    record.append((r.req, start, ids[:1 + n]))
                elif r.drafts:
                    record.append((r.req, r.start, list(r.token_ids)))
            return commit(batch, result, on_token)

        eng.scheduler.commit = spy
    eng.drain()
    eng.finish()
    assert eng.blocks.all_free(), "KV blocks leaked"
    s = eng.scheduler  # (the requests' own counts, as RequestOutput reports them, add up)
    assert sum(r.num_drafted for r in reqs) == s.num_drafted
    assert sum(r.num_accepted for r in reqs) == s.num_accepted
    return [(r.output_ids, r.finish_reason, [lp for lp, _ in r.output_logprobs])
            for r in reqs], eng


def _drafts_oracle(model, seq: list[int], D: int) -> tuple[list[int], float]:
    """The drafts the module proposes for a row whose input is seq[-1] at position
    len(seq) - 1: its pass over positions 0 .. len(seq) - 2 (each with the next token) gives
    draft 1 at the last of them; D - 1 chained steps give the rest. Returns them and the
    smallest top-2 margin of the argmaxes (near-ties may flip between batch shapes)."""
    r = model.runner(max_seqs=1, max_len=len(seq) + D + 1)
    streams: dict[int, torch.Tensor] = {}
    r.step({0: seq[:-1]}, streams=streams)
    lg, out = r.mtp_step({0: (streams[0], seq[1:])})[0]
    logits, h = lg[-1:], out[-1:]
    drafts, margin = [], float("inf")
    for i in range(D):
        top = logits[0].topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        drafts.append(int(logits[0].argmax()))
        if i + 1 < D:
            logits, h = r.mtp_step({0: (h, [drafts[-1]])})[0]
    return drafts, margin


def _check_drafts(model, rows, min_margin: float = 1e-4) -> int:
    """Every recorded verification row's drafts against the module's chain from the committed
    sequence (rows whose chain has a near-tie argmax are skipped); returns how many it
    checked."""
    checked = 0
    for req, start, ids in rows:
        seq = (req.prompt_ids + req.output_ids)[:start] + [ids[0]]
        want, margin = _drafts_oracle(model, seq, len(ids) - 1)
        if margin >= min_margin:
            assert ids[1:] == want, (start, ids, want)
            checked += 1
    return checked


@pytest.mark.parametrize("graphs", [False, True], ids=["sync", "pipelined"])
def test_mtp_drafts_keep_plain_tokens_and_are_the_modules(model, gen, graphs):
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    work = _workload(rng, 10, model.config.vocab_size)
    plain, _ = _run(model, work)
    D = rng.randint(2, 4)
    rows: list = []
    # (prompts of up to 40 tokens in chunks of 16: the module's entries of prompt chunks that
    # sample nothing, each chunk's last paired with the next chunk's first token)
    got, eng = _run(model, work, spec=SpeculativeConfig(D, method="mtp"), graphs=graphs,
                    chunk=16, record=rows)
    for (a, ra, la), (b, rb, lb) in zip(plain, got):
        assert a == b and ra == rb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-4, atol=1e-4)
    s = eng.scheduler
    assert s.num_drafted > 0 and 0 <= s.num_accepted <= s.num_drafted
    if graphs:
        assert eng.spec_pipelined and s.num_pipelined > 0
    # every verified row's drafts are the module's chain from the committed sequence
    assert _check_drafts(model, rows) > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["sync", "pipelined"])
def test_mtp_drafts_under_preemption(model, gen, graphs):
    """A KV budget that forces preemptions (recompute: the module's cache entries go with the
    blocks and are made again by the recomputing prefill): plain decoding's tokens, and the
    drafts still the module's chain."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    work = [([rng.randrange(2, model.config.vocab_size) for _ in range(30)],
             dataclasses.replace(sp, max_tokens=40, ignore_eos=True, stop_token_ids=()))
            for _, sp in _workload(rng, 8, model.config.vocab_size)]
    plain, _ = _run(model, work, kv_tokens=220)
    rows: list = []
    got, eng = _run(model, work, spec=SpeculativeConfig(3, method="mtp"), graphs=graphs,
                    chunk=16, record=rows, kv_tokens=220)
    assert [(a, r) for a, r, _ in plain] == [(a, r) for a, r, _ in got]
    assert eng.scheduler.num_preemptions > 0
    assert _check_drafts(model, rows[::4]) > 0


@pytest.mark.gpu
def test_cuda_mtp_drafts_in_pipelined_graph_rounds(gen):
    """On CUDA (float32): pipelined verification rounds in CUDA graphs with the MTP module
    drafting after each round's draws on the device - no host sync in the launch path
    (torch's sync debug mode would raise) - give plain decoding's tokens, and the verified
    drafts are the module's chain."""
    model = load("dummy:tiny-yarn", dtype=torch.float32, device="cuda", seed=5, mtp=True)
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    work = _workload(rng, 12, model.config.vocab_size)
    plain, _ = _run(model, work, graphs=None)
    rows: list = []
    got, eng = _run(model, work, spec=SpeculativeConfig(3, method="mtp"), graphs=None,
                    chunk=16, record=rows, forbid_sync=True)
    assert [(a, r) for a, r, _ in plain] == [(a, r) for a, r, _ in got]
    assert eng.spec_pipelined and eng.scheduler.num_pipelined > 0
    steps = eng.runner.graphs.steps
    assert any(k[1] > 1 and st.graph is not None for k, st in steps.items())
    assert _check_drafts(model, rows[:40], 1e-3) > 0


def test_mtp_config_errors():
    with pytest.raises(ValueError, match="speculative method must be one of"):
        SpeculativeConfig(method="eagle")
    plain = load("dummy:tiny-yarn", seed=5)  # (without its MTP modules)
    with pytest.raises(ValueError, match=r"load\(\.\.\., mtp=True\)"):
        LLMEngine(plain, EngineConfig(speculative=SpeculativeConfig(2, method="mtp")))
