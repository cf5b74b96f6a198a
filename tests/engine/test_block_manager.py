"""BlockManager's accounting: the capacity shortcut the scheduler takes per row agrees with the
exact per-kind block counts."""

from __future__ import annotations

import torch
from zeroinfer.engine.block_manager import BlockManager
from zeroinfer.model.cache import CacheSpec
from zeroinfer.model.dummy import dummy_config


def test_capacity_is_exactly_where_growth_starts(gen):
    for name in ("tiny", "tiny-yarn"):
        cfg = dummy_config(name)
        sizes = torch.randint(1, 9, (3,), generator=gen).tolist()
        bm = BlockManager(cfg, CacheSpec(10_000, 10_000, 10_000, 4, *sizes))
        for _ in range(200):
            held = torch.randint(0, 12, (3,), generator=gen).tolist()
            blocks = {k.name: list(range(n)) for k, n in zip(bm.kinds, held) if n}
            cap = bm.capacity(blocks)
            for tokens in range(max(0, cap - 40), cap + 40):
                fits = not any(bm.extra_blocks(blocks, tokens).values())
                assert fits == (tokens <= cap), (held, sizes, tokens, cap)


def test_grow_covers_and_can_grow_counts(gen):
    cfg = dummy_config("tiny")
    bm = BlockManager(cfg, CacheSpec(40, 12, 6, 2, 4, 2, 2))
    blocks: dict[str, list[int]] = {}
    tokens = 0
    while True:
        tokens += int(torch.randint(1, 9, (1,), generator=gen))
        if not bm.can_grow(blocks, tokens):
            # exactly some kind lacks free blocks
            need = bm.extra_blocks(blocks, tokens)
            assert any(len(bm.free[k]) < c for k, c in need.items())
            break
        bm.grow(blocks, tokens)
        assert tokens <= bm.capacity(blocks)
        assert not any(bm.extra_blocks(blocks, tokens).values())
    bm.release(blocks, None)
    assert bm.all_free()
