// CUDA MoE dispatch / combine (contract in zeroinfer/dispatch_combine.h).
//
// dispatch = routing (ids -> rows: a few hundred KB at most) + one bandwidth-bound gather.
//  Routing, small batches (T*k <= kSmallRouteMax and its tables fit in 48 KB of shared memory):
//   ONE block (route_small_kernel). The ids are staged in shared memory; each of 16 warps owns
//   a contiguous run of (token, slot) entries and counts it per expert (__match_any_sync); one
//   pass turns the per-warp counts into per-warp starting rows (prefix over the warps, then a
//   block scan of the tile-padded totals); a second walk assigns the rows. 1 launch, no scratch.
//  Routing, large batches: three launches over kChunk-entry chunks:
//   1. count: per-chunk expert counts into workspace[e][chunk] (expert-major), row_token := -1;
//   2. scan:  one warp per expert turns its chunk counts into chunk prefixes (two passes of
//             independent loads, no serial chain of global round trips) and writes its total;
//   3. place: one block per chunk; each block scans the E tile-padded totals itself (block 0
//             publishes counts / offsets), stages its ids in shared memory, and warp 0 walks them
//             in 32-entry steps ranking equal experts with __match_any_sync.
//  Either way each entry's row equals the CPU twin's serial (token, slot) order.
//  Gather (gather_rows_kernel): every token's activation row is read ONCE (16-byte vectors,
//  kGatherUnroll loads in flight per thread) and stored to its k destination rows; the grid is
//  tokens x row pieces, so a few tokens already spread over many SMs.
//
// combine (combine_kernel): grid = tokens x row pieces; each thread owns kCombineUnroll 16-byte
//  vectors, issues the loads of up to kCombineRows expert rows before accumulating them, and sums
//  in slot order with fmaf (fixed order: batch-invariant, bit-identical to the previous kernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "check.cuh"
#include "zeroinfer/dispatch_combine.h"
#include "zeroinfer/numeric.h"

namespace zi {
namespace {

constexpr int kChunk = 256;                // (token, slot) entries per block in count / place
constexpr int kPlaceThreads = 256;
constexpr int kScanWarps = 8;              // experts per scan block (one warp each)
constexpr int kSmallThreads = 512;         // route_small_kernel: 16 warps
constexpr int kSmallWarps = kSmallThreads / 32;
constexpr int64_t kSmallRouteMax = 16384;  // most (token, slot) entries routed by one block
constexpr size_t kSmemLimit = 48 * 1024;
constexpr int kGatherThreads = 128;
constexpr int kGatherUnroll = 4;           // vectors per thread, all loaded before storing
constexpr int kCombineThreads = 128;
constexpr int kCombineUnroll = 2;          // vectors per thread
constexpr int kCombineRows = 4;            // expert rows loaded before accumulating

__device__ __forceinline__ int load_id(const void* ids, bool is64, int64_t i) {
  return is64 ? static_cast<int>(static_cast<const int64_t*>(ids)[i])
              : static_cast<const int32_t*>(ids)[i];
}

__device__ __forceinline__ int pad_to(int c, int tile) { return (c + tile - 1) / tile * tile; }

// Exclusive scan of one int per thread over the block (blockDim a multiple of 32, <= 1024);
// *total = the block's sum, for every thread.
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;  // inclusive
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[nwarps - 1];
  __syncthreads();
  return before;
}

// One 32-entry step of a warp walk (lane = entry order; e = -1: no entry): the lane's row
// (cursor[e] + rank among equal experts, -1 for none); advances cursor by the step's counts.
__device__ __forceinline__ int rank_step(int e, int lane, int32_t* cursor) {
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  int row = -1;
  if (e >= 0) row = cursor[e] + __popc(peers & ((1u << lane) - 1u));
  __syncwarp();
  if (e >= 0 && lane == 31 - __clz(peers)) cursor[e] += __popc(peers);  // highest peer updates
  __syncwarp();
  return row;
}

// ---- small batches: the whole routing in one block ------------------------------------------
// Shared memory: cnt[kSmallWarps][E] int32, then the ids as int16 (E <= 32767).
__global__ void __launch_bounds__(kSmallThreads)
route_small_kernel(const void* ids, bool is64, int n, int topk, int num_experts, int tile,
                   int64_t capacity, int32_t* row_token, int32_t* token_row,
                   int32_t* expert_counts, int32_t* expert_offsets) {
  extern __shared__ int32_t smem[];
  int32_t* cnt = smem;
  int16_t* sid = reinterpret_cast<int16_t*>(smem + kSmallWarps * num_experts);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kSmallWarps * num_experts; i += blockDim.x) cnt[i] = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    sid[i] = static_cast<int16_t>(load_id(ids, is64, i));
  __syncthreads();
  // Warp w owns entries [seg0, seg1): whole 32-entry steps, in entry order across warps.
  const int seg = (n + kSmallWarps * 32 - 1) / (kSmallWarps * 32) * 32;
  const int seg0 = min(n, warp * seg), seg1 = min(n, seg0 + seg);
  int32_t* mine = cnt + warp * num_experts;
  for (int s = seg0; s < seg1; s += 32) {
    const int e = s + lane < seg1 ? sid[s + lane] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == 31 - __clz(peers)) mine[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Thread owns experts [e0, e1): per-warp prefixes, then the tile-padded offsets.
  const int per = (num_experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);
  int padded_sum = 0;
  for (int e = e0; e < e1; ++e) {
    int run = 0;
    for (int w = 0; w < kSmallWarps; ++w) {
      const int c = cnt[w * num_experts + e];
      cnt[w * num_experts + e] = run;
      run += c;
    }
    expert_counts[e] = run;
    padded_sum += pad_to(run, tile);
  }
  int total;
  int off = block_exclusive_scan(padded_sum, &total);  // (synchronises the block)
  for (int e = e0; e < e1; ++e) {
    const int count = expert_counts[e];  // written by this thread above
    expert_offsets[e] = off;
    for (int w = 0; w < kSmallWarps; ++w) cnt[w * num_experts + e] += off;
    for (int r = off + count; r < off + pad_to(count, tile); ++r) row_token[r] = -1;
    off += pad_to(count, tile);
  }
  if (threadIdx.x == 0) expert_offsets[num_experts] = total;
  for (int64_t r = total + static_cast<int64_t>(threadIdx.x); r < capacity; r += blockDim.x)
    row_token[r] = -1;
  __syncthreads();
  for (int s = seg0; s < seg1; s += 32) {
    const int i = s + lane;
    const int e = i < seg1 ? sid[i] : -1;
    const int row = rank_step(e, lane, mine);
    if (i < seg1) {
      token_row[i] = row;
      if (row >= 0) row_token[row] = i / topk;
    }
  }
}

// ---- large batches: count / scan / place ------------------------------------------------------
__global__ void __launch_bounds__(kPlaceThreads)
count_kernel(const void* ids, bool is64, int64_t n, int num_experts, int chunks,
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
    chunk_counts[static_cast<int64_t>(e) * chunks + blockIdx.x] = smem_counts[e];
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < capacity;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x)
    row_token[r] = -1;
}

// One warp per expert: chunk counts -> exclusive chunk prefixes (in place); totals[e].
__global__ void __launch_bounds__(kScanWarps * 32)
scan_kernel(int32_t* chunk_counts, int chunks, int num_experts, int32_t* totals) {
  const int lane = threadIdx.x & 31;
  const int e = blockIdx.x * kScanWarps + (threadIdx.x >> 5);
  if (e >= num_experts) return;
  int32_t* row = chunk_counts + static_cast<int64_t>(e) * chunks;
  // Lane owns chunks [c0, c1): sum (independent loads), warp scan, then write the prefixes.
  const int per = (chunks + 31) / 32;
  const int c0 = min(chunks, lane * per), c1 = min(chunks, c0 + per);
  int sum = 0;
  for (int c = c0; c < c1; ++c) sum += row[c];
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  int run = incl - sum;
  for (int c = c0; c < c1; ++c) {
    const int v = row[c];
    row[c] = run;
    run += v;
  }
  if (lane == 31) totals[e] = incl;
}

// Shared memory: cursor[E] int32.
__global__ void __launch_bounds__(kPlaceThreads)
place_kernel(const void* ids, bool is64, int64_t n, int topk, int num_experts, int tile,
             int chunks, const int32_t* chunk_start, const int32_t* totals,
             int32_t* row_token, int32_t* token_row, int32_t* expert_counts,
             int32_t* expert_offsets) {
  __shared__ int32_t sid[kChunk];
  extern __shared__ int32_t cursor[];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x)
    sid[i] = base + i < n ? load_id(ids, is64, base + i) : -1;
  // Segment offsets: every block scans the E padded totals (a few hundred ints, L2-resident).
  const int per = (num_experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);
  int padded_sum = 0;
  for (int e = e0; e < e1; ++e) padded_sum += pad_to(totals[e], tile);
  int total;
  int off = block_exclusive_scan(padded_sum, &total);
  for (int e = e0; e < e1; ++e) {
    const int count = totals[e];
    cursor[e] = off + chunk_start[static_cast<int64_t>(e) * chunks + blockIdx.x];
    if (blockIdx.x == 0) {
      expert_counts[e] = count;
      expert_offsets[e] = off;
    }
    off += pad_to(count, tile);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) expert_offsets[num_experts] = total;
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    for (int s = 0; s < kChunk; s += 32) {
      const int64_t i = base + s + lane;
      const int row = rank_step(sid[s + lane], lane, cursor);
      if (i < n) {
        token_row[i] = row;
        if (row >= 0) row_token[row] = static_cast<int32_t>(i / topk);
      }
    }
  }
}

// ---- gather: x[t] read once, stored to its k rows ---------------------------------------------
// grid.x = token, grid.y = piece of the row (kGatherThreads * kGatherUnroll vectors of V).
template <typename V>
__global__ void __launch_bounds__(kGatherThreads)
gather_rows_kernel(const V* x, int64_t row_vecs, int topk, const int32_t* token_row, V* sorted_x) {
  const int64_t t = blockIdx.x;
  const int64_t v0 = static_cast<int64_t>(blockIdx.y) * (kGatherThreads * kGatherUnroll) +
                     threadIdx.x;
  const V* src = x + t * row_vecs;
  V vals[kGatherUnroll];
#pragma unroll
  for (int u = 0; u < kGatherUnroll; ++u) {
    const int64_t v = v0 + u * kGatherThreads;
    if (v < row_vecs) vals[u] = __ldg(src + v);
  }
  for (int j = 0; j < topk; ++j) {
    const int32_t row = __ldg(token_row + t * topk + j);
    if (row < 0) continue;
    V* dst = sorted_x + static_cast<int64_t>(row) * row_vecs;
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int64_t v = v0 + u * kGatherThreads;
      if (v < row_vecs) dst[v] = vals[u];
    }
  }
}

template <typename V>
void launch_gather(const MoeDispatchParams& p, int64_t row_bytes, cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t pieces = (row_vecs + kGatherThreads * kGatherUnroll - 1) /
                         (kGatherThreads * kGatherUnroll);
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(pieces));
  gather_rows_kernel<V><<<grid, kGatherThreads, 0, stream>>>(
      static_cast<const V*>(p.x), row_vecs, static_cast<int>(p.topk), p.token_row,
      static_cast<V*>(p.sorted_x));
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch gather");
}

// ---- combine -------------------------------------------------------------------------------------
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

// kVec elements per vector (16 bytes of TIn when kVec * sizeof(TIn) == 16, else kVec == 1 and
// scalar accesses). grid.x = token, grid.y = piece of the row.
template <typename TIn, typename TW, typename TOut, int kVec>
__global__ void __launch_bounds__(kCombineThreads)
combine_kernel(const TIn* expert_out, const int32_t* token_row, const TW* weights,
               int64_t hidden, int topk, TOut* out) {
  constexpr bool kWide = kVec * sizeof(TIn) == 16;
  const int64_t t = blockIdx.x;
  const int64_t vecs = hidden / kVec;
  const int64_t v0 = static_cast<int64_t>(blockIdx.y) * (kCombineThreads * kCombineUnroll) +
                     threadIdx.x;
  float acc[kCombineUnroll][kVec];
#pragma unroll
  for (int u = 0; u < kCombineUnroll; ++u)
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[u][i] = 0.f;
  for (int j0 = 0; j0 < topk; j0 += kCombineRows) {
    int32_t rows[kCombineRows];
    float w[kCombineRows];
    alignas(16) TIn vals[kCombineRows][kCombineUnroll][kVec];
#pragma unroll
    for (int jj = 0; jj < kCombineRows; ++jj) {
      const int j = j0 + jj;
      rows[jj] = j < topk ? __ldg(token_row + t * topk + j) : -1;
      w[jj] = rows[jj] >= 0 ? to_float(weights[t * topk + j]) : 0.f;
    }
    // All loads first (up to kCombineRows * kCombineUnroll in flight), then the sums in order.
#pragma unroll
    for (int jj = 0; jj < kCombineRows; ++jj) {
      if (rows[jj] < 0) continue;
      const TIn* src = expert_out + static_cast<int64_t>(rows[jj]) * hidden;
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {
        const int64_t v = v0 + u * kCombineThreads;
        if (v >= vecs) continue;
        if constexpr (kWide) {
          *reinterpret_cast<uint4*>(vals[jj][u]) =
              __ldg(reinterpret_cast<const uint4*>(src + v * kVec));
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) vals[jj][u][i] = src[v * kVec + i];
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < kCombineRows; ++jj) {
      if (rows[jj] < 0) continue;
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u)
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          acc[u][i] = fmaf(w[jj], to_float(vals[jj][u][i]), acc[u][i]);
    }
  }
#pragma unroll
  for (int u = 0; u < kCombineUnroll; ++u) {
    const int64_t v = v0 + u * kCombineThreads;
    if (v >= vecs) continue;
    alignas(16) TOut o[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) o[i] = from_float<TOut>(acc[u][i]);
    TOut* dst = out + t * hidden + v * kVec;
    if constexpr (kWide && kVec * sizeof(TOut) % 16 == 0) {
#pragma unroll
      for (int q = 0; q < static_cast<int>(kVec * sizeof(TOut) / 16); ++q)
        reinterpret_cast<uint4*>(dst)[q] = reinterpret_cast<const uint4*>(o)[q];
    } else if constexpr (kWide && kVec * sizeof(TOut) == 8) {
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(o);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) dst[i] = o[i];
    }
  }
}

template <typename TIn, typename TW, typename TOut>
void launch_combine(const MoeCombineParams& p, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(TIn);
  // The wide path needs 16-byte input vectors and out rows aligned to their vector stores.
  const int64_t out_vec_bytes = kVec16 * static_cast<int64_t>(sizeof(TOut));
  const bool vec_ok = p.hidden % kVec16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.expert_out) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.out) % std::min<int64_t>(16, out_vec_bytes) == 0;
  const auto* in = static_cast<const TIn*>(p.expert_out);
  const auto* w = static_cast<const TW*>(p.weights);
  auto* out = static_cast<TOut*>(p.out);
  const int64_t vecs = vec_ok ? p.hidden / kVec16 : p.hidden;
  const int64_t pieces = std::max<int64_t>(
      1, (vecs + kCombineThreads * kCombineUnroll - 1) / (kCombineThreads * kCombineUnroll));
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(pieces));
  if (vec_ok) {
    combine_kernel<TIn, TW, TOut, kVec16><<<grid, kCombineThreads, 0, stream>>>(
        in, p.token_row, w, p.hidden, static_cast<int>(p.topk), out);
  } else {
    combine_kernel<TIn, TW, TOut, 1><<<grid, kCombineThreads, 0, stream>>>(
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

size_t small_route_smem(int64_t n, int64_t num_experts) {
  return static_cast<size_t>(kSmallWarps * num_experts) * sizeof(int32_t) +
         static_cast<size_t>(n) * sizeof(int16_t);
}

bool use_small_route(int64_t n, int64_t num_experts) {
  return n <= kSmallRouteMax && num_experts <= 32767 &&
         small_route_smem(n, num_experts) <= kSmemLimit;
}

int num_chunks(int64_t n) { return static_cast<int>(std::max<int64_t>(1, (n + kChunk - 1) / kChunk)); }

}  // namespace

int64_t moe_dispatch_workspace_bytes(int64_t num_tokens, int64_t topk, int64_t num_experts) {
  const int64_t n = num_tokens * topk;
  if (use_small_route(n, num_experts)) return 1;  // route_small_kernel needs no scratch
  // chunk counts [E][chunks] + expert totals [E]
  return (static_cast<int64_t>(num_chunks(n)) + 1) * num_experts *
         static_cast<int64_t>(sizeof(int32_t));
}

void moe_dispatch_cuda(const MoeDispatchParams& p, void* workspace, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t n = p.num_tokens * p.topk;
  const int num_experts = static_cast<int>(p.num_experts);
  const int tile = static_cast<int>(p.tile);
  const bool is64 = p.ids_dtype == DType::kInt64;
  if (use_small_route(n, num_experts)) {
    // The kernel's own static shared memory (block scan scratch) comes on top of the dynamic
    // part, so a dynamic size right at 48 KB needs the opt-in.
    const size_t smem = small_route_smem(n, num_experts);
    ZI_CUDA_CHECK(cudaFuncSetAttribute(route_small_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    route_small_kernel<<<1, kSmallThreads, smem, stream>>>(
        p.topk_ids, is64, static_cast<int>(n), static_cast<int>(p.topk), num_experts, tile,
        p.capacity, p.row_token, p.token_row, p.expert_counts, p.expert_offsets);
    ZI_CUDA_CHECK_LAUNCH("moe_dispatch route");
  } else {
    // place_kernel: cursor[E] dynamic + sid[kChunk] and the scan's 32 ints static, in 48 KB.
    const size_t smem = static_cast<size_t>(num_experts) * sizeof(int32_t);
    constexpr size_t kPlaceStatic = (kChunk + 32) * sizeof(int32_t);
    if (smem + kPlaceStatic > kSmemLimit) {
      throw std::invalid_argument(
          "moe_dispatch (CUDA): num_experts too large for one block (max " +
          std::to_string((kSmemLimit - kPlaceStatic) / sizeof(int32_t)) + ")");
    }
    const int chunks = num_chunks(n);
    auto* chunk_counts = static_cast<int32_t*>(workspace);
    int32_t* totals = chunk_counts + static_cast<int64_t>(chunks) * num_experts;
    count_kernel<<<chunks, kPlaceThreads, smem, stream>>>(p.topk_ids, is64, n, num_experts,
                                                          chunks, chunk_counts, p.row_token,
                                                          p.capacity);
    ZI_CUDA_CHECK_LAUNCH("moe_dispatch count");
    scan_kernel<<<(num_experts + kScanWarps - 1) / kScanWarps, kScanWarps * 32, 0, stream>>>(
        chunk_counts, chunks, num_experts, totals);
    ZI_CUDA_CHECK_LAUNCH("moe_dispatch scan");
    place_kernel<<<chunks, kPlaceThreads, smem, stream>>>(
        p.topk_ids, is64, n, static_cast<int>(p.topk), num_experts, tile, chunks, chunk_counts,
        totals, p.row_token, p.token_row, p.expert_counts, p.expert_offsets);
    ZI_CUDA_CHECK_LAUNCH("moe_dispatch place");
  }
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const int64_t row_bytes = p.hidden * (p.x_dtype == DType::kFloat32 ? 4
                                        : p.x_dtype == DType::kBFloat16 ? 2 : 1);
  // The widest vector that divides the row and both base addresses.
  const uintptr_t align = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.sorted_x) |
                          static_cast<uintptr_t>(row_bytes);
  if (align % 16 == 0) launch_gather<uint4>(p, row_bytes, stream);
  else if (align % 8 == 0) launch_gather<uint2>(p, row_bytes, stream);
  else if (align % 4 == 0) launch_gather<uint32_t>(p, row_bytes, stream);
  else if (align % 2 == 0) launch_gather<uint16_t>(p, row_bytes, stream);
  else launch_gather<uint8_t>(p, row_bytes, stream);
}

void moe_combine_cuda(const MoeCombineParams& p, void* stream_ptr) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.expert_out_dtype == DType::kFloat32) combine_w<float>(p, stream);
  else combine_w<uint16_t>(p, stream);
}

}  // namespace zi
