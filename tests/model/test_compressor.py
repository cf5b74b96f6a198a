"""The compressors' batched pooling (Compressor.compress_batch: every closing window of every
sequence pooled at once, the open windows' tokens buffered by one write) against a plain
per-sequence oracle, bitwise: each sequence must get the entries, and leave the state, that
the oracle gives it alone - whatever else shares the step, at any thread count."""

from __future__ import annotations

import copy

import pytest
import torch

from zeroinfer.model.attention import Compressor
from zeroinfer.model.cache import CompressorState, ForwardBatch
from zeroinfer.model.dummy import dummy_config
from zeroinfer.model.rope import RopeTables


def random_compressor(gen, *, rate, overlap, dtype, hidden=64, width=128):
    comp = Compressor(hidden, width, rate, overlap, 1e-6, dtype)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        comp.kv_norm.weight.add_(1.0)
    return comp


def random_state(gen, comp, slots, max_discard=0):
    state = CompressorState(slots, comp.rate, comp.width, comp.overlap, "cpu", max_discard)
    for t in (state.kv, state.gate):
        t.copy_(torch.randn(t.shape, generator=gen))
    return state


def step_batch(cu, ctx, slots):
    T = cu[-1]
    none = torch.empty(0, dtype=torch.int32)
    return ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long),
                        positions=torch.zeros(T, dtype=torch.long), cu_seqlens=cu,
                        context_lens=ctx, window_tables=none, csa_tables=none, hca_tables=none,
                        state_slots=slots)


def oracle(comp, kv, gate, ctx, state, slot, rope):
    """One sequence's step, written out: the open window's rows from the ring (position p at
    row p % size), then its new ones; each complete window pooled (CSA: after the Ca half of
    the window before it, from the ring when that window closed before the step); then every
    new token written to the ring, one position at a time. Returns the new entries [n, width]
    (None if none) and the first one's index."""
    m, w, R = comp.rate, comp.width, state.size
    held = ctx % m
    start = ctx - held
    ring = [(start + j) % R for j in range(held)]
    rows_kv = torch.cat([state.kv[slot, ring].to(kv.dtype), kv])
    rows_gate = torch.cat([state.gate[slot, ring].to(gate.dtype), gate])
    n = rows_kv.shape[0] // m
    entries = None
    if n:
        ck = rows_kv[: n * m].view(n, m, -1)
        cg = rows_gate[: n * m].view(n, m, -1) + comp.position_bias
        if comp.overlap:
            pool_kv = ck.new_zeros(n, 2 * m, w)
            pool_gate = cg.new_full((n, 2 * m, w), float("-inf"))
            pool_kv[:, m:], pool_gate[:, m:] = ck[..., w:], cg[..., w:]
            pool_kv[1:, :m], pool_gate[1:, :m] = ck[:-1, :, :w], cg[:-1, :, :w]
            if start >= m:  # a complete window precedes the step: its rows are in the ring
                before = [(start - m + j) % R for j in range(m)]
                pool_kv[0, :m] = state.kv[slot, before, :w].to(kv.dtype)
                pool_gate[0, :m] = (state.gate[slot, before, :w].to(gate.dtype)
                                    + comp.position_bias[:, :w])
            ck, cg = pool_kv, pool_gate
        positions = start + torch.arange(n) * m
        entries = comp._entries(ck, cg, rope.cos_sin("compress", positions, ck.dtype))
    for j in range(kv.shape[0]):
        state.kv[slot, (ctx + j) % R] = kv[j].float()
        state.gate[slot, (ctx + j) % R] = gate[j].float()
    return entries, start // m


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rate,overlap", [(4, True), (8, False), (2, True)])
def test_batched_pooling_equals_the_oracle_per_sequence(gen, dtype, rate, overlap):
    comp = random_compressor(gen, rate=rate, overlap=overlap, dtype=dtype)
    rope = RopeTables(dummy_config("tiny-yarn"), torch.device("cpu"))
    k = 9
    # Per sequence: tokens held (0 .. rate - 1) and new tokens: none of its windows closing,
    # exactly one (a decode step's case), several (prefill), at its first window or a later one.
    held = torch.randint(0, rate, (k,), generator=gen).tolist()
    windows = torch.randint(0, 5, (k,), generator=gen).tolist()
    new = [int(n) for n in torch.randint(1, 4 * rate, (k,), generator=gen)]
    new[:3] = [rate - held[0], rate - held[1], rate - held[2]]  # exactly one window
    windows[:3] = [0, 1, 3]  # the first window, the second (a saved half), a later one
    new[3] = max(1, rate - held[3] - 1)  # no window closes
    new[4] = 2 * rate + 1  # several
    ctx = [windows[i] * rate + held[i] for i in range(k)]
    slots = torch.randperm(12, generator=gen)[:k].tolist()
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    width = 2 * comp.width if overlap else comp.width
    kv = torch.randn(cu[-1], width, generator=gen).to(dtype)
    gate = torch.randn(cu[-1], width, generator=gen).to(dtype)
    state = random_state(gen, comp, 12, int(torch.randint(0, 6, (1,), generator=gen)))
    alone = copy.deepcopy(state)

    seqs, index, entries = comp.compress_batch(kv, gate, step_batch(cu, ctx, slots), state, rope)
    got = {}
    if entries is not None:
        assert entries.shape == (len(seqs), comp.width) and entries.dtype == dtype
        assert torch.isfinite(entries.float()).all()
        got = {(s, e): entries[j] for j, (s, e) in enumerate(zip(seqs, index))}
    want = {}
    for i in range(k):
        e, first = oracle(comp, kv[cu[i]:cu[i + 1]], gate[cu[i]:cu[i + 1]], ctx[i], alone,
                          slots[i], rope)
        for j in range(0 if e is None else e.shape[0]):
            want[(i, first + j)] = e[j]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # the state: every slot's ring, row for row (a step writes each sequence's last `size`
    # positions; the oracle writes them all, one after another)
    assert torch.equal(state.kv, alone.kv)
    assert torch.equal(state.gate, alone.gate)


@pytest.mark.parametrize("rate,overlap", [(4, True), (8, False), (2, True)])
def test_tokens_taken_back_leave_no_trace(gen, rate, overlap):
    """Speculative rounds: a round writes q tokens and a later one takes up to max_discard of
    them back (only a shorter length: no state is restored). Every entry of a window within
    the kept length must equal, bitwise, the entry of a run that never saw the taken-back
    tokens, round after round; an entry a taken-back token closed is written again when the
    kept tokens close its window (as the pool's slot would be)."""
    comp = random_compressor(gen, rate=rate, overlap=overlap, dtype=torch.float32)
    rope = RopeTables(dummy_config("tiny-yarn"), torch.device("cpu"))
    D = int(torch.randint(1, 6, (1,), generator=gen))
    spec = random_state(gen, comp, 4, max_discard=D)
    clean = random_state(gen, comp, 4)  # another ring size and other junk: neither matters
    slots, n_seq, width = [2, 0, 3], 3, (2 if overlap else 1) * comp.width
    true_kv = torch.randn(n_seq, 400, width, generator=gen)
    true_gate = torch.randn(n_seq, 400, width, generator=gen)
    length = [0] * n_seq
    got_spec: dict = {}
    got_clean: dict = {}

    def run(state, feeds, out):
        cu, ctx, kv, gate, sl = [0], [], [], [], []
        for s, (start, k, g) in feeds.items():
            cu.append(cu[-1] + k.shape[0])
            ctx.append(start)
            kv.append(k)
            gate.append(g)
            sl.append(slots[s])
        seqs, index, entries = comp.compress_batch(torch.cat(kv), torch.cat(gate),
                                                   step_batch(cu, ctx, sl), state, rope)
        order = list(feeds)
        for j, (i, e) in enumerate(zip(seqs, index)):
            out[(order[i], e)] = entries[j]

    for _ in range(40):
        spec_feeds, clean_feeds = {}, {}
        for s in range(n_seq):
            L = length[s]
            q = int(torch.randint(10, 30, (1,), generator=gen)) if L == 0 else \
                int(torch.randint(1, D + 2, (1,), generator=gen))
            keep = q if L == 0 else q - int(torch.randint(0, min(D, q) + 1, (1,), generator=gen))
            kv = torch.cat([true_kv[s, L:L + keep], torch.randn(q - keep, width, generator=gen)])
            gate = torch.cat([true_gate[s, L:L + keep],
                              torch.randn(q - keep, width, generator=gen)])
            spec_feeds[s] = (L, kv, gate)
            if keep:
                clean_feeds[s] = (L, true_kv[s, L:L + keep], true_gate[s, L:L + keep])
            length[s] = L + keep
        run(spec, spec_feeds, got_spec)
        if clean_feeds:
            run(clean, clean_feeds, got_clean)
        for s in range(n_seq):
            for e in range(length[s] // rate):
                assert torch.equal(got_spec[(s, e)], got_clean[(s, e)]), (s, e, length[s])
