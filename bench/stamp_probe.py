"""What the clock-stamp probes share (bench/probe_moe_stamps.py, bench/probe_mla_stamps.py): the
device code their stamped kernel copies carry, the patching of a kernel source at fixed anchors,
and the traced launches.

The device code: `g_zs[ZS_CTAS * ZS_SLOTS]`, one row of clock64() deltas a CTA (linear block index;
CTAs past ZS_CTAS are not recorded), written by `ZS_PUT(slot, t0)` (t0: the CTA's clock64() at
entry) and, once at the CTA's end, by `ZS_END(t0, g0)` (g0: its globaltimer at entry), which fills
the reserved slots 16 (clock cycles entry -> end), 17 (ns entry -> end) and 19 (g0). `zs_print`,
launched after the stamped kernel with one thread, prints per slot the min / median / max over the
CTAs in us, each CTA's cycles converted at its own rate (16 / 17), and as slot 18 each CTA's entry
on the globaltimer after the grid's earliest (the launch ramp). (Printf in the stamped kernel itself
would make ptxas serialise its wgmmas, hence the second kernel.)
"""

import os
import sys

_HEAD = r'''
#define ZS_CTAS {ctas}
#define ZS_SLOTS {slots}
__device__ long long g_zs[ZS_CTAS * ZS_SLOTS];
__device__ __forceinline__ unsigned long long zs_gtime() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
__device__ __forceinline__ int zs_cta() {{
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}}
#define ZS_PUT(slot, t0) \
  (zs_cta() < ZS_CTAS ? (void)(g_zs[zs_cta() * ZS_SLOTS + (slot)] = clock64() - (t0)) : (void)0)
#define ZS_END(t0, g0)                                                        \
  if (zs_cta() < ZS_CTAS) {{                                                   \
    g_zs[zs_cta() * ZS_SLOTS + 16] = clock64() - (t0);                        \
    g_zs[zs_cta() * ZS_SLOTS + 17] = static_cast<long long>(zs_gtime() - (g0)); \
    g_zs[zs_cta() * ZS_SLOTS + 19] = static_cast<long long>(g0);              \
  }}
__global__ void zs_print(int ctas) {{
  static long long v[ZS_CTAS];
  ctas = ctas < ZS_CTAS ? ctas : ZS_CTAS;
  long long g_min = -1;
  for (int c = 0; c < ctas; ++c) {{
    const long long g = g_zs[c * ZS_SLOTS + 19];
    if (g >= 0 && (g_min < 0 || g < g_min)) g_min = g;
  }}
  for (int s = 0; s < ZS_SLOTS; ++s) {{
    if (s == 16 || s == 17 || s == 19) continue;
    int n = 0;
    for (int c = 0; c < ctas; ++c) {{
      const long long* row = g_zs + c * ZS_SLOTS;
      if (row[17] <= 0) continue;  // (no end recorded)
      if (s == 18) {{
        if (row[19] >= 0) v[n++] = row[19] - g_min;
        continue;
      }}
      if (row[s] < 0) continue;
      v[n++] = (long long)(row[s] / (double(row[16]) / double(row[17])));
    }}
    if (n == 0) continue;
    for (int i = 1; i < n; ++i)
      for (int j = i; j > 0 && v[j] < v[j - 1]; --j) {{
        const long long y = v[j];
        v[j] = v[j - 1];
        v[j - 1] = y;
      }}
    printf("ZS slot %2d n %3d min %8.2f med %8.2f max %8.2f us\n", s, n, v[0] * 1e-3,
           v[n / 2] * 1e-3, v[n - 1] * 1e-3);
  }}
  double ghz = 0;
  int m = 0;
  for (int c = 0; c < ctas; ++c)
    if (g_zs[c * ZS_SLOTS + 17] > 0) {{
      ghz += double(g_zs[c * ZS_SLOTS + 16]) / g_zs[c * ZS_SLOTS + 17];
      ++m;
    }}
  printf("ZS clock %.3f GHz over %d CTAs\n", m ? ghz / m : 0.0, m);
}}
'''

# The CTA's entry stamps (t0, g0 of ZS_PUT / ZS_END), for a patch at the top of a kernel.
ENTRY = ("  const long long zs_t0 = clock64();\n"
         "  const unsigned long long zs_g0 = zs_gtime();\n")


def head(ctas: int, slots: int) -> str:
    """The device code above for `ctas` recorded CTAs of `slots` slots each (slots > 19)."""
    assert slots > 19, "slots 16-19 are reserved"
    return _HEAD.format(ctas=ctas, slots=slots)


def host_launch(launch: str, grid_ctas: str, ctas: int, slots: int) -> str:
    """`launch` (a host statement launching the stamped kernel) wrapped so that, with ZI_STAMPS
    set, the stamps are cleared before it and printed after it (grid_ctas: the grid's CTA count,
    a C++ expression)."""
    return ("    const bool zs_on = std::getenv(\"ZI_STAMPS\") != nullptr;\n"
            "    if (zs_on) {\n"
            "      void* zs = nullptr;\n"
            "      ZI_CUDA_CHECK(cudaGetSymbolAddress(&zs, g_zs));\n"
            f"      ZI_CUDA_CHECK(cudaMemsetAsync(zs, 0xff, sizeof(long long) * {ctas * slots},"
            " stream));\n"
            "    }\n"
            f"{launch}"
            f"    if (zs_on) zs_print<<<1, 1, 0, stream>>>(static_cast<int>({grid_ctas}));\n")


def make(kernel: str, patches: list[tuple[str, str]], out: str) -> None:
    """Write `kernel` with each (anchor, replacement) of `patches` applied to `out`; exit when an
    anchor is not found exactly once (the kernel moved on)."""
    src = open(kernel).read()
    for old, new in patches:
        if src.count(old) != 1:
            sys.exit(f"anchor found {src.count(old)} times (the kernel moved on): {old[:70]!r}")
        src = src.replace(old, new)
    open(out, "w").write("#include <cstdlib>\n" + src)


def trace(case: str, call) -> None:
    """Three warm-up calls, then two traced launches (L2 flushed before each, as the benchmarks
    time them; the stamped launcher reads ZI_STAMPS at every launch), then the call's kernel us."""
    import torch

    from zeroinfer.testing import bench

    flush = bench._l2_flush_buffer()
    for _ in range(3):
        call()
    for rep in range(2):
        flush.zero_()
        torch.cuda.synchronize()
        os.environ["ZI_STAMPS"] = "1"
        print(f"== {case} traced launch {rep}", flush=True)
        call()
        torch.cuda.synchronize()
        del os.environ["ZI_STAMPS"]
    print(f"== {case} kernel us {bench.time_kernels(call) * 1e6:.1f}", flush=True)
