"""Kernel times of indexer_scores cases under whichever zeroinfer build is on PYTHONPATH, for A/B
runs of builds (bench/ab_builds.sh ... NAME=ALT.cu@csrc/cuda/indexer.cu). Prints one JSON line
{case: [kernel_us, checksum]}: the checksum (the finite scores' float32 bits summed) tells
whether a variant changed any result.

  python3 bench/ab_indexer_cases.py decode:32:8192,prefill:4096:1024[,...]
a case is decode : batch : entries (one query a sequence, bench_indexer.py's decode rows) or
prefill : tokens : entries (one sequence's chunk, causal, ending at 4 x entries) [: f32]; q is
bf16-exact, as the model's, unless the case ends in `f32` (q float32: two MMAs a tile).
"""

import json
import sys

import torch

sys.path.insert(0, "bench")
from bench_indexer import DIM, case  # noqa: E402

from zeroinfer.ops import indexer_scores  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402


def main() -> None:
    cases = sys.argv[1].split(",")
    gen = torch.Generator().manual_seed(0)
    res = {}
    for c in cases:
        kind, a, n, *rest = c.split(":")
        a, n, q_exact = int(a), int(n), rest != ["f32"]
        if kind == "decode":
            args = case(gen, "cuda", torch.bfloat16, seqs=a, tokens=a, entries=n, q_exact=q_exact)
        else:
            args = case(gen, "cuda", torch.bfloat16, seqs=1, tokens=a, entries=n,
                        first_pos=4 * n - a, q_exact=q_exact)
        call = lambda: indexer_scores(*args, n, scale=DIM**-0.5)  # noqa: E731
        out = call()
        bits = out[out.isfinite()].view(torch.int32).long().sum().item()
        res[c] = [round(bench.time_kernels(call) * 1e6, 2), bits]
        del args, out
    print(json.dumps(res))


if __name__ == "__main__":
    main()
