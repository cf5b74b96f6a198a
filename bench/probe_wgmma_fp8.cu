// Probe (not part of the build): how fast can two or three consumer warpgroups run float8 wgmma
// chains out of shared memory on one SM, with and without the W4A8 per-128-k promotion?
// No global traffic at all: operands are random bytes already in shared memory, so this is the
// ceiling of the consumer side of a warp-specialised W4A8 tile (bench/results/h200/
// moe_gemm_NOTES.md, session 15).  Build and run on the H200:
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc -I csrc/include \
//        bench/probe_wgmma_fp8.cu -o /tmp/wgmma_probe && /tmp/wgmma_probe
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "cuda/ptx.cuh"
#include "cuda/wgmma.cuh"

using namespace zi;

#define ACC128(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64 x 256] += A[64 x 32] * B[32 x 256], e4m3, both from shared memory.
__device__ __forceinline__ void wgmma_m64n256k32_ss(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},"
      " %128, %129, 1, 1, 1;\n"
      "}\n"
      : ACC128(d)
      : "l"(da), "l"(db));
}

// Operand bytes are random & g_mask: 0x3f3f3f3f (small positive values, few toggling bits) or
// 0xf7f7f7f7 (any sign and exponent, mantissa bit 0 clear: no NaN): the tensor pipe's power, and
// so the clock it sustains, depends on the data.
__constant__ uint32_t g_mask;
constexpr int kSlots = 4;          // operand slots cycled through (addresses as in a ring)
constexpr int kA = 64 * 128;       // one warpgroup's A rows, one 128-k stage
// Modes: 0 chain of 4 k32 + wait<0> + promotion (the W4A8 tile); 1 the same without the
// promotion; 2 one chain across every stage, wait<1> per stage (no promotion: the plain FP8
// GEMM ceiling); 3 mode 0 with A from registers (RS); 4 mode 0 with two partial sets, stage kt+1's
// chain issued before stage kt's promotion (kUnroll stages unrolled: nothing in flight at a back
// edge, one promotion in kUnroll exposed).
// kScale (the promotion's scales): 0 per token (column) times a row factor, two ops an output
// (the tile without row bases); 1 per token, one fma an output (the tile with row bases: 16
// LDS.64 a stage); 2 per row, one fma an output (tokens as the M dimension, DeepGEMM's layout:
// two scalar loads a stage). kPing (2 warpgroups, modes 0/1): the warpgroups issue their chains
// strictly in turn (FA3's ping-pong by two named barriers), so one's drain and promotion run
// under the other's chain.
template <int kWgs, int kN, int kMode, int kUnroll = 8, int kScale = 0, bool kPing = false>
__global__ void __launch_bounds__(128 * kWgs, 1) probe(int stages, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr int kB = kN * 128;
  constexpr int kSlot = kWgs * kA + kB + kN * 4;
  const int tid = threadIdx.x, wg = tid / 128, t = tid & 3;
  // random operand bytes (finite e4m3: no 0x7f / 0xff), token scales
  for (int i = tid; i < kSlots * kSlot / 4; i += blockDim.x) {
    uint32_t x = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    reinterpret_cast<uint32_t*>(smem)[i] = x & g_mask;
  }
  for (int s = 0; s < kSlots; ++s)
    for (int i = tid; i < kN; i += blockDim.x)
      reinterpret_cast<float*>(smem + s * kSlot + kWgs * kA + kB)[i] = 1.0f + i * 1e-3f;
  wgmma::fence_proxy_async();
  __syncthreads();
  constexpr int kAcc = kN / 2;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  uint32_t afrag[4] = {0x3a3a3a3au ^ tid, 0x31313131u, 0x2c2c2c2cu, 0x38383838u};
  auto promote = [&](const float(&part)[kAcc], const uint8_t* base) {
    const float* sst = reinterpret_cast<const float*>(base + kWgs * kA + kN * 128);
    if constexpr (kScale == 2) {
      const int row = (tid & 127) / 32 * 16 + (tid & 31) / 4;  // this thread's rows, +8
      const float sg = sst[row], s8 = sst[row + 8];
#pragma unroll
      for (int j = 0; j < kAcc / 4; ++j) {
        acc[4 * j + 0] = fmaf(part[4 * j + 0], sg, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], sg, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], s8, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], s8, acc[4 * j + 3]);
      }
      return;
    }
    constexpr float fg = kScale == 1 ? 1.0f : 0.5f, f8 = kScale == 1 ? 1.0f : 0.25f;
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
      const float2 as = *reinterpret_cast<const float2*>(sst + j * 8 + 2 * t);
      acc[4 * j + 0] = fmaf(part[4 * j + 0] * fg, as.x, acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1] * fg, as.y, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2] * f8, as.x, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3] * f8, as.y, acc[4 * j + 3]);
    }
  };
  // One stage's chain of 4 k32 wgmmas (SS, n128) into `part`, from zero, committed as one group.
  auto chain_from_zero = [&](uint64_t da, uint64_t db, auto& part) {
    wgmma::chain_m64n128k128_e4m3_ss(part, da, db);
  };
  if constexpr (kMode == 4) {
    static_assert(kN == 128, "two 64-register partial sets");
    // descriptors from one opaque base a chain (else the unrolled loop keeps all 32 live)
    const uint64_t da0 = wgmma::desc_sw128(smem_u32(smem + wg * kA), 16, 1024);
    const uint64_t db0 = wgmma::desc_sw128(smem_u32(smem + kWgs * kA), 16, 1024);
    auto issue = [&](int s, float(&part)[kAcc]) {
      uint64_t da = da0, db = db0;
      asm volatile("" : "+l"(da), "+l"(db));
      da += ((s % kSlots) * kSlot) >> 4;
      db += ((s % kSlots) * kSlot) >> 4;
      chain_from_zero(da, db, part);
    };
    for (int s0 = 0; s0 < stages; s0 += kUnroll) {
      float pp[2][kAcc];
      issue(s0, pp[0]);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (k + 1 < kUnroll) {
          issue(s0 + k + 1, pp[(k + 1) & 1]);
          wgmma::wait<1>();
        } else {
          wgmma::wait<0>();
        }
        wgmma::fence_operands(pp[k & 1]);
        promote(pp[k & 1], smem + ((s0 + k) % kSlots) * kSlot);
      }
    }
  }
  else {
  static_assert(!kPing || (kWgs == 2 && kMode <= 1), "ping-pong: two warpgroups, modes 0 / 1");
  // turn barriers 1 (warpgroup 0's) and 2 (warpgroup 1's), 256 threads: 128 arrive, 128 sync
  if (kPing && wg == 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  for (int s = 0; s < stages; ++s) {
    const uint8_t* base = smem + (s % kSlots) * kSlot;
    const uint64_t da = wgmma::desc_sw128(smem_u32(base + wg * kA), 16, 1024);
    const uint64_t db = wgmma::desc_sw128(smem_u32(base + kWgs * kA), 16, 1024);
    if constexpr (kMode == 2) {
      wgmma::fence();
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint64_t desc[2] = {da + 2 * q, db + 2 * q};
        wgmma::fence_operands(desc);
        if constexpr (kN == 256)
          wgmma_m64n256k32_ss(acc, desc[0], desc[1]);
        else
          wgmma::wgmma_m64n128k32_e4m3_ss(acc, desc[0], desc[1], true);
      }
      wgmma::commit();
      wgmma::wait<1>();
    } else {
      float part[kAcc];
      if constexpr (kMode == 3) {
        wgmma::fence();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint64_t desc[1] = {db + 2 * q};
          wgmma::fence_operands(desc);
          wgmma::fence_operands(afrag);
          wgmma::wgmma_e4m3_rs<kN>(part, afrag, desc[0], q != 0);
        }
        wgmma::commit();
      } else {
        if constexpr (kPing) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
        chain_from_zero(da, db, part);
        // the other warpgroup's turn (warpgroup 1 skips its last: nobody would wait for it)
        if constexpr (kPing)
          if (wg == 0 || s + 1 < stages) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
      }
      wgmma::wait<0>();
      wgmma::fence_operands(part);
      if constexpr (kMode == 1) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[i] += part[i];
      } else {
        promote(part, base);
      }
    }
  }
  }
  wgmma::wait<0>();
  wgmma::fence_operands(acc);
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) r += acc[i];
  sink[blockIdx.x * blockDim.x + tid] = r;
}

template <int kWgs, int kN, int kMode, int kUnroll = 8, int kScale = 0, bool kPing = false>
void run(const char* name, int sms, float* sink) {
  constexpr int kSlot = kWgs * kA + kN * 128 + kN * 4;
  const int smem = kSlots * kSlot;
  cudaFuncSetAttribute(probe<kWgs, kN, kMode, kUnroll, kScale, kPing>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int stages = 4096;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  probe<kWgs, kN, kMode, kUnroll, kScale, kPing><<<sms, 128 * kWgs, smem>>>(64, sink);
  cudaEventRecord(a);
  for (int r = 0; r < 5; ++r) probe<kWgs, kN, kMode, kUnroll, kScale, kPing><<<sms, 128 * kWgs, smem>>>(stages, sink);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  const double flops = 5.0 * 2.0 * 64 * kWgs * kN * 128.0 * stages * sms;
  const cudaError_t e = cudaGetLastError();
  printf("%-52s %8.1f TFLOP/s %s\n", name, flops / (ms * 1e-3) / 1e12,
         e == cudaSuccess ? "" : cudaGetErrorString(e));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  cudaMalloc(&sink, sms * 512 * sizeof(float));
  const uint32_t wide = 0xf7f7f7f7u;
  cudaMemcpyToSymbol(g_mask, &wide, 4);
  run<2, 128, 0>("full-entropy bytes: 2 wg, n128, chain 4 + wait0 + promotion", sms, sink);
  run<2, 128, 4, 4>("full-entropy bytes: 2 wg, n128, two partial sets, unroll 4", sms, sink);
  run<2, 128, 2>("full-entropy bytes: 2 wg, n128, one chain, wait1 a stage", sms, sink);
  run<2, 256, 2>("full-entropy bytes: 2 wg, n256, one chain, wait1 a stage", sms, sink);
  const uint32_t narrow = 0x3f3f3f3fu;
  cudaMemcpyToSymbol(g_mask, &narrow, 4);
  run<2, 128, 0>("2 wg, n128, chain 4 + wait0 + promotion (tile)", sms, sink);
  run<2, 128, 4, 2>("2 wg, n128, two partial sets, unroll 2", sms, sink);
  run<2, 128, 4, 4>("2 wg, n128, two partial sets, unroll 4", sms, sink);
  run<2, 128, 4, 8>("2 wg, n128, two partial sets, unroll 8", sms, sink);
  run<1, 128, 4, 4>("1 wg, n128, two partial sets, unroll 4", sms, sink);
  run<2, 128, 1>("2 wg, n128, chain 4 + wait0, no promotion", sms, sink);
  run<2, 128, 2>("2 wg, n128, one chain, wait1 a stage", sms, sink);
  run<2, 256, 2>("2 wg, n256, one chain, wait1 a stage", sms, sink);
  run<1, 256, 2>("1 wg, n256, one chain, wait1 a stage", sms, sink);
  run<2, 128, 3>("2 wg, n128, RS, chain 4 + wait0 + promotion", sms, sink);
  run<3, 128, 0>("3 wg, n128, chain 4 + wait0 + promotion", sms, sink);
  run<3, 128, 2>("3 wg, n128, one chain, wait1 a stage", sms, sink);
  run<1, 128, 0>("1 wg, n128, chain 4 + wait0 + promotion", sms, sink);
  // session 16: the promotion's scales and ping-pong
  run<2, 128, 0, 8, 1>("2 wg, tile loop, token scales, one fma (row bases)", sms, sink);
  run<2, 128, 0, 8, 2>("2 wg, tile loop, row scales (tokens as M)", sms, sink);
  run<2, 128, 0, 8, 1, true>("2 wg, tile loop, token scales, ping-pong", sms, sink);
  run<2, 128, 0, 8, 2, true>("2 wg, tile loop, row scales, ping-pong", sms, sink);
  run<2, 128, 1, 8, 0, true>("2 wg, chain 4 + wait0, no promotion, ping-pong", sms, sink);
  run<2, 128, 4, 4, 2>("2 wg, two partial sets, unroll 4, row scales", sms, sink);
  run<3, 128, 0, 8, 2>("3 wg, tile loop, row scales", sms, sink);
  run<2, 128, 0, 8, 1>("2 wg, tile loop, token scales, one fma (again)", sms, sink);
  run<2, 128, 0, 8, 2>("2 wg, tile loop, row scales (again)", sms, sink);
  return 0;
}
