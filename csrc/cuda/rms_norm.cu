// CUDA RMS norms (contract in zeroinfer/rms_norm.h): one CTA of 256 threads a row; thread j makes
// lane j's sum of squares (coalesced strided reads), the lanes fold pairwise in shared memory in
// the contract's order, then the threads write the row (the row's second read hits L1 / L2).
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/rms_norm.h"

namespace zi {
namespace {

template <class T>
__global__ void __launch_bounds__(kRmsNormLanes) rms_norm_kernel(RmsNormParams p) {
  __shared__ float lanes[kRmsNormLanes];
  const int64_t row = blockIdx.x;
  const int j = threadIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.dim;
  T* y = static_cast<T*>(p.y) + row * p.dim;
  lanes[j] = rms_lane_sum(x, p.dim, j);
  __syncthreads();
  for (int h = kRmsNormLanes / 2; h >= 1; h /= 2) {
    if (j < h) lanes[j] = add_rn(lanes[j], lanes[j + h]);
    __syncthreads();
  }
  const float r = rms_factor(lanes[0], p.dim, p.eps);
  for (int64_t i = j; i < p.dim; i += kRmsNormLanes) rms_apply<T>(p, x, y, r, i);
}

}  // namespace

void rms_norm_cuda(const RmsNormParams& p, void* stream) {
  ZI_CHECK(p.dim >= 1, "rms_norm: need D >= 1");
  if (p.rows == 0) return;
  ZI_CHECK(p.rows <= 0x7fffffff, "rms_norm: too many rows for one launch");
  rms_dispatch(p.dtype, [&](auto type) {
    rms_norm_kernel<decltype(type)><<<static_cast<unsigned>(p.rows), kRmsNormLanes, 0,
                                      static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("rms_norm");
}

}  // namespace zi
