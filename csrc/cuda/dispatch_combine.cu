// CUDA MoE dispatch / combine (contract in zeroinfer/dispatch_combine.h).
//
// dispatch = routing (ids -> rows: a few hundred KB at most) + one bandwidth-bound gather.
//  Fused path (dispatch_fused_kernel; whenever its tables fit in shared memory): ONE cooperative
//   launch of G = min(T, #SMs) blocks, 512 threads, block b routing tokens [T*b/G, T*(b+1)/G):
//   1. ids into shared memory (alone: nothing queued in front of them); then warps 1-15 load the
//      block's first copy batch into registers and prefetch the next 128 KB of its x range (and
//      warp 0's first batch) into L2, all landing while the routing runs; each of 16 warps counts
//      its contiguous run of (token, slot) entries per expert (__match_any_sync); per-warp
//      exclusive prefixes; the block's per-expert counts -> workspace[b][E] (16-byte padded E).
//   2. grid barrier (cooperative_groups grid sync: the only global synchronisation; skipped with
//      one block, whose counts are the totals).
//   3. every block reads the whole [G][E] count table (int4 loads, L2-resident, kTableBatch loads
//      in flight per thread) for the expert totals and its own prefix over earlier blocks, and
//      scans the E tile-padded totals itself.
//   4. warps rank their runs (cursor = offset + earlier blocks + earlier warps) into shared
//      memory; the last warp goes on with the next block's first token (balanced copy, below).
//   5. the block copies an equal share of the T x row items (x read once, kFusedUnroll vectors
//      per thread in flight, stored to the token's k rows): the share may start inside its first
//      token and end inside the next block's first token, whose rows step 4 ranked as well, so
//      no block waits on another; the split points inside a token are rounded down to 32
//      vectors, so that warp accesses stay line-aligned. No second barrier.
//   6. posted stores last: token_row / row_token, counts / offsets and padding rows of its slice
//      of experts, its share of the unused tail (row_token = -1: spread over all SMs).
//   H200 measurements and the variants tried: bench/results/h200/dispatch_combine_NOTES.md.
//  Fallback (E too large for the fused tables, or ZEROINFER_DISPATCH_FUSED=0): count / scan /
//   place over kChunk-entry chunks, then gather_rows_kernel:
//   1. count: per-chunk expert counts into workspace[e][chunk] (expert-major), row_token := -1;
//   2. scan:  one warp per expert turns its chunk counts into chunk prefixes (two passes of
//             independent loads, no serial chain of global round trips) and writes its total;
//   3. place: one block per chunk; each block scans the E tile-padded totals itself (block 0
//             publishes counts / offsets), stages its ids in shared memory, and warp 0 walks them
//             in 32-entry steps ranking equal experts with __match_any_sync.
//   4. gather: every token's activation row is read ONCE (16-byte vectors, kGatherUnroll loads
//      in flight per thread) and stored to its k destination rows; grid = tokens x row pieces.
//  Either way each entry's row equals the CPU twin's serial (token, slot) order.
//
// combine (combine_kernel): grid = tokens x row pieces; each thread owns kCombineUnroll 16-byte
//  vectors, issues the loads of up to kCombineRows expert rows before accumulating them, and sums
//  in slot order with fmaf (fixed order: batch-invariant, bit-identical to the previous kernel).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "block_scan.cuh"
#include "check.cuh"
#include "launch.cuh"
#include "zeroinfer/dispatch_combine.h"
#include "zeroinfer/numeric.h"

namespace zi {
namespace {

constexpr int kChunk = 256;                // (token, slot) entries per block in count / place
constexpr int kPlaceThreads = 256;
constexpr int kScanWarps = 8;              // experts per scan block (one warp each)
constexpr int kFusedThreads = 512;         // dispatch_fused_kernel: 16 warps
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kFusedUnroll = 8;            // copy: vectors loaded per thread before storing
constexpr int kFusedMaxBlocks = 1024;      // bounds the [G][E] count table in the workspace
constexpr int kFusedMaxEntries = 16384;    // (token, slot) entries one block may own
constexpr int64_t kFusedPrefetch = 128 * 1024;  // x bytes per block prefetched into L2
constexpr int kTableBatch = 8;             // count-table rows a thread loads before summing
constexpr unsigned kBalanceQuantum = 32;   // copy split points inside a token: a warp's items
static_assert(kFusedUnroll * 4 == 32, "warp 1's lanes = (warp 0's batch vector, 128-B piece)");
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

// n / d for n >= 0, d > 0: 32-bit division whenever n fits (the 64-bit one is a long routine).
__device__ __forceinline__ int64_t div_nonneg(int64_t n, int d) {
  if (n > 0xffffffffll) return n / d;
  return static_cast<int64_t>(static_cast<uint32_t>(n) / static_cast<uint32_t>(d));
}

__device__ __forceinline__ int pad_to(int c, int tile) { return (c + tile - 1) / tile * tile; }

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

// ---- fused: routing + copy in one cooperative launch ------------------------------------------
__device__ __forceinline__ int4 operator+(int4 a, int4 b) {
  return make_int4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Shared memory (int32 units): red[2][NG][Ep] (int4-aligned, first), cnt[kFusedWarps][E],
// s_base[E], s_off[E], s_tot[E], ent[max_entries + topk] (ids, then rows; the extra topk hold
// the next block's first token, which the balanced copy split may reach into).
__host__ __device__ inline int fused_groups(int num_experts) {
  const int q = (num_experts + 3) / 4;  // int4 columns of the count table
  return q >= kFusedThreads ? 1 : kFusedThreads / q;
}

size_t fused_smem(int num_experts, int max_entries) {
  const int64_t ep = (num_experts + 3) / 4 * 4;
  return static_cast<size_t>(2 * fused_groups(num_experts) * ep +
                             (kFusedWarps + 3) * static_cast<int64_t>(num_experts) + max_entries) *
         sizeof(int32_t);
}

struct FusedArgs {
  const void* ids;
  bool is64;
  int64_t num_tokens;
  int topk, num_experts, tile;
  int64_t capacity;
  int32_t *row_token, *token_row, *expert_counts, *expert_offsets;
  int32_t* block_counts;  // workspace: [G][Ep]
};

// One copy batch of a thread: items base, base + kFusedThreads, .. below end (all in flight).
template <typename V>
__device__ __forceinline__ void fused_load_batch(V (&vals)[kFusedUnroll], const V* __restrict__ src,
                                                 unsigned base, unsigned end) {
#pragma unroll
  for (int u = 0; u < kFusedUnroll; ++u) {
    const unsigned it = base + u * kFusedThreads;
    if (it < end) vals[u] = __ldg(src + it);
  }
}

template <typename V>
__global__ void __launch_bounds__(kFusedThreads, 1)
dispatch_fused_kernel(FusedArgs a, const V* __restrict__ x, int row_vecs, V* sorted_x) {
  extern __shared__ __align__(16) int32_t fsm[];
  const int E = a.num_experts, Ep = (E + 3) / 4 * 4, Q = Ep / 4, NG = fused_groups(E);
  int32_t* red = fsm;                       // [2][NG][Ep]: totals, then earlier-block prefixes
  int32_t* cnt = red + 2 * NG * Ep;         // [kFusedWarps][E]
  int32_t* s_base = cnt + kFusedWarps * E;  // first row of this block's entries, per expert
  int32_t* s_off = s_base + E;              // segment start
  int32_t* s_tot = s_off + E;               // routed count
  int32_t* ent = s_tot + E;                 // ids, then rows: this block's entries + token t1's
  const int G = gridDim.x, b = blockIdx.x, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, k = a.topk;
  const int64_t t0 = div_nonneg(a.num_tokens * b, G), t1 = div_nonneg(a.num_tokens * (b + 1), G);
  const int ntok = static_cast<int>(t1 - t0), ne = ntok * k;
  const int64_t n0 = t0 * k;
  // The copy share below may end inside token t1 (the next block's first), so the block ranks
  // that token too: its ids follow the block's own in ent (k entries; none for the last block).
  const int ne_all = ne + (b + 1 < G ? k : 0);
  // The copy's share: items (token, vector) [c0, c1) counted from x[t0]. Every block copies the
  // same number of items however T splits over G, because the slowest block sets the kernel time
  // (whole tokens: 2 vs 1.5 tokens a block at T = 200). T*b = t0*G + r, so items*b/G =
  // t0*row_vecs + r*row_vecs/G: the range may start inside token t0 and end inside token t1.
  // The offset inside the token is rounded down to kBalanceQuantum vectors. It is a function of
  // (t0, r) only, so block b's end is still block b + 1's start, and with row_vecs % 32 == 0 each
  // warp's 32 items stay one aligned run of a row. Unrounded, every warp store touched 5 lines
  // instead of 4, and 8192 tokens ran 22 % slower on the H200 (dispatch_combine_NOTES.md).
  const V* src = x + t0 * row_vecs;
  constexpr unsigned kRoundDown = ~(kBalanceQuantum - 1);
  const int64_t r0 = a.num_tokens * b - t0 * G, r1 = a.num_tokens * (b + 1) - t1 * G;
  const unsigned c0 = static_cast<unsigned>(div_nonneg(r0 * row_vecs, G)) & kRoundDown;
  const unsigned c1 = static_cast<unsigned>(ntok * static_cast<int64_t>(row_vecs) +
                                            (static_cast<unsigned>(div_nonneg(r1 * row_vecs, G)) &
                                             kRoundDown));
  const char* xbytes = reinterpret_cast<const char*>(src);
  const int64_t xend = static_cast<int64_t>(c1) * static_cast<int64_t>(sizeof(V));
  for (int i = tid; i < kFusedWarps * E; i += kFusedThreads) cnt[i] = 0;
  // ids first, alone: they head the critical chain, so no x traffic is queued in front of them.
  for (int i = tid; i < ne_all; i += kFusedThreads) ent[i] = load_id(a.ids, a.is64, n0 + i);
  __syncthreads();
  // The copy's first batch goes into registers now and lands while the routing runs (its DRAM
  // latency leaves the critical chain); the next kFusedPrefetch bytes travel to L2 meanwhile.
  // Not in warp 0: it runs the grid barrier's fence (thread 0), and a fence may wait for the
  // warp's loads in flight, which would put x's DRAM latency back in front of the barrier.
  // Instead warp 1 prefetches warp 0's first batch into L2 (without it, warp 0 met the full
  // DRAM latency after the routing).
  V vals[kFusedUnroll];
  if (warp != 0) {
    fused_load_batch(vals, src, c0 + tid, c1);
    const int64_t first = (static_cast<int64_t>(c0) + kFusedThreads * kFusedUnroll) * sizeof(V);
    const int64_t end = min(xend, first + kFusedPrefetch);
    for (int64_t o = first + static_cast<int64_t>(tid - 32) * 128; o < end;
         o += (kFusedThreads - 32) * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(xbytes + o));
    if (warp == 1) {  // lane = (warp 0's batch vector u, 128-byte piece of its 32 items)
      const unsigned it = c0 + (lane & (kFusedUnroll - 1)) * kFusedThreads;
      const int64_t piece = (lane / kFusedUnroll) * 128;
      if (it < c1) {
        const int64_t cb = static_cast<int64_t>(min(32u, c1 - it)) * sizeof(V);
        const char* p = xbytes + static_cast<int64_t>(it) * sizeof(V);
        if (piece < cb) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + piece));
        if (piece == 3 * 128 && cb > 3 * 128)  // the 5th line of 512 bytes off a line boundary
          asm volatile("prefetch.global.L2 [%0];" ::"l"(p + cb - 1));
      }
    }
  }
  // Warp w owns entries [s0, s1): whole 32-entry steps, in entry order across warps.
  const int seg = (ne + kFusedWarps * 32 - 1) / (kFusedWarps * 32) * 32;
  const int nw = seg > 0 ? (ne + seg - 1) / seg : 0;  // warps that own entries
  const int s0 = min(ne, warp * seg), s1 = min(ne, s0 + seg);
  int32_t* mine = cnt + warp * E;
  for (int s = s0; s < s1; s += 32) {
    const int e = s + lane < s1 ? ent[s + lane] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == 31 - __clz(peers)) mine[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Per-warp exclusive prefixes; the block's counts go to its row of the table. One block (batch-1
  // decode): its counts are the totals, so it skips the table, the grid barrier's fence, atomic
  // and spin, and the table's L2 round trip.
  const bool solo = G == 1;
  for (int e = tid; e < Ep; e += kFusedThreads) {
    int run = 0;
    if (e < E) {
      for (int w = 0; w < nw; ++w) {
        const int c = cnt[w * E + e];
        cnt[w * E + e] = run;  // per-warp exclusive prefix inside the block
        run += c;
      }
    }
    if (!solo) {
      __stcg(a.block_counts + static_cast<int64_t>(b) * Ep + e, run);
    } else if (e < E) {
      s_tot[e] = run;
      s_base[e] = 0;
    }
  }
  const int per = (E + kFusedThreads - 1) / kFusedThreads;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  if (!solo) {
    cooperative_groups::this_grid().sync();
    // Totals and the prefix over earlier blocks: thread (group g, column q) sums rows g, g + NG, ..
    // in batches of kTableBatch loads, all issued before the first add. A plain unrolled loop of
    // __ldcg compiled to one load per row into the same registers, i.e. one dependent L2 round
    // trip per row on the critical chain: 17 in a row at G = 132, E = 256; batched, 3.
    const int4* table = reinterpret_cast<const int4*>(a.block_counts);
    for (int idx = tid; idx < Q * NG; idx += kFusedThreads) {
      const int q = idx % Q, g = idx / Q;
      int4 tot = make_int4(0, 0, 0, 0), bef = tot;
      for (int r0 = g; r0 < G; r0 += NG * kTableBatch) {
        int4 v[kTableBatch];
#pragma unroll
        for (int u = 0; u < kTableBatch; ++u) {
          const int bb = r0 + u * NG;
          v[u] = bb < G ? __ldcg(table + static_cast<int64_t>(bb) * Q + q) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kTableBatch; ++u) {
          tot = tot + v[u];
          if (r0 + u * NG < b) bef = bef + v[u];
        }
      }
      reinterpret_cast<int4*>(red)[g * Q + q] = tot;
      reinterpret_cast<int4*>(red)[(NG + g) * Q + q] = bef;
    }
    __syncthreads();
    for (int e = e0; e < e1; ++e) {
      int tot = 0, bef = 0;
      for (int g = 0; g < NG; ++g) {
        tot += red[g * Ep + e];
        bef += red[(NG + g) * Ep + e];
      }
      s_tot[e] = tot;
      s_base[e] = bef;
    }
  }
  __syncthreads();  // (one block: s_tot came from other threads)
  int padded_sum = 0;
  for (int e = e0; e < e1; ++e) padded_sum += pad_to(s_tot[e], a.tile);
  int total;
  int off = block_exclusive_scan(padded_sum, &total);  // (synchronises the block)
  for (int e = e0; e < e1; ++e) {
    s_off[e] = off;
    s_base[e] += off;
    off += pad_to(s_tot[e], a.tile);
  }
  __syncthreads();
  for (int i = tid; i < nw * E; i += kFusedThreads) cnt[i] += s_base[i % E];
  __syncthreads();
  // Rank: the rows go to shared memory only; the index outputs are written after the copy.
  for (int s = s0; s < s1; s += 32) {
    const int i = s + lane;
    const int row = rank_step(i < s1 ? ent[i] : -1, lane, mine);
    if (i < s1) ent[i] = row;
  }
  // The last owning warp's cursors now stand at the next block's first rows: it ranks the extra
  // token (rows for the copy only; block b + 1 ranks and publishes the same rows itself).
  if (warp == nw - 1) {
    for (int s = ne; s < ne_all; s += 32) {
      const int i = s + lane;
      const int row = rank_step(i < ne_all ? ent[i] : -1, lane, mine);
      if (i < ne_all) ent[i] = row;
    }
  }
  // Posted stores that nothing in this kernel reads back: token_row / row_token of the block's own
  // entries, then its slice of the experts (counts, offsets, padding rows) and its share of the
  // unused tail. Issued after the copy so that they never queue in front of its first stores -
  // except with one block (one token: batch-1 decode), where the copy is a few rows and the
  // stores, issued before it, drain under its loads instead of after them (measured on the H200,
  // session 7: 9.7 vs 11.5 us at one token; 1.2 us slower at 2048 tokens, hence one block only).
  auto index_stores = [&]() {
    for (int i = tid; i < ne; i += kFusedThreads) {
      const int row = ent[i];
      a.token_row[n0 + i] = row;
      if (row >= 0) a.row_token[row] = static_cast<int32_t>(t0 + i / k);
    }
    const int es0 = static_cast<int>(static_cast<int64_t>(E) * b / G);
    const int es1 = static_cast<int>(static_cast<int64_t>(E) * (b + 1) / G);
    for (int e = es0 + tid; e < es1; e += kFusedThreads) {
      a.expert_counts[e] = s_tot[e];
      a.expert_offsets[e] = s_off[e];
    }
    if (b == G - 1 && tid == 0) a.expert_offsets[E] = total;
    for (int e = es0 + warp; e < es1; e += kFusedWarps) {
      const int used = s_off[e] + s_tot[e], end = s_off[e] + pad_to(s_tot[e], a.tile);
      for (int r = used + lane; r < end; r += 32) a.row_token[r] = -1;
    }
    for (int64_t r = total + static_cast<int64_t>(b) * kFusedThreads + tid; r < a.capacity;
         r += static_cast<int64_t>(G) * kFusedThreads)
      a.row_token[r] = -1;
  };
  __syncthreads();  // (the ranks in ent[] are complete)
  if (G == 1) index_stores();
  // Copy: item = (local token, vector); x read once, stored to the token's k rows. Warps 1-15
  // hold their first batch already; warp 0 loads its own now (from L2: warp 1 prefetched it).
  const unsigned rv = static_cast<unsigned>(row_vecs);
  if (warp == 0) fused_load_batch(vals, src, c0 + tid, c1);
  for (unsigned base = c0 + tid;;) {
#pragma unroll
    for (int u = 0; u < kFusedUnroll; ++u) {
      const unsigned it = base + u * kFusedThreads;
      if (it >= c1) break;
      const unsigned tl = it / rv, v = it - tl * rv;
      for (int j = 0; j < k; ++j) {
        const int row = ent[tl * k + j];
        if (row >= 0) sorted_x[static_cast<int64_t>(row) * row_vecs + v] = vals[u];
      }
    }
    base += kFusedThreads * kFusedUnroll;
    if (base >= c1) break;
    fused_load_batch(vals, src, base, c1);
  }
  if (G != 1) index_stores();
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
               int64_t hidden, int topk, bool routed, TOut* out) {
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
      if (routed && rows[jj] >= 0) rows[jj] = static_cast<int32_t>(t * topk + j);
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
        in, p.token_row, w, p.hidden, static_cast<int>(p.topk), p.routed, out);
  } else {
    combine_kernel<TIn, TW, TOut, 1><<<grid, kCombineThreads, 0, stream>>>(
        in, p.token_row, w, p.hidden, static_cast<int>(p.topk), p.routed, out);
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

int num_chunks(int64_t n) { return static_cast<int>(std::max<int64_t>(1, (n + kChunk - 1) / kChunk)); }

// ZEROINFER_DISPATCH_FUSED=0 forces the count / scan / place + gather path (tests, A/B runs).
bool fused_allowed() {
  const char* v = std::getenv("ZEROINFER_DISPATCH_FUSED");
  return v == nullptr || v[0] != '0';
}

int64_t fused_workspace_bytes(int64_t num_tokens, int64_t num_experts) {
  const int64_t blocks = std::min<int64_t>(std::max<int64_t>(num_tokens, 1), kFusedMaxBlocks);
  return blocks * ((num_experts + 3) / 4 * 4) * static_cast<int64_t>(sizeof(int32_t));
}

// Launches dispatch_fused_kernel<V> if its tables fit; false (nothing launched) otherwise.
template <typename V>
bool try_fused(const MoeDispatchParams& p, int64_t row_bytes, void* workspace, cudaStream_t stream) {
  if (!fused_allowed() || p.num_experts > (1 << 20)) return false;
  const DeviceLimits dl = device_limits();
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>({p.num_tokens, static_cast<int64_t>(dl.sms), kFusedMaxBlocks}));
  const int64_t max_tokens = (p.num_tokens + blocks - 1) / blocks;
  const int64_t max_entries = max_tokens * p.topk;
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  // (+1 token: the balanced copy range may reach into the next block's first token.)
  if (max_entries > kFusedMaxEntries || (max_tokens + 1) * row_vecs >= (int64_t{1} << 31))
    return false;
  const int num_experts = static_cast<int>(p.num_experts);
  const size_t smem = fused_smem(num_experts, static_cast<int>(max_entries + p.topk));
  // The kernel's static shared memory (block scan + grid sync scratch) comes on top.
  if (smem + 1024 > static_cast<size_t>(dl.smem_optin)) return false;
  if (smem + 1024 > kSmemLimit) {  // (large E only: V4's 256 experts stay under 48 KB)
    ZI_CUDA_CHECK(cudaFuncSetAttribute(dispatch_fused_kernel<V>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  }
  FusedArgs args{p.topk_ids,      p.ids_dtype == DType::kInt64, p.num_tokens,
                 static_cast<int>(p.topk), num_experts, static_cast<int>(p.tile),
                 p.capacity,      p.row_token, p.token_row, p.expert_counts, p.expert_offsets,
                 static_cast<int32_t*>(workspace)};
  cudaLaunchAttribute coop = {};
  coop.id = cudaLaunchAttributeCooperative;
  coop.val.cooperative = 1;
  const cudaError_t err =
      launch_with(coop, dispatch_fused_kernel<V>, dim3(static_cast<unsigned>(blocks)),
                  dim3(kFusedThreads), smem, stream, args,
                  static_cast<const V*>(p.x), static_cast<int>(row_vecs),
                  static_cast<V*>(p.sorted_x));
  if (err == cudaErrorCooperativeLaunchTooLarge) {  // fewer SMs than reported (e.g. MPS)
    (void)cudaGetLastError();
    return false;
  }
  ZI_CUDA_CHECK(err);
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch fused");
  return true;
}

template <typename V>
void dispatch_with(const MoeDispatchParams& p, int64_t row_bytes, void* workspace,
                   cudaStream_t stream) {
  if (try_fused<V>(p, row_bytes, workspace, stream)) return;
  const int64_t n = p.num_tokens * p.topk;
  const int num_experts = static_cast<int>(p.num_experts);
  const bool is64 = p.ids_dtype == DType::kInt64;
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
  count_kernel<<<chunks, kPlaceThreads, smem, stream>>>(p.topk_ids, is64, n, num_experts, chunks,
                                                        chunk_counts, p.row_token, p.capacity);
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch count");
  scan_kernel<<<(num_experts + kScanWarps - 1) / kScanWarps, kScanWarps * 32, 0, stream>>>(
      chunk_counts, chunks, num_experts, totals);
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch scan");
  place_kernel<<<chunks, kPlaceThreads, smem, stream>>>(
      p.topk_ids, is64, n, static_cast<int>(p.topk), num_experts, static_cast<int>(p.tile),
      chunks, chunk_counts, totals, p.row_token, p.token_row, p.expert_counts, p.expert_offsets);
  ZI_CUDA_CHECK_LAUNCH("moe_dispatch place");
  if (p.num_tokens == 0 || p.hidden == 0) return;
  launch_gather<V>(p, row_bytes, stream);
}

}  // namespace

int64_t moe_dispatch_workspace_bytes(int64_t num_tokens, int64_t topk, int64_t num_experts) {
  const int64_t n = num_tokens * topk;
  // fallback: chunk counts [E][chunks] + expert totals [E]; fused: block counts [G][Ep]
  const int64_t fallback = (static_cast<int64_t>(num_chunks(n)) + 1) * num_experts *
                           static_cast<int64_t>(sizeof(int32_t));
  return std::max(fallback, fused_workspace_bytes(num_tokens, num_experts));
}

void moe_dispatch_cuda(const MoeDispatchParams& p, void* workspace, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t row_bytes = p.hidden * (p.x_dtype == DType::kFloat32 ? 4
                                        : p.x_dtype == DType::kBFloat16 ? 2 : 1);
  // The widest vector that divides the row and both base addresses.
  const uintptr_t align = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.sorted_x) |
                          static_cast<uintptr_t>(row_bytes);
  if (align % 16 == 0) dispatch_with<uint4>(p, row_bytes, workspace, stream);
  else if (align % 8 == 0) dispatch_with<uint2>(p, row_bytes, workspace, stream);
  else if (align % 4 == 0) dispatch_with<uint32_t>(p, row_bytes, workspace, stream);
  else if (align % 2 == 0) dispatch_with<uint16_t>(p, row_bytes, workspace, stream);
  else dispatch_with<uint8_t>(p, row_bytes, workspace, stream);
}

void moe_combine_cuda(const MoeCombineParams& p, void* stream_ptr) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.expert_out_dtype == DType::kFloat32) combine_w<float>(p, stream);
  else combine_w<uint16_t>(p, stream);
}

}  // namespace zi
