"""Benchmark the mHC ops against the torch forms they replaced in the model, at V4's shape (4
streams, 20 Sinkhorn iterations, hidden 4096): mhc_mixes (a hyper-connection's pre / post /
Sinkhorn comb in one launch; in torch a softmax and 2 * (iters - 1) + 1 normalisations, ~130
calls), mhc_collapse and mhc_mix (the streams into the block's input and the block's output back
into the streams; ~20 torch calls each). The streams are bf16 on CUDA, float32 on CPU (the
engine's dtypes there).

  python bench/bench_mhc.py                 # CPU twin vs torch (CPU)
  python bench/bench_mhc.py --device cuda   # CUDA kernel vs torch (CUDA)

mhc_mixes moves a few hundred bytes a token, so on a GPU it is bound by launch latency up to
thousands of tokens: what matters is one launch instead of ~130. The collapse and the mix move
~40-80 KB a token (bf16): launch-bound at decode, bandwidth-bound at prefill. Timed as the other op
benchmarks: `time_us` the eager call (L2 flushed before each), `graph_us` its CUDA-graph replay
with preallocated outputs, `kernel_us` the kernel's own device time (CUPTI); `bytes` the fewest
the op must move (mixes: z, scale, base read, pre, post, comb written; collapse: streams and pre
read, the input written; mix: streams, block output, post and comb read, new streams written).
"""

from __future__ import annotations

import torch

from zeroinfer.ops import MhcMixes, mhc_collapse, mhc_mix, mhc_mixes
from zeroinfer.testing import bench
from zeroinfer.testing.torch_forms import torch_collapse, torch_mix

STREAMS, ITERS, EPS, HIDDEN = 4, 20, 1e-6, 4096


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


def apply_rows(dev, dtype, ceilings, gen):
    """Rows of mhc_collapse and mhc_mix; each checked bitwise against its torch form first."""
    cuda = dev == "cuda"
    n, d, es = STREAMS, HIDDEN, torch.finfo(dtype).bits // 8
    rows = []
    for tokens in (1, 8, 64, 512, 4096) if cuda else (1, 8, 64, 512):
        streams = (torch.randn(tokens, n, d, generator=gen) * 2).to(dev, dtype)
        block = torch.randn(tokens, d, generator=gen).to(dev, dtype)
        z = (torch.randn(tokens, (2 + n) * n, generator=gen) * 3).to(dev)
        scale = (torch.rand(3, generator=gen) + 0.25).to(dev)
        base = torch.randn((2 + n) * n, generator=gen).to(dev)
        pre, post, comb = mhc_mixes(z, scale, base, streams=n, iters=ITERS, eps=EPS)
        assert torch.equal(mhc_collapse(pre, streams), torch_collapse(pre, streams))
        assert torch.equal(mhc_mix(streams, block, post, comb),
                           torch_mix(streams, block, post, comb))
        x_out, y_out = torch.empty_like(block), torch.empty_like(streams)
        common = {"tokens": tokens, "streams": n, "hidden": d, "dtype": str(dtype).split(".")[1]}
        rows.append({"op": "collapse", **common, **bench.small_op_row(
            lambda: mhc_collapse(pre, streams), lambda: mhc_collapse(pre, streams, out=x_out),
            lambda: torch_collapse(pre, streams),
            bytes_moved=tokens * (n * d * es + n * 4 + d * es), ceilings=ceilings, cuda=cuda)})
        rows.append({"op": "mix", **common, **bench.small_op_row(
            lambda: mhc_mix(streams, block, post, comb),
            lambda: mhc_mix(streams, block, post, comb, out=y_out),
            lambda: torch_mix(streams, block, post, comb),
            bytes_moved=tokens * (2 * n * d * es + d * es + (n + n * n) * 4), ceilings=ceilings,
            cuda=cuda)})
    return rows


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
        row = bench.small_op_row(call, fill, lambda: torch_mixes(z, scale, base),
                                 bytes_moved=op_bytes(tokens), ceilings=ceilings, cuda=cuda)
        rows.append({"op": "mixes", "tokens": tokens, "streams": STREAMS, "iters": ITERS, **row})
    rows += apply_rows(dev, torch.bfloat16 if cuda else torch.float32, ceilings, gen)
    bench.report_small_ops("mhc", rows, ["op", "tokens"], args=args, ceilings=ceilings)


if __name__ == "__main__":
    main()
