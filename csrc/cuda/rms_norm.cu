// CUDA RMS norms (contract in zeroinfer/rms_norm.h), two kernels, the contract's bits both:
// * rows of up to kWarpRowMax elements (V4's per-head q norm, 512, 64 rows a token): a warp a
//   row, 4 rows a CTA. Thread l holds the contract's lanes 8l .. 8l + 7, so its
//   elements of a 256-wide chunk are 8 consecutive ones - one 16-byte load (bf16) or two
//   (float32) where rows are 16-byte aligned. The fold's first five steps (h = 128 .. 8) pair
//   lanes of different threads (shuffles), the last three lanes of thread 0.
// * longer rows (the layer norms, 4096, and the mHC's over the flattened streams, 4 x 4096
//   float32): one CTA of 256 threads a row; thread j makes lane j's sum (coalesced strided
//   reads), the lanes fold in shared memory. (On the H100 a warp a row took 13.4 us for one
//   4096-wide bf16 row against this kernel's 8.7, and 31.9 against 30.0 us at 4096 rows.)
// Both then write the row, whose second read hits L1 / L2.
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/rms_norm.h"

namespace zi {
namespace {

constexpr int kWarpRowMax = 1024;
constexpr int kRowsPerCta = 4;
constexpr int kPerThread = kRmsNormLanes / 32;  // lanes a thread: 8

// The 8 elements at x + i (16-byte aligned when vec) as floats; scalar loads otherwise.
template <class T>
__device__ __forceinline__ void load8(const T* x, int64_t i, bool vec, float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    if (vec) {
      const uint4 w = *reinterpret_cast<const uint4*>(x + i);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(u[k] << 16);
        v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
      }
      return;
    }
  } else {
    if (vec) {
      const float4 a = *reinterpret_cast<const float4*>(x + i);
      const float4 b = *reinterpret_cast<const float4*>(x + i + 4);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
      v[7] = b.w;
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = to_float(x[i + k]);
}

// 8 floats to y + i (16-byte aligned), rounded to T.
template <class T>
__device__ __forceinline__ void store8(T* y, int64_t i, const float (&o)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint32_t u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      u[k] = uint32_t{from_float<T>(o[2 * k])} | uint32_t{from_float<T>(o[2 * k + 1])} << 16;
    *reinterpret_cast<uint4*>(y + i) = make_uint4(u[0], u[1], u[2], u[3]);
  } else {
    *reinterpret_cast<float4*>(y + i) = make_float4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<float4*>(y + i + 4) = make_float4(o[4], o[5], o[6], o[7]);
  }
}

template <class T>
__global__ void __launch_bounds__(32 * kRowsPerCta) rms_norm_warp_kernel(RmsNormParams p,
                                                                         bool vec) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 5);
  if (row >= p.rows) return;  // (whole warps: the shuffles below stay full)
  const int l = threadIdx.x & 31;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  T* y = static_cast<T*>(p.y) + row * p.dim;
  // Lane 8l + k sums elements 8l + k + 256 m, m ascending. A chunk's 8 elements are whole or
  // absent where D % 8 == 0 (vec); otherwise element by element.
  float s[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) s[k] = 0.f;
#pragma unroll 2
  for (int64_t c0 = 8 * l; c0 < p.dim; c0 += kRmsNormLanes) {
    if (vec || c0 + 8 <= p.dim) {
      float v[8];
      load8(x, c0, vec, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) s[k] = add_rn(s[k], mul_rn(v[k], v[k]));
    } else {
      for (int k = 0; c0 + k < p.dim; ++k) {
        const float v = to_float(x[c0 + k]);
        s[k] = add_rn(s[k], mul_rn(v, v));
      }
    }
  }
  // Lane j += lane j + h: h = 128 .. 8 across threads (thread l < h / 8 takes thread l + h / 8's
  // lanes), then h = 4, 2, 1 inside thread 0.
#pragma unroll
  for (int ht = 16; ht >= 1; ht /= 2) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const float other = __shfl_down_sync(0xffffffffu, s[k], ht);
      if (l < ht) s[k] = add_rn(s[k], other);
    }
  }
#pragma unroll
  for (int h = 4; h >= 1; h /= 2)
#pragma unroll
    for (int k = 0; k < h; ++k) s[k] = add_rn(s[k], s[k + h]);
  const float r = rms_factor(__shfl_sync(0xffffffffu, s[0], 0), p.dim, p.eps);
  for (int64_t c0 = 8 * l; c0 < p.dim; c0 += kRmsNormLanes) {
    if (!vec) {
      for (int k = 0; k < 8 && c0 + k < p.dim; ++k) rms_apply<T>(p, x, y, r, c0 + k);
      continue;
    }
    // 8 elements a load / store
    const bool weighted = p.weight != nullptr;
    const float rt = round_to<T>(r);
    float v[8], w[8] = {}, o[8];
    load8(x, c0, true, v);
    if (weighted) load8(p.weight, c0, true, w);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = rms_scaled(v[k], weighted, w[k], r, rt);
    store8(y, c0, o);
  }
}

// The CTA kernel's loads, kBatch a thread at a time, all issued before their first use: in a
// plain loop the compiler waited on each, a trip to memory an element (one 4096-wide row took
// 8.8 us on the H100, 3.8 with batches of 8, 2.9 with 16 - its whole share a thread). Longer
// rows take batches of 32 (the mHC's 4 x 4096 float32 rows: two trips instead of four; 80
// registers, 3 CTAs an SM for the many-row case - 64 would take 170, one CTA an SM): on the H100
// the mHC norm 4.6-5.0 -> 4.1 us at 1-8 tokens, 26.4 -> 22.8 at 512, 261 -> 236 at 4096.
template <class T, int kBatch>
__global__ void __launch_bounds__(kRmsNormLanes) rms_norm_kernel(RmsNormParams p) {
  __shared__ float lanes[kRmsNormLanes];
  const int64_t row = blockIdx.x;
  const int j = threadIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  T* y = static_cast<T*>(p.y) + row * p.dim;
  // Lane j's sum in the contract's order (elements j + 256 m, m ascending).
  constexpr int64_t kStep = kRmsNormLanes;
  float sum = 0.f;
  int64_t i = j;
  for (; i + (kBatch - 1) * kStep < p.dim; i += kBatch * kStep) {
    float v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) v[b] = to_float(x[i + b * kStep]);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) sum = add_rn(sum, mul_rn(v[b], v[b]));
  }
  for (; i < p.dim; i += kStep) {
    const float v = to_float(x[i]);
    sum = add_rn(sum, mul_rn(v, v));
  }
  lanes[j] = sum;
  __syncthreads();
  for (int h = kRmsNormLanes / 2; h >= 1; h /= 2) {
    if (j < h) lanes[j] = add_rn(lanes[j], lanes[j + h]);
    __syncthreads();
  }
  const float r = rms_factor(lanes[0], p.dim, p.eps);
  // A batch's loads (x again, the weight) all before its stores (y might alias them as far as
  // the compiler knows, so it would not move a load above a store). rms_scaled's arithmetic
  // written out, testing p.weight in the loop: with rms_scaled and the test hoisted into a flag,
  // ptxas gave the bf16 16-a-thread kernel 40 registers instead of 46, and the 4096-wide layer
  // norm took 3.33 us a token instead of 2.91 (H100, 3 alternated rounds; the same bits).
  const float rt = round_to<T>(r);
  for (i = j; i + (kBatch - 1) * kStep < p.dim; i += kBatch * kStep) {
    float v[kBatch], w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      v[b] = to_float(x[i + b * kStep]);
      w[b] = p.weight ? p.weight[i + b * kStep] : 0.f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      y[i + b * kStep] = from_float<T>(p.weight ? mul_rn(w[b], mul_rn(v[b], r))
                                                : mul_rn(v[b], rt));
  }
  for (; i < p.dim; i += kStep) rms_apply<T>(p, x, y, r, i);
}

}  // namespace

void rms_norm_cuda(const RmsNormParams& p, void* stream) {
  ZI_CHECK(p.dim >= 1, "rms_norm: need D >= 1");
  if (p.rows == 0) return;
  ZI_CHECK(p.rows <= 0x7fffffff, "rms_norm: too many rows for one launch");
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_float_or_bf16(p.dtype, "rms_norm: x must be float32 or bfloat16",
                         [&](auto type) {
    using T = decltype(type);
    if (p.dim <= kWarpRowMax) {
      auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
      const bool vec = p.dim % 8 == 0 && aligned(p.x) && aligned(p.y) &&
                       p.x_stride * static_cast<int64_t>(sizeof(T)) % 16 == 0 &&
                       (p.weight == nullptr || aligned(p.weight));
      const int64_t blocks = (p.rows + kRowsPerCta - 1) / kRowsPerCta;
      rms_norm_warp_kernel<T><<<static_cast<unsigned>(blocks), 32 * kRowsPerCta, 0, s>>>(p, vec);
    } else {
      const auto grid = static_cast<unsigned>(p.rows);
      const int64_t share = (p.dim + kRmsNormLanes - 1) / kRmsNormLanes;  // elements a thread
      // (a batch only where a thread has that many: the rest goes one load at a time)
      if (share < 32) {
        rms_norm_kernel<T, 16><<<grid, kRmsNormLanes, 0, s>>>(p);
      } else {
        rms_norm_kernel<T, 32><<<grid, kRmsNormLanes, 0, s>>>(p);
      }
    }
  });
  ZI_CUDA_CHECK_LAUNCH("rms_norm");
}

}  // namespace zi
