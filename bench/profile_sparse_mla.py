"""One sparse MLA call at a V4-Flash decode shape, for Nsight Compute on the H200:
  ncu --clock-control none -k regex:sparse_mla python3 bench/profile_sparse_mla.py [batch heads fmt]
"""

import sys

import torch

sys.path.insert(0, "bench")
from bench_sparse_mla import make_inputs  # noqa: E402

from zeroinfer.ops import sparse_mla_attention  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
heads = int(sys.argv[2]) if len(sys.argv) > 2 else 64
fmt = sys.argv[3] if len(sys.argv) > 3 else "fp8"
gen = torch.Generator(device="cuda").manual_seed(0)
a, _ = make_inputs(batch, heads, fmt, "cuda", gen)
for _ in range(2):
    sparse_mla_attention(**a)
torch.cuda.synchronize()
print("done")
