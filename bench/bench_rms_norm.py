"""Benchmark rms_norm (V4's weighted and unweighted RMS norms, one launch) against the torch forms
it replaced in the model (7-9 calls a use), at V4-Flash's shapes: the layer norms over hidden
4096 (bf16), q's per-head norm over 512 (unweighted, bf16, 64 heads a token) and the mHC's norm
over the flattened streams, 4 x 4096 (unweighted, float32). bf16 rows on CUDA; float32 on CPU.

  python bench/bench_rms_norm.py                 # CPU twin vs torch (CPU)
  python bench/bench_rms_norm.py --device cuda   # CUDA kernel vs torch (CUDA)

Launch-bound at decode, a bandwidth-bound pass at prefill (the row is read twice, the second
time from L1 / L2). Timed as the other op benchmarks (`time_us` eager with the L2 flushed,
`graph_us` its graph replay, `kernel_us` its own device work); `bytes` x read and y written once,
and the weight.
"""

from __future__ import annotations

import torch

from zeroinfer.ops import rms_norm
from zeroinfer.testing import bench
from zeroinfer.testing.torch_forms import torch_rms_norm, torch_rms_norm_unweighted

CASES = [  # name, per-token shape, weighted, dtype on CUDA
    ("layer", (4096,), True, torch.bfloat16),
    ("q_heads", (64, 512), False, torch.bfloat16),
    ("mhc", (4 * 4096,), False, torch.float32),
]


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in (1, 8, 64, 512, 4096) if cuda else (1, 8, 64, 512):
        for name, shape, weighted, dtype in CASES:
            dtype = dtype if cuda else torch.float32
            x = torch.randn((tokens, *shape), generator=gen).to(dev, dtype)
            w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dev) if weighted else None
            torch_call = (lambda: torch_rms_norm(x, w, 1e-6)) if weighted else \
                (lambda: torch_rms_norm_unweighted(x, 1e-6))
            # A fast wrong kernel must not post a number: the torch form to rounding first. bf16
            # unweighted rounds the factor and then the product, so two bf16 ulps (2^-7) apart.
            rtol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(rms_norm(x, w, 1e-6).float(), torch_call().float(),
                                       atol=1e-5, rtol=rtol)
            out = torch.empty_like(x)
            row = bench.small_op_row(
                lambda: rms_norm(x, w, 1e-6), lambda: rms_norm(x, w, 1e-6, out=out), torch_call,
                bytes_moved=2 * x.numel() * x.element_size() + (w.numel() * 4 if weighted else 0),
                ceilings=ceilings, cuda=cuda)
            rows.append({"norm": name, "shape": [tokens, *shape], "tokens": tokens,
                         "weighted": weighted, "dtype": str(dtype).split(".")[1], **row})
    bench.report_small_ops("rms_norm", rows, ["norm", "tokens"], args=args, ceilings=ceilings)


if __name__ == "__main__":
    main()
