"""Kernel times of sparse MLA cases under whichever zeroinfer build is on PYTHONPATH, for A/B runs
of two or more builds (bench/ab_builds.sh alternates them, one build a process; pass the variant
as NAME=FILE.cu@csrc/cuda/sparse_mla.cu). Prints one JSON line {case: [kernel_us, checksum]}: the
checksum (the bf16 outputs' bits summed) tells whether a variant changed any result.

  python3 bench/ab_mla_cases.py fp8:64:64,fp8:16:128:2,bf16:64:128[,...]
a case is cache (fp8 / bf16) : heads : requests [: query tokens a request, default 1], with
bench_sparse_mla.py's V4-Flash decode inputs (128 window + 512 compressed entries a query), or
cache : heads : tokens : p for its prefill inputs (one request of that many tokens).
"""

import json
import sys

import torch

sys.path.insert(0, "bench")
from bench_sparse_mla import make_inputs  # noqa: E402

from zeroinfer.ops import sparse_mla_attention  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    for case in sys.argv[1].split(","):
        parts = case.split(":")
        fmt, heads, requests = parts[0], int(parts[1]), int(parts[2])
        if len(parts) > 3 and parts[3] == "p":
            a, _ = make_inputs(requests, heads, fmt, "cuda", gen, prefill=True)
        else:
            s_q = int(parts[3]) if len(parts) > 3 else 1
            a, _ = make_inputs(requests * s_q, heads, fmt, "cuda", gen, s_q=s_q)
        out, lse = sparse_mla_attention(**a)
        chk = int(out.view(torch.int16).to(torch.int64).sum())
        call = lambda: sparse_mla_attention(**a, out=out, lse=lse)  # noqa: B023, E731
        res[case] = [bench.time_kernels(call) * 1e6, chk]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
