// The mixes of one mHC hyper-connection (V4's manifold-constrained hyper-connections) from its
// projection, per token, in float32:
//     z = [z_pre (N) | z_post (N) | z_comb (N*N, row-major)],  base likewise,  scale [3]
//     pre[i]  = sigmoid(z_pre[i] * scale[0] + base_pre[i]) + eps
//     post[i] = 2 * sigmoid(z_post[i] * scale[1] + base_post[i])
//     C       = softmax(z_comb * scale[2] + base_comb, over each row's N entries) + eps
//     C      /= column sums + eps                       (columns first)
//     iters - 1 times:  C /= row sums + eps;  C /= column sums + eps
// One launch in place of the ~6 * iters small torch ops a Sinkhorn loop costs (V4: 20 iterations,
// two hyper-connections a layer). Sums run in index order and every token is computed alone, so
// a token's mixes do not depend on the batch. Reference: zeroinfer.reference.mhc.
#pragma once

#include <cstdint>
#include <type_traits>

#include "zeroinfer/common.h"
#include "zeroinfer/numeric.h"

namespace zi {

constexpr int kMhcMaxStreams = 8;  // hc_mult; V4 uses 4

struct MhcMixesParams {
  int64_t num_tokens;   // T
  int32_t streams;      // N, 1..kMhcMaxStreams
  int32_t iters;        // Sinkhorn iterations (>= 1)
  float eps;            // the hyper-connection epsilon (floor and denominators)
  const float* z;       // [T, (2 + N) * N] the projection
  const float* scale;   // [3]
  const float* base;    // [(2 + N) * N]
  float* pre;           // [T, N] out
  float* post;          // [T, N] out
  float* comb;          // [T, N, N] out
};

namespace mhc_detail {

ZI_HD float sigmoid(float x) { return 1.f / (1.f + exp_f(-x)); }

}  // namespace mhc_detail

// Token t's mixes, one thread's loop: the CPU twin's, and the order of operations the CUDA kernel
// (which spreads the matrix over a warp's lanes, cuda/mhc.cu) keeps entry by entry.
template <int N>
ZI_HD void mhc_mixes_token(const MhcMixesParams& p, int64_t t) {
  using mhc_detail::sigmoid;
  constexpr int kWidth = (2 + N) * N;
  const float* z = p.z + t * kWidth;
  const float s_pre = p.scale[0], s_post = p.scale[1], s_comb = p.scale[2], eps = p.eps;
  for (int i = 0; i < N; ++i) {
    p.pre[t * N + i] = sigmoid(z[i] * s_pre + p.base[i]) + eps;
    p.post[t * N + i] = 2.f * sigmoid(z[N + i] * s_post + p.base[N + i]);
  }
  float c[N][N];
  for (int r = 0; r < N; ++r) {
    float m = -INFINITY;
    for (int k = 0; k < N; ++k) {
      c[r][k] = z[2 * N + r * N + k] * s_comb + p.base[2 * N + r * N + k];
      m = c[r][k] > m ? c[r][k] : m;
    }
    float sum = 0.f;
    for (int k = 0; k < N; ++k) {
      c[r][k] = exp_f(c[r][k] - m);
      sum += c[r][k];
    }
    for (int k = 0; k < N; ++k) c[r][k] = c[r][k] / sum + eps;
  }
  auto normalise_columns = [&] {
    for (int k = 0; k < N; ++k) {
      float sum = 0.f;
      for (int r = 0; r < N; ++r) sum += c[r][k];
      for (int r = 0; r < N; ++r) c[r][k] = c[r][k] / (sum + eps);
    }
  };
  normalise_columns();
  for (int it = 1; it < p.iters; ++it) {
    for (int r = 0; r < N; ++r) {
      float sum = 0.f;
      for (int k = 0; k < N; ++k) sum += c[r][k];
      for (int k = 0; k < N; ++k) c[r][k] = c[r][k] / (sum + eps);
    }
    normalise_columns();
  }
  for (int r = 0; r < N; ++r)
    for (int k = 0; k < N; ++k) p.comb[(t * N + r) * N + k] = c[r][k];
}

// Calls f(std::integral_constant<int, N>{}) for the runtime stream count (1..kMhcMaxStreams).
template <class F>
void mhc_dispatch_streams(int streams, F&& f) {
  switch (streams) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: ZI_CHECK(false, "mhc_mixes: streams must be in 1..kMhcMaxStreams");
  }
}

void mhc_mixes_cpu(const MhcMixesParams& p);
void mhc_mixes_cuda(const MhcMixesParams& p, void* stream);

// ---- applying the mixes to the residual streams -------------------------------------------
// Elementwise per (token t, dim d), with the roundings of the torch form the model had (HF's):
//   collapse   x[t, d]    = cast(sum_n pre[t, n] * float(streams[t, n, d]))    float32, n in order
//   mix        y[t, k, d] = post'[t, k] * out[t, d] + sum_j comb'[t, j, k] * streams[t, j, d]
//              post' and comb' cast to the streams' dtype first, every product and partial sum
//              rounded to that dtype (bf16 or float32) as torch's separate ops round them, j in
//              order (C transposed: input stream j feeds output stream k through comb[j, k]).
// No fused multiply-adds (mul_rn / add_rn, zeroinfer/numeric.h; the CPU file: -ffp-contract=off),
// so the CPU twin, the CUDA kernel and that torch form agree bitwise, and a token's result does
// not depend on the batch. Two launches in place of ~20 torch calls each.
struct MhcCollapseParams {
  int64_t num_tokens;   // T
  int32_t streams;      // N, 1..kMhcMaxStreams
  int64_t dim;          // D
  DType dtype;          // of streams and x: float32 or bfloat16
  const float* pre;     // [T, N]
  const void* x_in;     // streams [T, N, D]
  void* x_out;          // x [T, D] out
};

struct MhcMixParams {
  int64_t num_tokens;   // T
  int32_t streams;      // N, 1..kMhcMaxStreams
  int64_t dim;          // D
  DType dtype;          // of streams, out and y: float32 or bfloat16
  const float* post;    // [T, N]
  const float* comb;    // [T, N, N]
  const void* x_in;     // streams [T, N, D]
  const void* block;    // the block's output [T, D]
  void* y_out;          // y [T, N, D] out
};

template <class T, int N>
ZI_HD void mhc_collapse_elem(const MhcCollapseParams& p, int64_t t, int64_t d) {
  const T* x = static_cast<const T*>(p.x_in) + t * N * p.dim + d;
  const float* pre = p.pre + t * N;
  float acc = mul_rn(pre[0], to_float(x[0]));
  for (int n = 1; n < N; ++n) acc = add_rn(acc, mul_rn(pre[n], to_float(x[n * p.dim])));
  static_cast<T*>(p.x_out)[t * p.dim + d] = from_float<T>(acc);
}

// All N output streams of (t, d): each input element is read once.
template <class T, int N>
ZI_HD void mhc_mix_elem(const MhcMixParams& p, int64_t t, int64_t d) {
  const T* x = static_cast<const T*>(p.x_in) + t * N * p.dim + d;
  float xs[N];
  for (int j = 0; j < N; ++j) xs[j] = to_float(x[j * p.dim]);
  const float o = to_float(static_cast<const T*>(p.block)[t * p.dim + d]);
  const float* post = p.post + t * N;
  const float* comb = p.comb + t * N * N;
  T* y = static_cast<T*>(p.y_out) + t * N * p.dim + d;
  for (int k = 0; k < N; ++k) {
    float acc = round_to<T>(mul_rn(round_to<T>(post[k]), o));
    for (int j = 0; j < N; ++j)
      acc = round_to<T>(add_rn(acc, round_to<T>(mul_rn(round_to<T>(comb[j * N + k]), xs[j]))));
    y[k * p.dim] = from_float<T>(acc);
  }
}

// Calls f(T{}, std::integral_constant<int, N>{}) for the storage type and the stream count.
template <class F>
void mhc_dispatch_apply(DType dtype, int streams, F&& f) {
  ZI_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16,
           "mhc collapse / mix: streams must be float32 or bfloat16");
  mhc_dispatch_streams(streams, [&](auto n) {
    if (dtype == DType::kFloat32) {
      f(float{}, n);
    } else {
      f(uint16_t{}, n);
    }
  });
}

void mhc_collapse_cpu(const MhcCollapseParams& p);
void mhc_collapse_cuda(const MhcCollapseParams& p, void* stream);
void mhc_mix_cpu(const MhcMixParams& p);
void mhc_mix_cuda(const MhcMixParams& p, void* stream);

}  // namespace zi
