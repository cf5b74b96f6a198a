"""Benchmark mhc_mixes (a hyper-connection's pre / post / Sinkhorn comb in one launch) against the
torch form it replaced in the model (a softmax and 2 * (iters - 1) + 1 normalisations, ~130
calls), at V4's shape: 4 streams, 20 Sinkhorn iterations.

  python bench/bench_mhc.py                 # CPU twin vs torch (CPU)
  python bench/bench_mhc.py --device cuda   # CUDA kernel vs torch (CUDA)

The op moves a few hundred bytes a token, so on a GPU it is bound by launch latency up to
thousands of tokens: what matters is one launch instead of ~130. Timed as the other op
benchmarks: `time_us` the eager call (L2 flushed before each), `graph_us` its CUDA-graph replay
with preallocated outputs, `kernel_us` the kernel's own device time (CUPTI); `bytes` the fewest
the op must move (z, scale, base read; pre, post, comb written).
"""

from __future__ import annotations

import torch

from zeroinfer.ops import MhcMixes, mhc_mixes
from zeroinfer.testing import bench

STREAMS, ITERS, EPS = 4, 20, 1e-6


def torch_mixes(z, scale, base, n=STREAMS, iters=ITERS, eps=EPS):
    """The model's torch form before mhc_mixes (python/zeroinfer/model/mhc.py at a83ed14)."""
    z_pre, z_post, z_comb = z.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(z_pre * scale[0] + b_pre) + eps
    post = 2 * torch.sigmoid(z_post * scale[1] + b_post)
    comb = torch.softmax(z_comb.view(-1, n, n) * scale[2] + b_comb.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def op_bytes(tokens, n=STREAMS):
    width = (2 + n) * n
    return 4 * (tokens * width + 3 + width + tokens * (2 * n + n * n))


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    width = (2 + STREAMS) * STREAMS
    kw = dict(streams=STREAMS, iters=ITERS, eps=EPS)
    rows = []
    for tokens in (1, 8, 64, 512, 4096):
        z = (torch.randn(tokens, width, generator=gen) * 3).to(dev)
        scale = (torch.rand(3, generator=gen) + 0.25).to(dev)
        base = torch.randn(width, generator=gen).to(dev)
        ours = mhc_mixes(z, scale, base, **kw)
        # A fast wrong kernel must not post a number: it agrees with the torch form first.
        for got, want in zip(ours, torch_mixes(z, scale, base)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        out = MhcMixes(*(torch.empty_like(t) for t in ours))
        call = lambda: mhc_mixes(z, scale, base, **kw)  # noqa: E731
        fill = lambda: mhc_mixes(z, scale, base, **kw, out=out)  # noqa: E731
        rows.append({"tokens": tokens, "streams": STREAMS, "iters": ITERS, **bench.small_op_row(
            call, fill, lambda: torch_mixes(z, scale, base), bytes_moved=op_bytes(tokens),
            ceilings=ceilings, cuda=cuda)})
    bench.print_table(rows, ["tokens", *bench.small_op_columns(cuda)])
    extra = {"ceilings": ceilings, "timing": bench.SMALL_OP_TIMING} if cuda else None
    path = bench.write_results("mhc", rows, device=dev, extra=extra, out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
