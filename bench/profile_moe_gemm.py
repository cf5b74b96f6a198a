"""One MXFP4 grouped GEMM at a V4-Flash shape, for Nsight Compute on the H200:
  ncu --clock-control none -k regex:mxfp4 python3 bench/profile_moe_gemm.py \
      [tokens gemm act routing tile]
gemm: gate_up (N 4096 fused SwiGLU, K 4096) or down (N 4096, K 2048); act: bf16 or fp8;
routing: uniform or skewed (as in bench_moe_gemm.py); tile: 0 (the kernel's choice) or 1-4."""

import sys

import torch

sys.path.insert(0, "bench")
from bench_moe_gemm import (EXPERTS, HIDDEN, INTER, LIMIT, _quant_fp8,  # noqa: E402
                            make_weights, routing_offsets)

import zeroinfer.ops.moe_gemm as mg  # noqa: E402
from zeroinfer.ops.moe_gemm import mxfp4_grouped_gemm, mxfp4_prepack  # noqa: E402

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1
name = sys.argv[2] if len(sys.argv) > 2 else "gate_up"
act = sys.argv[3] if len(sys.argv) > 3 else "bf16"
skewed = (sys.argv[4] if len(sys.argv) > 4 else "uniform") == "skewed"
mg._FORCE_TILE = int(sys.argv[5]) if len(sys.argv) > 5 else 0
n, k, fuse = (2 * INTER, HIDDEN, True) if name == "gate_up" else (HIDDEN, INTER, False)
dgen = torch.Generator(device="cuda").manual_seed(1)
w, s = make_weights(EXPERTS, n, k, dgen)
pw = mxfp4_prepack(w, s, fuse_swiglu=fuse,
                   act_dtype=torch.bfloat16 if act == "bf16" else torch.float8_e4m3fn)
offsets = routing_offsets(tokens, EXPERTS, skewed, torch.Generator().manual_seed(0)).cuda()
m = int(offsets[-1])
x = torch.randn(m, k, generator=dgen, device="cuda") * 0.5
a, a_scale = (x.bfloat16(), None) if act == "bf16" else _quant_fp8(x)
for _ in range(2):
    mxfp4_grouped_gemm(a, pw, None, a_scale=a_scale, expert_offsets=offsets, fuse_swiglu=fuse,
                       swiglu_limit=LIMIT if fuse else None)
torch.cuda.synchronize()
print("done")
