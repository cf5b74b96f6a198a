"""Exact accounting of the paged caches: one free list per cache kind plus the compressor-state
slots. A request holding L tokens in cache needs
    window: ceil(L / Bw) blocks            (token positions)
    csa:    ceil((L // csa_rate) / Bc)     (compressed entries; also the indexer keys)
    hca:    ceil((L // hca_rate) / Bh)
and one state slot. Freed blocks go back to the front of the free list (LIFO) so a later test
of the paging sees reused, non-contiguous blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroinfer.model.cache import CacheSpec
from zeroinfer.model.config import ModelConfig


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KindSpec:
    name: str
    block_size: int
    rate: int  # tokens per unit (1 for window, csa_rate / hca_rate for compressed kinds)
    num_blocks: int

    def blocks_for(self, tokens: int) -> int:
        return _ceil_div(tokens // self.rate, self.block_size)


class BlockManager:
    def __init__(self, config: ModelConfig, spec: CacheSpec) -> None:
        self.kinds = [
            KindSpec("window", spec.window_block_size, 1, spec.num_window_blocks),
            KindSpec("csa", spec.csa_block_size, config.csa_rate, spec.num_csa_blocks),
            KindSpec("hca", spec.hca_block_size, config.hca_rate, spec.num_hca_blocks),
        ]
        self.free: dict[str, list[int]] = {k.name: list(range(k.num_blocks - 1, -1, -1))
                                           for k in self.kinds}
        self.free_slots = list(range(spec.num_state_slots - 1, -1, -1))
        self.num_slots = spec.num_state_slots
        # (name, tokens a block covers, rate - 1) per kind, for capacity()
        self._cover = tuple((k.name, k.block_size * k.rate, k.rate - 1) for k in self.kinds)

    def capacity(self, blocks: dict[str, list[int]]) -> int:
        """The most tokens `blocks` cover: a decode row needs new blocks only past it (once in
        a block's worth of steps), so the per-row checks start here. Kind k covers L tokens
        while (L // rate) <= held * block_size."""
        (a, at, ar), (b, bt, br), (c, ct, cr) = self._cover  # spelled out: it runs per row
        get = blocks.get
        return min(len(get(a, ())) * at + ar, len(get(b, ())) * bt + br, len(get(c, ())) * ct + cr)

    def extra_blocks(self, blocks: dict[str, list[int]], tokens: int) -> dict[str, int]:
        return {k.name: max(0, k.blocks_for(tokens) - len(blocks.get(k.name, ())))
                for k in self.kinds}

    def can_grow(self, blocks: dict[str, list[int]], tokens: int, need_slot: bool = False) -> bool:
        if need_slot and not self.free_slots:
            return False
        if tokens <= self.capacity(blocks):
            return True
        return all(len(self.free[n]) >= c for n, c in self.extra_blocks(blocks, tokens).items())

    def grow(self, blocks: dict[str, list[int]], tokens: int) -> None:
        """Extend `blocks` (in place) to cover `tokens` tokens; caller checked can_grow."""
        if tokens <= self.capacity(blocks):
            return
        for name, count in self.extra_blocks(blocks, tokens).items():
            free = self.free[name]
            if len(free) < count:
                raise RuntimeError(f"block manager: out of {name} blocks (caller skipped can_grow)")
            blocks.setdefault(name, []).extend(free.pop() for _ in range(count))

    def take_slot(self) -> int:
        return self.free_slots.pop()

    def release(self, blocks: dict[str, list[int]], slot: int | None) -> None:
        for name, ids in blocks.items():
            self.free[name].extend(reversed(ids))
        blocks.clear()
        if slot is not None:
            self.free_slots.append(slot)

    def all_free(self) -> bool:
        return (all(len(self.free[k.name]) == k.num_blocks for k in self.kinds)
                and len(self.free_slots) == self.num_slots)

    def usage(self) -> dict[str, float]:
        return {k.name: 1 - len(self.free[k.name]) / max(1, k.num_blocks) for k in self.kinds}
