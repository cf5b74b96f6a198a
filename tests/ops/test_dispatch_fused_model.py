"""A pure-Python model of dispatch_fused_kernel's index arithmetic (csrc/cuda/dispatch_combine.cu),
checked against the float64 reference on the CPU: the block / warp split of the entries, the
uint8 count table with its 16-bit packed sums and warp reduce-scatter, the int32 table, the
one-block path, the balanced copy split (a block's copy range may end inside the next block's
first token, whose rows it ranks itself; unrounded or rounded to 32 vectors) and the padding /
tail fills.

It cannot see scheduling or memory-ordering bugs (the GPU tests in test_dispatch_combine.py do);
it pins the arithmetic that decides which row every (token, slot, vector) lands in, so that a
mistake there shows up without a GPU. Keep it in step with the kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from zeroinfer.ops import moe_dispatch_ref
from zeroinfer.ops.dispatch_combine import moe_dispatch_capacity

WARPS, LANES, THREADS = 16, 32, 512  # kFusedWarps, warp size, kFusedThreads
ROW_BATCH = 8                         # kNarrowRowBatch
QUANTUM = 32                          # kBalanceQuantum
M32 = 0xFFFFFFFF


def pad_to(c, tile):
    return (c + tile - 1) // tile * tile


def narrow_row_bytes(E):
    return (E + 15) // 16 * 16


def match_any_ranks(es):
    """rank_step: each lane's rank among the earlier lanes holding the same expert."""
    seen, ranks = {}, []
    for e in es:
        ranks.append(seen.get(e, 0))
        seen[e] = seen.get(e, 0) + 1
    return ranks, seen


def fold_half(acc, n, off):
    """fold_half<N> over all 32 lanes at once (acc[lane][word], uint32 arithmetic)."""
    new = [list(a) for a in acc]
    for lane in range(LANES):
        upper = lane & off
        for i in range(n // 2):
            keep = acc[lane][i + n // 2] if upper else acc[lane][i]
            p = lane ^ off
            send = acc[p][i] if (p & off) else acc[p][i + n // 2]  # what the partner sends
            new[lane][i] = (keep + send) & M32
    return new


def narrow_totals(table, G, b, E):
    """narrow_totals: table[bb] = bytes of block bb's row -> (s_tot, s_bef)."""
    qn = narrow_row_bytes(E) // 16
    s_tot, s_bef = [None] * E, [None] * E
    for q in range(qn):
        acc = [[0] * 16 for _ in range(LANES)]
        for r0 in range(0, G, LANES * ROW_BATCH):
            for u in range(ROW_BATCH):
                for lane in range(LANES):
                    bb = r0 + u * LANES + lane
                    if bb >= G:
                        continue
                    before = M32 if bb < b else 0
                    chunk = table[bb][q * 16:(q + 1) * 16]
                    for j in range(4):
                        w = int.from_bytes(bytes(chunk[4 * j:4 * j + 4]), "little")
                        lo, hi = w & 0x00FF00FF, (w >> 8) & 0x00FF00FF
                        a = acc[lane]
                        a[2 * j] = (a[2 * j] + lo) & M32
                        a[2 * j + 1] = (a[2 * j + 1] + hi) & M32
                        a[8 + 2 * j] = (a[8 + 2 * j] + (lo & before)) & M32
                        a[9 + 2 * j] = (a[9 + 2 * j] + (hi & before)) & M32
        for n in (16, 8, 4, 2):
            acc = fold_half(acc, n, n)
        for lane in range(0, LANES, 2):
            total = (acc[lane][0] + acc[lane ^ 1][0]) & M32
            word = lane >> 1
            wj = word & 7
            e = q * 16 + 4 * (wj >> 1) + (wj & 1)
            dst = s_tot if word < 8 else s_bef
            if e < E:
                dst[e] = total & 0xFFFF
            if e + 2 < E:
                dst[e + 2] = total >> 16
    return s_tot, s_bef


def model_fused(ids, E, tile, rv, G, narrow, balance):
    """Outputs of one dispatch_fused_kernel launch; `written[(row, v)]` = source token.
    balance: 0 whole tokens, 1 equal item ranges, 2 the same rounded to QUANTUM vectors."""
    T, k = len(ids), len(ids[0]) if ids else 0
    flat = [e for row in ids for e in row]
    cap = moe_dispatch_capacity(T, k, E, tile)
    blocks = []
    for b in range(G):
        t0, t1 = T * b // G, T * (b + 1) // G
        ntok, ne, n0 = t1 - t0, (t1 - t0) * k, t0 * k
        ne_all = ne + (k if balance and b + 1 < G else 0)
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
    # The table after the grid barrier.
    if narrow:
        assert max(bl["ne"] for bl in blocks) <= 255 and G * max(bl["ne"] for bl in blocks) <= 65535
        table = [bl["run"] + [0] * (narrow_row_bytes(E) - E) for bl in blocks]
        assert all(0 <= c <= 255 for row in table for c in row)
    out_token_row = [None] * (T * k)
    row_token = [None] * cap
    counts, offsets = [None] * E, [None] * (E + 1)
    written = {}
    shares = []
    for b, bl in enumerate(blocks):
        if G == 1:
            s_tot, s_base = list(bl["run"]), [0] * E
        elif narrow:
            s_tot, s_base = narrow_totals(table, G, b, E)
        else:
            s_tot = [sum(blocks[bb]["run"][e] for bb in range(G)) for e in range(E)]
            s_base = [sum(blocks[bb]["run"][e] for bb in range(b)) for e in range(E)]
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
                steps += [(s, min(s + LANES, bl["ne_all"])) for s in range(bl["ne"], bl["ne_all"], LANES)]
            for s, s_end in steps:
                es = [ent[i] if ent[i] >= 0 else None for i in range(s, s_end)]
                ranks, step_counts = match_any_ranks(es)
                for i, e, r in zip(range(s, s_end), es, ranks):
                    ent[i] = -1 if e is None else cursors[w][e] + r
                for e, c in step_counts.items():
                    if e is not None:
                        cursors[w][e] += c
        # Copy range.
        t0, t1, ntok = bl["t0"], bl["t1"], bl["ntok"]
        c0, c1 = 0, ntok * rv
        if balance:
            r0, r1 = T * b - t0 * G, T * (b + 1) - t1 * G
            c0, c1 = r0 * rv // G, ntok * rv + r1 * rv // G
            assert T * rv * b // G == t0 * rv + c0 and T * rv * (b + 1) // G == t0 * rv + c1
            if balance == 2:  # the offset inside the token, rounded down (warp-aligned accesses)
                c0 = c0 // QUANTUM * QUANTUM
                c1 = ntok * rv + (r1 * rv // G) // QUANTUM * QUANTUM
                assert 0 <= c0 < max(rv, 1) and c0 <= c1
                if rv % QUANTUM == 0:  # every warp's 32 items in one row, 32-vector aligned
                    assert c0 % QUANTUM == 0 and c1 % QUANTUM == 0
        assert c1 <= len(ent) // k * rv if k else True  # never reads past the ranked tokens
        shares.append(c1 - c0)
        for it in range(c0, c1):
            tl, v = divmod(it, rv)
            for j in range(k):
                row = ent[tl * k + j]
                if row >= 0:
                    assert (row, v) not in written, "a cell written twice"
                    written[(row, v)] = t0 + tl
        # Index outputs, counts / offsets of the block's expert slice, padding, tail.
        for i in range(bl["ne"]):
            out_token_row[bl["n0"] + i] = ent[i]
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
    return dict(token_row=out_token_row, row_token=row_token, counts=counts, offsets=offsets,
                written=written, shares=shares)


def check(T, k, E, tile, rv, sms, narrow, balance, drop, seed, skew=False):
    rng = random.Random(seed)
    ids = [[(E - 1 if skew else rng.randrange(E)) if rng.random() >= drop else -1 for _ in range(k)]
           for _ in range(T)]
    G = max(1, min(T, sms))
    got = model_fused(ids, E, tile, rv, G, narrow, balance)
    x = torch.zeros(T, 1)
    _, ref_row_token, ref_token_row, ref_counts, ref_offsets = moe_dispatch_ref(
        x, torch.tensor(ids, dtype=torch.int64).view(T, k), E, tile=tile)
    assert got["counts"] == ref_counts.tolist()
    assert got["offsets"] == ref_offsets.tolist()
    assert got["token_row"] == ref_token_row.view(-1).tolist()
    assert got["row_token"] == ref_row_token.tolist()
    want = {(r, v): t for r, t in enumerate(ref_row_token.tolist()) if t >= 0 for v in range(rv)}
    assert got["written"] == want
    if balance:  # equal shares (+-1; rounded: each end moves by < QUANTUM) of the T * rv items
        slack = 1 if balance == 1 else 2 * QUANTUM - 1
        assert max(got["shares"]) - min(got["shares"]) <= slack and sum(got["shares"]) == T * rv


@pytest.mark.parametrize("narrow", [True, False])
@pytest.mark.parametrize("balance", [0, 1, 2])
@pytest.mark.parametrize("T,k,E,tile,rv,sms,drop", [
    (1, 6, 256, 64, 5, 132, 0.0),     # one block: no table, no barrier
    (2, 6, 256, 64, 3, 132, 0.0),
    (200, 6, 256, 64, 7, 132, 0.05),  # 1-2 tokens per block: the balanced split matters most
    (700, 6, 256, 64, 4, 132, 0.1),
    (533, 8, 40, 16, 9, 132, 0.0),    # E not a multiple of 16: a padded narrow row
    (90, 4, 300, 8, 6, 7, 0.2),       # several uint4 columns per warp (Qn = 19 > 16 warps)
    (300, 1, 3, 1, 2, 11, 0.0),       # k = 1, tile = 1
    (61, 9, 17, 4, 1, 5, 0.3),        # k = 9, one vector per row
    (203, 6, 256, 64, 128, 132, 0.05),  # rv a multiple of 32: rounded split points, 1-2 tokens a block
    (530, 6, 64, 64, 96, 132, 0.0),   # rv a multiple of 32, several tokens a block
    (77, 3, 16, 8, 45, 10, 0.1),      # rv not a multiple of 32: rounding still consistent
    (40, 5, 64, 64, 11, 3, 1.0),      # everything dropped
])
def test_fused_model_matches_reference(narrow, balance, T, k, E, tile, rv, sms, drop):
    check(T, k, E, tile, rv, sms, narrow, balance, drop, seed=T * 7919 + E)


def test_fused_model_narrow_limits():
    # 255 entries in a block (uint8 counts at their limit), all to one expert; expert totals near
    # the 16-bit packed-sum limit: 257 blocks x 255 = 65535.
    check(T=257 * 51, k=5, E=20, tile=64, rv=1, sms=257, narrow=True, balance=2, drop=0.0,
          seed=1, skew=True)


@pytest.mark.parametrize("seed", range(6))
def test_fused_model_random_shapes(seed):
    rng = random.Random(1000 + seed)
    T = rng.choice([1, 3, 17, 131, 132, 133, 250, 400])
    k, E = rng.randint(1, 9), rng.randint(1, 600)
    sms = rng.choice([132, 8, 1, 50])
    G = max(1, min(T, sms))
    ne_max = -(-T // G) * k
    narrow = ne_max <= 255 and G * ne_max <= 65535
    check(T, k, E, rng.choice([1, 4, 64]), rng.choice([rng.randint(1, 12), 32, 64, 100]), sms,
          narrow, rng.choice([0, 1, 2, 2]),
          rng.choice([0.0, 0.1, 0.5]), seed=seed)
