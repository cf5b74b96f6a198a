"""Benchmark the indexer's top-k selection (model.attention.select_top: torch.topk over
order-preserving int64 keys, ties by the lower entry) against the stable descending sort, at V4's
decode shapes: one query a sequence, 2k-32k compressed entries a sequence (CSA rate 4: 8k-128k
tokens of context), the top 512, float32 scores with many exact zeros (ReLU) and -inf past what
a query sees. Both give the same indices (asserted first). model.attention.top_entries takes
whichever is faster where (TOPK_SELECT_MIN_CUDA): this benchmark is what that choice rests on.

  python bench/bench_indexer_topk.py                 # CPU
  python bench/bench_indexer_topk.py --device cuda   # CUDA

Timed as the other op benchmarks (`time_us` eager, L2 flushed before each call; `graph_us` the
CUDA-graph replay; `kernel_us` the device work, CUPTI; `torch_us` the sort); `bytes` the scores
read and the indices written.
"""

from __future__ import annotations

import torch

from zeroinfer.model.attention import select_top
from zeroinfer.testing import bench

TOPK = 512


def scores_like_the_indexer(gen, rows, n):
    s = torch.relu(torch.randn(rows, n, generator=gen)) * torch.rand(rows, 1, generator=gen)
    visible = torch.randint(n // 2, n + 1, (rows, 1), generator=gen)
    return torch.where(torch.arange(n) < visible, s, float("-inf"))


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for queries in (1, 8, 32, 128) if cuda else (1, 8, 32):
        for n in (2048, 8192, 32768) if cuda else (2048, 8192):
            scores = scores_like_the_indexer(gen, queries, n).to(dev)
            sort = lambda: torch.sort(scores, dim=-1, descending=True,  # noqa: E731
                                      stable=True).indices[:, :TOPK]
            assert torch.equal(select_top(scores, TOPK), sort())
            row = bench.small_op_row(
                lambda: select_top(scores, TOPK), lambda: select_top(scores, TOPK), sort,
                bytes_moved=scores.numel() * 4 + queries * TOPK * 8, ceilings=ceilings,
                cuda=cuda)
            rows.append({"queries": queries, "entries": n, "k": TOPK, **row})
    bench.report_small_ops("indexer_topk", rows, ["queries", "entries"],
                           args=args, ceilings=ceilings)


if __name__ == "__main__":
    main()
