"""The indexer's top-k (attention.top_entries, and select_top: a selection over
order-preserving int64 keys, which it uses on the CPU and for large CUDA calls) against its
definition, a stable descending sort's first k: the same indices in the
same order, ties by the lower index, on rows full of ties (ReLU scores are often exactly 0),
-0 beside +0, and -inf past what a query sees; rows long enough for torch.topk's multi-block
selection on CUDA (70000)."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.model.attention import TOPK_SELECT_MIN_CUDA, select_top, top_entries


def tie_heavy_scores(gen, rows, n):
    """Scores on a coarse grid (many exact ties), a third exactly 0 of either sign, the rest of
    each row past a random visible count -inf, some rows all -inf."""
    s = (torch.randn(rows, n, generator=gen) * 4).round() / 4
    zero = torch.rand(rows, n, generator=gen) < 0.33
    sign = torch.where(torch.rand(rows, n, generator=gen) < 0.5, -1.0, 1.0)
    s = torch.where(zero, 0.0 * sign, s)
    visible = torch.randint(0, n + 1, (rows, 1), generator=gen)
    visible[0] = 0
    return torch.where(torch.arange(n) < visible, s, float("-inf"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows,n,k", [(7, 1, 1), (5, 37, 9), (16, 640, 64), (3, 5000, 512),
                                      (4, 300, 300), (2, 0, 0), (2, 70000, 512)])
def test_top_entries_is_a_stable_sorts_first_k(gen, device, rows, n, k):
    scores = tie_heavy_scores(gen, rows, n).to(device)
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    for form in (top_entries, select_top):
        got = form(scores, k)
        assert got.dtype == torch.int64 and got.shape == (rows, k)
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_large_cuda_calls_select(gen):
    """Past TOPK_SELECT_MIN_CUDA scores a CUDA call takes the selection: the same indices."""
    rows = TOPK_SELECT_MIN_CUDA // 32768 + 1
    scores = tie_heavy_scores(gen, rows, 32768).cuda()
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :512]
    assert torch.equal(top_entries(scores, 512), want)


def test_top_entries_ranks_minus_zero_with_plus_zero(gen):
    scores = torch.tensor([[0.0, -0.0, 0.0, -0.0, -1.0, 2.0]])
    assert select_top(scores, 6).tolist() == [[5, 0, 1, 2, 3, 4]]
