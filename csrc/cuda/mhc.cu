// CUDA mHC kernels (contract in zeroinfer/mhc.h).
// mixes: one thread a token, the N x N matrix in registers. A decode step has a few to a few
// hundred tokens, so the launch is the cost; what matters is that the ~6 * iters torch ops of a
// Sinkhorn loop become this one launch.
// collapse / mix: one thread a (token, dim), consecutive threads on consecutive dims (coalesced
// loads of each stream's row); mix reads a (token, dim)'s N stream values once for its N outputs.
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
  const unsigned blocks = apply_blocks(p.num_tokens * p.dim);
  mhc_dispatch_apply(p.dtype, p.streams, [&](auto type, auto n) {
    mhc_collapse_kernel<decltype(type), decltype(n)::value>
        <<<blocks, kApplyThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("mhc_collapse");
}

void mhc_mix_cuda(const MhcMixParams& p, void* stream) {
  if (p.num_tokens == 0 || p.dim == 0) return;
  const unsigned blocks = apply_blocks(p.num_tokens * p.dim);
  mhc_dispatch_apply(p.dtype, p.streams, [&](auto type, auto n) {
    mhc_mix_kernel<decltype(type), decltype(n)::value>
        <<<blocks, kApplyThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("mhc_mix");
}

}  // namespace zi
