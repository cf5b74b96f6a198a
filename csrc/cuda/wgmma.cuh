// Hopper warpgroup MMA (wgmma, sm_90a) helpers: shared-memory matrix descriptors and the few
// instruction shapes the kernels use. Operands live in shared memory in the canonical 128-byte
// swizzled layouts (CUTLASS's Swizzle<3,4,3>): rows of 128 bytes, 16-byte chunk c of row r stored
// at chunk c ^ (r % 8), every 1024-byte group of 8 rows aligned to 1024 bytes.
//   K-major (A, or B with K contiguous): 8-row groups SBO bytes apart; LBO unused.
//   N-major B (N contiguous, "transposed"): 64-element N blocks LBO bytes apart, 8-row K groups
//   SBO bytes apart.
// Order of use: writes by ordinary stores or cp.async -> fence_proxy_async() in each writing
// thread -> barrier -> wgmma_fence() -> wgmma calls -> wgmma_commit() -> wgmma_wait<0>().
#pragma once

#include <cstdint>

namespace zi::wgmma {

// The accumulator operands ("+f" d[0] .. d[N-1]) of the wrappers below.
#define ZI_WGMMA_ACC8(d, o)                                                                     \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
      "+f"(d[o + 6]), "+f"(d[o + 7])
#define ZI_WGMMA_ACC16(d) ZI_WGMMA_ACC8(d, 0), ZI_WGMMA_ACC8(d, 8)
#define ZI_WGMMA_ACC32(d) ZI_WGMMA_ACC16(d), ZI_WGMMA_ACC8(d, 16), ZI_WGMMA_ACC8(d, 24)
#define ZI_WGMMA_ACC64(d)                                                                      \
  ZI_WGMMA_ACC32(d), ZI_WGMMA_ACC8(d, 32), ZI_WGMMA_ACC8(d, 40), ZI_WGMMA_ACC8(d, 48),         \
      ZI_WGMMA_ACC8(d, 56)


__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes,
                                               uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // layout type 1: 128-byte swizzle
  return d;
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of wgmma accumulators across the asm statements
// that issue and wait for them (the registers are written asynchronously in between).
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for A fragments in registers (the RS form) and descriptors: every write of them is
// finished before the wgmma.fence that follows, so that ptxas finds no non-wgmma instruction
// defining a wgmma input inside a group (it would inject a warpgroup.arrive before each wgmma).
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint64_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+l"(r[i])::"memory");
}

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64], both from shared memory; B is K-major.
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                     bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : ZI_WGMMA_ACC32(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 128] (+)= A[64 x 16] * B[16 x 128], both from shared memory; B is N-major (transposed).
__device__ __forceinline__ void wgmma_m64n128k16_bf16_tb(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                         bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
      : ZI_WGMMA_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 128] += A[64 x 16] (registers, bf16) * B[16 x 128] (shared memory, K-major).
__device__ __forceinline__ void wgmma_m64n128k16_bf16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                         uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
      " {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
      "}\n"
      : ZI_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 64] += A[64 x 16] (registers, bf16) * B[16 x 64] (shared memory, K-major).
__device__ __forceinline__ void wgmma_m64n64k16_bf16_rs(float (&d)[32], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"
      " {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : ZI_WGMMA_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x N] += A (registers, bf16) * B (shared memory): the RS shapes the bf16 tiles use.
template <int N>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "bf16 RS wgmma: N = 64 or 128");
  if constexpr (N == 64)
    wgmma_m64n64k16_bf16_rs(d, a, desc_b);
  else
    wgmma_m64n128k16_bf16_rs(d, a, desc_b);
}

// D[64 x N] (+)= A[64 x 32] (registers, e4m3) * B[32 x N] (shared memory, e4m3, K-major);
// accumulate = false starts from zero. N / 2 accumulators a thread.
template <int N>
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b, bool accumulate);
template <>
__device__ __forceinline__ void wgmma_e4m3_rs<8>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3},"
      " {%4, %5, %6, %7}, %8, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

template <>
__device__ __forceinline__ void wgmma_e4m3_rs<32>(float (&d)[16], const uint32_t (&a)[4],
                                                  uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15},"
      " {%16, %17, %18, %19}, %20, p, 1, 1;\n"
      "}\n"
      : ZI_WGMMA_ACC16(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

template <>
__device__ __forceinline__ void wgmma_e4m3_rs<64>(float (&d)[32], const uint32_t (&a)[4],
                                                  uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"
      " {%32, %33, %34, %35}, %36, p, 1, 1;\n"
      "}\n"
      : ZI_WGMMA_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

template <>
__device__ __forceinline__ void wgmma_e4m3_rs<128>(float (&d)[64], const uint32_t (&a)[4],
                                                   uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
      " {%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : ZI_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// The 64 accumulator operands %0..%63 of an m64n128 float32 wgmma, as PTX text.
#define ZI_WGMMA_D64                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// D[64 x 128] (+)= A[64 x 32] * B[32 x 128], both e4m3 in shared memory, both K-major (the
// only float8 form); accumulate = false starts from zero.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " ZI_WGMMA_D64 ","
      " %64, %65, p, 1, 1;\n"
      "}\n"
      : ZI_WGMMA_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// The same from zero, with the accumulators as outputs only: the first wgmma of a chain defines
// them, so ptxas sees no dependence on their earlier values (two partial sets in flight).
#define ZI_WGMMA_OUT8(d, o)                                                                     \
  "=f"(d[o + 0]), "=f"(d[o + 1]), "=f"(d[o + 2]), "=f"(d[o + 3]), "=f"(d[o + 4]), "=f"(d[o + 5]), \
      "=f"(d[o + 6]), "=f"(d[o + 7])
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss_zero(float (&d)[64], uint64_t desc_a,
                                                             uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " ZI_WGMMA_D64 ","
      " %64, %65, p, 1, 1;\n"
      "}\n"
      : ZI_WGMMA_OUT8(d, 0), ZI_WGMMA_OUT8(d, 8), ZI_WGMMA_OUT8(d, 16), ZI_WGMMA_OUT8(d, 24),
        ZI_WGMMA_OUT8(d, 32), ZI_WGMMA_OUT8(d, 40), ZI_WGMMA_OUT8(d, 48), ZI_WGMMA_OUT8(d, 56)
      : "l"(desc_a), "l"(desc_b));
}
#undef ZI_WGMMA_OUT8
#undef ZI_WGMMA_D64

// One 128-k stage as a chain from zero: D[64 x 128] = A[64 x 128] * B[128 x 128], both e4m3 in
// shared memory (K-major, 128-byte swizzle: the k32 steps are +32 bytes, i.e. +2 in the
// descriptors' address field), four wgmmas committed as one group.
__device__ __forceinline__ void chain_m64n128k128_e4m3_ss(float (&d)[64], uint64_t desc_a,
                                                         uint64_t desc_b) {
  fence();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint64_t desc[2] = {desc_a + 2 * q, desc_b + 2 * q};
    fence_operands(desc);
    if (q == 0)
      wgmma_m64n128k32_e4m3_ss_zero(d, desc[0], desc[1]);
    else
      wgmma_m64n128k32_e4m3_ss(d, desc[0], desc[1], true);
  }
  commit();
}

#undef ZI_WGMMA_ACC64
#undef ZI_WGMMA_ACC32
#undef ZI_WGMMA_ACC16
#undef ZI_WGMMA_ACC8

}  // namespace zi::wgmma
