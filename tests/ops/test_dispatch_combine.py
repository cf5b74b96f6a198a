"""moe_dispatch / moe_combine against their float64 references, on fresh random routings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroinfer.ops import MoeDispatch, moe_combine, moe_combine_ref, moe_dispatch, moe_dispatch_ref
from zeroinfer.ops.dispatch_combine import moe_dispatch_capacity
from zeroinfer.testing.compare import assert_close_to_ref

POISON_ROW = -7


def random_ids(gen, T, k, E, *, drop=0.0, ids_dtype=torch.int32, skew=False):
    if skew:  # every token to expert E-1 (k slots of the same expert)
        ids = torch.full((T, k), E - 1, dtype=torch.long)
    else:
        ids = torch.randint(0, E, (T, k), generator=gen)
    if drop:
        ids[torch.rand(T, k, generator=gen) < drop] = -1
    return ids.to(ids_dtype)


def random_x(gen, T, D, dtype):
    x = torch.randn(T, D, generator=gen) * 3
    return x.to(dtype)


def poisoned_dispatch(x, T, k, E, tile, device="cpu"):
    cap = moe_dispatch_capacity(T, k, E, tile)
    sorted_x = torch.empty(cap, x.shape[1], dtype=x.dtype, device=device)
    sorted_x.view(torch.uint8).fill_(0x7F)  # NaN in every float format we accept
    fill = lambda *s: torch.full(s, POISON_ROW, dtype=torch.int32, device=device)  # noqa: E731
    return MoeDispatch(sorted_x, fill(cap), fill(T, k), fill(E), fill(E + 1))


def assert_dispatch_matches(d: MoeDispatch, x, ids, E, tile):
    ref_x, ref_row_token, ref_token_row, ref_counts, ref_offsets = moe_dispatch_ref(x, ids, E, tile=tile)
    assert torch.equal(d.expert_counts.cpu(), ref_counts)
    assert torch.equal(d.expert_offsets.cpu(), ref_offsets)
    assert torch.equal(d.token_row.cpu(), ref_token_row)
    assert torch.equal(d.row_token.cpu(), ref_row_token)
    used = ref_row_token >= 0
    got = d.sorted_x.cpu()
    # Rows are copies: compare the raw bytes, so a wrong row can never hide inside a tolerance.
    want = x.cpu()[ref_row_token[used].long()]
    assert torch.equal(got[used].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(ref_x[used], want.double())
    # Padding rows are documented as unwritten: the poison must still be there.
    assert bool((got[~used].view(torch.uint8) == 0x7F).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,k,E,tile,D", [
    (0, 2, 4, 1, 16), (1, 1, 1, 1, 8), (1, 6, 256, 16, 64), (7, 2, 3, 4, 24), (100, 6, 16, 1, 40),
    (257, 8, 32, 64, 32), (300, 1, 5, 7, 13),
])
def test_dispatch_matches_reference(gen, dtype, ids_dtype, T, k, E, tile, D):
    x = random_x(gen, T, D, dtype)
    ids = random_ids(gen, T, k, E, drop=0.1, ids_dtype=ids_dtype)
    out = poisoned_dispatch(x, T, k, E, tile)
    d = moe_dispatch(x, ids, E, tile=tile, out=out)
    assert d is out
    assert_dispatch_matches(d, x, ids, E, tile)


@pytest.mark.parametrize("case", ["all_to_one", "all_dropped", "single_token"])
def test_dispatch_edge_cases(gen, case):
    T, k, E, tile, D = {"all_to_one": (64, 6, 8, 16, 32), "all_dropped": (9, 3, 4, 8, 16),
                        "single_token": (1, 6, 256, 128, 64)}[case]
    x = random_x(gen, T, D, torch.bfloat16)
    ids = random_ids(gen, T, k, E, skew=case == "all_to_one",
                     drop=1.0 if case == "all_dropped" else 0.0)
    d = moe_dispatch(x, ids, E, tile=tile, out=poisoned_dispatch(x, T, k, E, tile))
    assert_dispatch_matches(d, x, ids, E, tile)
    if case == "all_to_one":
        assert d.expert_counts[-1] == T * k and int(d.expert_counts[:-1].sum()) == 0
    if case == "all_dropped":
        assert int(d.expert_offsets[-1]) == 0 and bool((d.token_row == -1).all())


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,D", [(0, 2, 8), (1, 1, 3), (33, 6, 72), (5, 8, 1024)])
def test_combine_matches_reference(gen, in_dtype, w_dtype, out_dtype, T, k, D):
    rows = T * k + 5
    expert_out = random_x(gen, rows, D, in_dtype)
    token_row = torch.randperm(rows, generator=gen)[: T * k].view(T, k).to(torch.int32)
    token_row[torch.rand(T, k, generator=gen) < 0.15] = -1
    w = torch.rand(T, k, generator=gen).to(w_dtype)
    out = torch.full((T, D), float("nan"), dtype=out_dtype)
    got = moe_combine(expert_out, token_row, w, out_dtype=out_dtype, out=out)
    assert got is out
    ref = moe_combine_ref(expert_out, token_row, w)
    assert_close_to_ref(got, ref, tol=1e-6 if out_dtype == torch.float32 else 8e-3)


def test_dispatch_expert_combine_round_trip_is_batch_invariant(gen):
    """Each token's combined output is bit-identical whether it is routed alone or in a batch:
    the per-token sum runs in slot order and never depends on other tokens."""
    T, k, E, D = 40, 6, 16, 64
    x = random_x(gen, T, D, torch.float32)
    ids = random_ids(gen, T, k, E)
    w = torch.rand(T, k, generator=gen)
    scale = torch.randn(E, generator=gen)

    def run(xs, ids_, w_):
        d = moe_dispatch(xs, ids_, E, tile=8)
        expert_of_row = torch.bucketize(torch.arange(d.sorted_x.shape[0]), d.expert_offsets[1:].long(),
                                        right=True).clamp(max=E - 1)
        expert_out = d.sorted_x * scale[expert_of_row][:, None]  # a different map per expert
        return moe_combine(expert_out, d.token_row, w_)

    full = run(x, ids, w)
    for t in (0, 17, T - 1):
        alone = run(x[t : t + 1], ids[t : t + 1], w[t : t + 1])
        assert torch.equal(alone[0], full[t])
    ref = (w * scale[ids.long()]).sum(1, dtype=torch.float64)[:, None] * x.double()
    assert_close_to_ref(full, ref, tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 40), k=st.integers(1, 8), E=st.integers(1, 40), tile=st.integers(1, 16),
       drop=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2**31 - 1))
def test_dispatch_properties(T, k, E, tile, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    x = random_x(gen, T, 8, torch.float32)
    ids = random_ids(gen, T, k, E, drop=drop)
    d = moe_dispatch(x, ids, E, tile=tile)
    offs, counts = d.expert_offsets.long(), d.expert_counts.long()
    assert bool((offs % tile == 0).all()) and bool((offs[1:] - offs[:-1] >= counts).all())
    assert int(counts.sum()) == int((ids >= 0).sum())
    # every routed (token, slot) has exactly one row, inside its expert's segment, holding it
    valid = ids >= 0
    rows = d.token_row[valid].long()
    assert rows.unique().numel() == rows.numel()
    e = ids[valid].long()
    assert bool((rows >= offs[e]).all()) and bool((rows < offs[e] + counts[e]).all())
    tok = torch.arange(T)[:, None].expand(T, k)[valid]
    assert torch.equal(d.row_token[rows].long(), tok)
    assert torch.equal(d.sorted_x[rows], x[tok])


# --- bad input -----------------------------------------------------------------------------

def test_dispatch_rejects_bad_input(gen):
    x = random_x(gen, 4, 8, torch.float32)
    ids = random_ids(gen, 4, 2, 3)
    with pytest.raises(TypeError, match="x must have dtype"):
        moe_dispatch(x.double(), ids, 3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        moe_dispatch(x.numpy(), ids, 3)
    with pytest.raises(ValueError, match="x must be 2-D"):
        moe_dispatch(x[None], ids, 3)
    with pytest.raises(TypeError, match="topk_ids must have dtype"):
        moe_dispatch(x, ids.float(), 3)
    with pytest.raises(ValueError, match="topk_ids must have shape"):
        moe_dispatch(x, ids[:3], 3)
    with pytest.raises(ValueError, match="topk_ids values must be in"):
        moe_dispatch(x, ids + 5, 3)
    with pytest.raises(ValueError, match="topk_ids values must be in"):
        moe_dispatch(x, ids - 3, 3)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        moe_dispatch(x, ids, 0)
    with pytest.raises(TypeError, match="tile must be an int"):
        moe_dispatch(x, ids, 3, tile=2.0)
    with pytest.raises(ValueError, match="x must be contiguous"):
        moe_dispatch(torch.randn(8, 4, generator=gen).t(), ids.repeat(2, 1), 3)
    with pytest.raises(ValueError, match="topk_ids must be on"):
        moe_dispatch(x, ids.to("meta"), 3)
    with pytest.raises(ValueError, match="out.sorted_x must have shape"):
        bad = poisoned_dispatch(x, 4, 2, 3, 1)
        moe_dispatch(x, ids, 3, tile=2, out=bad)


def test_dispatch_refuses_outputs_over_its_inputs(gen):
    """Every output of a preallocated MoeDispatch must stay clear of x and topk_ids: the kernel
    reads the ids after it has begun writing row_token (a row_token over topk_ids gave a
    dispatch of all -1 rows, silently); only sorted_x was checked."""
    T, k, E = 6, 2, 4
    x = random_x(gen, T, 8, torch.float32)
    ids = random_ids(gen, T, k, E)
    good = moe_dispatch(x, ids, E)
    cap = good.row_token.numel()
    for name in ("row_token", "token_row", "expert_counts", "expert_offsets"):
        buf = torch.empty(cap + T * k + 8, dtype=torch.int32)
        shared = buf[: T * k].view(T, k)
        shared.copy_(ids)
        out = poisoned_dispatch(x, T, k, E, 1)
        n = getattr(out, name).numel()
        out = MoeDispatch(**{**out.__dict__, name: buf[1:1 + n].view(getattr(out, name).shape)})
        with pytest.raises(ValueError, match=f"output out.{name} must not alias input topk_ids"):
            moe_dispatch(x, shared, E, out=out)
        assert torch.equal(shared, ids)
    fbuf = torch.empty(cap * 8 + T * 8, dtype=torch.float32)
    out = MoeDispatch(**{**poisoned_dispatch(x, T, k, E, 1).__dict__,
                         "row_token": fbuf[:cap].view(torch.int32)})
    with pytest.raises(ValueError, match="output out.row_token must not alias input x"):
        moe_dispatch(fbuf[cap // 2: cap // 2 + T * 8].view(T, 8), ids, E, out=out)
    out = poisoned_dispatch(x, T, k, E, 1)  # separate buffers: still the reference's result
    assert_dispatch_matches(moe_dispatch(x, ids, E, out=out), x, ids, E, 1)


def test_combine_rejects_bad_input(gen):
    eo = random_x(gen, 10, 8, torch.float32)
    rows = torch.randint(0, 10, (4, 2), generator=gen, dtype=torch.int32)
    w = torch.rand(4, 2, generator=gen)
    with pytest.raises(TypeError, match="expert_out must have dtype"):
        moe_combine(eo.double(), rows, w)
    with pytest.raises(TypeError, match="token_row must have dtype"):
        moe_combine(eo, rows.long(), w)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        moe_combine(eo, rows, w[:, :1])
    with pytest.raises(ValueError, match="token_row values must be in"):
        moe_combine(eo, rows + 10, w)
    with pytest.raises(TypeError, match="out_dtype must be"):
        moe_combine(eo, rows, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="output out must not alias input expert_out"):
        moe_combine(eo, rows, w, out=eo[:4])
    with pytest.raises(ValueError, match="topk_weights must be on"):
        moe_combine(eo, rows, w.to("meta"))


@pytest.mark.parametrize("routed", [False, True])
def test_combine_refuses_out_over_its_rows(gen, routed):
    """out must stay clear of token_row / topk_ids too: the kernel reads a token's rows while
    other tokens' outputs are written (an out over token_row turned later tokens' row indices
    into float bits: wrong sums, or an internal check failure). Apart, it is the reference."""
    T, k, D = 8, 2, 8
    eo = random_x(gen, T * k, D, torch.float32)
    w = torch.rand(T, k, generator=gen)
    if routed:
        rows = random_ids(gen, T, k, 5, drop=0.3)
        kw = dict(token_row=None, topk_ids=None)
    else:
        rows = torch.randint(-1, T * k, (T, k), generator=gen, dtype=torch.int32)
        kw = dict(token_row=None)
    buf = torch.empty(T * D, dtype=torch.float32)
    shared = buf.view(torch.int32)[: T * k].view(T, k)
    shared.copy_(rows)
    kw["topk_ids" if routed else "token_row"] = shared
    name = "topk_ids" if routed else "token_row"
    with pytest.raises(ValueError, match=f"output out must not alias input {name}"):
        moe_combine(eo, topk_weights=w, out=buf.view(T, D), **kw)
    assert torch.equal(shared, rows)
    kw[name] = rows
    got = moe_combine(eo, topk_weights=w, out=torch.empty(T, D), **kw)
    ref = moe_combine_ref(eo, kw["token_row"], w, topk_ids=kw.get("topk_ids"))
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


# --- GPU: the CUDA kernels against the CPU twin and the reference --------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("T,k,E,tile,D", [
    (0, 2, 4, 1, 16), (1, 6, 256, 128, 4096), (33, 6, 256, 64, 4096), (2048, 6, 256, 128, 512),
    (500, 8, 7, 1, 13), (4096, 6, 64, 16, 256),
])
def test_cuda_dispatch_matches_reference(gen, dtype, T, k, E, tile, D):
    x = random_x(gen, T, D, dtype)
    ids = random_ids(gen, T, k, E, drop=0.05)
    out = poisoned_dispatch(x, T, k, E, tile, device="cuda")
    d = moe_dispatch(x.cuda(), ids.cuda(), E, tile=tile, out=out)
    torch.cuda.synchronize()
    assert_dispatch_matches(d, x, ids, E, tile)


@pytest.mark.gpu
def test_cuda_dispatch_skewed_and_deterministic(gen):
    T, k, E, D = 4096, 6, 256, 256
    x = random_x(gen, T, D, torch.bfloat16).cuda()
    ids = random_ids(gen, T, k, E, skew=True).cuda()
    a = moe_dispatch(x, ids, E, tile=64, out=poisoned_dispatch(x, T, k, E, 64, device="cuda"))
    b = moe_dispatch(x, ids, E, tile=64)
    used = a.row_token >= 0  # padding rows are unwritten, so compare the rows in use
    assert torch.equal(a.token_row, b.token_row) and torch.equal(a.row_token, b.row_token)
    assert torch.equal(a.sorted_x[used], b.sorted_x[used])
    assert_dispatch_matches(a, x.cpu(), ids.cpu(), E, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,D", [(0, 2, 8), (1, 6, 4096), (300, 6, 4096), (77, 3, 100)])
def test_cuda_combine_matches_cpu(gen, in_dtype, out_dtype, T, k, D):
    rows = T * k + 3
    eo = random_x(gen, rows, D, in_dtype)
    token_row = torch.randperm(rows, generator=gen)[: T * k].view(T, k).to(torch.int32)
    token_row[torch.rand(T, k, generator=gen) < 0.1] = -1
    w = torch.rand(T, k, generator=gen)
    out = torch.full((T, D), float("nan"), dtype=out_dtype, device="cuda")
    got = moe_combine(eo.cuda(), token_row.cuda(), w.cuda(), out_dtype=out_dtype, out=out).cpu()
    cpu = moe_combine(eo, token_row, w, out_dtype=out_dtype)
    ref = moe_combine_ref(eo, token_row, w)
    tol = 1e-6 if out_dtype == torch.float32 else 8e-3
    assert_close_to_ref(got, ref, tol=tol)
    assert_close_to_ref(got, cpu, tol=tol, name="CUDA vs CPU twin")


# The CUDA dispatch runs ONE cooperative kernel (routing + copy, G = min(T, #SMs) blocks) when
# its tables fit in shared memory, else count / scan / place + gather;
# ZEROINFER_DISPATCH_FUSED=0 forces the latter. Every case runs on both paths. The fused kernel's
# branches the shapes below reach (comments assume 132 SMs): one block (no count table, no grid
# barrier), the int32 count table read in batches of 8 rows a thread (E = 256: 16-17 rows, the
# last batch partial), and copy ranges that start and end inside a token (split points inside a
# token are multiples of 32 vectors, so that needs rows of 32+ vectors: the vector-width and
# skewed tests).
PATHS = ["fused", "fallback"]


def set_path(monkeypatch, path):
    monkeypatch.setenv("ZEROINFER_DISPATCH_FUSED", "1" if path == "fused" else "0")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,k,E,tile,drop", [
    (2048, 8, 256, 64, 0.0),    # more tokens than SMs, uneven split over the blocks
    (2731, 6, 256, 64, 0.05),
    (1, 6, 256, 64, 0.0),       # one block
    (5, 4, 1000, 8, 0.0),       # fewer tokens than SMs; 2 experts per thread in the scan
    (3000, 6, 256, 128, 0.3),   # big tile, many dropped slots
    (700, 6, 768, 16, 0.0),
    (200, 6, 701, 16, 0.0),     # E not a multiple of 4 (padded count table)
    (50, 6, 2500, 8, 0.1),      # 625 int4 columns > 512 threads: one block group; >48 KB smem
    (5, 4, 3000, 8, 0.0),       # tables too large for the fused kernel: fallback either way
    (4000, 6, 64, 16, 1.0),     # everything dropped
    (1500, 1, 3, 1, 0.0),       # k = 1, tile = 1, few experts
    (203, 6, 256, 64, 0.05),    # 1-2 tokens per block: each also ranks the next block's first
    (4224, 8, 256, 64, 0.0),    # 32 x 8 = 256 entries per block; 16-17 table rows a thread
    (6000, 8, 128, 16, 0.1),    # 45-46 x 8 entries per block; E = 128: 8-9 table rows a thread
])
def test_cuda_dispatch_routing_paths(gen, monkeypatch, path, ids_dtype, T, k, E, tile, drop):
    set_path(monkeypatch, path)
    D = 24
    x = random_x(gen, T, D, torch.bfloat16)
    ids = random_ids(gen, T, k, E, drop=drop, ids_dtype=ids_dtype)
    out = poisoned_dispatch(x, T, k, E, tile, device="cuda")
    d = moe_dispatch(x.cuda(), ids.cuda(), E, tile=tile, out=out)
    torch.cuda.synchronize()
    assert_dispatch_matches(d, x, ids, E, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
# 300: 2-3 tokens of 65 vectors per block, copy ranges split tokens; 5544 = 132 x 42 tokens: 252
# entries of one expert per block, that expert's total 33264
@pytest.mark.parametrize("T", [0, 1, 300, 5544])
def test_cuda_dispatch_skewed_paths(gen, monkeypatch, path, T):
    set_path(monkeypatch, path)
    k, E, tile, D = 6, 256, 64, 520
    x = random_x(gen, T, D, torch.bfloat16)
    ids = random_ids(gen, T, k, E, skew=True)
    d = moe_dispatch(x.cuda(), ids.cuda(), E, tile=tile,
                     out=poisoned_dispatch(x, T, k, E, tile, device="cuda"))
    torch.cuda.synchronize()
    assert_dispatch_matches(d, x, ids, E, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,D,offset", [
    (torch.bfloat16, 8, 0),         # 16-byte vectors
    (torch.bfloat16, 4, 0),         # 8-byte
    (torch.bfloat16, 2, 0),         # 4-byte
    (torch.bfloat16, 1, 0),         # 2-byte
    (torch.float8_e4m3fn, 13, 0),   # 1-byte
    (torch.float32, 4096, 1),       # x 4 bytes off 16-byte alignment: 4-byte vectors
    (torch.bfloat16, 4104, 0),      # 513 vectors of 16 B: a second, 1-vector gather piece
    (torch.bfloat16, 7168, 0),      # V4 hidden size: 2 pieces
    (torch.float8_e4m3fn, 4097, 0),  # 1-byte vectors, 4097 per row: several copy batches
])
@pytest.mark.parametrize("T", [37, 203])  # one token per block; copy ranges that split tokens
def test_cuda_dispatch_gather_vector_widths(gen, monkeypatch, path, dtype, D, offset, T):
    set_path(monkeypatch, path)
    k, E, tile = 6, 16, 8
    base = random_x(gen, T * D + offset, 1, dtype).view(-1)
    x = base[offset:].view(T, D)
    ids = random_ids(gen, T, k, E, drop=0.1)
    xc = base.cuda()[offset:].view(T, D)
    d = moe_dispatch(xc, ids.cuda(), E, tile=tile, out=poisoned_dispatch(x, T, k, E, tile, "cuda"))
    torch.cuda.synchronize()
    assert_dispatch_matches(d, x, ids, E, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,D,out_offset", [
    (50, 9, 4096, 0),    # three groups of expert-row loads, several row pieces
    (20, 5, 1032, 0),    # a partial last row piece
    (31, 6, 256, 1),     # out misaligned: the scalar path
    (8, 1, 8, 0),
])
def test_cuda_combine_paths(gen, in_dtype, out_dtype, T, k, D, out_offset):
    rows = T * k + 3
    eo = random_x(gen, rows, D, in_dtype)
    token_row = torch.randperm(rows, generator=gen)[: T * k].view(T, k).to(torch.int32)
    token_row[torch.rand(T, k, generator=gen) < 0.2] = -1
    w = torch.rand(T, k, generator=gen).to(torch.bfloat16)
    buf = torch.full((T * D + out_offset,), float("nan"), dtype=out_dtype, device="cuda")
    out = buf[out_offset:].view(T, D)
    got = moe_combine(eo.cuda(), token_row.cuda(), w.cuda(), out_dtype=out_dtype, out=out).cpu()
    tol = 1e-6 if out_dtype == torch.float32 else 8e-3
    assert_close_to_ref(got, moe_combine_ref(eo, token_row, w), tol=tol)


@pytest.mark.gpu
def test_cuda_round_trip_is_batch_invariant(gen):
    """On the GPU too: a token's combined row is bit-identical alone (one block) or in a batch
    of 3000 (every SM)."""
    T, k, E, D = 3000, 6, 64, 512
    x = random_x(gen, T, D, torch.bfloat16).cuda()
    ids = random_ids(gen, T, k, E).cuda()
    w = torch.rand(T, k, generator=gen).cuda()

    def run(xs, ids_, w_):
        d = moe_dispatch(xs, ids_, E, tile=64)
        return moe_combine(d.sorted_x, d.token_row, w_)

    full = run(x, ids, w)
    for t in (0, 1234, T - 1):
        assert torch.equal(run(x[t : t + 1], ids[t : t + 1], w[t : t + 1])[0], full[t])


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_cuda_dispatch_in_cuda_graph(gen, monkeypatch, path):
    """The fused path is a cooperative launch: it must capture into a CUDA graph and replay
    (new ids and x copied into the captured inputs) to the reference result."""
    set_path(monkeypatch, path)
    T, k, E, tile, D = 700, 6, 256, 64, 256
    x = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    ids = torch.empty(T, k, dtype=torch.int32, device="cuda")
    out = poisoned_dispatch(x, T, k, E, tile, device="cuda")
    x.copy_(random_x(gen, T, D, torch.bfloat16))
    ids.copy_(random_ids(gen, T, k, E))
    moe_dispatch(x, ids, E, tile=tile, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_dispatch(x, ids, E, tile=tile, out=out)
    for _ in range(2):
        xs, ids_s = random_x(gen, T, D, torch.bfloat16), random_ids(gen, T, k, E, drop=0.1)
        x.copy_(xs)
        ids.copy_(ids_s)
        out.sorted_x.view(torch.uint8).fill_(0x7F)
        out.row_token.fill_(POISON_ROW)
        graph.replay()
        torch.cuda.synchronize()
        assert_dispatch_matches(out, xs, ids_s, E, tile)
