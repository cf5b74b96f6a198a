"""How much of an MXFP4 grouped-GEMM call is streaming its weight stages and how much is fixed
cost (the launch, the device-side schedule, each work item's prologue and output): the decode
inputs of bench_moe_gemm.py (256 experts, top-6 uniform routing, n = 4096 plain output) at 1 and
32 tokens, K swept 256 .. 4096, CUPTI kernel times on the H200 (L2 flushed). A least-squares
line through one case's points gives time = fixed + stages * per_stage (a stage: 128 of K for
every work item); the per-stage bytes over per_stage is the rate the stages stream at. Prints a
table; writes nothing (an exploration aid for bench/results/h200/moe_gemm_NOTES.md, session 11).

  python3 bench/probe_moe_gemm_k.py [tokens ...]    (default 1 32)
"""

import sys

import torch

sys.path.insert(0, "bench")
from bench_moe_gemm import EXPERTS, _quant_fp8, make_weights, routing_offsets  # noqa: E402
from probe_sparse_mla_tiles import fit  # noqa: E402

from zeroinfer.ops import mxfp4_grouped_gemm, mxfp4_prepack  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402

N = 4096
KS = (256, 512, 1024, 2048, 4096)
BYTES_PER_WEIGHT = 17 / 32  # e2m1 values + one UE8M0 byte per 32


def main() -> None:
    tokens_list = [int(x) for x in sys.argv[1:]] or [1, 32]
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    bw = bench.measure_cuda_ceilings()["hbm_bytes_per_s"]  # the copy rate the fractions use
    print(f"{'act':5s} {'tokens':>6s} {'K':>5s} {'kernel us':>10s} {'TB/s':>6s}")
    for fp8 in (False, True):
        act = torch.float8_e4m3fn if fp8 else torch.bfloat16
        for tokens in tokens_list:
            offsets = routing_offsets(tokens, EXPERTS, False, gen).cuda()
            m = int(offsets[-1])
            active = int((offsets[1:] > offsets[:-1]).sum())
            points = []
            for k in KS:
                w, s = make_weights(EXPERTS, N, k, dgen)
                pw = mxfp4_prepack(w, s, fuse_swiglu=False, act_dtype=act)
                x = torch.randn(m, k, generator=dgen, device="cuda") * 0.5
                a, a_scale = _quant_fp8(x) if fp8 else (x.bfloat16(), None)

                def run(a=a, a_scale=a_scale, pw=pw):
                    return mxfp4_grouped_gemm(a, pw, None, a_scale=a_scale, expert_offsets=offsets)

                us = bench.time_kernels(run) * 1e6
                tbps = active * N * k * BYTES_PER_WEIGHT / us / 1e6
                points.append((k // 128, us))
                print(f"{'fp8' if fp8 else 'bf16':5s} {tokens:6d} {k:5d} {us:10.1f} {tbps:6.2f}")
                del w, s, pw
            fixed, per_stage = fit(points)
            stage_tbps = active * N * 128 * BYTES_PER_WEIGHT / per_stage / 1e6
            print(f"  fit: {fixed:.1f} us fixed + {per_stage:.2f} us a stage (the stages stream "
                  f"at {stage_tbps:.2f} TB/s, {stage_tbps * 1e12 / bw:.2f} of the copy rate)")


if __name__ == "__main__":
    main()
