"""indexer_scores against its float64 reference, its invariants (rows independent of the batch,
the scale exact, -inf past what a token sees) and its argument checks; on a GPU, the CPU twin's
bits."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import indexer_scores, indexer_scores_ref


def make_case(gen, *, tokens, heads, dim, block, seqs, key_dtype=torch.float32,
              index_dtype=torch.int64, spare_blocks=3, min_blocks=1):
    """A paged key cache with the blocks of `seqs` sequences scattered over it (unused table
    entries -1), queries of random sequences each seeing a random prefix of its entries."""
    max_blocks = int(torch.randint(min_blocks, 6, (1,), generator=gen))
    n_blocks = seqs * max_blocks + spare_blocks
    keys = torch.randn(n_blocks, block, dim, generator=gen).to(key_dtype)
    table = torch.randperm(n_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks)
    entries = torch.randint(0, max_blocks * block + 1, (seqs,), generator=gen)
    entries[0] = max_blocks * block  # one sequence full
    for b in range(seqs):  # blocks past a sequence's entries are not allocated
        table[b, (int(entries[b]) + block - 1) // block:] = -1
    seq = torch.randint(0, seqs, (tokens,), generator=gen)
    seq[0] = 0
    visible = (torch.rand(tokens, generator=gen) * (entries[seq] + 1)).long()
    visible = visible.clamp(max=entries[seq])
    visible[0] = entries[seq[0]]  # at least one token sees all of its sequence
    q = torch.randn(tokens, heads, dim, generator=gen)
    weights = torch.randn(tokens, heads, generator=gen)  # signed, as V4's are
    args = dict(q=q, weights=weights, keys=keys, block_table=table.int(),
                seq_of_token=seq.to(index_dtype), visible=visible.to(index_dtype),
                num_entries=int(entries.max()))
    return args, dim**-0.5


SHAPES = [  # tokens, heads, dim, block, seqs
    (1, 64, 128, 64, 1),
    (37, 8, 128, 4, 5),
    (9, 3, 40, 5, 3),    # channels and heads off every tile
    (20, 33, 65, 7, 4),  # more heads than a CUDA pass
]


def poisoned(args, device="cpu"):
    return torch.full((args["q"].shape[0], args["num_entries"]), float("nan"), device=device)


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(gen, key_dtype, index_dtype, shape):
    tokens, heads, dim, block, seqs = shape
    args, scale = make_case(gen, tokens=tokens, heads=heads, dim=dim, block=block, seqs=seqs,
                            key_dtype=key_dtype, index_dtype=index_dtype)
    got = indexer_scores(**args, scale=scale, out=poisoned(args))
    ref = indexer_scores_ref(**args, scale=scale)
    assert not got.isnan().any(), "unwritten (poisoned) elements"
    cols = torch.arange(args["num_entries"])[None, :]
    past = cols >= args["visible"].long()[:, None]
    assert torch.equal(got.isinf(), past) and (got[past] < 0).all()  # -inf exactly past visible
    assert got[~past].abs().max() > 0 if (~past).any() else True
    # float32 sums of heads x dim terms against float64: bound by the terms' magnitudes
    mag = (args["weights"].abs().sum(1, keepdim=True) * dim**0.5 * 4 * scale).expand_as(got)
    err = (got.double() - ref).abs()[~past]
    assert (err <= 1e-5 * mag[~past] + 1e-6).all(), float(err.max())


def test_rows_do_not_depend_on_the_batch(gen):
    """A token's scores are the same bits alone, in another batch, with its sequence at another
    table row and with more columns: the property the model's batch-invariant top-k rests on."""
    args, scale = make_case(gen, tokens=40, heads=16, dim=128, block=4, seqs=6)
    full = indexer_scores(**args, scale=scale)
    for t in (0, 7, 39):
        b = int(args["seq_of_token"][t])
        table = torch.cat([torch.full((2, args["block_table"].shape[1]), -1, dtype=torch.int32),
                           args["block_table"][b:b + 1]])
        one = indexer_scores(args["q"][t:t + 1], args["weights"][t:t + 1], args["keys"], table,
                             torch.tensor([2]), args["visible"][t:t + 1], args["num_entries"],
                             scale=scale)
        assert torch.equal(one, full[t:t + 1])
    sub = indexer_scores(**{**args, **{k: args[k][10:25] for k in
                                       ("q", "weights", "seq_of_token", "visible")}}, scale=scale)
    assert torch.equal(sub, full[10:25])


def test_scale_is_exact_and_zero_keys_score_zero(gen):
    args, scale = make_case(gen, tokens=12, heads=8, dim=64, block=8, seqs=2)
    one = indexer_scores(**args, scale=1.0)
    assert torch.equal(indexer_scores(**args, scale=0.25), one * 0.25)  # powers of two: exact
    args["keys"].zero_()
    zero = indexer_scores(**args, scale=scale)
    assert (zero[zero.isfinite()] == 0).all() and zero.isfinite().any()


def test_visible_is_clamped_to_the_columns(gen):
    args, scale = make_case(gen, tokens=6, heads=4, dim=32, block=4, seqs=2)
    n = args["num_entries"]
    seq = args["seq_of_token"]
    args["block_table"][:] = torch.arange(args["block_table"].numel()).view_as(
        args["block_table"]) % args["keys"].shape[0]  # every block mapped
    args["visible"] = torch.where(seq == 0, -3, n + 5)
    got = indexer_scores(**args, scale=scale)
    assert got[seq == 0].isneginf().all()
    assert got[seq != 0].isfinite().all()


def test_unmapped_blocks_give_nan_and_bad_sequences_raise(gen):
    args, scale = make_case(gen, tokens=8, heads=4, dim=32, block=4, seqs=3, min_blocks=2)
    t, b, v = 0, 0, int(args["visible"][0])  # token 0 sees all of sequence 0's >= 8 entries
    args["block_table"][b, 0] = -1
    got = indexer_scores(**args, scale=scale)
    assert got[t, : min(v, 4)].isnan().all() and not got[t, 4:v].isnan().any()
    args["seq_of_token"][t] = 3
    with pytest.raises(ValueError, match=r"seq_of_token must index block_table's 3 rows"):
        indexer_scores(**args, scale=scale)


def test_table_entries_past_the_cache_raise_and_unread_ones_do_not(gen):
    """The kernel does not know keys' block count: a table entry a token reads that is not a
    block of keys must be refused by name (it was read out of bounds); one no token reads (at or
    past its visible entries' blocks) is never looked at."""
    args, scale = make_case(gen, tokens=8, heads=4, dim=32, block=4, seqs=3, min_blocks=2)
    ref = indexer_scores_ref(**args, scale=scale)
    nb = args["keys"].shape[0]
    table, seq, vis = args["block_table"], args["seq_of_token"], args["visible"]
    blocks_read = torch.zeros(table.shape[0], dtype=torch.long)  # per sequence, by any token
    for t in range(seq.shape[0]):
        b = int(seq[t])
        blocks_read[b] = max(int(blocks_read[b]), (int(vis[t]) + 3) // 4)
    for b in range(table.shape[0]):  # unread entries: any value at all
        table[b, int(blocks_read[b]):] = nb + int(torch.randint(0, 1 << 20, (1,), generator=gen))
    got = indexer_scores(**args, scale=scale)
    cols = torch.arange(args["num_entries"])[None, :]
    seen = cols < vis[:, None]
    torch.testing.assert_close(got.double()[seen], ref[seen], rtol=1e-5, atol=1e-5)
    j = int(torch.randint(0, int(blocks_read[0]), (1,), generator=gen))  # token 0 reads these
    for bad in (nb, nb + 1000):
        table[0, j] = bad
        with pytest.raises(ValueError, match=rf"block_table\[0, {j}\] = {bad} .*< keys.shape\[0\]"):
            indexer_scores(**args, scale=scale)
    with pytest.raises(ValueError, match="must be a block of keys"):  # a cache without blocks
        indexer_scores(**(args | dict(keys=args["keys"][:0])), scale=scale)


def test_no_tokens_no_entries(gen):
    args, scale = make_case(gen, tokens=4, heads=4, dim=32, block=4, seqs=2)
    empty = {**args, **{k: args[k][:0] for k in ("q", "weights", "seq_of_token", "visible")}}
    assert indexer_scores(**empty, scale=scale).shape == (0, args["num_entries"])
    assert indexer_scores(**{**args, "num_entries": 0}, scale=scale).shape == (4, 0)


def test_bad_arguments_name_what_was_expected(gen):
    args, scale = make_case(gen, tokens=5, heads=4, dim=32, block=4, seqs=2)
    q, tab = args["q"], args["block_table"]
    cases = [
        (dict(q=q.bfloat16()), TypeError, "q must have dtype float32"),
        (dict(q=q[0]), ValueError, "q must be 3-D"),
        (dict(weights=args["weights"][:, :3]), ValueError, r"weights must have shape \[5, 4\]"),
        (dict(keys=args["keys"].half()), TypeError, "keys must have dtype float32 or bfloat16"),
        (dict(keys=args["keys"][..., :16]), ValueError, r"keys must have shape \[\*, \*, 32\]"),
        (dict(block_table=tab.long()), TypeError, "block_table must have dtype int32"),
        (dict(block_table=torch.cat([tab, tab])[::2]), ValueError,
         "block_table must be contiguous"),
        (dict(visible=args["visible"].int()), TypeError, "visible must have dtype int64"),
        (dict(seq_of_token=args["seq_of_token"][:4]), ValueError, r"seq_of_token must have shape"),
        (dict(num_entries=-1), ValueError, "num_entries must be >= 0"),
        (dict(num_entries=tab.shape[1] * 4 + 1), ValueError, "num_entries .* exceeds"),
    ]
    for change, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            indexer_scores(**(args | change), scale=scale)
    with pytest.raises(ValueError, match="scale must be finite"):
        indexer_scores(**args, scale=float("inf"))
    with pytest.raises(ValueError, match=r"out must have shape"):
        indexer_scores(**args, scale=scale, out=torch.empty(5, 1))


def to_cuda(args):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def tensor_cores(args):
    """Whether the CUDA op takes its tensor-core kernel for these arguments."""
    d = args["q"].shape[-1]
    return args["keys"].dtype == torch.bfloat16 and d % 16 == 0 and d <= 128


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES + [(5, 64, 128, 64, 2), (3, 64, 128, 256, 3)])
def test_cuda_core_kernel_gives_the_cpu_bits(gen, key_dtype, index_dtype, shape):
    """float32 keys, and bf16 keys whose d the tensor-core kernel does not take: the CUDA-core
    kernel, the contract's exact order."""
    tokens, heads, dim, block, seqs = shape
    args, scale = make_case(gen, tokens=tokens, heads=heads, dim=dim, block=block, seqs=seqs,
                            key_dtype=key_dtype, index_dtype=index_dtype)
    if tensor_cores(args):
        pytest.skip("the tensor-core kernel: test_cuda_tensor_cores_match_reference")
    cpu = indexer_scores(**args, scale=scale)
    got = indexer_scores(**to_cuda(args), scale=scale, out=poisoned(args, "cuda"))
    assert got.is_cuda
    assert torch.equal(got.cpu(), cpu)


TC_SHAPES = [  # tokens, heads, dim, block, seqs
    (1, 64, 128, 64, 1),
    (37, 8, 128, 4, 5),
    (6, 100, 128, 64, 3),  # two head groups, the second partial
    (9, 3, 48, 5, 3),
    (4, 64, 16, 16, 2),
    (3, 64, 128, 256, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("q_bf16_exact", [False, True])
@pytest.mark.parametrize("shape", TC_SHAPES)
def test_cuda_tensor_cores_match_reference(gen, q_bf16_exact, shape):
    """bf16 keys on tensor cores: float32 accuracy against float64 whether q is bf16-exact (one
    MMA, as the model's) or not (q split in two bf16 halves); -inf exactly past visible."""
    tokens, heads, dim, block, seqs = shape
    args, scale = make_case(gen, tokens=tokens, heads=heads, dim=dim, block=block, seqs=seqs,
                            key_dtype=torch.bfloat16)
    if q_bf16_exact:
        args["q"] = args["q"].bfloat16().float()
    assert tensor_cores(args)
    got = indexer_scores(**to_cuda(args), scale=scale, out=poisoned(args, "cuda")).cpu()
    ref = indexer_scores_ref(**args, scale=scale)
    assert not got.isnan().any(), "unwritten (poisoned) elements"
    past = torch.arange(args["num_entries"])[None, :] >= args["visible"][:, None]
    assert torch.equal(got.isinf(), past) and (got[past] < 0).all()
    mag = (args["weights"].abs().sum(1, keepdim=True) * dim**0.5 * 4 * scale).expand_as(got)
    err = (got.double() - ref).abs()[~past]
    assert (err <= 1e-5 * mag[~past] + 1e-6).all(), float(err.max())
    # and a q rounded to bf16 would not pass at this bound: the low half is used
    if not q_bf16_exact and (~past).sum() > 20:
        coarse = indexer_scores_ref(**{**args, "q": args["q"].bfloat16().float()}, scale=scale)
        assert ((coarse - ref).abs()[~past] > 1e-5 * mag[~past] + 1e-6).any()


@pytest.mark.gpu
def test_cuda_tensor_cores_long_rows_through_the_ring(gen):
    """Sequences of thousands of entries: each CTA streams several tiles through its ring (the
    launcher gives a CTA more tiles the more there are), the last partial; float32 accuracy
    against float64, and each token alone gives the same bits (one CTA, other tiles a CTA)."""
    args, scale = make_case(gen, tokens=16, heads=64, dim=128, block=4096, seqs=2,
                            key_dtype=torch.bfloat16, min_blocks=4)
    args["q"] = args["q"].bfloat16().float()
    args["seq_of_token"][1] = args["seq_of_token"][0]
    args["visible"][1] = args["visible"][0] - 77  # a partial last tile
    got = indexer_scores(**to_cuda(args), scale=scale, out=poisoned(args, "cuda")).cpu()
    ref = indexer_scores_ref(**args, scale=scale)
    past = torch.arange(args["num_entries"])[None, :] >= args["visible"][:, None]
    assert torch.equal(got.isinf(), past) and (got[past] < 0).all()
    mag = (args["weights"].abs().sum(1, keepdim=True) * 128**0.5 * 4 * scale).expand_as(got)
    err = (got.double() - ref).abs()[~past]
    assert (err <= 1e-5 * mag[~past] + 1e-6).all(), float(err.max())
    for t in (0, 1, 15):
        one = {**args, "q": args["q"][t:t + 1], "weights": args["weights"][t:t + 1],
               "seq_of_token": args["seq_of_token"][t:t + 1],
               "visible": args["visible"][t:t + 1]}
        assert torch.equal(indexer_scores(**to_cuda(one), scale=scale).cpu(), got[t:t + 1])


@pytest.mark.gpu
def test_cuda_tensor_core_rows_do_not_depend_on_the_batch(gen):
    """On tensor cores a token's scores are the same bits alone, in a larger batch (another
    grid: tiles a CTA), at another table row and with more columns."""
    args, scale = make_case(gen, tokens=60, heads=64, dim=128, block=64, seqs=7,
                            key_dtype=torch.bfloat16)
    args["q"][::2] = args["q"][::2].bfloat16().float()  # some tokens bf16-exact, some not
    full = indexer_scores(**to_cuda(args), scale=scale).cpu()
    wide = indexer_scores(**to_cuda({**args, "num_entries": args["block_table"].shape[1] * 64}),
                          scale=scale).cpu()
    assert torch.equal(wide[:, : args["num_entries"]], full)
    for t in (0, 1, 31, 59):
        b = int(args["seq_of_token"][t])
        table = torch.cat([torch.full((3, args["block_table"].shape[1]), -1, dtype=torch.int32),
                           args["block_table"][b:b + 1]])
        one = {"q": args["q"][t:t + 1], "weights": args["weights"][t:t + 1],
               "keys": args["keys"], "block_table": table, "seq_of_token": torch.tensor([3]),
               "visible": args["visible"][t:t + 1], "num_entries": args["num_entries"]}
        assert torch.equal(indexer_scores(**to_cuda(one), scale=scale).cpu(), full[t:t + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype,dim", [(torch.float32, 32), (torch.bfloat16, 32)])
def test_cuda_unmapped_blocks_and_bad_sequences_give_nan(gen, key_dtype, dim):
    args, scale = make_case(gen, tokens=8, heads=4, dim=dim, block=4, seqs=3, key_dtype=key_dtype)
    v = int(args["visible"][0])
    args["block_table"][int(args["seq_of_token"][0]), 0] = -1
    args["seq_of_token"][1] = 7
    got = indexer_scores(**to_cuda(args), scale=scale).cpu()
    assert got[0, : min(v, 4)].isnan().all() and not got[0, 4:v].isnan().any()
    v1 = min(max(int(args["visible"][1]), 0), args["num_entries"])
    assert got[1, :v1].isnan().all() and got[1, v1:].isneginf().all()
