// CUDA length correction (contract in zeroinfer/length_correction.h): one warp per row; lane 0's
// row arithmetic is broadcast, the lanes stride over the row's token slots. A single small
// launch with no host reads, so it can sit inside a captured graph.
#include <cuda_runtime.h>

#include <cstdint>

#include "check.cuh"
#include "zeroinfer/length_correction.h"

namespace zi {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) correct_lengths_kernel(LengthCorrectionParams p) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= p.num_rows) return;
  const int32_t start = p.cu_q[row], q_opt = p.cu_q[row + 1] - start;
  int32_t prev = p.remap[row];
  if (prev >= p.num_prev_rows) prev = -1;
  if (prev < 0) {
    if (lane == 0) {
      p.q_len[row] = q_opt;
      p.k_len[row] = p.k_len_in[row];
    }
    for (int32_t j = lane; j < q_opt; j += 32) {
      p.positions[start + j] = p.positions_in[start + j];
      p.input_ids[start + j] = p.input_ids_in[start + j];
    }
    return;
  }
  const int32_t delta = p.prev_num_accepted[prev] - p.assumed_accepted[row];
  const int32_t q = max(0, min(min(q_opt, p.prev_num_next[prev]),
                               static_cast<int32_t>(p.prev_width)));
  if (lane == 0) {
    p.q_len[row] = q;
    p.k_len[row] = p.k_len_in[row] + delta - (q_opt - q);
  }
  const int32_t* next = p.prev_next_tokens + static_cast<int64_t>(prev) * p.prev_width;
  for (int32_t j = lane; j < q_opt; j += 32) {
    p.positions[start + j] = j < q ? p.positions_in[start + j] + delta : -1;
    p.input_ids[start + j] = j < q ? next[j] : 0;
  }
}

}  // namespace

void correct_lengths_cuda(const LengthCorrectionParams& p, void* stream) {
  if (p.num_rows == 0) return;
  const int64_t blocks = (p.num_rows * 32 + kThreads - 1) / kThreads;
  correct_lengths_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                           static_cast<cudaStream_t>(stream)>>>(p);
  ZI_CUDA_CHECK_LAUNCH("correct_lengths");
}

}  // namespace zi
