"""moe_dispatch / moe_combine at V4-Flash routing shapes for Nsight Compute on the H200 (kernel
durations without launch overhead), e.g.:
  ncu --clock-control none --metrics gpu__time_duration.sum -k regex:"dispatch|combine|gather" \
      python3 bench/profile_dispatch.py 1 512 2048
"""

import sys

import torch

from zeroinfer.ops import moe_combine, moe_dispatch

HIDDEN, EXPERTS, TOPK, TILE = 4096, 256, 6, 64
gen = torch.Generator(device="cuda").manual_seed(0)
for T in [int(a) for a in sys.argv[1:]] or [1, 512, 2048]:
    x = torch.randn(T, HIDDEN, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(T, EXPERTS, device="cuda", generator=gen).topk(TOPK, dim=1).indices.int()
    w = torch.rand(T, TOPK, device="cuda", generator=gen)
    for _ in range(2):
        d = moe_dispatch(x, ids, EXPERTS, tile=TILE)
        moe_combine(d.sorted_x, d.token_row, w)
    torch.cuda.synchronize()
    print("tokens", T, "done")
