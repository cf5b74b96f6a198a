"""Where a sparse MLA CTA's time goes: clock stamps at the phase boundaries of the 64-head kernels
(sparse_mla_fp8_kernel and sparse_mla_bf16_kernel, any R), to split the fixed cost of a work item
(the index -> slot -> row chain and Q before the first tile, the output stores after the last)
from the per-tile cost, and to see the grid's launch ramp.

  python3 bench/probe_mla_stamps.py make OUT.cu     # a stamped copy of csrc/cuda/sparse_mla.cu
  python3 bench/probe_mla_stamps.py run 128:64:fp8,64:64:fp8,128:64:bf16   # under that build

`make` needs no GPU: it patches the kernels at fixed anchors (and fails loudly when one moved) so
that thread 0 of each CTA stores clock64() deltas from its entry into a __device__ array, and the
launcher, when ZI_STAMPS is set, runs a one-thread kernel after the attention kernel that prints
per slot the min / median / max over the CTAs in us (each CTA's clock rate from its own
globaltimer span). Build it beside the tree with bench/ab_builds.sh (`bash bench/ab_builds.sh 0
true stamps=OUT.cu@csrc/cuda/sparse_mla.cu` builds without running anything), then
`PYTHONPATH=/tmp/ab/stamps:$PYTHONPATH python3 bench/probe_mla_stamps.py run CASES` traces two
launches a case (L2 flushed before each, as bench_sparse_mla.py times them) and times the call.
A case is requests : heads : fp8 / bf16 [: s_q] at bench_sparse_mla.py's decode shapes.

Slots (thread 0): 1 after the programmatic-launch wait; 2 (FP8) tile 0's rows dequantised into
shared memory, i.e. the index -> slot -> row chain done; 3 the first tile may start (FP8: after
the prologue's barrier; bf16: tile 0's copies landed); 4 + i the end of tile i (i < 10; FP8 after
the loop's closing barrier, bf16 after its P V); 14 the outputs stored (the CTA's end); 18 the
CTA's entry on the globaltimer, relative to the grid's earliest (the launch ramp, ns resolution of
that timer). (Printf in the attention kernel itself would make ptxas serialise its wgmmas, hence
the second kernel.)
"""

import os
import sys

KERNEL = "csrc/cuda/sparse_mla.cu"

_HEAD = r'''
__device__ long long g_zs[512 * 32];
__device__ __forceinline__ unsigned long long zs_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int zs_cta() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
#define ZS_PUT(slot, t0)                                                            \
  ((threadIdx.x == 0 && zs_cta() < 512) ? (void)(g_zs[zs_cta() * 32 + (slot)] = clock64() - (t0)) \
                                        : (void)0)
#define ZS_END(t0, g0)                                                    \
  if (threadIdx.x == 0 && zs_cta() < 512) {                               \
    g_zs[zs_cta() * 32 + 16] = clock64() - (t0);                          \
    g_zs[zs_cta() * 32 + 17] = static_cast<long long>(zs_gtime() - (g0)); \
    g_zs[zs_cta() * 32 + 19] = static_cast<long long>(g0);                \
  }
__global__ void zs_print(int ctas) {
  static long long v[512];
  ctas = ctas < 512 ? ctas : 512;  // (g_zs holds 512 CTAs)
  long long g_min = -1;
  for (int c = 0; c < ctas; ++c) {
    const long long g = g_zs[c * 32 + 19];
    if (g >= 0 && (g_min < 0 || g < g_min)) g_min = g;
  }
  for (int s = 0; s < 32; ++s) {
    if (s == 16 || s == 17 || s == 19) continue;
    int n = 0;
    for (int c = 0; c < ctas; ++c) {
      if (g_zs[c * 32 + 17] <= 0) continue;
      if (s == 18) {
        v[n++] = g_zs[c * 32 + 19] - g_min;
        continue;
      }
      const long long x = g_zs[c * 32 + s];
      if (x < 0) continue;
      // cycles -> ns by the CTA's own rate (16, 17: its end clock, its globaltimer span)
      const double rate = double(g_zs[c * 32 + 16]) / double(g_zs[c * 32 + 17]);
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
  double ghz = 0;
  int m = 0;
  for (int c = 0; c < ctas; ++c)
    if (g_zs[c * 32 + 17] > 0) {
      ghz += double(g_zs[c * 32 + 16]) / g_zs[c * 32 + 17];
      ++m;
    }
  printf("ZS clock %.3f GHz over %d CTAs\n", m ? ghz / m : 0.0, m);
}
'''

_ENTRY = ("  const long long zs_t0 = clock64();\n"
          "  const unsigned long long zs_g0 = zs_gtime();\n")

# Two long source lines the anchors below take whole.
_BF16_WAIT = ("      cp_async_wait<4>();  // tile it (and Q) landed for this thread's copies;"
              " it + 1's may not\n")
_FP8_BARRIER = ("    __syncthreads();  // tile it+1 and its flags complete;"
                " everyone is done with tile it and P\n")

# (anchor, replacement) pairs, each anchor found exactly once in the kernel source.
_PATCHES = [
    ("// Warp layout of a CTA of 16 R heads (see the header comment).\n",
     _HEAD + "// Warp layout of a CTA of 16 R heads (see the header comment).\n"),
    # bf16 kernel
    ("  const auto [sQ, sK, sP, sRed, sRefs, sValid, sXchg] = smem_tiles<R, false>(smem_raw);\n"
     "  const WorkItem w = work_item<R>(a);\n"
     "  await_earlier_kernels();  // (a programmatic launch: launch.cuh)\n",
     _ENTRY +
     "  const auto [sQ, sK, sP, sRed, sRefs, sValid, sXchg] = smem_tiles<R, false>(smem_raw);\n"
     "  const WorkItem w = work_item<R>(a);\n"
     "  await_earlier_kernels();  // (a programmatic launch: launch.cuh)\n"
     "  ZS_PUT(1, zs_t0);\n"),
    (_BF16_WAIT, _BF16_WAIT + "      if (it == 0) ZS_PUT(3, zs_t0);\n"),
    ("      wgmma::fence_operands(reinterpret_cast<float(&)[G::OT * 4]>(acc[0][0]));\n    }\n",
     "      wgmma::fence_operands(reinterpret_cast<float(&)[G::OT * 4]>(acc[0][0]));\n"
     "      if (it < 10) ZS_PUT(4 + it, zs_t0);\n    }\n"),
    ("      __syncthreads();  // ... and everyone's; all warps are done with tile it-1\n",
     "      __syncthreads();  // ... and everyone's; all warps are done with tile it-1\n"
     "      if (it == 0) ZS_PUT(3, zs_t0);\n"),
    ("      pv_issue<R>(acc, p_base, k_base, rg, cg, lane);\n      pv_wait<R>(acc);\n    }\n",
     "      pv_issue<R>(acc, p_base, k_base, rg, cg, lane);\n      pv_wait<R>(acc);\n"
     "      if (it < 10) ZS_PUT(4 + it, zs_t0);\n    }\n"),
    ("  cp_async_wait<0>();\n\n"
     "  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);\n}\n",
     "  cp_async_wait<0>();\n\n"
     "  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);\n"
     "  ZS_PUT(14, zs_t0);\n  ZS_END(zs_t0, zs_g0)\n}\n"),
    # FP8 kernel
    ("      smem_tiles<R, true>(smem_raw);\n"
     "  const WorkItem w = work_item<R>(a);\n"
     "  await_earlier_kernels();  // (a programmatic launch: launch.cuh)\n",
     "      smem_tiles<R, true>(smem_raw);\n" + _ENTRY +
     "  const WorkItem w = work_item<R>(a);\n"
     "  await_earlier_kernels();  // (a programmatic launch: launch.cuh)\n"
     "  ZS_PUT(1, zs_t0);\n"),
    ("  store_fp8_row(rows, sK, e, q);\n  if (q == 0) sValid[e] = rows.valid;\n",
     "  store_fp8_row(rows, sK, e, q);\n  if (q == 0) sValid[e] = rows.valid;\n"
     "  ZS_PUT(2, zs_t0);\n"),
    ("  load_fp8_row(rows, ref1, q);\n  __syncthreads();\n",
     "  load_fp8_row(rows, ref1, q);\n  __syncthreads();\n  ZS_PUT(3, zs_t0);\n"),
    (_FP8_BARRIER + "  }\n\n"
     "  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);\n}\n",
     _FP8_BARRIER + "    if (it < 10) ZS_PUT(4 + it, zs_t0);\n  }\n\n"
     "  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);\n"
     "  ZS_PUT(14, zs_t0);\n  ZS_END(zs_t0, zs_g0)\n}\n"),
    # the launcher
    ("  launch_programmatic(kernel, grid, dim3(Geom<R>::kThreads), bytes, stream, a);\n",
     "  const bool zs_on = std::getenv(\"ZI_STAMPS\") != nullptr;\n"
     "  if (zs_on) {\n"
     "    void* zs = nullptr;\n"
     "    ZI_CUDA_CHECK(cudaGetSymbolAddress(&zs, g_zs));\n"
     "    ZI_CUDA_CHECK(cudaMemsetAsync(zs, 0xff, sizeof(long long) * 512 * 32, stream));\n"
     "  }\n"
     "  launch_programmatic(kernel, grid, dim3(Geom<R>::kThreads), bytes, stream, a);\n"
     "  if (zs_on) zs_print<<<1, 1, 0, stream>>>(static_cast<int>(grid.x * grid.y * grid.z));\n"),
]


def make(out: str) -> None:
    src = open(KERNEL).read()
    for old, new in _PATCHES:
        if src.count(old) != 1:
            sys.exit(f"anchor found {src.count(old)} times (the kernel moved on): {old[:70]!r}")
        src = src.replace(old, new)
    open(out, "w").write("#include <cstdlib>\n" + src)


def run(cases: str) -> None:
    import torch

    sys.path.insert(0, "bench")
    from bench_sparse_mla import make_inputs

    from zeroinfer.ops import sparse_mla_attention
    from zeroinfer.testing import bench

    flush = bench._l2_flush_buffer()
    for case in cases.split(","):
        parts = case.split(":")
        b, h, fmt = int(parts[0]), int(parts[1]), parts[2]
        s_q = int(parts[3]) if len(parts) > 3 else 1
        gen = torch.Generator(device="cuda").manual_seed(0)
        a, _ = make_inputs(b * s_q, h, fmt, "cuda", gen, s_q=s_q)

        def call():
            return sparse_mla_attention(**a)

        for _ in range(3):
            call()
        for rep in range(2):
            flush.zero_()
            torch.cuda.synchronize()
            os.environ["ZI_STAMPS"] = "1"  # (the launcher reads it at every launch)
            print(f"== {case} traced launch {rep}", flush=True)
            call()
            torch.cuda.synchronize()
            del os.environ["ZI_STAMPS"]
        print(f"== {case} kernel us {bench.time_kernels(call) * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(__doc__)
