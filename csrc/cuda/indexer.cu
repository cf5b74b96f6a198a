// CUDA indexer scores (contract in zeroinfer/indexer.h): a CTA scores 128 entries of one query
// token, one entry a thread. Passes of 32 heads x 32 channels: the warps stage the pass's key
// channels of the CTA's 128 entries in shared memory (a warp reads a row's 32 channels in one
// coalesced load; stored transposed with a padded stride, so the thread of entry j reads column j
// without bank conflicts) and the token's q of those heads and channels; each thread then runs
// its entry's 32 dot chains, channels ascending - the contract's order, so the bits are the CPU
// twin's. CUDA cores in float32, rounded steps: correct and batch-invariant first; the tensor-core
// form (DeepGEMM's fp8 paged MQA logits) is the next step (bench/bench_indexer.py).
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/indexer.h"

namespace zi {
namespace {

constexpr int kEntries = 128;  // a CTA's entries, one a thread
constexpr int kPass = 32;      // heads, and channels, a pass

template <class K>
__global__ void __launch_bounds__(kEntries) indexer_scores_kernel(IndexerScoresParams p) {
  using indexer_detail::load;
  __shared__ float ks[kPass][kEntries + 1];       // [channel][entry]
  __shared__ __align__(16) float qs[kPass][kPass];  // [channel][head]
  const int64_t t = blockIdx.x;
  const int64_t s0 = static_cast<int64_t>(blockIdx.y) * kEntries;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t s = s0 + tid;
  float* out = p.out + t * p.num_entries;
  const int64_t visible = indexer_visible(p, t);
  if (s0 >= visible) {  // the whole tile past what the token sees (uniform across the CTA)
    if (s < p.num_entries) out[s] = -__int_as_float(0x7f800000);
    return;
  }
  // This thread's entry's key offset (-1: none), which the warp's staging loop broadcasts.
  const int64_t row_off = s < visible ? indexer_key_offset(p, t, s) : -1;
  const K* keys = static_cast<const K*>(p.keys);
  const float* q = p.q + t * p.heads * p.dim;
  const float* w = p.weights + t * p.heads;
  float acc = 0.f;
  for (int64_t h0 = 0; h0 < p.heads; h0 += kPass) {
    const int nh = p.heads - h0 < kPass ? static_cast<int>(p.heads - h0) : kPass;
    float dot[kPass];
#pragma unroll
    for (int h = 0; h < kPass; ++h) dot[h] = 0.f;
    for (int64_t i0 = 0; i0 < p.dim; i0 += kPass) {
      const int nc = p.dim - i0 < kPass ? static_cast<int>(p.dim - i0) : kPass;
      __syncthreads();  // the last pass's reads of ks / qs are done
      for (int r = 0; r < 32; ++r) {  // the warp's 32 rows, channel i0 + lane of each
        const int64_t off = __shfl_sync(0xffffffffu, row_off, r);
        ks[lane][warp * 32 + r] = off >= 0 && lane < nc ? load(keys, off + i0 + lane) : 0.f;
      }
      for (int e = tid; e < kPass * kPass; e += kEntries) {  // qs[i][h] = q[h0 + h][i0 + i]
        const int h = e / kPass, i = e % kPass;
        qs[i][h] = h < nh && i < nc ? q[(h0 + h) * p.dim + i0 + i] : 0.f;
      }
      __syncthreads();
      for (int i = 0; i < nc; ++i) {
        const float k = ks[i][tid];
#pragma unroll
        for (int h = 0; h < kPass; h += 4) {
          const float4 q4 = *reinterpret_cast<const float4*>(&qs[i][h]);
          dot[h] = add_rn(dot[h], mul_rn(q4.x, k));
          dot[h + 1] = add_rn(dot[h + 1], mul_rn(q4.y, k));
          dot[h + 2] = add_rn(dot[h + 2], mul_rn(q4.z, k));
          dot[h + 3] = add_rn(dot[h + 3], mul_rn(q4.w, k));
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kPass; ++h)
      if (h < nh) acc = indexer_head_term(acc, w[h0 + h], dot[h]);
  }
  if (s < visible) {
    out[s] = row_off < 0 ? __int_as_float(0x7fc00000) : mul_rn(acc, p.scale);
  } else if (s < p.num_entries) {
    out[s] = -__int_as_float(0x7f800000);
  }
}

}  // namespace

void indexer_scores_cuda(const IndexerScoresParams& p, void* stream) {
  ZI_CHECK(p.heads >= 1 && p.dim >= 1 && p.block_size >= 1 && p.num_entries >= 0,
           "indexer_scores: bad sizes");
  ZI_CHECK(p.num_entries <= p.table_stride * p.block_size,
           "indexer_scores: more entries than the table covers");
  if (p.num_tokens == 0 || p.num_entries == 0) return;
  const int64_t tiles = (p.num_entries + kEntries - 1) / kEntries;
  ZI_CHECK(p.num_tokens <= 0x7fffffff && tiles <= 65535,
           "indexer_scores: too many tokens or entries for one launch");
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(tiles));
  indexer_dispatch(p.key_dtype, [&](auto type) {
    indexer_scores_kernel<decltype(type)>
        <<<grid, kEntries, 0, static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("indexer_scores");
}

}  // namespace zi
