"""Structured output: a request's tokens kept to a JSON schema, any JSON object, a regular
expression, an EBNF grammar or a list of choices, by xgrammar (an optional dependency:
`pip install "zeroinfer[structured]"`).

A constrained request holds a grammar matcher. When a round is launched, the runner asks each
constrained row's matcher for the bitmask of the tokens that keep the output in the language
(`token_bitmask`), and the sampler draws only among those (temperature, top-k/p and min-p act
on what is left; the logprobs reported stay those of the raw distribution). When the round
commits, the matcher accepts the token; once the language is complete it allows only the end of
sequence, and accepting that finishes the request ("stop").

The mask of a row's token needs the row's previous token in its matcher. Under the zero-overhead
scheduler that token is still on the device when the next round is launched, so a round with a
constrained row launches its forward at once and its sampling only after the round before is
committed (ModelRunner.launch(defer_sampling=True), then launch_sampling): the device runs the
forward meanwhile, and the constrained request decodes every round.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_KINDS = ("json", "regex", "grammar", "choice", "json_object")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of:

    json          a JSON schema (a dict, or its JSON text): the output is a JSON value of it;
    json_object   True: the output is any JSON object;
    regex         the output matches this regular expression (whole);
    grammar       an EBNF grammar (GBNF, xgrammar's dialect) whose `root` rule the output is;
    choice        the output is one of these strings (stored as a tuple).

    any_whitespace (json, json_object): False allows no whitespace between JSON tokens (compact
    output, and a bound on the length of a schema without free strings).
    """

    json: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    json_object: bool = False
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput needs exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool) or not isinstance(self.any_whitespace, bool):
            raise TypeError("StructuredOutput.json_object and .any_whitespace must be bools")
        if self.json is not None:
            if isinstance(self.json, dict):
                try:
                    object.__setattr__(self, "json", json.dumps(self.json))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"StructuredOutput.json: the schema is not JSON: {e}") from e
            elif isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"StructuredOutput.json: not JSON text: {e}") from e
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("StructuredOutput.json: a schema is a JSON object, got "
                                     f"{type(schema).__name__}")
            else:
                raise TypeError("StructuredOutput.json must be a dict or a str, got "
                                f"{type(self.json).__name__}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"StructuredOutput.{k} must be a non-empty str, got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise TypeError("StructuredOutput.choice must be a list of strings, got "
                                f"{type(self.choice).__name__}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutput.choice must hold one or more non-empty "
                                 f"strings, got {list(self.choice)!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("structured output needs xgrammar: pip install "
                          "\"zeroinfer[structured]\" (or pip install xgrammar)") from e
    return xgrammar


_SHARED: dict[tuple[str, int], GrammarBackend] = {}


class GrammarBackend:
    """The grammar compiler for one tokenizer and model vocabulary (xgrammar's TokenizerInfo is
    built from the tokenizer's tokenizer.json; compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgr = _xgrammar()
        path = getattr(tokenizer, "path", None)
        if path is None or not Path(path).is_file():
            raise ValueError("structured output needs a tokenizer with a tokenizer.json (`path`), "
                             "such as zeroinfer.tokenizer.Tokenizer")
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"structured output: the tokenizer has {tokenizer.vocab_size} ids, "
                             f"more than the model's vocabulary of {vocab_size}")
        from transformers import PreTrainedTokenizerFast  # (an xgrammar dependency)

        hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
        # Ids past the tokenizer's, up to the model's vocabulary, are never allowed.
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id])
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of a row's bitmask

    @classmethod
    def shared(cls, tokenizer, vocab_size: int) -> GrammarBackend:
        """One backend per tokenizer file and vocabulary size in the process (building the
        TokenizerInfo takes seconds; compiled grammars are shared too)."""
        key = (str(getattr(tokenizer, "path", None)), vocab_size)
        if key not in _SHARED:
            _SHARED[key] = cls(tokenizer, vocab_size)
        return _SHARED[key]

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher of the spec's language; ValueError naming the kind if it does not
        compile."""
        xgr = _xgrammar()
        c = self.compiler
        try:
            if spec.json is not None:
                g = c.compile_json_schema(spec.json, any_whitespace=spec.any_whitespace)
            elif spec.json_object:
                g = c.compile_json_schema('{"type": "object"}',
                                          any_whitespace=spec.any_whitespace)
            elif spec.regex is not None:
                g = c.compile_regex(spec.regex)
            elif spec.grammar is not None:
                g = c.compile_grammar(spec.grammar)
            else:  # choice: an EBNF alternation of the literal strings (JSON escapes)
                g = c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                               for s in spec.choice))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured output: the {spec.kind} does not compile: {e}") from e
        return xgr.GrammarMatcher(g)

    def token_bitmask(self, matchers: Sequence, drafts: Sequence | None = None) -> torch.Tensor:
        """int32 [rows, words] on the CPU: bit j of word i allows token 32 i + j. One row a
        matcher (None: every token allowed); with drafts (a token list a matcher: a
        speculative verification row's), 1 + len(drafts[i]) rows for matcher i: its mask now,
        then after each of its drafts in turn, the matcher rolled back afterwards. Past a draft
        the language does not allow (or one that completes it) every token is allowed: a draw
        there is never kept, since the draft before it cannot be drawn."""
        xgr = _xgrammar()
        counts = [1] * len(matchers) if drafts is None else [1 + len(d) for d in drafts]
        mask = xgr.allocate_token_bitmask(sum(counts), self.vocab_size)
        mask.fill_(-1)
        row = 0
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, row)
                taken = 0
                for t in (drafts[i] if drafts is not None else ()):
                    if not m.accept_token(t):
                        break
                    taken += 1
                    if m.is_terminated():
                        break
                    m.fill_next_token_bitmask(mask, row + taken)
                if taken:
                    m.rollback(taken)
            row += counts[i]
        return mask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from an int32 bitmask [R, words] (token 32 i + j allowed iff bit j
    of word i is set; tokens past the mask's words are not allowed). No host sync."""
    R, W = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(R, W * 32).bool()
    if W * 32 >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - W * 32))


__all__ = ["GrammarBackend", "StructuredOutput", "allowed_tokens"]
