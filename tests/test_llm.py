"""The LLM front end and the `zeroinfer` command line, on the embedded dummy model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from zeroinfer import LLM, SamplingParams
from zeroinfer.llm import RequestOutput


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy", device="cpu", max_num_seqs=8, max_model_len=128, seed=3)


def test_generate_text_and_ids_in_order(llm):
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (3, 1, 5)]
    outs = llm.generate(["Hello", [5, 6, 7, 8], "The capital of France is"], params, use_tqdm=False)
    assert llm.engine.blocks.all_free()  # a finished call holds no KV blocks
    assert [len(o.token_ids) for o in outs] == [3, 1, 5]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert outs[0].prompt == "Hello" and outs[0].prompt_token_ids == llm.tokenizer.encode("Hello", add_bos=True)
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert outs[2].text == llm.tokenizer.decode(outs[2].token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_logprobs(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=6, seed=77, ignore_eos=True, logprobs=2)
    a = llm.generate([[9, 10, 11]], p, use_tqdm=False)[0]
    b = llm.generate([[9, 10, 11], [1, 2]], [p, SamplingParams(max_tokens=2)], use_tqdm=False)[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 6 and all(lp <= 0 and len(top) == 2 for lp, top in a.logprobs)


def test_integer_ids_of_any_integral_type(llm, gen):
    """Token ids as numpy integers (what a tokenizer or a dataset hands over) are token ids:
    the same tokens as the Python ints, and a Python-int prompt in the output."""
    np = pytest.importorskip("numpy")
    ids = torch.randint(3, 1000, (int(torch.randint(2, 9, (1,), generator=gen)),),
                        generator=gen).tolist()
    p = SamplingParams(temperature=0.8, max_tokens=4, seed=int(torch.randint(0, 1000, (1,),
                                                                            generator=gen)))
    want = llm.generate([ids], p, use_tqdm=False)[0]
    for kind in (np.int64, np.int32, np.uint16):
        got = llm.generate([[kind(t) for t in ids]], p, use_tqdm=False)[0]
        assert got.token_ids == want.token_ids, kind
        assert got.prompt_token_ids == ids and all(type(t) is int for t in got.prompt_token_ids)
    single = llm.generate(np.array(ids).tolist(), p, use_tqdm=False)  # (one prompt, not many)
    assert len(single) == 1 and single[0].token_ids == want.token_ids
    single = llm.generate(list(np.array(ids)), p, use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == want.token_ids


def test_stop_token_text_is_not_output(llm, gen):
    """A request ended by one of its stop_token_ids keeps the token in token_ids but not its
    text (as EOS's), with or without stop strings beside it (the detokenizer of stop strings
    never sees the token: the text was once with it without them and without it with them)."""
    ids = torch.randint(3, 100000, (6,), generator=gen).tolist()
    free = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)[0]
    k = int(torch.randint(1, 12, (1,), generator=gen))
    stop_tok = free.token_ids[k]
    k = free.token_ids.index(stop_tok)  # (its first place)
    want = llm.tokenizer.decode(free.token_ids[:k], skip_special_tokens=True)
    never = "".join(sorted(set("\x00\x01\x02") - set(free.text)))  # (no stop string is hit)
    for stop in (None, [never]):
        out = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0,
                                                 stop_token_ids=[stop_tok], stop=stop),
                           use_tqdm=False)[0]
        assert out.token_ids == free.token_ids[:k + 1] and out.finish_reason == "stop"
        assert out.text == want, (stop, out.text, want)


def test_stop_strings_cut_the_text(llm):
    free = llm.generate(["Hello"], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)[0]
    stop = free.text[3:6]
    if not stop.strip():
        pytest.skip("generated text has no usable stop substring")
    cut = llm.generate(["Hello"], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop],
                                                 temperature=0.0),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and free.text.startswith(cut.text)


def test_prompt_logits_match_the_model(llm):
    ids = [3, 17, 250, 9000, 4, 4, 120000]
    got = llm.prompt_logits(ids)
    assert torch.equal(got, llm.model.logits(ids))


def test_finished_requests_are_not_kept(llm, gen):
    """A call's requests leave the engine with their outputs: a long-lived LLM (`zeroinfer
    chat`) kept every past request, with prompt_logits' [tokens, vocab] logits each."""
    V = llm.model.config.vocab_size
    prompts = [torch.randint(2, V, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 20, (3,), generator=gen)]
    before = set(llm.engine.requests)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    logits = llm.prompt_logits(prompts[0])
    assert set(llm.engine.requests) == before  # (the module's other calls: none either)
    assert logits.shape == (len(prompts[0]), V) and len(outs) == 3
    assert not llm.engine.has_work() and llm.engine.blocks.all_free()


def test_chat_parses_reply(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert out.message is not None and isinstance(out.message.content, str)


@pytest.mark.parametrize("bad,exc,match", [
    ("", ValueError, "prompt 0 is empty"),
    ([], ValueError, "prompts is empty"),
    ([[1, 2], [3, 129280]], ValueError, "outside the vocabulary"),
    ([[2] * 200], ValueError, "max_model_len"),
    ([3.5], TypeError, "prompt 0 must be"),
])
def test_bad_prompts_rejected(llm, bad, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(bad, use_tqdm=False)
    assert llm.engine.blocks.all_free() or llm.engine.has_work() is False


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_p=1.0), "min_p"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kw)


def test_malformed_chat_and_unknown_model(llm):
    with pytest.raises(ValueError, match="conversation 0"):
        llm.chat([{"content": "no role"}], use_tqdm=False)
    with pytest.raises(FileNotFoundError):
        LLM("/nonexistent/checkpoint", device="cpu")


def test_decode_graphs_give_the_same_tokens(llm, gen):
    """LLM(decode_graphs=True): decode rounds in fixed shapes (on a GPU, CUDA graphs; here the
    same form eagerly) sample what the default CPU path samples."""
    fixed = LLM("dummy", device="cpu", max_num_seqs=8, max_model_len=128, seed=3,
                decode_graphs=True)
    seeds = torch.randint(0, 2**31, (4,), generator=gen).tolist()
    params = [SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=s, ignore_eos=True)
              for s in seeds]
    prompts = ["Hello", [5, 6, 7, 8], "The capital of France is", "A"]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in fixed.generate(prompts, params, use_tqdm=False)] == want
    assert fixed.engine.runner.graphs.steps and llm.engine.runner.graphs is None


def test_fp8_kv_cache_option():
    """LLM(kv_cache_dtype="fp8") serves from K=V caches in the V4 FP8 layout; anything but
    "auto" / "fp8" is refused by name."""
    llm = LLM("dummy", device="cpu", max_num_seqs=4, max_model_len=64, kv_cache_dtype="fp8")
    assert llm.engine.spec.kv_fp8 and llm.engine.runner.caches[0].window.dtype == torch.uint8
    out = llm.generate(["Hello", [5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [4, 4]
    assert llm.engine.blocks.all_free()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("dummy", device="cpu", kv_cache_dtype="int8")


def test_cli_generate_prints_jsonl():
    outs = []
    # (--eager: no CUDA graphs, on the CPU the same path; speculative decoding: the same tokens)
    for flags in ([], ["--eager"], ["--speculative-tokens", "3"],
                  ["--speculative-tokens", "2", "--speculative-method", "mtp"]):
        run = subprocess.run([sys.executable, "-m", "zeroinfer", "generate", "Hello", "Bonjour",
                              "--max-tokens", "3", "--ignore-eos", "--quiet", *flags],
                             capture_output=True, text=True, check=True, timeout=300)
        outs.append([json.loads(line) for line in run.stdout.splitlines()])
        if "mtp" in flags:  # (the MTP module always drafts: its rows' drafts counted)
            assert re.search(r"speculative \(mtp, up to 2 drafts a row\): \d+ of [1-9]\d* "
                             r"drafts kept", run.stderr), run.stderr
    fp8 = subprocess.run([sys.executable, "-m", "zeroinfer", "generate", "Hello",
                          "--max-tokens", "3", "--ignore-eos", "--quiet", "--kv-cache-dtype",
                          "fp8"], capture_output=True, text=True, check=True, timeout=300).stdout
    assert len(json.loads(fp8.splitlines()[0])["token_ids"]) == 3
    rows = outs[0]
    assert [r["prompt"] for r in rows] == ["Hello", "Bonjour"]
    assert all(len(r["token_ids"]) == 3 and r["finish_reason"] == "length" for r in rows)
    assert outs[1] == rows and outs[2] == rows and outs[3] == rows


def test_cli_rejects_bad_input():
    r = subprocess.run([sys.executable, "-m", "zeroinfer", "generate", "x", "--max-tokens", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "max_tokens" in r.stderr
    for flags in (["--json-schema", "@/nowhere/schema.json"], ["--file", "/nowhere/prompts.txt"]):
        r = subprocess.run([sys.executable, "-m", "zeroinfer", "generate", "x", *flags],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "/nowhere/" in r.stderr and "Traceback" not in r.stderr, \
            r.stderr


def test_stop_strings_that_never_complete_keep_the_whole_text(llm, gen):
    """A request with stop strings that ends by max_tokens (or EOS) without hitting one: its
    text is the whole output's. The streaming detokenizer holds back a tail that could still
    grow into a stop string; the end of the request must release it, not drop it."""
    params = dict(max_tokens=int(torch.randint(4, 10, (1,), generator=gen)), ignore_eos=True,
                  temperature=0.0)
    prompt = [int(t) for t in torch.randint(3, 1000, (5,), generator=gen)]
    free = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert free.text
    for k in (1, 2, 3):  # the text's last characters, then one it never has
        stop = free.text[-k:] + "\ue000\U000f0000"
        got = llm.generate([prompt], SamplingParams(**params, stop=[stop]), use_tqdm=False)[0]
        assert got.token_ids == free.token_ids and got.finish_reason == "length"
        assert got.text == free.text, (k, stop)


def test_chat_parses_the_reply_of_the_request_it_encoded(llm, gen, monkeypatch):
    """chat() parses each reply with the request it encoded: an assistant prefix continuation
    (the prompt already closed the thinking: the reply is content), and tools (a tool call in
    the reply becomes tool_calls, not DSML markup in content)."""
    conv = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure,", "prefix": True}]
    out = llm.chat(conv, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    want = llm.tokenizer.parse_chat_output(out.token_ids, messages=conv)
    assert want.reasoning_content is None and out.message == want
    assert out.message.content == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)

    # tools: a reply that is a tool call (the dummy model's random weights never make one, so
    # the engine's output is replaced by the call's tokens; the prompt is the real one)
    city = "".join(chr(int(c)) for c in torch.randint(ord("a"), ord("z") + 1, (6,),
                                                       generator=gen))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
            f"<｜DSML｜parameter name=\"city\" string=\"true\">{city}</｜DSML｜parameter>\n"
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    tok = llm.tokenizer
    seen = []

    def run(encoded, params, use_tqdm):
        seen.extend(ids for _, ids in encoded)
        return [RequestOutput("0", None, ids, tok.encode(call) + [tok.eos_token_id], call,
                              "stop") for _, ids in encoded]

    monkeypatch.setattr(llm, "_run", run)
    conv = [{"role": "user", "content": "weather?"}]
    out = llm.chat(conv, thinking=False, tools=tools, use_tqdm=False)[0]
    assert seen == [tok.encode_chat(conv, thinking=False, tools=tools)]
    (tc,) = out.message.tool_calls
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": city}
    assert out.message.content == ""


def test_chat_reply_is_cut_at_a_stop_string(llm, gen):
    """chat() with a stop string that the reply hits: the parsed message is the text cut before
    it (as `text` is), never the stop string or what the token that completed it goes on to."""
    conv = [{"role": "user", "content": "".join(
        chr(int(c)) for c in torch.randint(ord("a"), ord("z") + 1, (8,), generator=gen))}]
    p = dict(max_tokens=10, ignore_eos=True, temperature=0.0)
    free = llm.chat(conv, SamplingParams(**p), thinking=False, use_tqdm=False)[0]
    text = free.message.content
    starts = [a for a in range(1, len(text) - 1)
              if text[a:a + 2].strip() and "\ufffd" not in text[a:a + 2]]
    if not starts:
        pytest.skip("no usable stop substring in the reply")
    a = starts[int(torch.randint(0, len(starts), (1,), generator=gen))]
    stop = text[a:a + 2]
    cut = llm.chat(conv, SamplingParams(**p, stop=[stop]), thinking=False, use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    assert cut.message.content == cut.text and cut.message.reasoning_content is None
