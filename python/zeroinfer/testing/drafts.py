"""A stand-in drafter for tests and benchmarks of speculative decoding: it drafts from a known
continuation (what plain decoding produced), each draft wrong with a set probability, so the
verification path can be driven at any acceptance rate - which a random-weight model's n-gram
drafts cannot give. It has NgramIndex's interface (engine/speculative.py): set it as a
request's `ngram` after add_request."""

from __future__ import annotations

import random


class FutureDrafter:
    def __init__(self, future: list[int], rng: random.Random, wrong: float, vocab: int,
                 *, full: bool = False) -> None:
        """future: the request's output tokens under plain decoding. wrong: the probability
        that a draft is replaced by a random token. full: always draft as many as asked (else
        a random number up to it)."""
        self.future, self.rng, self.wrong, self.vocab, self.full = future, rng, wrong, vocab, full
        self.done = 0  # outputs committed

    def extend(self, tokens) -> None:
        self.done += len(tokens)

    def propose(self, k: int) -> list[int]:
        n = k if self.full else self.rng.randint(0, k)
        out = self.future[self.done:self.done + n]
        return [self.rng.randrange(self.vocab) if self.rng.random() < self.wrong else t
                for t in out]
