// CUDA sparse MLA attention for Hopper (contract in zeroinfer/sparse_mla.h): bf16 queries over a
// paged bf16 cache or the V4 FP8 ("MODEL1") cache, per-token index lists (main + extra), sinks,
// LSE. Decode and prefill are the same kernel: every query token has its own list, so the work
// item is (token, group of heads, split of the list).
//
// One CTA covers 16*R query heads of one token (R = 1, 2 or 4 row groups of 16 heads; more heads
// take more CTAs) over tiles of kTileN = 64 list entries. The 64 KV rows of a tile are gathered
// by cp.async (FP8: into a raw staging ring, then dequantised ONCE per CTA into a bf16 tile
// shared by all its heads; bf16: straight into a double-buffered tile). Warps are arranged R x C:
//   S = Q K^T   warp (rg, cg) computes heads rg*16.. over entries cg*(64/C).. (all 512 dims),
//   softmax     row maxima exchanged through shared memory within the row group,
//   O += P V    P goes through shared memory; warp (rg, cg) owns output dims cg*(512/C)..
// so one warp's fp32 accumulator is 16 x 512/C. R = 1 (8 warps) and R = 2 (16 warps) use
// mma.sync m16n8k16 with ldmatrix; R = 4 (8 warps = two warpgroups, C = 2) uses wgmma: each
// warpgroup computes S for half of the entries and O for half of the dims, operands read by
// the tensor cores straight from the 128-byte-swizzled tiles (wgmma.cuh). Where the time goes on
// the H200, and what was tried: bench/results/h200/sparse_mla_NOTES.md.
//
// Split-KV: with few (token, head-group) items the list is cut into `num_splits` pieces; each
// writes an unnormalised fp32 partial (O, max, sum) to the workspace and a combine kernel merges
// them in a fixed order (deterministic). Scores are kept in base 2: s2 = (q.k) * scale * log2(e).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "check.cuh"
#include "wgmma.cuh"
#include "zeroinfer/sparse_mla.h"

namespace zi {
namespace {

constexpr int kDim = 512;
constexpr int kTileN = 64;                       // list entries per tile
// Warps per CTA: 8 for one row group of 16 heads, 16 otherwise (more warps in flight hide the
// ldmatrix/mma/dequantisation latencies of a CTA that owns a whole SM's shared memory).
// 64 heads (R = 4) run on wgmma with two warpgroups (one per half of the entries in S = QK^T,
// one per half of the output dims in O = PV).
constexpr int warps_for(int R) { return R == 2 ? 16 : 8; }
constexpr int kRowBytes = kDim * 2;              // one bf16 row in shared memory (64 chunks)
constexpr int kFp8Row = 576;                     // 448 e4m3 + 64 bf16
constexpr int kStageBytes = kTileN * kFp8Row + kTileN * 8;  // raw FP8 tile + its scales
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Byte offset of 16-byte chunk `c` (0..63) of row `r` in a tile of kRows rows of 512 bf16: eight
// 64-column panels of kRows x 128 bytes, chunk c % 8 of a row stored at (c % 8) ^ (r % 8). This
// is the canonical 128-byte-swizzled wgmma layout (K-major for Q and K, N-major for V), and it
// keeps ldmatrix conflict-free: eight rows at one chunk hit eight different bank groups.
template <int kRows>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * (kRows * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                          uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D += A(16x16, row) * B(16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Barrier over the C warps of one row group (ids 1..4; 0 is __syncthreads).
template <int C>
__device__ __forceinline__ void row_group_sync(int rg) {
  if constexpr (C == 1) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + rg), "r"(C * 32) : "memory");
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 4 e4m3 bytes (little-endian in `x`) times 2^k -> 2 packed bf16 pairs. e4m3 -> f16 is exact, so
// is the power-of-two scale and the rounding to bf16 (3 mantissa bits fit in 7).
__device__ __forceinline__ void dequant4(uint32_t x, float scale, uint32_t& lo, uint32_t& hi) {
  __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu),
                                              __NV_E4M3);
  __half2_raw h1 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16),
                                              __NV_E4M3);
  const float2 f0 = __half22float2(*reinterpret_cast<__half2*>(&h0));
  const float2 f1 = __half22float2(*reinterpret_cast<__half2*>(&h1));
  lo = pack_bf16(f0.x * scale, f0.y * scale);
  hi = pack_bf16(f1.x * scale, f1.y * scale);
}

__device__ __forceinline__ float ue8m0(uint32_t b) {
  return b ? __uint_as_float(b << 23) : __uint_as_float(0x00400000u);  // 2^(b-127)
}

struct CacheView {
  const uint8_t* data;
  const int32_t* indices;  // row t at indices + t * stride
  int64_t stride;
  int64_t block_stride;    // bytes
  uint32_t block_size;
  int32_t topk;
};

struct KernelArgs {
  const __nv_bfloat16* q;
  int64_t q_stride_token, q_stride_head;
  CacheView kv, extra;     // extra.topk == 0 when absent
  const float* sink;       // [H] or nullptr
  float scale_log2;        // softmax_scale * log2(e)
  int num_heads;
  int num_splits;
  int tiles_per_split;
  // Final outputs (num_splits == 1).
  __nv_bfloat16* out;
  int64_t out_stride_token, out_stride_head;
  float* lse;
  int64_t lse_stride_token;
  // Partials (num_splits > 1): [split][token][head] (O: x512).
  float* part_o;
  float* part_m;
  float* part_l;
  int64_t num_tokens;
};

// Slot of list position `pos` of token t (main list then extra list), or -1; sets *which.
__device__ __forceinline__ int32_t lookup(const KernelArgs& a, int64_t t, int pos, int& which) {
  if (pos < a.kv.topk) {
    which = 0;
    return a.kv.indices[t * a.kv.stride + pos];
  }
  which = 1;
  const int p2 = pos - a.kv.topk;
  return p2 < a.extra.topk ? a.extra.indices[t * a.extra.stride + p2] : -1;
}

// Where a tile's row lives: resolved once per entry (by threads 0..63, from indices fetched an
// iteration earlier so their global-memory latency hides behind the previous tile's math) and
// published in shared memory for all threads' cp.asyncs. row == nullptr: skip (zero-fill).
struct RowRef {
  const uint8_t* row;    // FP8: the 576-byte row; bf16: the 1024-byte row
  const uint8_t* scale;  // FP8: the 8 scale bytes
};

// Slot of list position `e` of tile `tile` (kN entries a tile; -1 past the list or the split),
// and its cache.
template <int kN = kTileN>
__device__ __forceinline__ void fetch_slot(const KernelArgs& a, int64_t t, int tile, int tile_end,
                                           int e, int32_t& slot, int& which) {
  const int pos = tile * kN + e;
  slot = -1;
  which = 0;
  if (tile < tile_end && pos < a.kv.topk + a.extra.topk) slot = lookup(a, t, pos, which);
}

template <bool kFp8>
__device__ __forceinline__ RowRef resolve(const KernelArgs& a, int32_t slot, int which) {
  RowRef r{nullptr, nullptr};
  if (slot < 0) return r;
  const CacheView& c = which ? a.extra : a.kv;
  const uint32_t blk = static_cast<uint32_t>(slot) / c.block_size;
  const uint32_t off = static_cast<uint32_t>(slot) - blk * c.block_size;
  const uint8_t* base = c.data + static_cast<int64_t>(blk) * c.block_stride;
  if constexpr (kFp8) {
    r.row = base + static_cast<int64_t>(off) * kFp8Row;
    r.scale = base + static_cast<int64_t>(c.block_size) * kFp8Row + off * 8u;
  } else {
    r.row = base + static_cast<int64_t>(off) * kRowBytes;
  }
  return r;
}

// Issue the cp.asyncs of one tile from the published RowRefs: FP8 -> raw staging buffer, bf16 ->
// swizzled tile. Skipped entries are zero-filled (src-size 0 reads nothing; `dummy` is any valid
// address, since an empty cache's data pointer may be null).
// kN entries a tile, copied by kThreads threads of which this is number `tid`.
template <bool kFp8, int kThreads, int kN = kTileN>
__device__ __forceinline__ void load_tile(const RowRef* refs, const void* dummy, uint8_t* dst,
                                          int tid) {
  constexpr int kChunks = kFp8 ? 37 : 64;  // FP8: 36 x 16 B row + one 8 B scale chunk
#pragma unroll 4
  for (int j = 0; j < (kN * kChunks + kThreads - 1) / kThreads; ++j) {
    const int i = tid + j * kThreads;
    if (i >= kN * kChunks) break;
    const int e = i / kChunks, c = i - e * kChunks;
    const RowRef r = refs[e];
    const bool valid = r.row != nullptr;
    if constexpr (kFp8) {
      if (c < 36) {
        cp_async16(smem_u32(dst + e * kFp8Row + c * 16), valid ? r.row + c * 16 : dummy, valid);
      } else {
        cp_async8(smem_u32(dst + kN * kFp8Row + e * 8), valid ? r.scale : dummy, valid);
      }
    } else {
      cp_async16(smem_u32(dst) + swz<kN>(e, c), valid ? r.row + c * 16 : dummy, valid);
    }
  }
}

// Raw FP8 staging tile -> swizzled bf16 tile (zero-filled rows stay zero).
template <int kThreads, int kN = kTileN>
__device__ __forceinline__ void dequant_tile(const uint8_t* stage, uint8_t* tile, int tid) {
  const uint8_t* scales = stage + kN * kFp8Row;
#pragma unroll
  for (int j = 0; j < kN * 64 / kThreads; ++j) {
    const int i = tid + j * kThreads;
    const int e = i >> 6, c = i & 63;
    uint4 v;
    if (c < 56) {
      const uint2 raw = *reinterpret_cast<const uint2*>(stage + e * kFp8Row + c * 8);
      const float s = ue8m0(scales[e * 8 + (c >> 3)]);
      dequant4(raw.x, s, v.x, v.y);
      dequant4(raw.y, s, v.z, v.w);
    } else {
      v = *reinterpret_cast<const uint4*>(stage + e * kFp8Row + 448 + (c - 56) * 16);
    }
    *reinterpret_cast<uint4*>(tile + swz<kN>(e, c)) = v;
  }
}

// One tile's online-softmax step for a warp holding S rows rg*16 + g (+8) over entries n0..:
// mask skipped entries, exchange row maxima with the other C-1 warps of the row group through
// `red` ([16 R][C] floats, double-buffered by the caller), rescale the running max/sum, and
// write P = exp2(s - m) as bf16 into the swizzled P tile. Returns the O rescale factors.
template <int NT, int C>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], const int* valid_flags, int n0,
                                             float* red, uint8_t* sP, int rg, int cg, int g,
                                             int q4, float scale_log2, float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2]) {
  // ---- mask, scale, tile maxima ---------------------------------------------------------
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const bool valid = valid_flags[n0 + j * 8 + q4 * 2 + x] != 0;
      s[j][x] = valid ? s[j][x] * scale_log2 : -INFINITY;
      s[j][2 + x] = valid ? s[j][2 + x] * scale_log2 : -INFINITY;
      mx[0] = fmaxf(mx[0], s[j][x]);
      mx[1] = fmaxf(mx[1], s[j][2 + x]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
  if constexpr (C > 1) {
    if (q4 == 0) {
      red[(rg * 16 + g) * C + cg] = mx[0];
      red[(rg * 16 + g + 8) * C + cg] = mx[1];
    }
    row_group_sync<C>(rg);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < C; ++c) m = fmaxf(m, red[(rg * 16 + g + 8 * r) * C + c]);
      mx[r] = m;
    }
  }
  float m_new[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m_new[r] = fmaxf(m_run[r], mx[r]);
    alpha[r] = m_run[r] == -INFINITY ? 0.f : exp2f(m_run[r] - m_new[r]);
    m_run[r] = m_new[r];
    l_run[r] *= alpha[r];
  }

  // ---- P = exp2(s - m) -> shared memory (bf16); rescale O ---------------------------------
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    float p[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = x >> 1;
      p[x] = m_new[r] == -INFINITY ? 0.f : exp2f(s[j][x] - m_new[r]);
      l_run[r] += p[x];
    }
    const int col = n0 + j * 8 + q4 * 2;  // entry within the tile
    const int row = rg * 16 + g;
    const uint32_t lo = pack_bf16(p[0], p[1]), hi = pack_bf16(p[2], p[3]);
    // P rows are 128 bytes (8 chunks), swizzled by row & 7.
    *reinterpret_cast<uint32_t*>(sP + row * 128 + (((col >> 3) ^ (row & 7)) << 4) +
                                 (col & 7) * 2) = lo;
    *reinterpret_cast<uint32_t*>(sP + (row + 8) * 128 + (((col >> 3) ^ ((row + 8) & 7)) << 4) +
                                 (col & 7) * 2) = hi;
  }
}

// 1 / (sum + exp(sink)) for a row with running max m (base 2) and sum l, or 0 when no key was
// valid (l == 0): the output's normalisation, shared by the one-split store and the combine.
__device__ __forceinline__ float output_scale(float l, float m, const float* sink, int h) {
  if (!(l > 0.f)) return 0.f;
  float denom = l;
  if (sink != nullptr) denom += exp2f(sink[h] * kLog2e - m);
  return 1.f / denom;
}

// Barrier over the threads that compute (all of the CTA, or the kConsumers threads of a
// warp-specialised CTA, named barrier 5).
template <int kConsumers>
__device__ __forceinline__ void consumer_sync() {
  if constexpr (kConsumers == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync 5, %0;\n" ::"n"(kConsumers) : "memory");
  }
}

// The end of a work item: the row sums are combined over the C warps of each row group, then
// the normalised output and LSE are written (one split), or the unnormalised partial O with its
// max and sum (several splits, merged by sparse_mla_combine_kernel).
template <int OT, int C, int kConsumers>
__device__ __forceinline__ void store_outputs(float (&acc)[OT][4], float (&m_run)[2],
                                              float (&l_run)[2], float* sRed, int rg, int cg,
                                              int g, int q4, const KernelArgs& a, int64_t t,
                                              int head0, int split) {
  // ---- epilogue: row sums over the row group, then normalise or write partials -------------
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if constexpr (C > 1) {
    consumer_sync<kConsumers>();  // every warp is past its last use of sRed
    if (q4 == 0) {
      sRed[(rg * 16 + g) * C + cg] = l_run[0];
      sRed[(rg * 16 + g + 8) * C + cg] = l_run[1];
    }
    row_group_sync<C>(rg);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = 0.f;
#pragma unroll
      for (int c = 0; c < C; ++c) l += sRed[(rg * 16 + g + 8 * r) * C + c];
      l_run[r] = l;
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = head0 + rg * 16 + g + 8 * r;
    if (h >= a.num_heads) continue;
    const float l = l_run[r], m = m_run[r];
    if (a.num_splits == 1) {
      const float inv = output_scale(l, m, a.sink, h);
      __nv_bfloat16* o = a.out + t * a.out_stride_token + static_cast<int64_t>(h) * a.out_stride_head;
#pragma unroll
      for (int j = 0; j < OT; ++j) {
        const int d = cg * (kDim / C) + j * 8 + q4 * 2;
        *reinterpret_cast<uint32_t*>(o + d) = pack_bf16(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
      }
      if (cg == 0 && q4 == 0)
        a.lse[t * a.lse_stride_token + h] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
    } else {
      const int64_t item = (static_cast<int64_t>(split) * a.num_tokens + t) * a.num_heads + h;
      float* o = a.part_o + item * kDim;
#pragma unroll
      for (int j = 0; j < OT; ++j) {
        const int d = cg * (kDim / C) + j * 8 + q4 * 2;
        *reinterpret_cast<float2*>(o + d) = make_float2(acc[j][2 * r], acc[j][2 * r + 1]);
      }
      if (cg == 0 && q4 == 0) {
        a.part_m[item] = m;
        a.part_l[item] = l;
      }
    }
  }
}

template <int R, bool kFp8>
struct Smem {
  static constexpr int kHeads = 16 * R;
  static constexpr int kThreads = warps_for(R) * 32;
  static constexpr int kC = warps_for(R) / R;
  // Pipeline depth: FP8 stages raw tiles (one bf16 tile); bf16 double-buffers the tile itself.
  static constexpr int kStages = kFp8 ? (R == 4 ? 2 : 3) : 2;
  static constexpr int kTiles = kFp8 ? 1 : 2;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kHeads * kRowBytes;
  static constexpr int kStage = kK + kTiles * kTileN * kRowBytes;
  static constexpr int kP = kStage + (kFp8 ? kStages * kStageBytes : 0);
  static constexpr int kRed = kP + kHeads * kTileN * 2;        // [2][R][16][C] floats
  static constexpr int kRefs = kRed + 2 * R * 16 * kC * 4;     // [64] RowRef
  static constexpr int kValid = kRefs + kTileN * 16;           // [kStages][64] int
  static constexpr int kBytes = kValid + kStages * kTileN * 4;
  static constexpr int kAlloc = kBytes + 1024;  // slack to align the base to 1024 bytes
  static_assert(R != 4 || (kK % 1024 == 0 && kStage % 1024 == 0 && kP % 1024 == 0),
                "wgmma operands must start on 1024-byte boundaries");
};

template <int R, bool kFp8>
__global__ void __launch_bounds__(Smem<R, kFp8>::kThreads, 1)
    sparse_mla_kernel(const KernelArgs a) {
  using S = Smem<R, kFp8>;
  constexpr int C = S::kC;
  constexpr int kThreads = S::kThreads;
  constexpr int kEntriesPerWarp = kTileN / C;   // S columns of one warp: 8, 16 or 32
  constexpr int NT = kEntriesPerWarp / 8;       // n8 tiles of S per warp
  constexpr int kDimsPerWarp = kDim / C;        // O columns of one warp
  constexpr int OT = kDimsPerWarp / 8;          // n8 tiles of O per warp

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The 128-byte swizzle is a function of address bits, so operand tiles sit on 1024-byte
  // boundaries of the shared window.
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* sQ = smem + S::kQ;
  uint8_t* sK = smem + S::kK;
  uint8_t* sP = smem + S::kP;
  float* sRed = reinterpret_cast<float*>(smem + S::kRed);

  const int64_t t = blockIdx.x;
  const int head0 = blockIdx.y * S::kHeads;
  const int split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr bool kWgmma = R == 4;
  // wgmma: warpgroup cg = warp / 4 holds all 64 rows, warp rg = warp % 4 rows 16 rg.. of them.
  const int rg = kWgmma ? warp & 3 : warp / C, cg = kWgmma ? warp >> 2 : warp % C;
  const int g = lane >> 2, q4 = lane & 3;

  const int total = a.kv.topk + a.extra.topk;
  const int ntiles = (total + kTileN - 1) / kTileN;
  const int tile_begin = split * a.tiles_per_split;
  const int tile_end = min(ntiles, tile_begin + a.tiles_per_split);
  const int n = max(0, tile_end - tile_begin);

  // Q: 16R heads x 512 bf16, swizzled; heads past H are zero-filled.
  for (int i = threadIdx.x; i < S::kHeads * 64; i += kThreads) {
    const int r = i >> 6, c = i & 63, h = head0 + r;
    const bool valid = h < a.num_heads;
    const __nv_bfloat16* src =
        a.q + t * a.q_stride_token + static_cast<int64_t>(valid ? h : 0) * a.q_stride_head + c * 8;
    cp_async16(smem_u32(sQ) + swz<S::kHeads>(r, c), src, valid);
  }

  // Pipeline. Tile `it` of this split lives in stage it % kStages (FP8: raw staging buffer;
  // bf16: the tile buffer itself); its validity flags in sValid[stage]. Threads 0..63 own one
  // list entry each: they fetch the slots of a tile one iteration before its copies are issued.
  RowRef* sRefs = reinterpret_cast<RowRef*>(smem + S::kRefs);
  int* sValid = reinterpret_cast<int*>(smem + S::kValid);
  auto stage_ptr = [&](int stage) {
    return kFp8 ? smem + S::kStage + stage * kStageBytes : sK + stage * kTileN * kRowBytes;
  };
  const bool owner = threadIdx.x < kTileN;
  auto publish = [&](int32_t slot, int which, int stage) {
    sRefs[threadIdx.x] = resolve<kFp8>(a, slot, which);
    sValid[stage * kTileN + threadIdx.x] = slot >= 0;
  };
  int32_t pf_slot = -1;
  int pf_which = 0;
  // Prologue: tiles 0 .. kStages-2 (the Q copies join the first group).
#pragma unroll
  for (int st = 0; st < S::kStages - 1; ++st) {
    if (owner) {
      fetch_slot(a, t, tile_begin + st, tile_end, threadIdx.x, pf_slot, pf_which);
      publish(pf_slot, pf_which, st);
    }
    __syncthreads();
    if (st < n) load_tile<kFp8, kThreads>(sRefs, a.q, stage_ptr(st), threadIdx.x);
    cp_async_commit();
    __syncthreads();  // sRefs is reused by the next prologue tile
  }
  if (owner)
    fetch_slot(a, t, tile_begin + S::kStages - 1, tile_end, threadIdx.x, pf_slot, pf_which);

  float acc[OT][4];
#pragma unroll
  for (int j = 0; j < OT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows g, g + 8 (base-2 units)
  float l_run[2] = {0.f, 0.f};              // this thread's partial sums

  const uint32_t q_base = smem_u32(sQ);
  const uint32_t p_base = smem_u32(sP);

  for (int it = 0; it < n; ++it) {
    const int stage = it % S::kStages;
    cp_async_wait<S::kStages - 2>();  // tile `it` (and Q) landed for this thread's copies
    if constexpr (kWgmma) wgmma::fence_proxy_async();  // cp.async data -> tensor-core reads
    __syncthreads();  // ... and everyone's; all warps are done with tile it-1
    uint8_t* kt = kFp8 ? sK : stage_ptr(stage);
    if constexpr (kFp8) {
      dequant_tile<kThreads>(stage_ptr(stage), sK, threadIdx.x);
      if constexpr (kWgmma) wgmma::fence_proxy_async();
    }
    const int ahead = it + S::kStages - 1;  // the tile whose copies are issued now
    if (owner) {
      publish(pf_slot, pf_which, ahead % S::kStages);
      fetch_slot(a, t, tile_begin + ahead + 1, tile_end, threadIdx.x, pf_slot, pf_which);
    }
    __syncthreads();  // bf16 tile ready (FP8), sRefs published
    if (ahead < n) load_tile<kFp8, kThreads>(sRefs, a.q, stage_ptr(ahead % S::kStages), threadIdx.x);
    cp_async_commit();
    const int* valid_flags = sValid + stage * kTileN;
    const uint32_t k_base = smem_u32(kt);

    // ---- S = Q K^T over this warp's entries --------------------------------------------
    float s[NT][4];
    const int n0 = cg * kEntriesPerWarp;
    if constexpr (kWgmma) {
      // Warpgroup cg: S[64 heads, 32 entries] over 32 k-steps; Q and K both K-major.
      float(&sd)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(s[0][0]);
      // Descriptors advance by constants (start address in 16-byte units, low 14 bits).
      const uint64_t dq = wgmma::desc_sw128(q_base, 16, 1024);
      const uint64_t dk = wgmma::desc_sw128(k_base + n0 * 128, 16, 1024);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kDim / 16; ++kk) {
        const uint32_t qoff = (kk >> 2) * (S::kHeads * 128) + (kk & 3) * 32;
        const uint32_t koff = (kk >> 2) * (kTileN * 128) + (kk & 3) * 32;
        wgmma::wgmma_m64n32k16_bf16(sd, dq + (qoff >> 4), dk + (koff >> 4), kk > 0);
      }
      wgmma::commit();
      wgmma::wait<0>();
    } else {
      // kAcc independent accumulator sets over k break the mma dependency chain when a warp has
      // few n8 tiles (one chain per tile otherwise).
      constexpr int kAcc = NT >= 4 ? 1 : 4 / NT;
      float sa[kAcc][NT][4];
#pragma unroll
      for (int u = 0; u < kAcc; ++u)
#pragma unroll
        for (int j = 0; j < NT; ++j) sa[u][j][0] = sa[u][j][1] = sa[u][j][2] = sa[u][j][3] = 0.f;
#pragma unroll 2
      for (int k0 = 0; k0 < kDim / 16; k0 += kAcc) {
#pragma unroll
        for (int u = 0; u < kAcc; ++u) {
          const int kk = k0 + u;
          uint32_t a0, a1, a2, a3;
          ldsm_x4(q_base + swz<S::kHeads>(rg * 16 + (lane & 15), 2 * kk + (lane >> 4)), a0, a1, a2, a3);
          if constexpr (NT == 1) {
            uint32_t b0, b1;
            ldsm_x2(k_base + swz<kTileN>(n0 + (lane & 7), 2 * kk + ((lane >> 3) & 1)), b0, b1);
            mma_bf16(sa[u][0], a0, a1, a2, a3, b0, b1);
          } else {
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4(k_base + swz<kTileN>(n0 + j * 8 + (lane & 7) + ((lane >> 4) << 3),
                                   2 * kk + ((lane >> 3) & 1)),
                      b0, b1, b2, b3);
              mma_bf16(sa[u][j], a0, a1, a2, a3, b0, b1);
              mma_bf16(sa[u][j + 1], a0, a1, a2, a3, b2, b3);
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          float v = sa[0][j][x];
#pragma unroll
          for (int u = 1; u < kAcc; ++u) v += sa[u][j][x];
          s[j][x] = v;
        }
    }

    float alpha[2];
    softmax_step<NT, C>(s, valid_flags, n0, sRed + (it & 1) * (R * 16 * C), sP, rg, cg, g, q4,
                        a.scale_log2, m_run, l_run, alpha);
    // Once the running maxima settle, most tiles leave them unchanged: skip the rescale then.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < OT; ++j) {
        acc[j][0] *= alpha[0];
        acc[j][1] *= alpha[0];
        acc[j][2] *= alpha[1];
        acc[j][3] *= alpha[1];
      }
    }
    if constexpr (kWgmma) {
      wgmma::fence_proxy_async();  // P (ordinary stores) -> tensor-core reads
      __syncthreads();             // each warpgroup reads all 64 rows of P
    } else {
      row_group_sync<C>(rg);
    }

    // ---- O += P V over this warp's output dims ---------------------------------------------
    if constexpr (kWgmma) {
      // Warpgroup cg: O[64 heads, dims 256 cg ..+256] in two N=128 halves; P K-major, V N-major
      // (the K tile read with dims contiguous: 64-dim panels 8 KB apart, 8-entry groups 1 KB).
      const uint64_t dp = wgmma::desc_sw128(p_base, 16, 1024);
      const uint64_t dv = wgmma::desc_sw128(k_base + cg * 4 * (kTileN * 128), kTileN * 128, 1024);
      wgmma::fence();
#pragma unroll
      for (int ks = 0; ks < kTileN / 16; ++ks) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float(&od)[64] = reinterpret_cast<float(&)[64]>(acc[half * 16][0]);
          const uint32_t voff = half * 2 * (kTileN * 128) + ks * 16 * 128;
          wgmma::wgmma_m64n128k16_bf16_tb(od, dp + ((ks * 32) >> 4), dv + (voff >> 4), true);
        }
      }
      wgmma::commit();
      wgmma::wait<0>();
    } else {
      const int d0 = cg * kDimsPerWarp / 8;  // first 16-byte chunk of this warp's dims
#pragma unroll
      for (int ks = 0; ks < kTileN / 16; ++ks) {
        uint32_t a0, a1, a2, a3;
        {
          const int row = rg * 16 + (lane & 15), ch = 2 * ks + (lane >> 4);
          ldsm_x4(p_base + row * 128 + ((ch ^ (row & 7)) << 4), a0, a1, a2, a3);
        }
#pragma unroll
        for (int j = 0; j < OT; j += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(k_base + swz<kTileN>(ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                 d0 + j + (lane >> 4)),
                    b0, b1, b2, b3);
          mma_bf16(acc[j], a0, a1, a2, a3, b0, b1);
          mma_bf16(acc[j + 1], a0, a1, a2, a3, b2, b3);
        }
      }
    }
  }
  cp_async_wait<0>();

  store_outputs<OT, C, 0>(acc, m_run, l_run, sRed, rg, cg, g, q4, a, t, head0, split);
}

// Merge the split partials of one (token, head) per warp, in split order.
__global__ void __launch_bounds__(128) sparse_mla_combine_kernel(const KernelArgs a) {
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (h >= a.num_heads) return;
  const int64_t stride = a.num_tokens * a.num_heads;
  const int64_t item0 = t * a.num_heads + h;
  float m = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) m = fmaxf(m, a.part_m[item0 + s * stride]);
  float l = 0.f;
  float o[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i] = 0.f;
  if (m != -INFINITY) {
    for (int s = 0; s < a.num_splits; ++s) {
      const int64_t item = item0 + s * stride;
      const float ms = a.part_m[item];
      if (ms == -INFINITY) continue;
      const float w = exp2f(ms - m);
      l += a.part_l[item] * w;
      const float4* po = reinterpret_cast<const float4*>(a.part_o + item * kDim);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = po[lane + 32 * i];
        o[4 * i + 0] += v.x * w;
        o[4 * i + 1] += v.y * w;
        o[4 * i + 2] += v.z * w;
        o[4 * i + 3] += v.w * w;
      }
    }
  }
  const float inv = output_scale(l, m, a.sink, h);
  __nv_bfloat16* out = a.out + t * a.out_stride_token + static_cast<int64_t>(h) * a.out_stride_head;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int d = 4 * (lane + 32 * i);
    uint2 v;
    v.x = pack_bf16(o[4 * i] * inv, o[4 * i + 1] * inv);
    v.y = pack_bf16(o[4 * i + 2] * inv, o[4 * i + 3] * inv);
    *reinterpret_cast<uint2*>(out + d) = v;
  }
  if (lane == 0) a.lse[t * a.lse_stride_token + h] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

int rows_per_cta(int64_t num_heads) {  // R: row groups of 16 heads per CTA
  return num_heads > 32 ? 4 : (num_heads > 16 ? 2 : 1);
}

template <int R, bool kFp8>
void launch(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = Smem<R, kFp8>::kAlloc;
  static_assert(bytes <= 227 * 1024, "shared memory budget");
  auto* kernel = sparse_mla_kernel<R, kFp8>;
  ZI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<grid, Smem<R, kFp8>::kThreads, bytes, stream>>>(a);
}

CacheView view_of(const SparseMlaCache& c) {
  return CacheView{static_cast<const uint8_t*>(c.data), c.indices, c.indices_stride,
                   c.block_stride_bytes, static_cast<uint32_t>(c.block_size),
                   static_cast<int32_t>(c.topk)};
}

}  // namespace

SparseMlaCudaPlan sparse_mla_cuda_plan(int64_t num_tokens, int64_t num_heads, int64_t total_topk,
                                       int64_t num_sms) {
  SparseMlaCudaPlan plan;
  const int64_t heads_per_cta = 16 * rows_per_cta(num_heads);
  const int64_t items = num_tokens * ((num_heads + heads_per_cta - 1) / heads_per_cta);
  const int64_t ntiles = (total_topk + kTileN - 1) / kTileN;
  int64_t splits = 1;
  // One CTA per SM (shared memory): split the list only while the grid is under one wave.
  if (items > 0 && items < num_sms && ntiles > 1)
    splits = std::min<int64_t>(ntiles, std::max<int64_t>(1, num_sms / items));
  const int64_t per_split = splits > 0 ? (ntiles + splits - 1) / splits : 0;
  if (per_split > 0) splits = (ntiles + per_split - 1) / per_split;  // no empty split
  plan.num_splits = std::max<int64_t>(1, splits);
  plan.tiles_per_split = std::max<int64_t>(1, per_split);
  plan.workspace_floats =
      plan.num_splits > 1 ? plan.num_splits * num_tokens * num_heads * (kDim + 2) : 0;
  return plan;
}

void sparse_mla_attention_cuda(const SparseMlaParams& p, const SparseMlaCudaPlan& plan,
                               float* workspace, void* stream) {
  ZI_CHECK(p.q_dtype == DType::kBFloat16, "sparse_mla_attention_cuda: q must be bfloat16");
  const bool fp8 = p.kv.dtype == DType::kUInt8;
  ZI_CHECK(fp8 || p.kv.dtype == DType::kBFloat16,
           "sparse_mla_attention_cuda: cache must be bfloat16 or the FP8 layout");
  ZI_CHECK(!p.has_extra || p.extra_kv.dtype == p.kv.dtype,
           "sparse_mla_attention_cuda: extra cache must have the main cache's format");
  ZI_CHECK(p.num_heads >= 1 && p.num_tokens >= 0, "sparse_mla_attention_cuda: bad sizes");
  ZI_CHECK(plan.num_splits == 1 || workspace != nullptr,
           "sparse_mla_attention_cuda: a split plan needs a workspace");
  if (p.num_tokens == 0) return;
  ZI_CHECK(p.kv.topk + (p.has_extra ? p.extra_kv.topk : 0) < (int64_t{1} << 30),
           "sparse_mla_attention_cuda: index lists too long");

  KernelArgs a{};
  a.q = static_cast<const __nv_bfloat16*>(p.q);
  a.q_stride_token = p.q_stride_token;
  a.q_stride_head = p.q_stride_head;
  a.kv = view_of(p.kv);
  if (p.has_extra) {
    a.extra = view_of(p.extra_kv);
  } else {
    a.extra = CacheView{a.kv.data, a.kv.indices, 0, 0, 1, 0};
  }
  a.sink = p.attn_sink;
  a.scale_log2 = p.softmax_scale * kLog2e;
  a.num_heads = static_cast<int>(p.num_heads);
  a.num_splits = static_cast<int>(plan.num_splits);
  a.tiles_per_split = static_cast<int>(plan.tiles_per_split);
  a.out = static_cast<__nv_bfloat16*>(p.out);
  a.out_stride_token = p.out_stride_token;
  a.out_stride_head = p.out_stride_head;
  a.lse = p.lse;
  a.lse_stride_token = p.lse_stride_token;
  a.num_tokens = p.num_tokens;
  if (plan.num_splits > 1) {
    const int64_t items = plan.num_splits * p.num_tokens * p.num_heads;
    a.part_o = workspace;
    a.part_m = workspace + items * kDim;
    a.part_l = a.part_m + items;
  }

  const int R = rows_per_cta(p.num_heads);
  const int64_t heads_per_cta = 16 * R;
  dim3 grid(static_cast<unsigned>(p.num_tokens),
            static_cast<unsigned>((p.num_heads + heads_per_cta - 1) / heads_per_cta),
            static_cast<unsigned>(plan.num_splits));
  auto s = static_cast<cudaStream_t>(stream);
  if (fp8) {
    if (R == 1) launch<1, true>(a, grid, s);
    else if (R == 2) launch<2, true>(a, grid, s);
    else launch<4, true>(a, grid, s);
  } else {
    if (R == 1) launch<1, false>(a, grid, s);
    else if (R == 2) launch<2, false>(a, grid, s);
    else launch<4, false>(a, grid, s);
  }
  ZI_CUDA_CHECK_LAUNCH("sparse_mla_attention");
  if (plan.num_splits > 1) {
    dim3 cgrid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>((p.num_heads + 3) / 4));
    sparse_mla_combine_kernel<<<cgrid, 128, 0, s>>>(a);
    ZI_CUDA_CHECK_LAUNCH("sparse_mla_combine");
  }
}

}  // namespace zi
