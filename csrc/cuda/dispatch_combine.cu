// CUDA MoE dispatch / combine (contract in zeroinfer/dispatch_combine.h).
//
// dispatch runs three launches with no host round trip:
//   1. count:  one block per chunk of kChunk (token, slot) entries counts its experts into
//              workspace[chunk][e] (shared-memory atomics: counts do not depend on order), and
//              the grid fills row_token with -1.
//   2. scan:   one block turns the per-chunk counts into per-chunk starting rows (chunk prefix
//              per expert plus the tile-aligned expert offset) and writes counts/offsets.
//   3. place:  one block per chunk: warp 0 walks the chunk in 32-entry steps in (token, slot)
//              order, ranking equal experts with __match_any_sync, so each entry's row is the
//              same as the CPU twin's serial order; then all warps copy the activation rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "zeroinfer/dispatch_combine.h"
#include "zeroinfer/numeric.h"

namespace zi {
namespace {

constexpr int kChunk = 256;        // (token, slot) entries per block in count/place
constexpr int kPlaceThreads = 256;
constexpr int kScanThreads = 1024;

__device__ __forceinline__ int load_id(const void* ids, bool is64, int64_t i) {
  return is64 ? static_cast<int>(static_cast<const int64_t*>(ids)[i])
              : static_cast<const int32_t*>(ids)[i];
}

__global__ void count_kernel(const void* ids, bool is64, int64_t n, int num_experts,
                             int32_t* chunk_counts, int32_t* row_token, int64_t capacity) {
  extern __shared__ int32_t smem_counts[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) smem_counts[e] = 0;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    if (base + i < n) {
      const int e = load_id(ids, is64, base + i);
      if (e >= 0) atomicAdd(&smem_counts[e], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    chunk_counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = smem_counts[e];
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < capacity;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x)
    row_token[r] = -1;
}

// Exclusive block-wide scan of one int per thread.
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_sums[kScanThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;  // inclusive
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[(blockDim.x >> 5) - 1];
  __syncthreads();
  return before;
}

__global__ void __launch_bounds__(kScanThreads)
scan_kernel(int32_t* chunk_counts, int num_chunks, int num_experts, int tile,
            int32_t* expert_counts, int32_t* expert_offsets) {
  // Each thread owns a run of consecutive experts; first per-expert chunk prefixes, then one
  // block scan over the tile-padded totals.
  const int per_thread = (num_experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per_thread);
  const int e1 = min(num_experts, e0 + per_thread);
  int padded_sum = 0;
  for (int e = e0; e < e1; ++e) {
    int run = 0;
    for (int c = 0; c < num_chunks; ++c) {
      int32_t* slot = chunk_counts + static_cast<int64_t>(c) * num_experts + e;
      const int cnt = *slot;
      *slot = run;
      run += cnt;
    }
    expert_counts[e] = run;
    padded_sum += (run + tile - 1) / tile * tile;
  }
  int total;
  int off = block_exclusive_scan(padded_sum, &total);
  for (int e = e0; e < e1; ++e) {
    expert_offsets[e] = off;
    off += (expert_counts[e] + tile - 1) / tile * tile;
  }
  if (threadIdx.x == 0) expert_offsets[num_experts] = total;
}

template <int kVecBytes>
__global__ void __launch_bounds__(kPlaceThreads)
place_kernel(const void* ids, bool is64, int64_t n, int topk, int num_experts,
             const int32_t* chunk_start, const int32_t* expert_offsets, const uint8_t* x,
             int64_t row_bytes, uint8_t* sorted_x, int32_t* row_token, int32_t* token_row) {
  __shared__ int32_t rows[kChunk];
  extern __shared__ int32_t cursor[];  // [num_experts]
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    cursor[e] = expert_offsets[e] + chunk_start[static_cast<int64_t>(blockIdx.x) * num_experts + e];
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    for (int s = 0; s < kChunk; s += 32) {
      const int64_t i = base + s + lane;
      const int e = i < n ? load_id(ids, is64, i) : -1;
      // Lanes with the same expert rank among themselves in lane (= entry) order.
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      int row = -1;
      if (e >= 0) {
        row = cursor[e] + __popc(peers & ((1u << lane) - 1u));
      }
      __syncwarp();
      if (e >= 0 && lane == 31 - __clz(peers)) cursor[e] += __popc(peers);  // highest peer
      __syncwarp();
      rows[s + lane] = row;
      if (i < n) {
        token_row[i] = row;
        if (row >= 0) row_token[row] = static_cast<int32_t>(i / topk);
      }
    }
  }
  __syncthreads();
  // Copy activation rows: one warp per entry, kVecBytes per lane access.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t vecs = row_bytes / kVecBytes;
  for (int s = warp; s < kChunk; s += kPlaceThreads / 32) {
    const int64_t i = base + s;
    const int row = rows[s];
    if (i >= n || row < 0) continue;
    const int64_t t = i / topk;
    const uint8_t* src = x + t * row_bytes;
    uint8_t* dst = sorted_x + static_cast<int64_t>(row) * row_bytes;
    if constexpr (kVecBytes == 16) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (int64_t v = lane; v < vecs; v += 32) d4[v] = __ldg(s4 + v);
    } else {
      for (int64_t v = lane; v < vecs; v += 32) dst[v] = src[v];
    }
  }
}

template <typename TIn>
__device__ __forceinline__ float to_float(TIn v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<uint16_t>(uint16_t v) { return bf16_to_float(v); }

template <typename TOut>
__device__ __forceinline__ TOut from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ uint16_t from_float<uint16_t>(float v) { return float_to_bf16(v); }

// One block per token; each thread owns kVec consecutive elements per step and sums the k
// expert rows in slot order (fixed order: the result does not depend on the batch).
template <typename TIn, typename TW, typename TOut, int kVec>
__global__ void combine_kernel(const TIn* expert_out, const int32_t* token_row, const TW* weights,
                               int64_t hidden, int topk, TOut* out) {
  const int64_t t = blockIdx.x;
  for (int64_t v = static_cast<int64_t>(threadIdx.x) * kVec; v < hidden;
       v += static_cast<int64_t>(blockDim.x) * kVec) {
    float acc[kVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u) acc[u] = 0.f;
    for (int j = 0; j < topk; ++j) {
      const int32_t r = token_row[t * topk + j];
      if (r < 0) continue;
      const float w = to_float(weights[t * topk + j]);
      TIn vals[kVec];
      const TIn* src = expert_out + static_cast<int64_t>(r) * hidden + v;
      if constexpr (kVec * sizeof(TIn) == 16) {
        *reinterpret_cast<uint4*>(vals) = __ldg(reinterpret_cast<const uint4*>(src));
      } else {
#pragma unroll
        for (int u = 0; u < kVec; ++u) vals[u] = src[u];
      }
#pragma unroll
      for (int u = 0; u < kVec; ++u) acc[u] = fmaf(w, to_float(vals[u]), acc[u]);
    }
#pragma unroll
    for (int u = 0; u < kVec; ++u) out[t * hidden + v + u] = from_float<TOut>(acc[u]);
  }
}

template <typename TIn, typename TW, typename TOut>
void launch_combine(const MoeCombineParams& p, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(TIn);
  const bool vec_ok = p.hidden % kVec16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.expert_out) % 16 == 0;
  const int threads = static_cast<int>(std::min<int64_t>(
      256, std::max<int64_t>(32, (p.hidden / (vec_ok ? kVec16 : 1) + 31) / 32 * 32)));
  const auto* in = static_cast<const TIn*>(p.expert_out);
  const auto* w = static_cast<const TW*>(p.weights);
  auto* out = static_cast<TOut*>(p.out);
  if (vec_ok) {
    combine_kernel<TIn, TW, TOut, kVec16><<<p.num_tokens, threads, 0, stream>>>(
        in, p.token_row, w, p.hidden, static_cast<int>(p.topk), out);
  } else {
    combine_kernel<TIn, TW, TOut, 1><<<p.num_tokens, threads, 0, stream>>>(
        in, p.token_row, w, p.hidden, static_cast<int>(p.topk), out);
  }
  ZI_CUDA_CHECK_LAUNCH("moe_combine");
}

template <typename TIn, typename TW>
void combine_out(const MoeCombineParams& p, cudaStream_t s) {
  if (p.out_dtype == DType::kFloat32) launch_combine<TIn, TW, float>(p, s);
  else launch_combine<TIn, TW, uint16_t>(p, s);
}

template <typename TIn>
void combine_w(const MoeCombineParams& p, cudaStream_t s) {
  if (p.weights_dtype == DType::kFloat32) combine_out<TIn, float>(p, s);
  else combine_out<TIn, uint16_t>(p, s);
}

}  // namespace

int64_t moe_dispatch_workspace_bytes(int64_t num_tokens, int64_t topk, int64_t num_experts) {
  const int64_t chunks = (num_tokens * topk + kChunk - 1) / kChunk;
  return std::max<int64_t>(1, chunks) * num_experts * static_cast<int64_t>(sizeof(int32_t));
}

void moe_dispatch_cuda(const MoeDispatchParams& p, void* workspace, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t n = p.num_tokens * p.topk;
  const int num_experts = static_cast<int>(p.num_experts);
  const bool is64 = p.ids_dtype == DType::kInt64;
  const int chunks = static_cast<int>(std::max<int64_t>(1, (n + kChunk - 1) / kChunk));
  auto* chunk_counts = static_cast<int32_t*>(workspace);
  const size_t smem = static_cast<size_t>(num_experts) * sizeof(int32_t);
  if (smem > 48 * 1024) {
    throw std::invalid_argument("moe_dispatch (CUDA): num_experts too large for one block (max 12288)");
  }
  count_kernel<<<chunks, 256, smem, stream>>>(p.topk_ids, is64, n, num_experts, chunk_counts,
                                              p.row_token, p.capacity);
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch count");
  scan_kernel<<<1, kScanThreads, 0, stream>>>(chunk_counts, chunks, num_experts,
                                              static_cast<int>(p.tile), p.expert_counts,
                                              p.expert_offsets);
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch scan");
  const int64_t row_bytes = p.hidden * (p.x_dtype == DType::kFloat32 ? 4
                                        : p.x_dtype == DType::kBFloat16 ? 2 : 1);
  const bool vec_ok = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.sorted_x) % 16 == 0;
  const auto* x = static_cast<const uint8_t*>(p.x);
  auto* dst = static_cast<uint8_t*>(p.sorted_x);
  if (vec_ok) {
    place_kernel<16><<<chunks, kPlaceThreads, smem, stream>>>(
        p.topk_ids, is64, n, static_cast<int>(p.topk), num_experts, chunk_counts,
        p.expert_offsets, x, row_bytes, dst, p.row_token, p.token_row);
  } else {
    place_kernel<1><<<chunks, kPlaceThreads, smem, stream>>>(
        p.topk_ids, is64, n, static_cast<int>(p.topk), num_experts, chunk_counts,
        p.expert_offsets, x, row_bytes, dst, p.row_token, p.token_row);
  }
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch place");
}

void moe_combine_cuda(const MoeCombineParams& p, void* stream_ptr) {
  if (p.num_tokens == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.expert_out_dtype == DType::kFloat32) combine_w<float>(p, stream);
  else combine_w<uint16_t>(p, stream);
}

}  // namespace zi
