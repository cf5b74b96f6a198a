// CUDA mHC kernels (contract in zeroinfer/mhc.h).
// mixes: one thread a token, the N x N matrix in registers. A decode step has a few to a few
// hundred tokens, so the launch is the cost; what matters is that the ~6 * iters torch ops of a
// Sinkhorn loop become this one launch.
// collapse / mix: one thread a (token, dim), consecutive threads on consecutive dims (coalesced
// loads of each stream's row); mix reads a (token, dim)'s N stream values once for its N outputs.
// Where rows are 16-byte aligned (the model's case) collapse and mix take 16 bytes of a (token,
// row) a thread - 8 bf16 or 4 float32 dims - so a token's pre, or post / comb, are loaded (and
// rounded) once for 8 (4) outputs instead of once each; the mix's bf16 runs on bf16x2
// arithmetic with the same bits (argued below).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/mhc.h"

namespace zi {
namespace {

constexpr int kThreads = 128;
constexpr int kApplyThreads = 256;

template <int N>
__global__ void __launch_bounds__(kThreads) mhc_mixes_kernel(MhcMixesParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t < p.num_tokens) mhc_mixes_token<N>(p, t);
}

template <class T, int N>
__global__ void __launch_bounds__(kApplyThreads) mhc_collapse_kernel(MhcCollapseParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + threadIdx.x;
  if (i < p.num_tokens * p.dim) mhc_collapse_elem<T, N>(p, i / p.dim, i % p.dim);
}

template <class T, int N>
__global__ void __launch_bounds__(kApplyThreads) mhc_mix_kernel(MhcMixParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + threadIdx.x;
  if (i < p.num_tokens * p.dim) mhc_mix_elem<T, N>(p, i / p.dim, i % p.dim);
}

// mix on 16 bytes of a row a thread: four lanes of the arithmetic type, float32 for float32
// streams and bf16x2 pairs for bf16 ones. bf16 x bf16 -> bf16 (mul.rn.bf16x2) is round_to<bf16>
// of the float product, which is exact; bf16 + bf16 -> bf16 (add.rn.bf16x2) is round_to<bf16> of
// the float sum: rounding to float first and then to bf16 cannot differ from rounding once (24 >=
// 2 * 8 + 2 bits: double rounding is innocuous for +, -, x). Subnormals kept by both; the _rn
// forms are never contracted into an fma. So each term is mhc_mix_elem's, in bf16 two outputs an
// instruction.
template <class T>
struct MixLanes;

template <>
struct MixLanes<float> {
  using Lane = float;
  static __device__ __forceinline__ Lane splat(float v) { return v; }
  static __device__ __forceinline__ Lane mul(Lane a, Lane b) { return mul_rn(a, b); }
  static __device__ __forceinline__ Lane add(Lane a, Lane b) { return add_rn(a, b); }
};

template <>
struct MixLanes<uint16_t> {
  using Lane = __nv_bfloat162;
  static __device__ __forceinline__ Lane splat(float v) {
    return __bfloat162bfloat162(__float2bfloat16_rn(v));
  }
  static __device__ __forceinline__ Lane mul(Lane a, Lane b) { return __hmul2_rn(a, b); }
  static __device__ __forceinline__ Lane add(Lane a, Lane b) { return __hadd2_rn(a, b); }
};

template <class T, int N>
__global__ void __launch_bounds__(kApplyThreads) mhc_mix_vec_kernel(MhcMixParams p) {
  using L = MixLanes<T>;
  struct Chunk {
    typename L::Lane h[4];
  };
  static_assert(sizeof(Chunk) == 16, "16 bytes of a row");
  constexpr int V = 16 / sizeof(T);  // dims a chunk
  const int64_t vecs = p.dim / V;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + threadIdx.x;
  if (i >= p.num_tokens * vecs) return;
  const int64_t t = i / vecs, d = (i - t * vecs) * V;
  const T* x = static_cast<const T*>(p.x_in) + t * N * p.dim + d;
  Chunk xs[N];
#pragma unroll
  for (int j = 0; j < N; ++j) xs[j] = *reinterpret_cast<const Chunk*>(x + j * p.dim);
  const Chunk o = *reinterpret_cast<const Chunk*>(static_cast<const T*>(p.block) + t * p.dim + d);
  const float* post = p.post + t * N;
  const float* comb = p.comb + t * N * N;
  T* y = static_cast<T*>(p.y_out) + t * N * p.dim + d;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const typename L::Lane pk = L::splat(post[k]);
    Chunk acc;
#pragma unroll
    for (int h = 0; h < 4; ++h) acc.h[h] = L::mul(pk, o.h[h]);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const typename L::Lane c = L::splat(comb[j * N + k]);
#pragma unroll
      for (int h = 0; h < 4; ++h) acc.h[h] = L::add(acc.h[h], L::mul(c, xs[j].h[h]));
    }
    *reinterpret_cast<Chunk*>(y + k * p.dim) = acc;
  }
}

// collapse, 16 bytes of the output row a thread (8 bf16 / 4 float32 dims): mhc_collapse_elem's
// float32 arithmetic on each, the token's pre loaded once for all of them.
template <class T, int N>
__global__ void __launch_bounds__(kApplyThreads) mhc_collapse_vec_kernel(MhcCollapseParams p) {
  constexpr int V = 16 / sizeof(T);
  union Vec {
    uint4 raw;
    T v[V];
  };
  const int64_t vecs = p.dim / V;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + threadIdx.x;
  if (i >= p.num_tokens * vecs) return;
  const int64_t t = i / vecs, d = (i - t * vecs) * V;
  const T* x = static_cast<const T*>(p.x_in) + t * N * p.dim + d;
  const float* pre = p.pre + t * N;
  float acc[V];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    Vec in;
    in.raw = *reinterpret_cast<const uint4*>(x + n * p.dim);
    const float w = pre[n];
#pragma unroll
    for (int e = 0; e < V; ++e)
      acc[e] = n == 0 ? mul_rn(w, to_float(in.v[e])) : add_rn(acc[e], mul_rn(w, to_float(in.v[e])));
  }
  Vec out;
#pragma unroll
  for (int e = 0; e < V; ++e) out.v[e] = from_float<T>(acc[e]);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.x_out) + t * p.dim + d) = out.raw;
}

bool aligned16(const void* a) { return (reinterpret_cast<uintptr_t>(a) & 15u) == 0; }

unsigned apply_blocks(int64_t elems) {
  const int64_t blocks = (elems + kApplyThreads - 1) / kApplyThreads;
  ZI_CHECK(blocks <= 0x7fffffff, "mhc collapse / mix: too many elements for one launch");
  return static_cast<unsigned>(blocks);
}

}  // namespace

void mhc_mixes_cuda(const MhcMixesParams& p, void* stream) {
  ZI_CHECK(p.iters >= 1, "mhc_mixes: iters must be >= 1");
  if (p.num_tokens == 0) return;
  const int64_t blocks = (p.num_tokens + kThreads - 1) / kThreads;
  mhc_dispatch_streams(p.streams, [&](auto n) {
    mhc_mixes_kernel<decltype(n)::value><<<static_cast<unsigned>(blocks), kThreads, 0,
                                           static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("mhc_mixes");
}

void mhc_collapse_cuda(const MhcCollapseParams& p, void* stream) {
  if (p.num_tokens == 0 || p.dim == 0) return;
  const int vec = p.dtype == DType::kBFloat16 ? 8 : 4;  // dims in 16 bytes
  const bool vectors = p.dim % vec == 0 && aligned16(p.x_in) && aligned16(p.x_out);
  const unsigned blocks = apply_blocks(p.num_tokens * (vectors ? p.dim / vec : p.dim));
  const auto s = static_cast<cudaStream_t>(stream);
  mhc_dispatch_apply(p.dtype, p.streams, [&](auto type, auto n) {
    using T = decltype(type);
    constexpr int N = decltype(n)::value;
    if (vectors) {
      mhc_collapse_vec_kernel<T, N><<<blocks, kApplyThreads, 0, s>>>(p);
    } else {
      mhc_collapse_kernel<T, N><<<blocks, kApplyThreads, 0, s>>>(p);
    }
  });
  ZI_CUDA_CHECK_LAUNCH("mhc_collapse");
}

void mhc_mix_cuda(const MhcMixParams& p, void* stream) {
  if (p.num_tokens == 0 || p.dim == 0) return;
  const int vec = p.dtype == DType::kBFloat16 ? 8 : 4;  // dims in 16 bytes
  const bool vectors = p.dim % vec == 0 && aligned16(p.x_in) && aligned16(p.block) &&
                       aligned16(p.y_out);
  const unsigned blocks = apply_blocks(p.num_tokens * (vectors ? p.dim / vec : p.dim));
  const auto s = static_cast<cudaStream_t>(stream);
  mhc_dispatch_apply(p.dtype, p.streams, [&](auto type, auto n) {
    using T = decltype(type);
    constexpr int N = decltype(n)::value;
    if (vectors) {
      mhc_mix_vec_kernel<T, N><<<blocks, kApplyThreads, 0, s>>>(p);
    } else {
      mhc_mix_kernel<T, N><<<blocks, kApplyThreads, 0, s>>>(p);
    }
  });
  ZI_CUDA_CHECK_LAUNCH("mhc_mix");
}

}  // namespace zi
