"""Per-request sampling parameters, validated and normalised when constructed.

`SamplingParams` is immutable (frozen); every field is checked in `__post_init__`, which raises
`TypeError` for a value of the wrong type and `ValueError` for a value out of range, naming the
field and the allowed range. Normalisation:

* numeric fields are stored as plain Python `float` / `int` (numpy scalars are accepted);
* `top_k == -1` is stored as 0 (both mean "disabled");
* `stop` (a string, a sequence of strings or None) becomes a tuple of non-empty strings;
* `stop_token_ids` (a sequence of ints or None) becomes a tuple of ints.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from zeroinfer.structured_output import StructuredOutput

MAX_LOGPROBS = 20
SEED_LIMIT = 2**63  # seeds are non-negative int64 values


def _int(name: str, value: object) -> int:
    """An integer (bools rejected), as a plain int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    return int(value)


def _float(name: str, value: object) -> float:
    """A finite real number (bools rejected), as a plain float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingParams.{name} must be a float, got {type(value).__name__}")
    f = float(value)
    if not math.isfinite(f):
        raise ValueError(f"SamplingParams.{name} must be finite, got {f}")
    return f


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    temperature     >= 0; 0 means greedy (argmax, ties to the lowest token id).
    top_k           0 or -1 = disabled (stored as 0), else >= 1: keep the k most likely tokens.
    top_p           in (0, 1]: keep the smallest set of most likely tokens whose mass reaches
                    top_p (the most likely token is always kept); 1 = disabled.
    min_p           in [0, 1): drop tokens with p < min_p * p_max; 0 = disabled.
    max_tokens      >= 1: most tokens to generate.
    stop            strings that end generation: None, one string or a sequence of them;
                    stored as a tuple of non-empty strings.
    stop_token_ids  token ids (>= 0) that end generation; stored as a tuple of ints. The
                    token ends the output's token ids; its text is not in the output text.
    ignore_eos      keep generating past the end-of-sequence token.
    seed            None (the engine draws one) or an int in [0, 2**63).
    logprobs        None = no log-probabilities; k in [0, 20] = the sampled token's logprob
                    plus the k most likely alternatives (of the raw, unfiltered distribution).
    structured      None, or a StructuredOutput (zeroinfer.structured_output): the output is
                    kept to a JSON schema, a regex, a grammar or a list of choices (xgrammar).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        t = _float("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {t}")
        put("temperature", t)

        k = _int("top_k", self.top_k)
        if k < -1:
            raise ValueError(f"SamplingParams.top_k must be 0 or -1 (disabled) or >= 1, got {k}")
        put("top_k", max(k, 0))

        p = _float("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p}")
        put("top_p", p)

        mp = _float("min_p", self.min_p)
        if not 0.0 <= mp < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1), got {mp}")
        put("min_p", mp)

        n = _int("max_tokens", self.max_tokens)
        if n < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {n}")
        put("max_tokens", n)

        put("stop", _stop_strings(self.stop))
        put("stop_token_ids", _stop_ids(self.stop_token_ids))

        if not isinstance(self.ignore_eos, bool):
            raise TypeError(
                f"SamplingParams.ignore_eos must be a bool, got {type(self.ignore_eos).__name__}"
            )

        if self.seed is not None:
            s = _int("seed", self.seed)
            if not 0 <= s < SEED_LIMIT:
                raise ValueError(f"SamplingParams.seed must be None or in [0, 2**63), got {s}")
            put("seed", s)

        if self.logprobs is not None:
            lp = _int("logprobs", self.logprobs)
            if not 0 <= lp <= MAX_LOGPROBS:
                raise ValueError(
                    f"SamplingParams.logprobs must be None or in [0, {MAX_LOGPROBS}], got {lp}"
                )
            put("logprobs", lp)

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise TypeError("SamplingParams.structured must be None or a StructuredOutput, got "
                            f"{type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise TypeError(
            "SamplingParams.stop must be None, a string or a list of strings, "
            f"got {type(stop).__name__}"
        )
    out = []
    for s in items:
        if not isinstance(s, str):
            raise TypeError(
                f"SamplingParams.stop must hold only strings, got {type(s).__name__}"
            )
        if not s:
            raise ValueError("SamplingParams.stop strings must be non-empty, got ''")
        out.append(s)
    return tuple(out)


def _stop_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(
            "SamplingParams.stop_token_ids must be None or a list of ints, "
            f"got {type(ids).__name__}"
        )
    out = []
    for i in ids:
        v = _int("stop_token_ids element", i)
        if v < 0:
            raise ValueError(f"SamplingParams.stop_token_ids must be ints >= 0, got {v}")
        out.append(v)
    return tuple(out)


__all__ = ["MAX_LOGPROBS", "SamplingParams", "StructuredOutput"]
