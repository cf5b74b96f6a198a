"""A/B of the MXFP4 grouped GEMM's tile shapes on the H200 at V4-Flash expert shapes: the tiny
(3), small (1), wgmma (4: 64 tokens) and wide (2: 128 tokens) tiles (bf16 runs tiny and small on
mma.sync, float8 every tile on wgmma), each forced for every expert, checked against each other
(relative error, bitwise equality) and timed (CUDA-graph replay, L2 flushed), with TFLOP/s and
the fraction of the bf16 (or, with `fp8`, the measured fp8) peak.
Used for every step in bench/results/h200/moe_gemm_NOTES.md (sessions 4-6).

  python3 bench/ab_moe_tile.py [fp8] [tokens ...]   (default bf16, 2048 8192; uniform + skewed)
"""

import sys

import torch

sys.path.insert(0, "bench")
from bench_moe_gemm import (EXPERTS, HIDDEN, INTER, LIMIT, _fp8_ceiling, _quant_fp8,  # noqa: E402
                            make_weights, routing_offsets)

import zeroinfer.ops.moe_gemm as mg  # noqa: E402
from zeroinfer.ops import mxfp4_grouped_gemm, mxfp4_prepack  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402

fp8 = "fp8" in sys.argv[1:]
tokens_list = [int(a) for a in sys.argv[1:] if a != "fp8"] or [2048, 8192]
ceil = bench.measure_cuda_ceilings()
peak = (_fp8_ceiling() if fp8 else None) or ceil["bf16_flops_per_s"]
act = torch.float8_e4m3fn if fp8 else torch.bfloat16
gen = torch.Generator().manual_seed(0)
dgen = torch.Generator(device="cuda").manual_seed(1)
for name, (n, k, fuse) in {"gate_up": (2 * INTER, HIDDEN, True), "down": (HIDDEN, INTER, False)}.items():
    w, s = make_weights(EXPERTS, n, k, dgen)
    pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=act)
    for tokens in tokens_list:
        for skew in (False, True):
            offsets = routing_offsets(tokens, EXPERTS, skew, gen).cuda()
            m = int(offsets[-1])
            x = torch.randn(m, k, generator=dgen, device="cuda") * 0.5
            a, a_scale = _quant_fp8(x) if fp8 else (x.bfloat16(), None)
            run = lambda: mxfp4_grouped_gemm(a, pw, None, a_scale=a_scale,  # noqa: E731
                                             expert_offsets=offsets, fuse_swiglu=fuse,
                                             swiglu_limit=LIMIT if fuse else None)
            res = {}
            tiles = (3, 1, 2, 4)
            for tile in tiles:
                mg._FORCE_TILE = tile
                out = run().float()
                t = bench.time_cuda_graph(run, warmup=3, reps=20)
                res[tile] = (out, t)
            mg._FORCE_TILE = 0
            ref = res[tiles[1]][0]
            err = float((res[4][0] - ref).norm() / ref.norm().clamp(min=1e-30))
            same = all(torch.equal(res[tl][0], ref) for tl in tiles)
            flops = 2.0 * m * n * k
            line = " ".join(f"tile{tl} {t * 1e6:8.1f} us {flops / t / 1e12:6.1f} TF/s "
                            f"({flops / t / peak:.0%})" for tl, (_, t) in res.items())
            print(f"{name:7s} {'fp8 ' if fp8 else 'bf16'} tokens={tokens:5d} "
                  f"{'skewed ' if skew else 'uniform'} rows={m:6d} {line}  rel.err {err:.2e} "
                  f"bitwise {'yes' if same else 'no'}", flush=True)
