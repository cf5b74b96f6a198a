"""Benchmark moe_route (V4's router after its linear layer: sqrtsoftplus scores, top-k with the
selection bias, renormalised weights; one launch) against the torch form it replaced in the
model (~12 calls), at V4-Flash's router shape: 256 experts, top-6, routed scaling 1.5, bf16
logits on CUDA (float32 on CPU), 1-4096 tokens.

  python bench/bench_moe_route.py                 # CPU twin vs torch (CPU)
  python bench/bench_moe_route.py --device cuda   # CUDA kernel vs torch (CUDA)

Launch-bound at decode; `bytes` the logits read and the ids / weights written. Timed as the
other op benchmarks (`time_us` eager with the L2 flushed, `graph_us` its graph replay,
`kernel_us` its own device work).
"""

from __future__ import annotations

import torch

from zeroinfer.ops import moe_route
from zeroinfer.testing import bench
from zeroinfer.testing.torch_forms import torch_moe_route

EXPERTS, TOPK, SCALE = 256, 6, 1.5


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in (1, 8, 64, 512, 4096):
        logits = (torch.randn(tokens, EXPERTS, generator=gen) * 2).to(dev, dtype)
        bias = (torch.randn(EXPERTS, generator=gen) * 0.5).to(dev)
        ids, w = moe_route(logits, TOPK, scale=SCALE, bias=bias)
        # A fast wrong kernel must not post a number: the torch form's experts and weights
        # (its top-k is unsorted: both by expert id) to rounding first.
        t_ids, t_w = torch_moe_route(logits, TOPK, SCALE, bias)
        a, b = torch.sort(ids, dim=1), torch.sort(t_ids, dim=1)
        assert torch.equal(a.values, b.values)
        torch.testing.assert_close(w.gather(1, a.indices), t_w.gather(1, b.indices),
                                   atol=1e-6, rtol=8e-3)
        out = (torch.empty_like(ids), torch.empty_like(w))
        row = bench.small_op_row(
            lambda: moe_route(logits, TOPK, scale=SCALE, bias=bias),
            lambda: moe_route(logits, TOPK, scale=SCALE, bias=bias, out=out),
            lambda: torch_moe_route(logits, TOPK, SCALE, bias),
            bytes_moved=logits.numel() * logits.element_size() + EXPERTS * 4 + tokens * TOPK * 8,
            ceilings=ceilings, cuda=cuda)
        rows.append({"tokens": tokens, "experts": EXPERTS, "k": TOPK,
                     "dtype": str(dtype).split(".")[1], **row})
    bench.report_small_ops("moe_route", rows, ["tokens"], args=args, ceilings=ceilings)


if __name__ == "__main__":
    main()
