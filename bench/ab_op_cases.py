"""Kernel times of the launch-bound ops (moe_route, rms_norm) under whichever zeroinfer build is
on PYTHONPATH, for A/B runs of builds (bench/ab_builds.sh). Prints one JSON line
{case: [kernel_us, checksum]}: the checksum (the outputs' bits summed) tells whether a variant
changed any result.

  python3 bench/ab_op_cases.py route:1,route:512,norm:layer:1,norm:mhc:8[,...]
a case is route : tokens (bench_moe_route.py's shape: 256 experts, top-6, bf16 logits) or
norm : kind : tokens (bench_rms_norm.py's kinds: layer, q_heads, mhc).
"""

import json
import sys

import torch

sys.path.insert(0, "bench")
from bench_moe_route import EXPERTS, SCALE, TOPK  # noqa: E402
from bench_rms_norm import CASES as NORMS  # noqa: E402

from zeroinfer.ops import moe_route, rms_norm  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402


def bits(t: torch.Tensor) -> int:
    return t.contiguous().view(-1).view(torch.uint8).long().sum().item()


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    res = {}
    for c in sys.argv[1].split(","):
        op, *rest = c.split(":")
        if op == "route":
            tokens = int(rest[0])
            logits = (torch.randn(tokens, EXPERTS, generator=gen) * 2).to("cuda", torch.bfloat16)
            bias = (torch.randn(EXPERTS, generator=gen) * 0.5).cuda()
            call = lambda: moe_route(logits, TOPK, scale=SCALE, bias=bias)  # noqa: E731
            check = lambda: sum(bits(t) for t in call())  # noqa: E731
        else:
            kind, tokens = rest[0], int(rest[1])
            _, shape, weighted, dtype = next(n for n in NORMS if n[0] == kind)
            x = torch.randn(tokens, *shape, generator=gen).to("cuda", dtype)
            w = (torch.randn(shape[-1], generator=gen) * 0.1 + 1).cuda() if weighted else None
            call = lambda: rms_norm(x, w, 1e-6)  # noqa: E731
            check = lambda: bits(call())  # noqa: E731
        res[c] = [round(bench.time_kernels(call) * 1e6, 2), check()]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
