// CUDA mHC mixes (contract in zeroinfer/mhc.h): one thread a token, the N x N matrix in
// registers. A decode step has a few to a few hundred tokens, so the launch is the cost; what
// matters is that the ~6 * iters torch ops of a Sinkhorn loop become this one launch.
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/mhc.h"

namespace zi {
namespace {

constexpr int kThreads = 128;

template <int N>
__global__ void __launch_bounds__(kThreads) mhc_mixes_kernel(MhcMixesParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t < p.num_tokens) mhc_mixes_token<N>(p, t);
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

}  // namespace zi
