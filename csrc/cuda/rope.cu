// CUDA RoPE (contract in zeroinfer/rope.h): one thread an output pair, consecutive threads on
// consecutive pairs of a vector (coalesced). At decode a launch; at prefill a bandwidth-bound copy.
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/rope.h"

namespace zi {
namespace {

constexpr int kThreads = 256;

template <class T, class C>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t pairs = p.dim / 2;
  if (i >= p.num_tokens * p.heads * pairs) return;
  const int64_t v = i / pairs;
  rope_pair<T, C>(p, v / p.heads, v % p.heads, i % pairs);
}

}  // namespace

void rope_rotate_cuda(const RopeParams& p, void* stream) {
  ZI_CHECK(p.dim % 2 == 0 && p.half_rope >= 1 && 2 * p.half_rope <= p.dim,
           "rope_rotate: need an even d and 1 <= r / 2 <= d / 2");
  const int64_t pairs = p.num_tokens * p.heads * (p.dim / 2);
  if (pairs == 0) return;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  ZI_CHECK(blocks <= 0x7fffffff, "rope_rotate: too many elements for one launch");
  rope_dispatch(p.dtype, p.table_dtype, [&](auto type, auto table) {
    rope_kernel<decltype(type), decltype(table)>
        <<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("rope_rotate");
}

}  // namespace zi
