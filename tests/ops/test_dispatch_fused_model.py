"""A pure-Python model of dispatch_fused_kernel's index arithmetic (csrc/cuda/dispatch_combine.cu),
checked against the float64 reference on the CPU: the block / warp split of the entries, the
one-block path (no count table), the int32 count table read in batches of rows after the grid
barrier, the balanced copy split (a block's copy range may start inside its first token and end
inside the next block's first token, whose rows it ranks itself; split points inside a token
rounded down to 32 vectors) and the padding / tail fills.

It cannot see scheduling or memory-ordering bugs (the GPU tests in test_dispatch_combine.py do);
it pins the arithmetic that decides which row every (token, slot, vector) lands in, so that a
mistake there shows up without a GPU. Keep it in step with the kernel.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from zeroinfer.ops import moe_dispatch_ref
from zeroinfer.ops.dispatch_combine import moe_dispatch_capacity

WARPS, LANES, THREADS = 16, 32, 512  # kFusedWarps, warp size, kFusedThreads
TABLE_BATCH = 8                       # kTableBatch
QUANTUM = 32                          # kBalanceQuantum
POISON = -7


def pad_to(c, tile):
    return (c + tile - 1) // tile * tile


def fused_groups(E):
    q = (E + 3) // 4
    return 1 if q >= THREADS else THREADS // q


def match_any_ranks(es):
    """rank_step: each lane's rank among the earlier lanes holding the same expert."""
    seen, ranks = {}, []
    for e in es:
        ranks.append(seen.get(e, 0))
        seen[e] = seen.get(e, 0) + 1
    return ranks, seen


def table_totals(table, G, b, E):
    """The int32 table read after the grid barrier -> (s_tot, s_base before the scan).
    table[bb] = block bb's row (Ep entries, zero-padded). Thread (group g, int4 column q) sums
    rows g, g + NG, .. in batches of TABLE_BATCH loads; then each expert sums the NG partials."""
    Ep = (E + 3) // 4 * 4
    Q, NG = Ep // 4, fused_groups(E)
    red_tot = [[POISON] * Ep for _ in range(NG)]
    red_bef = [[POISON] * Ep for _ in range(NG)]
    for idx in range(Q * NG):  # threads tid, tid + THREADS, ..: every (q, g) once
        q, g = idx % Q, idx // Q
        tot, bef = [0] * 4, [0] * 4
        for r0 in range(g, G, NG * TABLE_BATCH):
            batch = []
            for u in range(TABLE_BATCH):
                bb = r0 + u * NG
                batch.append(table[bb][4 * q:4 * q + 4] if bb < G else [0] * 4)
            for u, v in enumerate(batch):
                tot = [a + c for a, c in zip(tot, v)]
                if r0 + u * NG < b:
                    bef = [a + c for a, c in zip(bef, v)]
        red_tot[g][4 * q:4 * q + 4] = tot
        red_bef[g][4 * q:4 * q + 4] = bef
    s_tot = [sum(red_tot[g][e] for g in range(NG)) for e in range(E)]
    s_base = [sum(red_bef[g][e] for g in range(NG)) for e in range(E)]
    return s_tot, s_base


def copy_range(T, G, b, t0, t1, rv):
    """The block's copy share [c0, c1) in items counted from x[t0] (kBalanceQuantum rounding)."""
    r0, r1 = T * b - t0 * G, T * (b + 1) - t1 * G
    c0 = (r0 * rv // G) // QUANTUM * QUANTUM
    c1 = (t1 - t0) * rv + (r1 * rv // G) // QUANTUM * QUANTUM
    return c0, c1


def model_fused(ids, x, E, tile, G):
    """Outputs of one dispatch_fused_kernel launch on poisoned buffers. x: T rows of rv floats
    (one float per vector: the model moves whole vectors)."""
    T, k = len(ids), len(ids[0]) if ids else 0
    rv = len(x[0]) if x else 0
    Ep = (E + 3) // 4 * 4
    flat = [e for row in ids for e in row]
    cap = moe_dispatch_capacity(T, k, E, tile)
    blocks = []
    for b in range(G):
        t0, t1 = T * b // G, T * (b + 1) // G
        ntok, ne, n0 = t1 - t0, (t1 - t0) * k, t0 * k
        ne_all = ne + (k if b + 1 < G else 0)
        ent = flat[n0:n0 + ne_all]
        seg = -(-ne // (WARPS * LANES)) * LANES
        nw = -(-ne // seg) if seg else 0
        spans = [(min(ne, w * seg), min(ne, min(ne, w * seg) + seg)) for w in range(WARPS)]
        cnt = [[0] * E for _ in range(WARPS)]
        for w, (s0, s1) in enumerate(spans):
            for e in ent[s0:s1]:
                if e >= 0:
                    cnt[w][e] += 1
        run = [0] * E
        for e in range(E):
            for w in range(nw):
                c = cnt[w][e]
                cnt[w][e] = run[e]
                run[e] += c
        blocks.append(dict(t0=t0, t1=t1, ntok=ntok, ne=ne, n0=n0, ne_all=ne_all, ent=ent, nw=nw,
                           spans=spans, cnt=cnt, run=run))
    table = [bl["run"] + [0] * (Ep - E) for bl in blocks]  # the workspace after the barrier
    token_row = [POISON] * (T * k)
    row_token = [POISON] * cap
    counts, offsets = [POISON] * E, [POISON] * (E + 1)
    sorted_x = [[math.nan] * rv for _ in range(cap)]
    writes, shares = [0] * cap, []
    for b, bl in enumerate(blocks):
        if G == 1:  # one block: its counts are the totals (no table, no grid barrier)
            s_tot, s_base = list(bl["run"]), [0] * E
        else:
            s_tot, s_base = table_totals(table, G, b, E)
        s_off, off = [], 0
        for e in range(E):
            s_off.append(off)
            off += pad_to(s_tot[e], tile)
        total = off
        s_base = [s_base[e] + s_off[e] for e in range(E)]
        cursors = [[bl["cnt"][w][e] + s_base[e] for e in range(E)] for w in range(bl["nw"])]
        ent = list(bl["ent"])
        for w in range(bl["nw"]):
            s0, s1 = bl["spans"][w]
            steps = [(s, min(s + LANES, s1)) for s in range(s0, s1, LANES)]
            if w == bl["nw"] - 1:  # the extra token, after the warp's own steps
                steps += [(s, min(s + LANES, bl["ne_all"]))
                          for s in range(bl["ne"], bl["ne_all"], LANES)]
            for s, s_end in steps:
                es = [ent[i] if ent[i] >= 0 else None for i in range(s, s_end)]
                ranks, step_counts = match_any_ranks(es)
                for i, e, r in zip(range(s, s_end), es, ranks):
                    ent[i] = -1 if e is None else cursors[w][e] + r
                for e, c in step_counts.items():
                    if e is not None:
                        cursors[w][e] += c
        # Copy.
        t0, ntok = bl["t0"], bl["ntok"]
        c0, c1 = copy_range(T, G, b, t0, bl["t1"], rv)
        assert 0 <= c0 < max(rv, 1) and c0 <= c1
        assert k == 0 or c1 <= len(ent) // k * rv  # never past the ranked tokens
        if rv % QUANTUM == 0:  # every warp's 32 items in one row, 32-vector aligned
            assert c0 % QUANTUM == 0 and c1 % QUANTUM == 0
        shares.append(c1 - c0)
        for it in range(c0, c1):
            tl, v = divmod(it, rv)
            for j in range(k):
                row = ent[tl * k + j]
                if row >= 0:
                    sorted_x[row][v] = x[t0 + tl][v]
                    writes[row] += 1
        # Posted stores after the copy: index outputs, the block's expert slice, padding, tail.
        for i in range(bl["ne"]):
            token_row[bl["n0"] + i] = ent[i]
            if ent[i] >= 0:
                row_token[ent[i]] = t0 + i // k
        for e in range(E * b // G, E * (b + 1) // G):
            counts[e], offsets[e] = s_tot[e], s_off[e]
            for r in range(s_off[e] + s_tot[e], s_off[e] + pad_to(s_tot[e], tile)):
                row_token[r] = -1
        if b == G - 1:
            offsets[E] = total
        for tid in range(THREADS):
            for r in range(total + b * THREADS + tid, cap, G * THREADS):
                row_token[r] = -1
    return dict(token_row=token_row, row_token=row_token, counts=counts, offsets=offsets,
                sorted_x=sorted_x, writes=writes, shares=shares)


def check(T, k, E, tile, rv, sms, drop, seed, skew=False):
    rng = random.Random(seed)
    ids = [[(E - 1 if skew else rng.randrange(E)) if rng.random() >= drop else -1
            for _ in range(k)] for _ in range(T)]
    x = torch.randn(T, rv, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    G = max(1, min(T, sms))
    got = model_fused(ids, x.tolist(), E, tile, G)
    ref_x, ref_row_token, ref_token_row, ref_counts, ref_offsets = moe_dispatch_ref(
        x, torch.tensor(ids, dtype=torch.int64).view(T, k), E, tile=tile)
    assert got["counts"] == ref_counts.tolist()
    assert got["offsets"] == ref_offsets.tolist()
    assert got["token_row"] == ref_token_row.view(-1).tolist()
    assert got["row_token"] == ref_row_token.tolist()
    used = ref_row_token >= 0
    assert got["writes"] == [rv if u else 0 for u in used.tolist()]  # each cell exactly once
    sx = torch.tensor(got["sorted_x"], dtype=torch.float64).view(len(used), rv)
    assert torch.equal(sx[used], ref_x[used])
    assert bool(sx[~used].isnan().all())  # padding rows unwritten
    # Equal shares of the T * rv items: +-1, and each end rounded down by < QUANTUM.
    assert sum(got["shares"]) == T * rv
    assert max(got["shares"]) - min(got["shares"]) <= 2 * QUANTUM - 1


@pytest.mark.parametrize("T,k,E,tile,rv,sms,drop", [
    (1, 6, 256, 64, 5, 132, 0.0),       # one block: no table, no barrier
    (1, 6, 256, 64, 512, 132, 0.1),     # one block, V4 row (512 vectors)
    (2, 6, 256, 64, 3, 132, 0.0),
    (200, 6, 256, 64, 7, 132, 0.05),    # 1-2 tokens per block
    (700, 6, 256, 64, 4, 132, 0.1),     # E = 256 at G = 132: 16-17 table rows a thread, 3 batches
    (533, 8, 42, 16, 9, 132, 0.0),      # E not a multiple of 4: zero-padded table rows
    (90, 4, 300, 8, 6, 7, 0.2),
    (50, 6, 2500, 8, 3, 132, 0.1),      # 625 int4 columns > 512 threads: NG = 1, 7 batches a thread
    (300, 1, 3, 1, 2, 11, 0.0),         # k = 1, tile = 1
    (61, 9, 17, 4, 1, 5, 0.3),          # k = 9, one vector per row
    (203, 6, 256, 64, 128, 132, 0.05),  # rv % 32 == 0: ranges start / end inside tokens
    (530, 6, 64, 64, 96, 132, 0.0),     # rv % 32 == 0, several tokens a block
    (77, 3, 16, 8, 45, 10, 0.1),        # rv % 32 != 0: rounding still tiles the items
    (40, 5, 64, 64, 11, 3, 1.0),        # everything dropped
])
def test_fused_model_matches_reference(seed, T, k, E, tile, rv, sms, drop):
    check(T, k, E, tile, rv, sms, drop, seed=seed)


def test_fused_model_skewed_large_counts(seed):
    # Every entry to one expert: 600 a block and 79200 in all, past any 8- or 16-bit count.
    check(T=132 * 100, k=6, E=20, tile=64, rv=1, sms=132, drop=0.0, seed=seed, skew=True)


@pytest.mark.parametrize("case", range(6))
def test_fused_model_random_shapes(seed, case):
    rng = random.Random(seed * 8 + case)
    T = rng.choice([1, 3, 17, 131, 132, 133, 250, 400])
    k, E = rng.randint(1, 9), rng.randint(1, 600)
    check(T, k, E, rng.choice([1, 4, 64]), rng.choice([rng.randint(1, 12), 32, 64, 100]),
          rng.choice([132, 8, 1, 50]), rng.choice([0.0, 0.1, 0.5]), seed=seed * 8 + case,
          skew=rng.random() < 0.2)
