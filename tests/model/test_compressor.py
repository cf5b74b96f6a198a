"""The compressors' batched decode pooling against the one-sequence path, bitwise: sequences
whose new tokens close exactly one window each are pooled together (Compressor._pool_one_each);
each must get the entry, and leave the state, that Compressor._pool gives it alone."""

from __future__ import annotations

import copy

import pytest
import torch

from zeroinfer.model.attention import Compressor, OneWindowEach
from zeroinfer.model.cache import CompressorState
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


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rate,overlap", [(4, True), (8, False), (2, True)])
def test_pooled_together_equals_pooled_alone(gen, dtype, rate, overlap):
    comp = random_compressor(gen, rate=rate, overlap=overlap, dtype=dtype)
    rope = RopeTables(dummy_config("tiny-yarn"), torch.device("cpu"))
    k = 7
    # Per sequence: tokens held (0 .. rate - 1), so rate - held new ones close its window, and
    # the window's start: the first window (no overlap half saved) or a later one.
    held = torch.randint(0, rate, (k,), generator=gen).tolist()
    windows = torch.randint(0, 5, (k,), generator=gen).tolist()
    windows[:3] = [0, 1, 3]  # the first window, the second (a saved half), a later one
    slots = torch.randperm(12, generator=gen)[:k].tolist()
    new = [rate - h for h in held]
    x_rows = sum(new) + 3  # rows of other sequences around them
    kv_all = torch.randn(x_rows, 2 * comp.width if overlap else comp.width, generator=gen)
    gate_all = torch.randn(kv_all.shape, generator=gen)
    kv_all, gate_all = kv_all.to(dtype), gate_all.to(dtype)
    group, lo = [], 2
    for i in range(k):
        group.append((i, lo, held[i], windows[i] * rate, slots[i]))
        lo += new[i]
    state = random_state(gen, comp, 12)
    alone_state = copy.deepcopy(state)
    together = comp._pool_one_each(kv_all, gate_all, OneWindowEach(group, rate, kv_all.device),
                                   state, rope)
    assert together.shape == (k, comp.width) and together.dtype == dtype
    for g, (i, lo, h, start, slot) in enumerate(group):
        entries, first = comp._pool(kv_all[lo:lo + rate - h], gate_all[lo:lo + rate - h],
                                    start + h, alone_state, slot, rope)
        assert first == start // rate and entries.shape == (1, comp.width)
        assert torch.equal(together[g], entries[0])
    if overlap:
        assert torch.equal(state.overlap_kv, alone_state.overlap_kv)
        assert torch.equal(state.overlap_gate, alone_state.overlap_gate)
    assert torch.isfinite(together.float()).all()
