"""Benchmark rope_rotate (V4's RoPE on the last 64 of 512 channels, one launch) against the torch
form it replaced in the model (~12 calls a use), at V4-Flash's shapes: the queries [T, 64, 512]
and the K=V entries [T, 512]. bf16 on CUDA, float32 on CPU (the engine's dtypes there).

  python bench/bench_rope.py                 # CPU twin vs torch (CPU)
  python bench/bench_rope.py --device cuda   # CUDA kernel vs torch (CUDA)

Launch-bound at decode, a bandwidth-bound copy at prefill. Timed as the other op benchmarks:
`time_us` the eager call (L2 flushed before each), `graph_us` its CUDA-graph replay with a
preallocated output, `kernel_us` the kernel's own device time (CUPTI); `bytes` the fewest the op
must move (x read and written, cos and sin read).
"""

from __future__ import annotations

import torch

from zeroinfer.ops import rope_rotate
from zeroinfer.testing import bench
from zeroinfer.testing.torch_forms import torch_rope

HEADS, DIM, HALF = 64, 512, 32


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    es = torch.finfo(dtype).bits // 8
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in (1, 8, 64, 512, 4096) if cuda else (1, 8, 64, 512):
        pos = torch.randint(0, 1 << 16, (tokens,), generator=gen).float()
        freqs = pos[:, None] * (1e4 ** -(torch.arange(HALF) / HALF))[None, :]
        cos, sin = freqs.cos().to(dev, dtype), freqs.sin().to(dev, dtype)
        for what, shape in (("q", (tokens, HEADS, DIM)), ("kv", (tokens, DIM))):
            x = torch.randn(shape, generator=gen).to(dev, dtype)
            # A fast wrong kernel must not post a number: the torch form's bits first.
            assert torch.equal(rope_rotate(x, cos, sin), torch_rope(x, cos, sin))
            out = torch.empty_like(x)
            row = bench.small_op_row(
                lambda: rope_rotate(x, cos, sin), lambda: rope_rotate(x, cos, sin, out=out),
                lambda: torch_rope(x, cos, sin),
                bytes_moved=2 * x.numel() * es + 2 * cos.numel() * es, ceilings=ceilings,
                cuda=cuda)
            rows.append({"tensor": what, "shape": list(shape), "tokens": tokens,
                         "dtype": str(dtype).split(".")[1], **row})
    bench.report_small_ops("rope", rows, ["tensor", "tokens"], args=args, ceilings=ceilings)


if __name__ == "__main__":
    main()
