"""Where a float8 wide-tile CTA's time goes: clock stamps at its phase boundaries (the method of
moe_gemm_NOTES.md sessions 18 and 23).

  python3 bench/probe_moe_stamps.py make OUT.cu [nowarm]   # a stamped copy of csrc/cuda/moe_gemm.cu
  python3 bench/probe_moe_stamps.py run gate_up:512:skewed,down:512:skewed   # under that build

`make` needs no GPU: it patches the kernel at fixed anchors (and fails loudly when one moved)
so that consumer thread 0 and producer thread 0 store clock64() deltas from the CTA's entry into a
__device__ array, and the launcher, when ZI_STAMPS is set, runs a one-thread kernel after the
GEMM that prints per slot the min / median / max over the CTAs in us (each CTA's clock rate from
its own globaltimer span). `nowarm` also drops the consumers' warm-up pass. Build it beside the
tree with bench/ab_builds.sh (`bash bench/ab_builds.sh 0 true stamps=OUT.cu` builds without
running anything), then `PYTHONPATH=/tmp/ab/stamps:$PYTHONPATH python3 bench/probe_moe_stamps.py
run CASES` traces two launches a case (L2 flushed before each) and times the kernel. Cases as
bench/ab_moe_cases.py (gemm:tokens:routing, W4A8).

Slots: consumer thread 0: 1 schedule built; pass p = 0 (the warm-up) .. 3: 2+3p first full barrier
passed, 3+3p stage loop done, 4+3p epilogue done; 15 its end. Producer thread 0, item i = 0..2:
20+6i item tile known, 21+6i first copies issued, 22+6i first weights landed, 23+6i first stage
decoded, 24+6i first stage handed over, 25+6i last stage handed over. Lane 0 of consumer warp w
(0..7): 40+w / 48+w the epilogue of the first / second item done (the next item's first full
barrier waits for the slowest warp of warpgroup 0). (Printf in the GEMM kernel
itself would make ptxas serialise its wgmmas, hence the second kernel.)
"""

import os
import sys

KERNEL = "csrc/cuda/moe_gemm.cu"

_HEAD = r'''
__device__ long long g_zs[256 * 64];
__device__ __forceinline__ unsigned long long zs_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define ZS_PUT(slot, t0) \
  (blockIdx.x < 256 ? (void)(g_zs[blockIdx.x * 64 + (slot)] = clock64() - (t0)) : (void)0)
__global__ void zs_print(int ctas) {
  static long long v[256];
  ctas = ctas < 256 ? ctas : 256;  // (g_zs holds 256 CTAs)
  for (int s = 0; s < 64; ++s) {
    int n = 0;
    for (int c = 0; c < ctas; ++c) {
      const long long x = g_zs[c * 64 + s];
      if (x < 0 || s == 16 || s == 17) continue;
      // cycles -> ns by the CTA's own rate (16, 17: its end clock, its globaltimer span)
      const double rate = double(g_zs[c * 64 + 16]) / double(g_zs[c * 64 + 17]);
      v[n++] = (long long)(x / rate);
    }
    if (n == 0) continue;
    for (int i = 1; i < n; ++i)
      for (int j = i; j > 0 && v[j] < v[j - 1]; --j) {
        const long long y = v[j];
        v[j] = v[j - 1];
        v[j - 1] = y;
      }
    printf("ZS slot %2d n %3d min %8.2f med %8.2f max %8.2f us\n", s, n, v[0] * 1e-3,
           v[n / 2] * 1e-3, v[n - 1] * 1e-3);
  }
  double ghz = 0; int m = 0;
  for (int c = 0; c < ctas; ++c)
    if (g_zs[c * 64 + 17] > 0) {
      ghz += double(g_zs[c * 64 + 16]) / g_zs[c * 64 + 17];
      ++m;
    }
  printf("ZS clock %.3f GHz over %d CTAs\n", ghz / m, m);
}
'''

_PASS = ("(static_cast<int>((it - (static_cast<int64_t>(blockIdx.x) - gridDim.x))"
         " / gridDim.x))")

# (anchor, replacement) pairs, each anchor found exactly once in the kernel source.
_PATCHES = [
    ("// ---- the warp-specialised float8 wide tile (tokens as M) ---",
     _HEAD + "// ---- the warp-specialised float8 wide tile (tokens as M) ---"),
    ("  const Mxfp4CudaGemmParams& p = prm.p;\n",
     "  const long long zs_t0 = clock64();\n  const unsigned long long zs_g0 = zs_gtime();\n"
     "  const Mxfp4CudaGemmParams& p = prm.p;\n"),
    ("  const Schedule<C> sch(p, smem + C::pipe_bytes);  // (its barrier publishes the above)\n",
     "  const Schedule<C> sch(p, smem + C::pipe_bytes);  // (its barrier publishes the above)\n"
     "  if (threadIdx.x == 0) ZS_PUT(1, zs_t0);\n"),
    ("      const ItemTile w = sch.tile_of(p, it);\n"
     "      const bool row_based = tile_row_based(w);",
     "      const ItemTile w = sch.tile_of(p, it);\n"
     "      const int zi = static_cast<int>((it - blockIdx.x) / gridDim.x);\n"
     "      const bool zs_on = ptid == 0 && zi < 3;\n"
     "      if (zs_on) ZS_PUT(20 + 6 * zi, zs_t0);\n"
     "      const bool row_based = tile_row_based(w);"),
    ("        if (st < kt_total) fill(st);\n        cp_async_commit();\n      }\n",
     "        if (st < kt_total) fill(st);\n        cp_async_commit();\n      }\n"
     "      if (zs_on) ZS_PUT(21 + 6 * zi, zs_t0);\n"),
    ("        mbar_wait(smem_u32(&weights_mb[slot]), (phases >> slot) & 1u);"
     "  // the packed weights\n",
     "        mbar_wait(smem_u32(&weights_mb[slot]), (phases >> slot) & 1u);"
     "  // the packed weights\n"
     "        if (zs_on && kt == 0) ZS_PUT(22 + 6 * zi, zs_t0);\n"),
    ("        for (int h = 0; h < kS; ++h) decode_strip(slot, decoded & 1, h);\n"
     "        ++decoded;\n",
     "        for (int h = 0; h < kS; ++h) decode_strip(slot, decoded & 1, h);\n"
     "        if (zs_on && kt == 0) ZS_PUT(23 + 6 * zi, zs_t0);\n        ++decoded;\n"),
    ("        bar_arrive(C::bar_full + 2 * slot, C::full0_count);  // warpgroup 0 (1 follows it)\n"
     "        slot = slot == C::stages - 1 ? 0 : slot + 1;\n      }\n",
     "        bar_arrive(C::bar_full + 2 * slot, C::full0_count);  // warpgroup 0 (1 follows it)\n"
     "        if (zs_on && kt == 0) ZS_PUT(24 + 6 * zi, zs_t0);\n"
     "        slot = slot == C::stages - 1 ? 0 : slot + 1;\n      }\n"
     "      if (zs_on) ZS_PUT(25 + 6 * zi, zs_t0);\n"),
    ("        bar_sync(C::bar_full + 2 * slot + cw, cw == 0 ? C::full0_count : C::full1_count);"
     "\n",
     "        bar_sync(C::bar_full + 2 * slot + cw, cw == 0 ? C::full0_count : C::full1_count);"
     "\n"
     f"        if (threadIdx.x == 0 && taken + kt_total == stop && {_PASS} < 4)\n"
     f"          ZS_PUT(2 + 3 * {_PASS}, zs_t0);\n"),
    ("    ItemTile wn = w;\n",
     f"    const int zp = {_PASS};\n"
     "    if (threadIdx.x == 0 && zp < 4) ZS_PUT(3 + 3 * zp, zs_t0);\n    ItemTile wn = w;\n"),
    ("    w = wn;\n    row_based = rbn;\n  }\n}",
     "    if (threadIdx.x == 0 && zp < 4) ZS_PUT(4 + 3 * zp, zs_t0);\n"
     "    if ((threadIdx.x & 31) == 0 && zp >= 1 && zp <= 2)\n"
     "      ZS_PUT(40 + 8 * (zp - 1) + (threadIdx.x >> 5), zs_t0);\n"
     "    w = wn;\n    row_based = rbn;\n  }\n"
     "  if (threadIdx.x == 0 && blockIdx.x < 256) {\n"
     "    g_zs[blockIdx.x * 64 + 16] = clock64() - zs_t0;\n"
     "    g_zs[blockIdx.x * 64 + 17] = static_cast<long long>(zs_gtime() - zs_g0);\n"
     "    ZS_PUT(15, zs_t0);\n  }\n}"),
    ("    launch_programmatic(kernel, g, b, static_cast<size_t>(smem), stream, prm);\n",
     "    void* zs = nullptr;\n"
     "    ZI_CUDA_CHECK(cudaGetSymbolAddress(&zs, g_zs));\n"
     "    ZI_CUDA_CHECK(cudaMemsetAsync(zs, 0xff, sizeof(long long) * 256 * 64, stream));\n"
     "    launch_programmatic(kernel, g, b, static_cast<size_t>(smem), stream, prm);\n"
     "    if (std::getenv(\"ZI_STAMPS\") != nullptr)\n"
     "      zs_print<<<1, 1, 0, stream>>>(static_cast<int>(grid));\n"),
]
_NOWARM = ("for (int64_t it = static_cast<int64_t>(blockIdx.x) - gridDim.x; it < items;",
           "for (int64_t it = static_cast<int64_t>(blockIdx.x); it < items;")


def make(out: str, nowarm: bool) -> None:
    src = open(KERNEL).read()
    for old, new in _PATCHES + ([_NOWARM] if nowarm else []):
        if src.count(old) != 1:
            sys.exit(f"anchor found {src.count(old)} times (the kernel moved on): {old[:70]!r}")
        src = src.replace(old, new)
    open(out, "w").write("#include <cstdlib>\n" + src)


def run(cases: str) -> None:
    import torch

    sys.path.insert(0, "bench")
    from ab_moe_cases import make_case

    from zeroinfer.testing import bench

    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    flush = bench._l2_flush_buffer()
    for case in cases.split(","):
        gemm, _ = make_case(case, torch.float8_e4m3fn, gen, dgen)
        for _ in range(3):
            gemm()
        for rep in range(2):
            flush.zero_()
            torch.cuda.synchronize()
            os.environ["ZI_STAMPS"] = "1"  # (the launcher reads it at every launch)
            print(f"== {case} traced launch {rep}", flush=True)
            gemm()
            torch.cuda.synchronize()
            del os.environ["ZI_STAMPS"]
        print(f"== {case} kernel us {bench.time_kernels(gemm) * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        make(sys.argv[2], "nowarm" in sys.argv[3:])
    elif len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(__doc__)
