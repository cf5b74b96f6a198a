"""Speculative decoding: drafts by n-gram lookup, verified by the target model in one round.

A decode row of a request becomes a verification row: its next input token and up to d drafts
(tokens the drafter guesses follow it). The round samples every one of the row's positions
with the request's sampler; draft j is accepted while the token sampled before it equals it,
and the row emits the accepted drafts and the first sampled token that differs (the bonus).
Each emitted token is exactly what a round without drafts would have sampled at its position:
the sampler's randomness is keyed by (request seed, position), so greedy and seeded sampling
give the same tokens with or without speculation, whatever the drafts (for a point-mass draft
this is rejection sampling: the draft is kept with probability p(draft), and otherwise the
token comes from p without it). Drafts only change how many tokens a round yields.

Two drafters (SpeculativeConfig.method):
- "mtp": the model's own multi-token-prediction module (engine/mtp_drafter.py), run on the
  device after each round's draws - greedy drafts from the main model's last streams; the
  checkpoint must carry the module (`mtp.*`, loaded with load(..., mtp=True)).
- "ngram" (the default; no extra weights) is described here.

The n-gram drafter is prompt lookup: the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n in [min_ngram, max_ngram] that
occurs. It needs no model and wins where text repeats its context (code edits, extraction,
retrieval-augmented answers). NgramIndex keeps a map from each n-gram to its latest
continuation, updated as tokens are committed, so a proposal costs O(max_ngram) a row.

Taken-back drafts need no cache rollback: a row's K/V, compressed entries and compressor
rings of rejected positions are written again when the kept tokens reach them
(model/cache.py, CacheSpec.max_discard = num_draft_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """num_draft_tokens: the most drafts a row verifies (a verification row is 1 + that many
    tokens); method: the drafter, "ngram" (prompt lookup) or "mtp" (the model's MTP module);
    min_ngram / max_ngram: the suffix lengths the n-gram drafter looks up, longest first."""

    num_draft_tokens: int = 4
    min_ngram: int = 1
    max_ngram: int = 3
    method: str = "ngram"

    @property
    def lookahead(self) -> int:
        """Positions past a decode row's first that the row holds blocks for: its drafts', and
        with the MTP drafter its chain's (it drafts from the row's last accepted position on,
        writing its own cache there)."""
        D = self.num_draft_tokens
        return 2 * D - 1 if self.method == "mtp" else D

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got "
                             f"{self.method!r}")
        for f in ("num_draft_tokens", "min_ngram", "max_ngram"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative {f} must be a positive int, got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative min_ngram ({self.min_ngram}) must be <= max_ngram "
                             f"({self.max_ngram})")


class NgramIndex:
    """A sequence's tokens and, for each n in [min_n, max_n], the latest position at which each
    n-gram was followed by a token (so a match always has a continuation)."""

    def __init__(self, tokens: Sequence[int], min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            # every n-gram that ends at the current last token is now followed by t
            end = len(self.tokens)
            for n, table in self.latest.items():
                if end >= n:
                    table[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to k drafts: what followed the latest earlier occurrence of the longest suffix
        n-gram that occurred before; [] if none did."""
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) < n:
                continue
            at = self.latest[n].get(tuple(toks[len(toks) - n:]))
            if at is not None:
                return toks[at:at + k]
        return []


class DeviceDrafts:
    """A request's drafts as the device's drafter (the MTP module) last left them, for rounds
    built on the host: each committed round brings the drafts that follow its last token."""

    def __init__(self) -> None:
        self.drafts: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        self.drafts = []  # (until the round's own drafts arrive with its commit)

    def propose(self, k: int) -> list[int]:
        return self.drafts[:max(k, 0)]


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts a verification row keeps: sampled[j] is the token drawn at draft j's
    position (after the row's input token and drafts 0 .. j-1); drafts are kept while they
    equal what was drawn there."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
