"""Small representative calls of every CUDA kernel, for compute-sanitizer (memcheck/racecheck):
  compute-sanitizer --tool memcheck python3 bench/sanitize_cases.py"""

import torch

from zeroinfer.ops import correct_lengths, moe_combine, moe_dispatch

gen = torch.Generator().manual_seed(1)
for T, k, E, tile, D in [(1, 6, 256, 64, 4096), (300, 6, 256, 16, 4096), (77, 3, 5, 1, 13)]:
    x = torch.randn(T, D, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.randint(-1, E, (T, k), generator=gen, dtype=torch.int32).cuda()
    d = moe_dispatch(x, ids, E, tile=tile)
    w = torch.rand(T, k, generator=gen).cuda()
    moe_combine(d.sorted_x, d.token_row, w)

R, S = 300, 4
i32 = dict(dtype=torch.int32, device="cuda")
cu = torch.arange(0, (R + 1) * S, S, **i32)
correct_lengths(torch.randperm(R, **i32), torch.randint(1, S + 1, (R,), **i32),
                torch.randint(0, 1000, (R, S), **i32), torch.full((R,), S, **i32),
                torch.full((R,), S, **i32), cu, torch.randint(S, 900, (R,), **i32),
                torch.randint(0, 900, (R * S,), **i32), torch.randint(0, 1000, (R * S,), **i32))
torch.cuda.synchronize()
print("sanitize cases done")
