"""indexer_scores against its float64 reference, its invariants (rows independent of the batch,
the scale exact, -inf past what a token sees) and its argument checks; on a GPU, the CPU twin's
bits."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import indexer_scores, indexer_scores_ref


def make_case(gen, *, tokens, heads, dim, block, seqs, key_dtype=torch.float32,
              index_dtype=torch.int64, spare_blocks=3):
    """A paged key cache with the blocks of `seqs` sequences scattered over it (unused table
    entries -1), queries of random sequences each seeing a random prefix of its entries."""
    max_blocks = int(torch.randint(1, 6, (1,), generator=gen))
    n_blocks = seqs * max_blocks + spare_blocks
    keys = torch.randn(n_blocks, block, dim, generator=gen).to(key_dtype)
    table = torch.randperm(n_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks)
    entries = torch.randint(0, max_blocks * block + 1, (seqs,), generator=gen)
    for b in range(seqs):  # blocks past a sequence's entries are not allocated
        table[b, (int(entries[b]) + block - 1) // block:] = -1
    seq = torch.randint(0, seqs, (tokens,), generator=gen)
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
    args, scale = make_case(gen, tokens=8, heads=4, dim=32, block=4, seqs=3)
    t = 0  # sees all of its sequence's entries
    b, v = int(args["seq_of_token"][t]), int(args["visible"][t])
    if v == 0:
        pytest.skip("drew an empty sequence")  # (the seeded draw does not)
    args["block_table"][b, 0] = -1
    got = indexer_scores(**args, scale=scale)
    assert got[t, : min(v, 4)].isnan().all() and not got[t, 4:v].isnan().any()
    args["seq_of_token"][t] = 3
    with pytest.raises(ValueError, match=r"seq_of_token must index block_table's 3 rows"):
        indexer_scores(**args, scale=scale)


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
        (dict(block_table=tab.t()), ValueError, "block_table must be contiguous"),
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


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES + [(5, 64, 128, 64, 2), (3, 64, 128, 256, 3)])
def test_cuda_gives_the_cpu_bits(gen, key_dtype, index_dtype, shape):
    tokens, heads, dim, block, seqs = shape
    args, scale = make_case(gen, tokens=tokens, heads=heads, dim=dim, block=block, seqs=seqs,
                            key_dtype=key_dtype, index_dtype=index_dtype)
    cpu = indexer_scores(**args, scale=scale)
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    got = indexer_scores(**dev, scale=scale, out=poisoned(args, "cuda"))
    assert got.is_cuda
    assert torch.equal(got.cpu(), cpu)


@pytest.mark.gpu
def test_cuda_unmapped_blocks_and_bad_sequences_give_nan(gen):
    args, scale = make_case(gen, tokens=8, heads=4, dim=32, block=4, seqs=3)
    v = int(args["visible"][0])
    args["block_table"][int(args["seq_of_token"][0]), 0] = -1
    args["seq_of_token"][1] = 7
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    got = indexer_scores(**dev, scale=scale).cpu()
    assert got[0, : min(v, 4)].isnan().all() and not got[0, 4:v].isnan().any()
    v1 = min(max(int(args["visible"][1]), 0), args["num_entries"])
    assert got[1, :v1].isnan().all() and got[1, v1:].isneginf().all()
