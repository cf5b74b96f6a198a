"""Structured output (zeroinfer.structured_output, xgrammar): the sampler draws only allowed
tokens (checked against a float64 oracle of the masked distribution), and the engine's outputs
on the tiny dummy model with the real tokenizer are in the language asked for - checked by
Python's own json / re, not by xgrammar - at temperature 0 and above, in the zero-overhead and
the synchronous scheduler, beside unconstrained requests whose tokens do not change. Bad specs
are refused with an error naming them, and the engine keeps serving."""

from __future__ import annotations

import json
import re

import pytest
import torch
from zeroinfer import LLM, SamplingParams, SpeculativeConfig, StructuredOutput
from zeroinfer.sampling.sampler import SamplingBatch, sample
from zeroinfer.structured_output import allowed_tokens


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 words of a bool [R, V] (the oracle's own packing, one bit at a time)."""
    R, V = allowed.shape
    W = (V + 31) // 32
    words = torch.zeros(R, W, dtype=torch.int64)
    for t in range(V):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_allowed_tokens_unpacks_the_bitmask(gen):
    V = int(torch.randint(40, 200, (1,), generator=gen))
    allowed = torch.rand(5, V, generator=gen) < 0.3
    allowed[:, int(torch.randint(0, V, (1,), generator=gen))] = True
    mask = _bitmask(allowed)
    assert torch.equal(allowed_tokens(mask, V), allowed)
    wider = allowed_tokens(mask, mask.shape[1] * 32 + 7)  # past the words: not allowed
    assert torch.equal(wider[:, :V], allowed) and not wider[:, V:].any()


def test_sampler_draws_only_allowed_tokens(gen):
    """Greedy rows take the largest allowed logit; sampled rows (temperature, top-k, top-p)
    draw only allowed tokens, each about as often as the masked, filtered distribution says;
    the logprob stays that of the raw distribution."""
    R, V = 6, 300
    logits = torch.randn(R, V, generator=gen) * 3
    allowed = torch.rand(R, V, generator=gen) < 0.2
    allowed[torch.arange(R), torch.randint(0, V, (R,), generator=gen)] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, min_p=0.05)]
    draws = 400
    counts = torch.zeros(R, V)
    for i in range(draws):
        sb = SamplingBatch.build(params, [7 + r for r in range(R)], [i] * R, "cpu",
                                 _bitmask(allowed))
        res = sample(logits, sb)
        tok = res.tokens
        assert allowed[torch.arange(R), tok].all()
        raw = torch.log_softmax(logits.double(), -1)[torch.arange(R), tok]
        assert torch.allclose(res.logprob.double(), raw, atol=1e-5)
        counts[torch.arange(R), tok] += 1
    masked = logits.double().masked_fill(~allowed, float("-inf"))
    for r in (0, 4):  # greedy: the first largest allowed logit, every time
        assert counts[r, int(masked[r].argmax())] == draws
    p = torch.softmax(masked[1], -1)  # temperature 1, no filter: frequencies follow p
    assert float((counts[1] / draws - p).abs().max()) < 0.1


@pytest.fixture(scope="module")
def llms():
    pytest.importorskip("xgrammar")
    # zero-overhead, synchronous, and speculative (synchronous rounds; the unconstrained
    # requests draft, the constrained ones do not)
    return {mode: LLM("dummy", max_num_seqs=6, max_model_len=200, async_scheduling=mode == "zos",
                      speculative=SpeculativeConfig(3) if mode == "spec" else None)
            for mode in ("zos", "sync", "spec")}


@pytest.fixture
def llm(llms):
    return llms["zos"]


SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "color"], "additionalProperties": False}


def _schema_ok(text: str) -> bool:
    v = json.loads(text)
    return (isinstance(v, dict) and set(v) == {"ok", "n", "color"}
            and isinstance(v["ok"], bool) and type(v["n"]) is int and 0 <= v["n"] <= 99
            and v["color"] in ("red", "green", "blue"))


CASES = [
    (StructuredOutput(json=SCHEMA, any_whitespace=False), _schema_ok),
    (StructuredOutput(json=json.dumps(SCHEMA), any_whitespace=False), _schema_ok),
    (StructuredOutput(regex=r"(yes|no), [0-9]{2}!"),
     lambda t: re.fullmatch(r"(yes|no), [0-9]{2}!", t) is not None),
    (StructuredOutput(grammar='root ::= "x=" [0-9] [0-9] ";" ("ok" | "ko")'),
     lambda t: re.fullmatch(r"x=[0-9]{2};(ok|ko)", t) is not None),
    (StructuredOutput(choice=["alpha beta", "gamma", "δέλτα \"q\""]),
     lambda t: t in ("alpha beta", "gamma", "δέλτα \"q\"")),
]


@pytest.mark.parametrize("mode", ["zos", "sync", "spec"])
def test_outputs_are_in_the_language(llms, gen, mode):
    llm = llms[mode]
    prompts, params, checks = [], [], []
    for spec, ok in CASES:
        for temp in (0.0, 0.9):
            seed = int(torch.randint(0, 2**31, (1,), generator=gen))
            prompts.append(torch.randint(2, 120000, (int(torch.randint(1, 9, (1,),
                                                                     generator=gen)),),
                                         generator=gen).tolist())
            params.append(SamplingParams(max_tokens=80, temperature=temp, seed=seed,
                                         structured=spec))
            checks.append(ok)
    free = [torch.randint(2, 120000, (5,), generator=gen).tolist() for _ in range(2)]
    free_params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts + free, params + [free_params] * 2, use_tqdm=False)
    for o, ok, p in zip(outs, checks, params):
        assert o.finish_reason == "stop", (o.text, p.structured)
        assert o.token_ids[-1] == llm.tokenizer.eos_token_id
        assert ok(o.text), (o.text, p.structured)
    # Unconstrained requests beside them: the same tokens as alone.
    alone = llm.generate(free, free_params, use_tqdm=False)
    assert [o.token_ids for o in outs[-2:]] == [o.token_ids for o in alone]
    # A seed gives the same constrained output again, a token a round (its sampling waits for
    # the commit before, not its row).
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    try:
        again = llm.generate(prompts[1:2], params[1:2], use_tqdm=False)
    finally:
        del llm.engine.step
    assert again[0].token_ids == outs[1].token_ids
    assert len(steps) <= len(again[0].token_ids) + 2  # (+2: the one ahead, the last commit)
    assert llm.engine.blocks.all_free()


def test_constrained_drafts_keep_plain_tokens(llms, gen):
    """Speculative drafts of constrained requests: each position's mask follows the drafts
    before it (the matcher accepts them, then rolls back), so the tokens are plain decoding's,
    and good drafts are kept (drafts from plain decoding's output, a third of them wrong)."""
    import random

    from zeroinfer.testing.drafts import FutureDrafter

    prompts, params = [], []
    for spec, _ in CASES:
        prompts.append(torch.randint(2, 120000, (6,), generator=gen).tolist())
        params.append(SamplingParams(max_tokens=80, temperature=0.9, structured=spec,
                                     seed=int(torch.randint(0, 2**31, (1,), generator=gen))))
    plain = [o.token_ids for o in llms["sync"].generate(prompts, params, use_tqdm=False)]
    llm = llms["spec"]
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    futures, add = {tuple(p): w for p, w in zip(prompts, plain)}, llm.engine.add_request

    def add_with_drafter(ids, p, **k):
        req = add(ids, p, **k)
        req.drafter = FutureDrafter(futures[tuple(ids)], rng, 0.3, llm.model.config.vocab_size)
        return req

    llm.engine.add_request = add_with_drafter
    s = llm.engine.scheduler
    kept = s.num_accepted
    try:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del llm.engine.add_request
    assert got == plain
    assert s.num_accepted > kept
    assert llm.engine.blocks.all_free()


def test_json_object_starts_an_object(llm, gen):
    p = SamplingParams(max_tokens=30, temperature=0.0,
                       structured=StructuredOutput(json_object=True, any_whitespace=False))
    o = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0]
    assert o.text.startswith("{")
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict)


def test_bad_specs_are_named_and_the_engine_keeps_serving(llm):
    for kw, named in ((dict(), "exactly one"), (dict(regex="a", choice=["b"]), "exactly one"),
                      (dict(choice="ab"), "choice"), (dict(choice=["a", ""]), "choice"),
                      (dict(json="{not json"), "json"), (dict(json=[1]), "json"),
                      (dict(regex=""), "regex")):
        with pytest.raises((ValueError, TypeError), match=named):
            StructuredOutput(**kw)
    with pytest.raises(TypeError, match="structured"):
        SamplingParams(structured={"regex": "a"})
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(regex="(unclosed"))
    with pytest.raises(ValueError, match="regex does not compile"):
        llm.generate([[3, 4]], bad, use_tqdm=False)
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(grammar="root ::= undefined"))
    with pytest.raises(ValueError, match="grammar does not compile"):
        llm.generate([[3, 4]], bad, use_tqdm=False)
    ok = llm.generate([[3, 4]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].token_ids) == 3 and llm.engine.blocks.all_free()
    no_tok = LLM("dummy", tokenizer=None, max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        no_tok.generate([[3, 4]], SamplingParams(structured=StructuredOutput(choice=["a"])),
                        use_tqdm=False)


def test_a_refused_request_leaves_the_engine_as_it_was(llm, gen):
    """A request whose grammar does not compile, after good ones: refused with nothing of the
    call left queued, and nothing drawn for it - the requests after it get the ids, seeds and
    tokens they get without it."""
    from zeroinfer.engine.engine import LLMEngine

    prompts = [torch.randint(2, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 12, (3,), generator=gen)]
    good = SamplingParams(max_tokens=4, temperature=0.8, ignore_eos=True)  # (the engine's seeds)
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(regex="(unclosed"))
    with pytest.raises(ValueError, match="prompt 2: .*regex does not compile"):
        llm.generate(prompts, [good, good, bad], use_tqdm=False)
    assert not llm.engine.has_work() and llm.engine.blocks.all_free()

    seed = int(torch.randint(0, 2**31, (1,), generator=gen))

    def run(refused: bool):
        eng = LLMEngine(llm.model, llm.engine.cfg, seed=seed, tokenizer=llm.tokenizer)
        reqs = [eng.add_request(prompts[0], good)]
        if refused:
            with pytest.raises(ValueError, match="regex does not compile"):
                eng.add_request(prompts[1], bad)
        reqs += [eng.add_request(p, good) for p in prompts[1:]]
        eng.finish()
        assert eng.blocks.all_free()
        eng.close()
        return [(r.request_id, r.seed, r.output_ids) for r in reqs]

    assert run(refused=True) == run(refused=False)


def test_cli_structured_flags(tmp_path, capsys):
    pytest.importorskip("xgrammar")
    from zeroinfer.__main__ import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    common = ["--max-tokens", "60", "--quiet", "--temperature", "0.8"]
    for flags, ok in (([f"--json-schema=@{schema}"], None),
                      (["--regex", "(yes|no)-[a-c]"], r"(yes|no)-[a-c]"),
                      (["--choice", "up", "--choice", "down"], r"up|down")):
        assert main(["generate", "a", "b", *common, *flags]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(rows) == 2
        for r in rows:
            assert r["finish_reason"] == "stop"
            if ok is None:
                assert _schema_ok(r["text"]), r["text"]
            else:
                assert re.fullmatch(ok, r["text"]), r["text"]
    assert main(["generate", "a", "--regex", "(bad", "--max-tokens", "3", "--quiet"]) == 2
    assert "regex does not compile" in capsys.readouterr().err


def test_chat_reply_under_a_grammar_is_the_answer(llm, gen):
    """A constrained chat reply is asked without thinking (a grammar binds the reply from its
    first token: with thinking on it bound the reasoning and left the answer empty), so the
    message's content is in the language; thinking=True with a grammar is refused."""
    choices = ["yes", "no", "maybe so"]
    conv = [{"role": "user", "content": "".join(
        chr(int(c)) for c in torch.randint(0x61, 0x7b, (int(torch.randint(3, 12, (1,),
                                                                          generator=gen)),),
                                           generator=gen))}]
    p = SamplingParams(max_tokens=16, temperature=0.9,
                       seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
                       structured=StructuredOutput(choice=choices))
    out = llm.chat(conv, p, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(conv, thinking=False)
    assert out.message.content in choices and not out.message.reasoning_content, out.message
    with pytest.raises(ValueError, match="conversation 0: structured output"):
        llm.chat(conv, p, thinking=True, use_tqdm=False)
    assert not llm.engine.has_work() and llm.engine.blocks.all_free()
