"""HostBlockTables (the runner's host mirror of every slot's block tables) against the tables
built from the requests' block lists, over random rounds: lists growing, slots freed and taken
by other requests, requests coming back with new lists (preemption), kinds without blocks."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from zeroinfer.engine.runner import KINDS, HostBlockTables


def _naive(rows):
    out = {}
    for k in KINDS:
        width = max([len(r.req.blocks.get(k, ())) for r in rows] + [1])
        out[k] = torch.tensor([list(r.req.blocks.get(k, ())) + [-1] * (width - len(
            r.req.blocks.get(k, ()))) for r in rows], dtype=torch.int32)
    return out


def test_mirror_equals_the_lists_round_after_round(gen):
    def rint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    ht = HostBlockTables()
    free_slots = list(range(12))
    live = []
    next_block = 0
    for _ in range(300):
        op = rint(0, 10)
        if op < 2 and free_slots:  # admit: a new request in a free slot
            req = SimpleNamespace(slot=free_slots.pop(rint(0, len(free_slots))), blocks={})
            live.append(req)
        elif op < 3 and live:  # finish or preempt: the slot goes back, the lists are dropped
            req = live.pop(rint(0, len(live)))
            free_slots.append(req.slot)
            req.blocks = {}
        for req in live:  # growth, in place, by 0-40 blocks (wider than the mirror at times)
            for k in KINDS:
                if rint(0, 3) == 0:
                    n = rint(1, 40 if rint(0, 20) == 0 else 3)
                    req.blocks.setdefault(k, []).extend(range(next_block, next_block + n))
                    next_block += n
        if not live:
            continue
        rows = [SimpleNamespace(req=r) for r in live if rint(0, 4)]  # a subset, any order
        rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
        if not rows:
            continue
        got, want = ht.tables(rows), _naive(rows)
        for k in KINDS:
            assert torch.equal(got[k], want[k]), k
