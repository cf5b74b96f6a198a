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


def random_state(gen, comp, slots):
    state = CompressorState(slots, comp.rate, comp.width, comp.overlap, "cpu")
    for t in (state.buf_kv, state.buf_gate, state.overlap_kv, state.overlap_gate):
        if t is not None:
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
    """One sequence's step, written out: its buffered rows then its new ones, each complete
    window pooled (CSA: after the Ca half of the window before it), the rest buffered.
    Returns the new entries [n, width] and the first one's index."""
    m, w = comp.rate, comp.width
    held = ctx % m
    start = ctx - held
    rows_kv = torch.cat([state.buf_kv[slot, :held].to(kv.dtype), kv])
    rows_gate = torch.cat([state.buf_gate[slot, :held].to(gate.dtype), gate])
    n = rows_kv.shape[0] // m
    if n == 0:  # the new tokens join the buffer (the held rows stay as stored, float32)
        state.buf_kv[slot, held:held + kv.shape[0]] = kv.float()
        state.buf_gate[slot, held:held + kv.shape[0]] = gate.float()
        return None, start // m
    rest = rows_kv.shape[0] - n * m  # new tokens all: n * m > held
    state.buf_kv[slot, :rest] = rows_kv[n * m:].float()
    state.buf_gate[slot, :rest] = rows_gate[n * m:].float()
    ck = rows_kv[: n * m].view(n, m, -1)
    cg = rows_gate[: n * m].view(n, m, -1) + comp.position_bias
    if comp.overlap:
        pool_kv = ck.new_zeros(n, 2 * m, w)
        pool_gate = cg.new_full((n, 2 * m, w), float("-inf"))
        pool_kv[:, m:], pool_gate[:, m:] = ck[..., w:], cg[..., w:]
        pool_kv[1:, :m], pool_gate[1:, :m] = ck[:-1, :, :w], cg[:-1, :, :w]
        if start >= m:  # a complete window precedes: its Ca half was saved
            pool_kv[0, :m] = state.overlap_kv[slot].to(pool_kv.dtype)
            pool_gate[0, :m] = state.overlap_gate[slot].to(pool_gate.dtype)
        state.overlap_kv[slot] = ck[-1, :, :w].float()
        state.overlap_gate[slot] = cg[-1, :, :w].float()
        ck, cg = pool_kv, pool_gate
    positions = start + torch.arange(n) * m
    return comp._entries(ck, cg, rope.cos_sin("compress", positions, ck.dtype)), start // m


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
    new = [int(n) for n in torch.randint(1, 3 * rate, (k,), generator=gen)]
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
    state = random_state(gen, comp, 12)
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
    # the state: every buffer row a sequence holds after the step, and CSA's saved halves
    for i in range(k):
        rest = (ctx[i] + new[i]) % rate
        assert torch.equal(state.buf_kv[slots[i], :rest], alone.buf_kv[slots[i], :rest])
        assert torch.equal(state.buf_gate[slots[i], :rest], alone.buf_gate[slots[i], :rest])
    if overlap:
        assert torch.equal(state.overlap_kv, alone.overlap_kv)
        assert torch.equal(state.overlap_gate, alone.overlap_gate)
