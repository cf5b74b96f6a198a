// CUDA mHC kernels (contract in zeroinfer/mhc.h).
// mixes: a token's N x N matrix spread over the lanes of a warp, one entry a lane (N <= 5; V4's
// N = 4: two tokens a warp) or one row a lane (N = 6..8), row and column sums gathered with
// shuffles in index order. A decode step has one to a few hundred tokens, so this is latency:
// one thread a token (mhc_mixes_token, the CPU twin's loop) ran 2 * iters * N^2 correctly
// rounded divisions back to back, ~23 us at V4's shape on an H100; a lane here runs 2 * iters.
// Every entry sees the operations of mhc_mixes_token in the same order, so the bits are its.
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

// How a token's N x N entries sit on a warp's lanes: entry e = r * N + k is on lane e / kPerLane
// of the token's group, in its register e % kPerLane.
template <int N>
struct MixesLanes {
  static constexpr int kPerLane = N * N <= 32 ? 1 : N;
  static constexpr int kLanes = N * N / kPerLane;         // lanes a token
  static constexpr int kTokensPerWarp = 32 / kLanes;
};

template <int N>
__global__ void __launch_bounds__(kThreads) mhc_mixes_kernel(MhcMixesParams p) {
  using mhc_detail::sigmoid;
  using L = MixesLanes<N>;
  constexpr int P = L::kPerLane;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  // Lanes past the last whole group (32 % kLanes of them) shadow the last group: every lane
  // takes part in every shuffle (full mask) and reads in bounds; only live lanes store.
  const int group = min(lane / L::kLanes, L::kTokensPerWarp - 1);
  const int base = group * L::kLanes;
  const int sub = lane - base < L::kLanes ? lane - base : lane - base - L::kLanes;
  const int64_t token = warp * L::kTokensPerWarp + group;
  const bool live = lane / L::kLanes < L::kTokensPerWarp && token < p.num_tokens;
  const int64_t t = token < p.num_tokens ? token : 0;
  const float* z = p.z + t * ((2 + N) * N);
  const float eps = p.eps;

  for (int i = sub; i < 2 * N; i += L::kLanes) {
    const float v = i < N ? sigmoid(z[i] * p.scale[0] + p.base[i]) + eps
                          : 2.f * sigmoid(z[i] * p.scale[1] + p.base[i]);
    if (live) (i < N ? p.pre[t * N + i] : p.post[t * N + i - N]) = v;
  }

  // My entries: (row, col of register j) = (r0, k0 + j) with P = N (a row), or (r0, k0), P = 1.
  const int r0 = P == 1 ? sub / N : sub;
  const int k0 = P == 1 ? sub % N : 0;
  float c[P];
  const float s_comb = p.scale[2];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int e = 2 * N + r0 * N + k0 + j;
    c[j] = z[e] * s_comb + p.base[e];
  }
  // Entry (r, k) of the token's matrix, from the lane that holds it. In the row-a-lane layout
  // the register is k, so k must be a compile-time index there (every caller's loop unrolls).
  auto at = [&](int r, int k) {
    if constexpr (P == 1) {
      return __shfl_sync(kAll, c[0], base + r * N + k);
    } else {
      return __shfl_sync(kAll, c[k], base + r);
    }
  };
  {  // softmax over the row: max, exp, in-order sum, divide, + eps
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < N; ++k) m = fmaxf(m, at(r0, k));
#pragma unroll
    for (int j = 0; j < P; ++j) c[j] = exp_f(c[j] - m);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) sum += at(r0, k);
#pragma unroll
    for (int j = 0; j < P; ++j) c[j] = c[j] / sum + eps;
  }
  auto normalise_rows = [&] {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) sum += at(r0, k);
#pragma unroll
    for (int j = 0; j < P; ++j) c[j] = c[j] / (sum + eps);
  };
  auto normalise_columns = [&] {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < N; ++r) {
        if constexpr (P == 1) {
          sum += at(r, k0);
        } else {
          sum += __shfl_sync(kAll, c[j], base + r);  // entry (r, j)
        }
      }
      c[j] = c[j] / (sum + eps);
    }
  };
  normalise_columns();
  for (int it = 1; it < p.iters; ++it) {
    normalise_rows();
    normalise_columns();
  }
  if (live) {
#pragma unroll
    for (int j = 0; j < P; ++j) p.comb[(t * N + r0) * N + k0 + j] = c[j];
  }
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
  mhc_dispatch_streams(p.streams, [&](auto n) {
    constexpr int N = decltype(n)::value;
    const int64_t warps = (p.num_tokens + MixesLanes<N>::kTokensPerWarp - 1) /
                          MixesLanes<N>::kTokensPerWarp;
    const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
    ZI_CHECK(blocks <= 0x7fffffff, "mhc_mixes: too many tokens for one launch");
    mhc_mixes_kernel<N><<<static_cast<unsigned>(blocks), kThreads, 0,
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
