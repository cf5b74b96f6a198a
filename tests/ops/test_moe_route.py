"""moe_route against HF's torch form (the reference), its tie order, batch invariance and
argument checks; on a GPU, the CPU twin's choices."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.ops import moe_route, moe_route_ref

# (tokens, experts, k): the CUDA kernel's four lane widths (2, 4, 8, 16 experts a lane) among them
SHAPES = [(1, 8, 1), (37, 64, 6), (11, 100, 8), (5, 256, 6), (9, 300, 16), (3, 6, 6)]


def poisoned(tokens, k, device="cpu"):
    return (torch.full((tokens, k), -7, dtype=torch.int32, device=device),
            torch.full((tokens, k), float("nan"), device=device))


def tol(dtype):  # one rounding of the logits' dtype apart at most (exp / log1p, the sum order)
    return dict(atol=1e-7, rtol=2e-6) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_learned_routing_matches_reference(gen, dtype, shape):
    T, E, k = shape
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.5
    ids, w = moe_route(logits, k, scale=1.5, bias=bias, out=poisoned(T, k))
    ref_ids, ref_w = moe_route_ref(logits, k, scale=1.5, bias=bias)
    assert torch.equal(ids.long(), ref_ids)  # (random logits: no ties)
    torch.testing.assert_close(w.double(), ref_w, **tol(dtype))
    torch.testing.assert_close(w.double().sum(1), torch.full((T,), 1.5, dtype=torch.float64),
                               atol=0, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_routing_matches_reference(gen, dtype):
    T, E, k, V = 23, 64, 6, 50
    logits = torch.randn(T, E, generator=gen).to(dtype)
    table = torch.randint(0, E, (V, k), generator=gen)
    table[3] = table[3, 0]  # a row naming one expert k times (HF sums their weights)
    input_ids = torch.randint(0, V, (T,), generator=gen)
    input_ids[0] = 3
    ids, w = moe_route(logits, k, scale=2.5, hash_table=table, input_ids=input_ids,
                       out=poisoned(T, k))
    ref_ids, ref_w = moe_route_ref(logits, k, scale=2.5, hash_table=table, input_ids=input_ids)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w.double(), ref_w, **tol(dtype))


def test_ties_go_to_the_lower_expert_in_descending_order(gen):
    """Keys that tie exactly (logits on a coarse grid, no bias spread): the chosen experts are the
    k largest keys, descending, equal keys by expert index - a stable descending sort."""
    T, E, k = 16, 64, 6
    logits = torch.randint(-2, 3, (T, E), generator=gen).float()
    bias = torch.zeros(E)
    ids, _ = moe_route(logits, k, scale=1.0, bias=bias)
    keys = torch.nn.functional.softplus(logits).sqrt() + bias
    want = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids.long(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(gen, dtype):
    logits = torch.randn(41, 256, generator=gen).to(dtype)
    bias = torch.randn(256, generator=gen) * 0.1
    full = moe_route(logits, 6, scale=1.5, bias=bias)
    for lo, hi in ((0, 1), (7, 8), (3, 30), (40, 41)):
        part = moe_route(logits[lo:hi].contiguous(), 6, scale=1.5, bias=bias)
        assert torch.equal(part[0], full[0][lo:hi]) and torch.equal(part[1], full[1][lo:hi])


def test_argument_errors(gen):
    logits, bias = torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen)
    table, ids = torch.randint(0, 8, (10, 2), generator=gen), torch.tensor([1, 2, 3, 9])
    cases = [
        (dict(logits=logits.half(), k=2, bias=bias), TypeError, "logits must have dtype"),
        (dict(logits=torch.randn(4, 600), k=2, bias=torch.randn(600)), ValueError, "1..512"),
        (dict(logits=logits, k=0, bias=bias), ValueError, "k must be >= 1"),
        (dict(logits=logits, k=17, bias=bias), ValueError, "k must be <= 16"),
        (dict(logits=logits, k=9, bias=bias), ValueError, "k must be <= the number of experts"),
        (dict(logits=logits, k=2), ValueError, "exactly one of bias"),
        (dict(logits=logits, k=2, bias=bias, hash_table=table), ValueError, "exactly one of"),
        (dict(logits=logits, k=2, bias=bias.double()), TypeError, "bias must have dtype"),
        (dict(logits=logits, k=2, hash_table=table), ValueError, "needs input_ids"),
        (dict(logits=logits, k=3, hash_table=table, input_ids=ids), ValueError,
         "hash_table must have shape"),
        (dict(logits=logits, k=2, hash_table=table, input_ids=ids + 7), ValueError,
         r"input_ids must be in \[0, 10\)"),
        (dict(logits=logits, k=2, hash_table=table * 3, input_ids=ids), ValueError,
         r"expert ids in \[0, 8\)"),
        (dict(logits=logits.t(), k=2, bias=torch.randn(4)), ValueError, "contiguous"),
    ]
    for kw, exc, msg in cases:
        logits_, k = kw.pop("logits"), kw.pop("k")
        with pytest.raises(exc, match=msg):
            moe_route(logits_, k, scale=1.0, **kw)
    with pytest.raises(ValueError, match="out\\[1\\] \\(weights\\) must have shape"):
        moe_route(logits, 2, scale=1.0, bias=bias,
                  out=(torch.empty(4, 2, dtype=torch.int32), torch.empty(4, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 256, 6)])
def test_cuda_matches_the_cpu_twin(gen, dtype, shape):
    """The CUDA kernel chooses as the CPU twin, with the same weights to the last bit - except
    where exp / log1p's last float bit, which differs between the devices, moves a score across a
    rounding of its dtype (bf16: ~1 score in 30000). Those few tokens must still hold a valid
    choice: the top k, descending, with every key within that ulp. And each token's result does
    not depend on the batch."""
    T, E, k = shape
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.5
    ids, w = moe_route(logits.cuda(), k, scale=1.5, bias=bias.cuda(), out=poisoned(T, k, "cuda"))
    ids, w = ids.cpu(), w.cpu()
    cpu_ids, cpu_w = moe_route(logits, k, scale=1.5, bias=bias)
    same = (ids == cpu_ids).all(1)
    assert same.float().mean() >= 0.99
    torch.testing.assert_close(w[same], cpu_w[same], **tol(dtype))
    s = torch.nn.functional.softplus(logits.double()).sqrt()
    keys = s + bias.double()
    slack = 2 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-23) * float(s.max())
    for t in (~same).nonzero().flatten().tolist():
        chosen = ids[t].long()
        others = torch.ones(E, dtype=torch.bool)
        others[chosen] = False
        picked = keys[t, chosen]
        assert (picked[:-1] >= picked[1:] - slack).all()
        assert not others.any() or picked.min() >= keys[t, others].max() - slack
    assert ((ids >= 0) & (ids < E)).all() and torch.isfinite(w).all()
    part = moe_route(logits[T // 2:].cuda().contiguous(), k, scale=1.5, bias=bias.cuda())
    assert torch.equal(part[0].cpu(), ids[T // 2:]) and torch.equal(part[1].cpu(), w[T // 2:])


@pytest.mark.gpu
def test_cuda_ties_go_to_the_lower_expert(gen):
    """Exact ties (logits on a coarse grid: equal logits give equal scores on either device, and
    unequal ones are far apart): the CPU twin's choices, descending, ties to the lower expert."""
    logits = torch.randint(-2, 3, (64, 256), generator=gen).float()
    bias = torch.zeros(256)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        ids, _ = moe_route(x.cuda(), 6, scale=1.0, bias=bias.cuda())
        assert torch.equal(ids.cpu(), moe_route(x, 6, scale=1.0, bias=bias)[0])


@pytest.mark.gpu
def test_cuda_hash_routing_and_bad_ids(gen):
    T, E, k, V = 37, 64, 6, 50
    logits = torch.randn(T, E, generator=gen).bfloat16()
    table = torch.randint(0, E, (V, k), generator=gen)
    input_ids = torch.randint(0, V - 1, (T,), generator=gen)
    input_ids[2] = V - 1  # the one token of that row
    ids, w = moe_route(logits.cuda(), k, scale=1.5, hash_table=table.cuda(),
                       input_ids=input_ids.cuda(), out=poisoned(T, k, "cuda"))
    cpu_ids, cpu_w = moe_route(logits, k, scale=1.5, hash_table=table, input_ids=input_ids)
    assert torch.equal(ids.cpu(), cpu_ids)
    torch.testing.assert_close(w.cpu(), cpu_w, **tol(torch.bfloat16))
    # on CUDA nothing is checked on the host: a bad token id or table entry marks its token
    input_ids[1], table[V - 1, 0] = V + 4, E
    ids, w = moe_route(logits.cuda(), k, scale=1.5, hash_table=table.cuda(),
                       input_ids=input_ids.cuda())
    for t in (1, 2):
        assert (ids[t] == -1).all() and w[t].isnan().all()
    assert (ids[0] >= 0).all() and not w[0].isnan().any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_row_strided_logits_give_their_contiguous_copys_result(gen, device):
    """Logits a column slice of a wider matrix (the MoE's one GEMM): the same ids and weights as
    the slice made contiguous."""
    wide = torch.randn(19, 256 + 2048, generator=gen).to(device, torch.bfloat16)
    logits = wide[:, 64:64 + 256]
    bias = (torch.randn(256, generator=gen) * 0.5).to(device)
    got = moe_route(logits, 6, scale=1.5, bias=bias)
    want = moe_route(logits.contiguous(), 6, scale=1.5, bias=bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_nan_logits_rank_first_as_in_torch_topk(gen):
    """A NaN score ranks above every number (torch.topk's order), and poisons its token's
    weights, so a broken router output is loud rather than silently routed."""
    logits = torch.randn(4, 32, generator=gen)
    logits[1, 7] = float("nan")
    ids, w = moe_route(logits, 4, scale=1.0, bias=torch.zeros(32))
    assert int(ids[1, 0]) == 7 and w[1].isnan().all()
    assert not w[[0, 2, 3]].isnan().any()
    ref_ids, _ = moe_route_ref(logits, 4, scale=1.0, bias=torch.zeros(32))
    assert int(ref_ids[1, 0]) == 7
