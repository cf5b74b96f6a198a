"""A stand-in drafter for tests and benchmarks of speculative decoding: it drafts from a known
continuation (what plain decoding produced), each draft wrong with a set probability, so the
verification path can be driven at any acceptance rate - which a random-weight model's n-gram
drafts cannot give. It has NgramIndex's interface (engine/speculative.py): set it as a
request's `drafter` after add_request."""

from __future__ import annotations

import random
import weakref

# SpeculativeState -> (table, ends, wrong, seed) of the proposer draft_on_device_by_slot set on it
_by_slot: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def speculative_workload(rng: random.Random, n: int, vocab: int, *, repetitive: bool,
                         max_stops: int = 6) -> list:
    """n (prompt, SamplingParams) pairs for speculative-decoding tests: greedy and seeded
    sampling, top-k, logprobs, stop tokens and length limits that can fall inside accepted
    drafts. repetitive: prompts that repeat a short motif (the n-gram drafter finds matches)."""
    from zeroinfer.sampling_params import SamplingParams

    work = []
    for _ in range(n):
        if repetitive:
            motif = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 4))]
            prompt = (motif * 12)[:rng.randint(1, 40)]
        else:
            prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 0.8]), top_k=rng.choice([0, 20]),
            max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5, logprobs=1,
            stop_token_ids=[rng.randrange(2, vocab) for _ in range(rng.randint(0, max_stops))],
            seed=rng.randrange(2**31))
        work.append((prompt, params))
    return work


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


def draft_on_device_from(engine, reqs, futures: list[list[int]], rng: random.Random,
                         wrong: float) -> None:
    """Make `engine`'s device drafter (its SpeculativeState.propose, which drafts the rows of
    pipelined rounds) draft from known continuations too: for the request in each slot, the
    tokens at its positions length .. length + n (n random up to D), each wrong with
    probability `wrong`. It reads the slots on the host (a sync: for CPU tests, and on a GPU
    without the epilogue's CUDA graphs, which cannot hold host reads)."""
    import torch

    st = engine.runner.spec_state
    vocab = engine.model.config.vocab_size
    seqs = [(r, list(r.prompt_ids) + list(f)) for r, f in zip(reqs, futures)]

    def propose(slots, length):
        out = torch.zeros(len(slots), st.D, dtype=torch.int64, device=slots.device)
        count = torch.zeros(len(slots), dtype=torch.int64, device=slots.device)
        for i, (s, n_known) in enumerate(zip(slots.tolist(), length.tolist())):
            seq = next((q for r, q in seqs if r.slot == s and not r.finished), None)
            if seq is None:
                continue
            d = seq[n_known:n_known + rng.randint(0, st.D)]
            d = [rng.randrange(vocab) if rng.random() < wrong else t for t in d]
            if d:
                out[i, :len(d)] = torch.tensor(d)
            count[i] = len(d)
        return out, count

    st.use_proposer(propose, capturable=False)


def draft_on_device_by_slot(engine, seqs: dict[int, list[int]], wrong: float,
                            seed: int = 0) -> None:
    """draft_on_device_from without host reads (for benchmarks on a GPU): `seqs` maps a state
    slot to its request's whole sequence (prompt, then plain decoding's output), fixed for the
    run (no preemption). Every row drafts the full D tokens its sequence still has, each wrong
    with probability `wrong`, drawn on the device by a counter-based hash of (seed + slot,
    position) - no generator state, so the epilogue's CUDA graphs can hold it. Called again on
    the same engine with sequences of the same longest length (and the same wrong / seed), it
    refills the proposer's tables in place and keeps the captured epilogues."""
    import torch

    from zeroinfer.sampling.sampler import random_bits

    st = engine.runner.spec_state
    dev = st.hist.device
    longest = max(len(s) for s in seqs.values())
    table = torch.zeros(st.hist.shape[0], longest + st.D, dtype=torch.int64)
    ends = torch.zeros(st.hist.shape[0], dtype=torch.int64)
    for slot, seq in seqs.items():
        table[slot, :len(seq)] = torch.tensor(seq)
        ends[slot] = len(seq)
    table, ends = table.to(dev), ends.to(dev)
    vocab = engine.model.config.vocab_size
    prev = _by_slot.get(st)
    if prev is not None and prev[0].shape == table.shape and prev[2:] == (wrong, seed):
        # The same proposer over new sequences (a benchmark's next pass): refilled in place, so
        # the epilogue graphs captured with it stay valid (use_proposer would drop them).
        prev[0].copy_(table)
        prev[1].copy_(ends)
        return
    _by_slot[st] = (table, ends, wrong, seed)

    def propose(slots, length):
        d = torch.arange(st.D, device=dev)
        at = (length[:, None] + d).clamp(max=table.shape[1] - 1)
        out = table[slots[:, None], at]
        bits = random_bits((slots[:, None] + seed).expand_as(at).reshape(-1), at.reshape(-1), 2)
        u = ((bits[:, 0] >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53
        bad = (u < wrong).view(out.shape)
        rand_tok = (bits[:, 1] & ((1 << 62) - 1)) % vocab
        out = torch.where(bad, rand_tok.view(out.shape), out)
        return out, (ends[slots] - length).clamp(min=0, max=st.D)

    st.use_proposer(propose, capturable=True)
