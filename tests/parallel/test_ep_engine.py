"""The engine under expert parallelism, on CPU ranks over gloo: every rank serves its own
prompts (some none, some fewer rounds than the others) and holds its slots of the routed
experts; greedy tokens equal the single-device LLM's, with the experts rebalanced mid-run, and
no rank leaks a KV block."""

from __future__ import annotations

import pytest
import torch
from zeroinfer.parallel.launch import run_ranks

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "dummy:tiny-yarn"


def _prompts(seed, rank, counts, vocab):
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    return [torch.randint(2, vocab, (int(torch.randint(3, 20, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(counts[rank])]


def _engine_worker(rank, world, seed, counts, async_scheduling, graphs, spec=False):
    import random

    from zeroinfer import LLM, SamplingParams, SpeculativeConfig
    from zeroinfer.model import model_config
    from zeroinfer.parallel import ExpertParallel
    from zeroinfer.testing.drafts import FutureDrafter

    cfg = model_config(MODEL)
    ep = ExpertParallel.for_model(cfg, redundant_experts=3, load_window=3, rebalance_interval=6)
    kw = dict(tokenizer=None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=24,
              async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(seed, rank, counts, cfg.vocab_size)
    ref = LLM(MODEL, device="cpu", **kw)  # (on the CPU, as the EP is, on a GPU machine too)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)] if prompts else []
    want2 = ([o.token_ids for o in ref.generate(prompts[:1], params, use_tqdm=False)]
             if prompts else [])
    # graphs: decode rounds in the fixed shapes the GPU captures (the group's class, the
    # fixed-capacity exchange; a rank without sequences runs a step of padding). spec:
    # verification rows of drafts from the reference's output, 30% of them wrong; each rank's
    # rows padded to the group's longest.
    # spec "mtp": the MTP module drafts (whole on every rank: no exchange)
    llm = LLM(MODEL, ep=ep, decode_graphs=graphs,
              speculative=(SpeculativeConfig(3, method="mtp") if spec == "mtp"
                           else SpeculativeConfig(3) if spec else None), **kw)
    if spec is True:
        futures = {tuple(p): w for p, w in zip(prompts, want)}
        rng, add = random.Random(seed + rank), llm.engine.add_request

        def add_with_drafter(ids, p, **k):
            req = add(ids, p, **k)
            req.drafter = FutureDrafter(futures[tuple(ids)], rng, 0.3, cfg.vocab_size)
            return req

        llm.engine.add_request = add_with_drafter
    before = ep.placement.phys_to_logical.clone()
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # A second call, where this rank has other prompts again: the group steps together.
    got2 = [o.token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)]
    assert llm.engine.blocks.all_free(), "KV blocks leaked"
    moved = not torch.equal(before, ep.placement.phys_to_logical.cpu())
    fixed = llm.engine.runner.graph_rounds  # (rows' length -> rounds)
    fixed = bool(fixed) and (not spec or any(q > 1 for q in fixed))
    return got == want and got2 == want2, moved, ep.load.steps, len(prompts), fixed == graphs


@pytest.mark.parametrize("async_scheduling, graphs, spec",
                         [(True, False, False), (False, False, False), (True, True, False),
                          (True, True, True), (True, True, "mtp")],
                         ids=["zos", "sync", "zos-graphs", "spec-graphs", "mtp-graphs"])
def test_ep_engine_greedy_equals_single_device(seed, async_scheduling, graphs, spec):
    # Rank 1 has no prompts in the first call and serves the others' tokens only.
    res = run_ranks(_engine_worker, 3, seed, [3, 0, 6], async_scheduling, graphs, spec)
    for ok, moved, steps, n, fixed in res:
        assert ok and fixed  # (fixed: decode graph steps ran exactly when asked for)
    steps = {r[2] for r in res}
    assert len(steps) == 1 and steps.pop() >= 6  # every rank counted every group round
    assert all(r[1] for r in res), "the experts were rebalanced at least once"


def test_cli_generate_over_ep_ranks(capsys):
    # `zeroinfer generate --ep-ranks 2` spawns two CPU ranks over gloo, deals the prompts out
    # and prints them in input order: the single-process command's lines, token for token.
    from zeroinfer.__main__ import main

    prompts = ["Hello", "The capital of France is", "one two three", "4 5"]
    common = ["--max-tokens", "6", "--quiet", "--max-model-len", "64", "--max-num-seqs", "4",
              "--device", "cpu"]
    assert main(["generate", *prompts, *common]) == 0
    single = capsys.readouterr().out
    assert main(["generate", *prompts, *common, "--ep-ranks", "2", "--redundant-experts", "2",
                 "--eplb-interval", "4", "--eplb-window", "2"]) == 0
    assert capsys.readouterr().out == single
    assert main(["generate", "x", "--ep-ranks", "0"]) == 2
