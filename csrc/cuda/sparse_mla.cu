// CUDA sparse MLA attention for Hopper (contract in zeroinfer/sparse_mla.h): bf16 queries over a
// paged bf16 cache or the V4 FP8 ("MODEL1") cache, per-token index lists (main + extra), sinks,
// LSE. Decode and prefill are the same kernel: every query token has its own list, so the work
// item is (token, group of heads, split of the list).
//
// One CTA covers 16*R query heads of one token (R = 1, 2 or 4 row groups of 16 heads; more heads
// take more CTAs) over tiles of kTileN = 64 list entries, dequantised or copied ONCE per CTA into
// a bf16 tile that all its heads share:
//   bf16 cache (sparse_mla_bf16_kernel): rows gathered by cp.async into a double-buffered tile
//     (64 heads: each warpgroup copies the half of the rows it reads, tile it + 2's rows during
//     tile it's P V, a 16-row group as soon as the P V step that read its place retired).
//   FP8 cache (sparse_mla_fp8_kernel): the kThreads/64 threads that own a list entry load its row
//     into registers one tile ahead (after an L2 prefetch one tile earlier still) and dequantise
//     it exactly with bit moves and one bf16x2 multiply a pair, into the tile the MMA does not
//     read at the moment (two tiles; one for 16 heads, so that two CTAs share an SM).
// Warps are arranged R x C:
//   S = Q K^T   warp (rg, cg) ends with heads rg*16.. over entries cg*(64/C).. (all 512 dims;
//               on mma.sync computed as partials over half of the dims and 16 entries, summed
//               through shared memory, so that the row group's Q is read twice, not 8 times),
//   softmax     row maxima exchanged through shared memory within the row group; the running
//               max moves lazily (only when it grows by more than 2^8),
//   O += P V    P goes through shared memory; warp (rg, cg) owns output dims cg*(512/C)..
// so one warp's fp32 accumulator is 16 x 512/C. R = 1 (8 warps) and R = 2 (16 warps) use
// mma.sync m16n8k16 with ldmatrix; R = 4 (8 warps = two warpgroups, C = 2) uses wgmma, operands
// read by the tensor cores straight from the 128-byte-swizzled tiles (wgmma.cuh): each
// warpgroup computes S over half of the dims for all entries and keeps its half of the entries
// after a fixed-order exchange, and O for half of the dims; the FP8 dequantisation of the next
// tile runs while P V is in flight. Outputs leave through shared memory in 16-byte stores.
// Up to 16 heads over the FP8 cache run sparse_mla_fp8_h16_kernel instead (K dequantised into
// mma registers, dims split across the warps; 64-entry tiles up to one wave of CTAs, 32-entry
// tiles at two CTAs an SM beyond): the plan (sparse_mla_cuda_plan) picks.
// Where the time goes on the H200, and what was tried: bench/results/h200/sparse_mla_NOTES.md.
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
#include "launch.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"
#include "zeroinfer/numeric.h"
#include "zeroinfer/sparse_mla.h"

namespace zi {
namespace {

constexpr int kDim = 512;
constexpr int kTileN = 64;                       // list entries per tile
// Warps per CTA: 8 for one row group of 16 heads, 16 otherwise (more warps in flight hide the
// ldmatrix/mma/dequantisation latencies of a CTA that owns a whole SM's shared memory).
// 64 heads (R = 4) run on wgmma with two warpgroups (one per half of the dims in S = QK^T, then
// of the entries in the softmax, and one per half of the output dims in O = PV).
constexpr int warps_for(int R) { return R == 2 ? 16 : 8; }
constexpr int kRowBytes = kDim * 2;              // one bf16 row in shared memory (64 chunks)
constexpr int kFp8Row = 576;                     // 448 e4m3 + 64 bf16
constexpr int kFp8Chunks = kFp8Row / 16;         // 16-byte chunks of an FP8 row: 36
constexpr int kNopeChunks = 448 / 16;            // of them e4m3 (16 values each): 28
constexpr int kRopeChunk0 = 448 / 8;             // first bf16 tile chunk of the RoPE dims: 56
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

// 4 e4m3 bytes (little-endian in `x`) times 2^k -> 2 packed bf16 pairs, through f16 and fp32:
// exact for every scale (e4m3 -> f16 is exact, so is the power-of-two scale and the rounding to
// bf16: 3 mantissa bits fit in 7). The slow path (dequant16_slow) below.
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

// Two e4m3 values (bytes kLo and kHi of `w`) -> the bf16 pair with the same bits moved down by 4:
// sign in place, exponent and mantissa in the bf16 fields. Its value is the e4m3 value times 2^-120
// exactly (e4m3 subnormals land on bf16 subnormals). Three instructions: prmt puts byte kHi at
// byte 3, byte kLo sign-replicated at byte 2 (selector bit 3), byte kLo at byte 1 and zero at byte
// 0; the arithmetic shift by 4 leaves each 16-bit lane as s s s s s e e e e m m m 0 0 0 0 (the upper
// lane's copies of the sign from bit 31, the lower lane's from the replicated byte) and the mask
// keeps the sign and the 7 exponent/mantissa bits. (The mask-shift-or form took 4; checked for all
// 65,536 byte pairs against the bit formula in tests/ops/test_sparse_mla.py's model.)
template <int kLo, int kHi>
__device__ __forceinline__ uint32_t e4m3x2_as_bf16x2_shifted(uint32_t w) {
  constexpr uint32_t kSel = (kHi << 12) | ((8 | kLo) << 8) | (kLo << 4) | 4;
  uint32_t a;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(a) : "r"(w), "r"(0u), "n"(kSel));
  return static_cast<uint32_t>(static_cast<int32_t>(a) >> 4) & 0x87F087F0u;
}

// 16 e4m3 values times 2^(b-127) (UE8M0 byte b) -> 16 bf16 in two 16-byte chunks.
// Fast (b <= 134, i.e. scales up to 2^7; a real cache's scales are far below): bit moves plus one
// bf16x2 multiply by 2^(b-7) = 2^120 * 2^(b-127) per pair, 2 instructions a value, exact because a
// product with a power of two is. Slow (any b): through f16 and fp32. The caller picks once per
// row (fp8_row_fast), so the hot loop holds only the fast code.
__device__ __forceinline__ void dequant16_fast(const uint4& x, uint32_t b, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t o[8];
  const uint32_t m = (b + 120u) << 7;  // bf16 bits of 2^(b-7)
  const uint32_t m2 = m | (m << 16);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = bf16x2_mul(e4m3x2_as_bf16x2_shifted<0, 1>(w[i]), m2);
    o[2 * i + 1] = bf16x2_mul(e4m3x2_as_bf16x2_shifted<2, 3>(w[i]), m2);
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ void dequant16_slow(const uint4& x, uint32_t b, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t o[8];
  const float sc = ue8m0_to_float(static_cast<uint8_t>(b));
#pragma unroll
  for (int i = 0; i < 4; ++i) dequant4(w[i], sc, o[2 * i], o[2 * i + 1]);
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

// Whether every NoPE block scale of a row (bytes 0-6 of the 8 scale bytes; byte 7 is padding)
// takes dequant16_fast.
__device__ __forceinline__ bool fp8_row_fast(uint2 scales) {
  return (__vcmpgtu4(scales.x, 0x86868686u) | (__vcmpgtu4(scales.y, 0x86868686u) & 0x00ffffffu)) ==
         0u;
}

struct CacheView {
  const uint8_t* data;
  const int32_t* indices;  // row t at indices + t * stride
  int64_t stride;
  int64_t block_stride;    // bytes
  uint32_t block_size;
  int32_t block_shift;     // log2(block_size) when a power of two (V4's pages are), else -1
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

// Where a list entry's cache row lives (row == nullptr: skip, zero-fill). The bf16 kernel
// resolves each entry once (threads 0..63) and publishes it in shared memory for every thread's
// cp.asyncs; in the FP8 kernel the threads that load an entry resolve it themselves.
struct RowRef {
  const uint8_t* row;    // FP8: the 576-byte row; bf16: the 1024-byte row
  const uint8_t* scale;  // FP8: the 8 scale bytes
};

// Slot of entry `e` of tile `tile` (-1 past the list or the split), and its cache.
__device__ __forceinline__ void fetch_slot(const KernelArgs& a, int64_t t, int tile, int tile_end,
                                           int e, int32_t& slot, int& which) {
  const int pos = tile * kTileN + e;
  slot = -1;
  which = 0;
  if (tile < tile_end && pos < a.kv.topk + a.extra.topk) slot = lookup(a, t, pos, which);
}

template <bool kFp8>
__device__ __forceinline__ RowRef resolve(const KernelArgs& a, int32_t slot, int which) {
  RowRef r{nullptr, nullptr};
  if (slot < 0) return r;
  const CacheView& c = which ? a.extra : a.kv;
  const uint32_t blk = c.block_shift >= 0 ? static_cast<uint32_t>(slot) >> c.block_shift
                                          : static_cast<uint32_t>(slot) / c.block_size;
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

// Issue the cp.asyncs of one bf16 tile from the published RowRefs into the swizzled tile.
// Skipped entries are zero-filled (src-size 0 reads nothing; `dummy` is any valid address of at
// least 1 KB, since an empty cache's data pointer may be null). Thread `tid` of kThreads.
// Thread tid copies chunk j = tid % 8 of every 128-byte panel of rows tid / 8 + (kThreads / 8) r:
// eight lanes fill a panel's line (a warp: four whole lines a copy, as when each copy took the
// next chunk), and a thread's rows, validity and swizzled places are worked out once, so its
// copies are one instruction each (immediate offsets). (Each copy re-deriving its row and
// swizzle cost ~20 instructions: 29% of the bf16 kernel's issue. Four threads a row, each
// on its own sectors, measured 11-25% slower: sixteen lines a copy instead of four.)
template <int kThreads>
__device__ __forceinline__ void load_tile_bf16(const RowRef* refs, const void* dummy, uint8_t* dst,
                                               int tid) {
  constexpr int kRowStep = kThreads / 8;            // rows covered by one copy of every thread
  constexpr int kRowsPer = kTileN / kRowStep;       // rows a thread
  static_assert(kThreads % 8 == 0 && kTileN % kRowStep == 0 && kRowStep % 8 == 0, "row split");
  const int j = tid & 7, e0 = tid >> 3;
  const uint32_t base = smem_u32(dst) + ((j ^ (e0 & 7)) << 4);  // (e0 + kRowStep r) % 8 == e0 % 8
#pragma unroll
  for (int r = 0; r < kRowsPer; ++r) {
    const int e = e0 + r * kRowStep;
    const RowRef ref = refs[e];
    const bool valid = ref.row != nullptr;
    const uint8_t* src = (valid ? ref.row : static_cast<const uint8_t*>(dummy)) + j * 16;
#pragma unroll
    for (int p = 0; p < 8; ++p)
      cp_async16(base + p * (kTileN * 128) + e * 128, src + p * 128, valid);
  }
}

// 64 heads (wgmma): warpgroup cg reads only 64-dim panels 4 cg ..+4 of a tile (its half of the
// dims in S, and its half of the output dims in P V), so it copies that half of every row itself,
// 16-row group `r` at a time: rows 16 r + tid / 8, chunk tid % 8 of each of its four panels
// (eight lanes fill a panel's line, as in load_tile_bf16). Thread `tid` of the warpgroup's 128.
__device__ __forceinline__ void load_rows_bf16_half(const RowRef* refs, const void* dummy,
                                                    uint8_t* dst, int tid, int cg, int r) {
  const int j = tid & 7, e = (tid >> 3) + 16 * r;
  const RowRef ref = refs[e];
  const bool valid = ref.row != nullptr;
  const uint8_t* src =
      (valid ? ref.row : static_cast<const uint8_t*>(dummy)) + cg * (kRowBytes / 2) + j * 16;
  const uint32_t base = smem_u32(dst) + 4 * cg * (kTileN * 128) + e * 128 + ((j ^ (e & 7)) << 4);
#pragma unroll
  for (int p = 0; p < 4; ++p) cp_async16(base + p * (kTileN * 128), src + p * 128, valid);
}

__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// One list entry's FP8 row, held in the registers of the kP threads that own the entry from the
// moment its loads are issued (one tile ahead, so their latency hides behind a tile of math)
// until it is dequantised into the bf16 tile. Thread q of the entry holds 16-byte chunks
// c = q, q + kP, ... of the 576-byte row (the first kNopeChunks: e4m3 dims 16c.., the rest: the
// bf16 RoPE dims)
// and all 8 scale bytes.
template <int kP>
struct Fp8Rows {
  static constexpr int kChunks = (kFp8Chunks + kP - 1) / kP;
  uint4 v[kChunks];
  uint2 scales;
  bool valid;
};

template <int kP>
__device__ __forceinline__ void load_fp8_row(Fp8Rows<kP>& r, const RowRef& ref, int q) {
  r.valid = ref.row != nullptr;
  if (!r.valid) {  // zero rows: a skipped entry contributes exactly nothing
#pragma unroll
    for (int k = 0; k < Fp8Rows<kP>::kChunks; ++k) r.v[k] = make_uint4(0, 0, 0, 0);
    r.scales = make_uint2(0, 0);
    return;
  }
#pragma unroll
  for (int k = 0; k < Fp8Rows<kP>::kChunks; ++k) {
    const int c = q + kP * k;
    if (c < kFp8Chunks) r.v[k] = ldg_stream16(ref.row + c * 16);
  }
  r.scales = *reinterpret_cast<const uint2*>(ref.scale);
}

// Pull an entry's FP8 row and scales into L2 ahead of the register loads: thread q of kP touches
// every 128-byte line of its share of the 576-byte row (q == 0 also the scale line). With rows
// in registers for only one tile ahead, this keeps enough bytes in flight to cover HBM latency.
// (Per-line prefetch.global: the bulk prefetch takes uniform operands, which a per-thread
// address turns into a 32-way serialised loop.)
template <int kP>
__device__ __forceinline__ void prefetch_fp8_row(const RowRef& ref, int q) {
  if (ref.row == nullptr) return;
  constexpr int kPart = (kFp8Row + kP - 1) / kP;  // bytes per thread (< 256: at most 3 lines)
  const int begin = q * kPart;
  const int last = min(begin + kPart, kFp8Row) - 1;
  if (begin <= last) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ref.row + begin));
    if (begin + 128 <= last) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ref.row + begin + 128));
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ref.row + last));
  }
  if (q == 0) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ref.scale));
}

// Dequantise the held row of entry `e` into the swizzled bf16 tile: the fast loop when every scale
// of the row allows it (always, for real caches), else the slow one. One test a row instead of one
// a chunk keeps the slow code out of the hot loop (and out of the instruction cache).
template <int kP, bool kFast>
__device__ __forceinline__ void store_fp8_chunks(const Fp8Rows<kP>& r, uint8_t* tile, int e, int q) {
  const uint64_t sc = (static_cast<uint64_t>(r.scales.y) << 32) | r.scales.x;
#pragma unroll
  for (int k = 0; k < Fp8Rows<kP>::kChunks; ++k) {
    const int c = q + kP * k;
    if (c >= kFp8Chunks) continue;
    if (c < kNopeChunks) {
      uint4 lo, hi;
      const uint32_t b = static_cast<uint32_t>(sc >> (8 * (c >> 2))) & 0xffu;
      if constexpr (kFast)
        dequant16_fast(r.v[k], b, lo, hi);
      else
        dequant16_slow(r.v[k], b, lo, hi);
      *reinterpret_cast<uint4*>(tile + swz<kTileN>(e, 2 * c)) = lo;
      *reinterpret_cast<uint4*>(tile + swz<kTileN>(e, 2 * c + 1)) = hi;
    } else {
      *reinterpret_cast<uint4*>(tile + swz<kTileN>(e, kRopeChunk0 + (c - kNopeChunks))) = r.v[k];
    }
  }
}

template <int kP>
__device__ __forceinline__ void store_fp8_row(const Fp8Rows<kP>& r, uint8_t* tile, int e, int q) {
  if (fp8_row_fast(r.scales))
    store_fp8_chunks<kP, true>(r, tile, e, q);
  else
    store_fp8_chunks<kP, false>(r, tile, e, q);
}

// ---- online-softmax pieces shared by the kernels ------------------------------------------
// Lazy rescaling: the running max moves only when a tile's max exceeds it by more than
// kRescaleSlack (base 2), so P <= 2^kRescaleSlack (bf16 holds it with full relative precision,
// the sums are fp32). O and l always refer to the same max, so the result is unchanged, and
// after the first tiles almost no tile pays for the 2 x OT x 2 multiplies of the O rescale.
constexpr float kRescaleSlack = 8.f;

// Rows g and g + 8: move the running maxima to the tile maxima `mx` where they pass them by more
// than the slack, scale the running sums, and return the O rescale factors (1: unchanged).
__device__ __forceinline__ void rescale_rows(const float (&mx)[2], float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    alpha[r] = 1.f;
    if (mx[r] > m_run[r] + kRescaleSlack) {  // false while both are -inf
      alpha[r] = m_run[r] == -INFINITY ? 0.f : exp2_approx(m_run[r] - mx[r]);
      m_run[r] = mx[r];
      l_run[r] *= alpha[r];
    }
  }
}

// P = exp2(s - m) of one score against its row's running max (0 while the row has none).
__device__ __forceinline__ float prob(float s, float m) {
  return m == -INFINITY ? 0.f : exp2_approx(s - m);
}

// Packed P pairs of rows `row` and `row + 8`, entries col, col + 1, into the P tile: rows of 128
// bytes (8 chunks), swizzled by row & 7.
__device__ __forceinline__ void store_p_pairs(uint8_t* sP, int row, int col, uint32_t lo,
                                              uint32_t hi) {
  *reinterpret_cast<uint32_t*>(sP + row * 128 + (((col >> 3) ^ (row & 7)) << 4) +
                               (col & 7) * 2) = lo;
  *reinterpret_cast<uint32_t*>(sP + (row + 8) * 128 + (((col >> 3) ^ ((row + 8) & 7)) << 4) +
                               (col & 7) * 2) = hi;
}

// O rows g and g + 8 times their rescale factors, skipped (warp-uniformly) when both are 1:
// once the running maxima settle, most tiles leave them unchanged.
template <int OT>
__device__ __forceinline__ void rescale_acc(float (&acc)[OT][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < OT; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }
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
  rescale_rows(mx, m_run, l_run, alpha);

  // ---- P = exp2(s - m) -> shared memory (bf16) ---------------------------------------------
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    float p[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = x >> 1;
      p[x] = prob(s[j][x], m_run[r]);
      l_run[r] += p[x];
    }
    const int col = n0 + j * 8 + q4 * 2;  // entry within the tile
    store_p_pairs(sP, rg * 16 + g, col, pack_bf16(p[0], p[1]), pack_bf16(p[2], p[3]));
  }
}

// Which work item a CTA runs (query token, group of 16R heads, split of the list: tiles
// [tile_begin, tile_end), n of them) and where the thread sits in the warp layout. wgmma:
// warpgroup cg = warp / 4 holds all 64 rows, warp rg = warp % 4 rows 16 rg.. of them.
struct WorkItem {
  int64_t t;
  int head0, split, tile_begin, tile_end, n;
  int lane, rg, cg, g, q4;
};

// 1 / (sum + exp(sink)) for a row with running max m (base 2) and sum l, or 0 when no key was
// valid (l == 0): the output's normalisation, shared by the one-split store and the combine.
// sink_logit is -inf without a sink.
__device__ __forceinline__ float output_scale(float l, float m, float sink_logit) {
  if (!(l > 0.f)) return 0.f;
  return 1.f / (l + exp2f(sink_logit * kLog2e - m));
}

__device__ __forceinline__ float sink_logit(const KernelArgs& a, int h) {
  return a.sink != nullptr && h < a.num_heads ? a.sink[h] : -INFINITY;
}

// The sink logits of this thread's two output rows, loaded when a work item starts so that the
// epilogue does not wait for them.
__device__ __forceinline__ void load_sinks(const KernelArgs& a, const WorkItem& w,
                                           float (&sinks)[2]) {
  sinks[0] = sink_logit(a, w.head0 + w.rg * 16 + w.g);
  sinks[1] = sink_logit(a, w.head0 + w.rg * 16 + w.g + 8);
}

// The end of a work item: the row sums are combined over the C warps of each row group, then
// the normalised bf16 output goes through shared memory (`stage`: the Q tile, no longer read) so
// that it leaves in coalesced 16-byte stores, with the LSE; or, with several splits, the
// unnormalised partial O with its max and sum (merged by sparse_mla_combine_kernel).
template <int kHeads, int OT, int C>
__device__ __forceinline__ void store_outputs(float (&acc)[OT][4], float (&m_run)[2],
                                              float (&l_run)[2], float* sRed, uint8_t* stage,
                                              const KernelArgs& a, const WorkItem& w,
                                              const float (&sinks)[2]) {
  const auto& [t, head0, split, tile_begin, tile_end, n, lane, rg, cg, g, q4] = w;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  // Every warp is past its last use of sRed and of the Q tile.
  __syncthreads();
  if constexpr (C > 1) {
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
    const int row = rg * 16 + g + 8 * r, h = head0 + row;
    const float l = l_run[r], m = m_run[r];
    if (a.num_splits == 1) {
      const float inv = output_scale(l, m, sinks[r]);
#pragma unroll
      for (int j = 0; j < OT; ++j) {
        const int d = cg * (kDim / C) + j * 8 + q4 * 2;
        *reinterpret_cast<uint32_t*>(stage + swz<kHeads>(row, d >> 3) + (d & 7) * 2) =
            pack_bf16(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
      }
      if (cg == 0 && q4 == 0 && h < a.num_heads)
        a.lse[t * a.lse_stride_token + h] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
    } else if (h < a.num_heads) {
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
  if (a.num_splits == 1) {
    __syncthreads();
    for (int i = threadIdx.x; i < kHeads * 64; i += blockDim.x) {
      const int row = i >> 6, c = i & 63, h = head0 + row;
      if (h < a.num_heads)
        *reinterpret_cast<uint4*>(a.out + t * a.out_stride_token +
                                  static_cast<int64_t>(h) * a.out_stride_head + c * 8) =
            *reinterpret_cast<const uint4*>(stage + swz<kHeads>(row, c));
    }
  }
}

// Warp layout of a CTA of 16 R heads (see the header comment).
template <int R>
struct Geom {
  static constexpr int kHeads = 16 * R;
  static constexpr int kThreads = warps_for(R) * 32;
  static constexpr int C = warps_for(R) / R;
  static constexpr bool kWgmma = R == 4;
  static constexpr int kEntriesPerWarp = kTileN / C;  // S columns of one warp: 8, 16 or 32
  static constexpr int NT = kEntriesPerWarp / 8;      // n8 tiles of S per warp
  static constexpr int kDimsPerWarp = kDim / C;       // O columns of one warp
  static constexpr int OT = kDimsPerWarp / 8;         // n8 tiles of O per warp
};

template <int R, bool kFp8>
struct Smem {
  static constexpr int kHeads = Geom<R>::kHeads;
  static constexpr int kC = Geom<R>::C;
  // bf16 tiles: cp.async double buffer. FP8: rows wait in registers; dequantised into the other
  // of two tiles while the current one is used, except for 16 heads, where one tile (82 KB)
  // lets two CTAs share an SM.
  static constexpr int kTiles = (kFp8 && R == 1) ? 1 : 2;
  static constexpr int kCtasPerSm = (kFp8 && R == 1) ? 2 : 1;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kHeads * kRowBytes;
  static constexpr int kP = kK + kTiles * kTileN * kRowBytes;
  static constexpr int kRed = kP + kHeads * kTileN * 2;        // [2][R][16][C] floats
  static constexpr int kRefs = kRed + 2 * R * 16 * kC * 4;     // [2][64] RowRef (bf16)
  static constexpr int kValid = kRefs + 2 * kTileN * 16;       // [3][64] int
  static constexpr int kXchg = kValid + 3 * kTileN * 4;        // wgmma S halves [2][128][16]
  // wgmma: S halves [2][128][16] floats; mma.sync: partial S [R][2 dim halves][16][kXPitch].
  // Floats a row: 8 mod 32, so a half-warp's float2 accesses (rows g, columns 2 q4) cover 32
  // distinct banks.
  static constexpr int kXPitch = kTileN + 8;
  static constexpr int kBytes =
      kXchg + (R == 4 ? 2 * 128 * 16 * 4 : R * 2 * 16 * kXPitch * 4);
  static constexpr int kAlloc = kBytes + 1024;  // slack to align the base to 1024 bytes
  static_assert(R != 4 || (kK % 1024 == 0 && kP % 1024 == 0),
                "wgmma operands must start on 1024-byte boundaries");
};

// S = Q K^T for this warp's entries of the tile at k_base (all 512 dims); complete on return.
// wgmma (64 heads): warpgroup cg computes a partial S over ALL 64 entries and dims 256 cg ..+256
// (16 m64n64k16 instead of 32 m64n32k16 over all dims: half the Q operand reads from shared
// memory), then the warpgroups swap the halves they do not keep through `xchg` ([2][128][16]
// floats): warpgroup cg ends with entries 32 cg ..+32, summed in a fixed order (dims 0..255
// first), as the softmax expects.
template <int R>
__device__ __forceinline__ void scores(float (&s)[Geom<R>::NT][4], uint32_t q_base,
                                       uint32_t k_base, int rg, int cg, int lane, float* xchg) {
  using G = Geom<R>;
  constexpr int NT = G::NT;
  if constexpr (G::kWgmma) {
    static_assert(NT == 4, "64 heads: each warpgroup keeps 32 entries");
    float full[32];  // this warpgroup's partial S[64 heads, 64 entries]: n8 group j at 4j..
    const uint64_t dq = wgmma::desc_sw128(q_base, 16, 1024);
    const uint64_t dk = wgmma::desc_sw128(k_base, 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kDim / 32; ++k) {
      const int kk = cg * (kDim / 32) + k;  // k-step of 16 dims
      const uint32_t qoff = (kk >> 2) * (G::kHeads * 128) + (kk & 3) * 32;
      const uint32_t koff = (kk >> 2) * (kTileN * 128) + (kk & 3) * 32;
      wgmma::wgmma_m64n64k16_bf16(full, dq + (qoff >> 4), dk + (koff >> 4), k > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(full);
    // Give away the other warpgroup's 32 entries, take this one's from it.
    const int tid = threadIdx.x & 127;
    float4* mine = reinterpret_cast<float4*>(xchg) + cg * 4 * 128;
    const float4* theirs = reinterpret_cast<const float4*>(xchg) + (cg ^ 1) * 4 * 128;
    // (Selects with constant register indices: a run-time index would put `full` on the stack.)
    const bool first = cg == 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float g4[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) g4[x] = first ? full[16 + 4 * i + x] : full[4 * i + x];
      mine[i * 128 + tid] = make_float4(g4[0], g4[1], g4[2], g4[3]);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = theirs[i * 128 + tid];
      const float o[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        // Fixed order: the dims 0..255 partial first, whichever warpgroup holds it.
        const float own = first ? full[4 * i + x] : full[16 + 4 * i + x];
        s[i][x] = first ? own + o[x] : o[x] + own;
      }
    }
  } else {
    static_assert(NT == 1 && G::C == 8, "mma.sync kernels: 16 heads a row group, 8 warps");
    // 16 or 32 heads (8 warps a row group): were each warp to take its 8 entries over all 512
    // dims, every warp would read the whole Q of its row group from shared memory each tile
    // (8x Q, the kernel's largest shared-memory stream, and one ldmatrix of Q per mma). Instead
    // warp cg computes a partial S over entries 16 (cg / 2) ..+16 and dims 256 (cg % 2) ..+256
    // (Q read twice in all, one Q ldmatrix per two mmas), the partials meet in `xchg`, and each
    // warp sums the two halves of its own 8 entries, dims 0..255 first (fixed order).
    constexpr int kPitch = Smem<R, false>::kXPitch;
    const int eq = cg >> 1, dh = cg & 1;
    float sa[2][2][4];  // [k-step parity][n8 tile][fragment]
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) sa[u][j][0] = sa[u][j][1] = sa[u][j][2] = sa[u][j][3] = 0.f;
    // A thread's ldmatrix row is fixed and its chunk is 2 kk + hi, so the swizzled chunk
    // (2 kk + hi) ^ (row % 8) takes four values (kk % 4) and the 64-column panel moves by a
    // constant every four k-steps: four base addresses plus immediates, no per-step math.
    const int qrow = rg * 16 + (lane & 15), qhi = lane >> 4;
    const int krow = 16 * eq + (lane & 7) + ((lane >> 4) << 3), khi = (lane >> 3) & 1;
    uint32_t qa[4], ka[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // dims 256 dh.. start 4 panels in
      qa[j] = q_base + dh * 4 * (G::kHeads * 128) + qrow * 128 +
              ((((2 * j) | qhi) ^ (qrow & 7)) << 4);
      ka[j] = k_base + dh * 4 * (kTileN * 128) + krow * 128 + ((((2 * j) | khi) ^ (krow & 7)) << 4);
    }
#pragma unroll
    for (int kk = 0; kk < kDim / 32; ++kk) {
      uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
      ldsm_x4(qa[kk & 3] + (kk >> 2) * (G::kHeads * 128), a0, a1, a2, a3);
      ldsm_x4(ka[kk & 3] + (kk >> 2) * (kTileN * 128), b0, b1, b2, b3);
      mma_bf16(sa[kk & 1][0], a0, a1, a2, a3, b0, b1);
      mma_bf16(sa[kk & 1][1], a0, a1, a2, a3, b2, b3);
    }
    const int g = lane >> 2, q4 = lane & 3;
    float* part = xchg + (rg * 2 + dh) * 16 * kPitch;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 16 * eq + 8 * j + 2 * q4;
      *reinterpret_cast<float2*>(part + g * kPitch + col) =
          make_float2(sa[0][j][0] + sa[1][j][0], sa[0][j][1] + sa[1][j][1]);
      *reinterpret_cast<float2*>(part + (g + 8) * kPitch + col) =
          make_float2(sa[0][j][2] + sa[1][j][2], sa[0][j][3] + sa[1][j][3]);
    }
    row_group_sync<G::C>(rg);
    const float* p0 = xchg + (rg * 2) * 16 * kPitch + 8 * cg + 2 * q4;
    const float* p1 = p0 + 16 * kPitch;
    const float2 lo0 = *reinterpret_cast<const float2*>(p0 + g * kPitch);
    const float2 hi0 = *reinterpret_cast<const float2*>(p0 + (g + 8) * kPitch);
    const float2 lo1 = *reinterpret_cast<const float2*>(p1 + g * kPitch);
    const float2 hi1 = *reinterpret_cast<const float2*>(p1 + (g + 8) * kPitch);
    s[0][0] = lo0.x + lo1.x;
    s[0][1] = lo0.y + lo1.y;
    s[0][2] = hi0.x + hi1.x;
    s[0][3] = hi0.y + hi1.y;
  }
}

// O += P V over this warp's output dims (P in shared memory, V = the tile at k_base). wgmma:
// issued asynchronously, finished by pv_wait; mma.sync: complete on return.
// kGroups (wgmma): one commit group a 16-entry step (ks), so that the rows a step reads can be
// refilled as soon as it retires (the bf16 kernel's early copies).
template <int R, bool kGroups = false>
__device__ __forceinline__ void pv_issue(float (&acc)[Geom<R>::OT][4], uint32_t p_base,
                                         uint32_t k_base, int rg, int cg, int lane) {
  using G = Geom<R>;
  constexpr int OT = G::OT;
  if constexpr (G::kWgmma) {
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
      if (kGroups) wgmma::commit();
    }
    if (!kGroups) wgmma::commit();
  } else {
    static_assert(G::kDimsPerWarp % 64 == 0, "a warp's dims start on a 64-dim panel");
    // Fixed rows and chunk parities again (see scores): P row rg*16 + lane % 16, chunk
    // 2 ks + hi; V row ks*16 + r0 (r0 % 8 = lane % 8), chunk d0 + j + hi with d0 % 8 == 0.
    const int prow = rg * 16 + (lane & 15), hi = lane >> 4;
    const int r0 = (lane & 7) + (((lane >> 3) & 1) << 3);
    const uint32_t v_base = k_base + (cg * G::kDimsPerWarp / 64) * (kTileN * 128) + r0 * 128;
    uint32_t pa[4], va[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      pa[m] = p_base + prow * 128 + ((((2 * m) | hi) ^ (prow & 7)) << 4);
      va[m] = v_base + ((((2 * m) | hi) ^ (lane & 7)) << 4);
    }
#pragma unroll
    for (int ks = 0; ks < kTileN / 16; ++ks) {
      uint32_t a0, a1, a2, a3;
      ldsm_x4(pa[ks], a0, a1, a2, a3);
#pragma unroll
      for (int j = 0; j < OT; j += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(va[(j & 7) >> 1] + (j >> 3) * (kTileN * 128) + ks * 16 * 128, b0, b1, b2, b3);
        mma_bf16(acc[j], a0, a1, a2, a3, b0, b1);
        mma_bf16(acc[j + 1], a0, a1, a2, a3, b2, b3);
      }
    }
  }
}

template <int R>
__device__ __forceinline__ void pv_wait(float (&acc)[Geom<R>::OT][4]) {
  if constexpr (Geom<R>::kWgmma) {
    wgmma::wait<0>();
    wgmma::fence_operands(reinterpret_cast<float(&)[Geom<R>::OT * 4]>(acc[0][0]));
  }
}

// The softmax of one tile for the scores in s, the O rescale, and the barrier after which P is
// readable by every warp that needs it.
template <int R>
__device__ __forceinline__ void softmax_and_rescale(float (&s)[Geom<R>::NT][4],
                                                    float (&acc)[Geom<R>::OT][4],
                                                    const int* valid_flags, float* red,
                                                    uint8_t* sP, int rg, int cg, int g, int q4,
                                                    float scale_log2, float (&m_run)[2],
                                                    float (&l_run)[2]) {
  using G = Geom<R>;
  float alpha[2];
  softmax_step<G::NT, G::C>(s, valid_flags, cg * G::kEntriesPerWarp, red, sP, rg, cg, g, q4,
                            scale_log2, m_run, l_run, alpha);
  rescale_acc(acc, alpha);
  if constexpr (G::kWgmma) {
    wgmma::fence_proxy_async();  // P (ordinary stores) -> tensor-core reads
    __syncthreads();             // each warpgroup reads all 64 rows of P
  } else {
    row_group_sync<G::C>(rg);
  }
}

// Q: 16R heads x 512 bf16 into the swizzled Q tile by cp.async; heads past H are zero-filled.
template <int R>
__device__ __forceinline__ void load_q(const KernelArgs& a, int64_t t, int head0, uint8_t* sQ) {
  using G = Geom<R>;
  for (int i = threadIdx.x; i < G::kHeads * 64; i += G::kThreads) {
    const int r = i >> 6, c = i & 63, h = head0 + r;
    const bool valid = h < a.num_heads;
    const __nv_bfloat16* src =
        a.q + t * a.q_stride_token + static_cast<int64_t>(valid ? h : 0) * a.q_stride_head + c * 8;
    cp_async16(smem_u32(sQ) + swz<G::kHeads>(r, c), src, valid);
  }
}

// The 1024-byte-aligned base of the dynamic shared memory: the 128-byte swizzle is a function of
// address bits, so operand tiles sit on 1024-byte boundaries of the shared window.
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

template <int R>
__device__ __forceinline__ WorkItem work_item(const KernelArgs& a) {
  using G = Geom<R>;
  WorkItem w;
  w.t = blockIdx.x;
  w.head0 = blockIdx.y * G::kHeads;
  w.split = blockIdx.z;
  const int ntiles = (a.kv.topk + a.extra.topk + kTileN - 1) / kTileN;
  w.tile_begin = w.split * a.tiles_per_split;
  w.tile_end = min(ntiles, w.tile_begin + a.tiles_per_split);
  w.n = max(0, w.tile_end - w.tile_begin);
  w.lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  w.rg = G::kWgmma ? warp & 3 : warp / G::C;
  w.cg = G::kWgmma ? warp >> 2 : warp % G::C;
  w.g = w.lane >> 2;
  w.q4 = w.lane & 3;
  return w;
}

// The regions of a CTA's shared memory (layout in Smem).
struct SmemTiles {
  uint8_t *q, *k, *p;
  float* red;
  RowRef* refs;
  int* valid;
  float* xchg;
};

template <int R, bool kFp8>
__device__ __forceinline__ SmemTiles smem_tiles(uint8_t* raw) {
  using S = Smem<R, kFp8>;
  uint8_t* smem = aligned_smem(raw);
  return SmemTiles{smem + S::kQ, smem + S::kK, smem + S::kP,
                   reinterpret_cast<float*>(smem + S::kRed),
                   reinterpret_cast<RowRef*>(smem + S::kRefs),
                   reinterpret_cast<int*>(smem + S::kValid),
                   reinterpret_cast<float*>(smem + S::kXchg)};
}

// bf16 cache: tiles gathered by cp.async into a double buffer, rows resolved one tile ahead.
template <int R>
__global__ void __launch_bounds__(Geom<R>::kThreads, 1) sparse_mla_bf16_kernel(const KernelArgs a) {
  using G = Geom<R>;
  using S = Smem<R, false>;
  constexpr int kThreads = G::kThreads;
  constexpr int kStages = 2;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const auto [sQ, sK, sP, sRed, sRefs, sValid, sXchg] = smem_tiles<R, false>(smem_raw);
  const WorkItem w = work_item<R>(a);
  await_earlier_kernels();  // (a programmatic launch: launch.cuh)
  const auto& [t, head0, split, tile_begin, tile_end, n, lane, rg, cg, g, q4] = w;
  float sinks[2];
  load_sinks(a, w, sinks);

  load_q<R>(a, t, head0, sQ);

  const bool owner = threadIdx.x < kTileN;
  auto publish = [&](int32_t slot, int which, int tile) {
    sRefs[(tile & 1) * kTileN + threadIdx.x] = resolve<false>(a, slot, which);
    sValid[(tile % 3) * kTileN + threadIdx.x] = slot >= 0;
  };
  int32_t pf_slot = -1;
  int pf_which = 0;
  float acc[G::OT][4];
#pragma unroll
  for (int j = 0; j < G::OT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows g, g + 8 (base-2 units)
  float l_run[2] = {0.f, 0.f};              // this thread's partial sums
  const uint32_t q_base = smem_u32(sQ);
  const uint32_t p_base = smem_u32(sP);
  // S and the softmax of tile `it` (at k_base); P in shared memory on return.
  auto scores_softmax = [&](int it, uint32_t k_base) {
    float s[G::NT][4];
    scores<R>(s, q_base, k_base, rg, cg, lane, sXchg);
    softmax_and_rescale<R>(s, acc, sValid + (it % 3) * kTileN, sRed + (it & 1) * (R * 16 * G::C),
                           sP, rg, cg, g, q4, a.scale_log2, m_run, l_run);
  };

  if constexpr (G::kWgmma) {
    // 64 heads: each warpgroup copies its own half of the rows (load_rows_bf16_half), and tile
    // it + 2's rows go into buffer it % 2 during tile it's P V, a 16-row group as soon as the P V
    // step that reads it retired (four commit groups a tile, wgmma and cp.async alike), instead
    // of all at once after the next tile's barrier: the copies, which the tile waits on with two
    // buffers (sparse_mla_NOTES.md, sessions 17-18, 32), start ~3/8 of a P V earlier on average.
    // A tile's row references and flags are published two iterations ahead (by threads 0..63,
    // visible to both warpgroups after the scores exchange, before that P V).
    const int wtid = threadIdx.x & 127;
    auto copy_tile = [&](int tile, int buf) {  // the prologue's tiles: four groups each
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (tile < n)
          load_rows_bf16_half(sRefs + (tile & 1) * kTileN, a.q, sK + buf * kTileN * kRowBytes,
                              wtid, cg, r);
        cp_async_commit();
      }
    };
    if (owner) {
      fetch_slot(a, t, tile_begin, tile_end, threadIdx.x, pf_slot, pf_which);
      publish(pf_slot, pf_which, 0);
    }
    __syncthreads();
    copy_tile(0, 0);  // (Q's copies join its first group)
    if (owner) {
      fetch_slot(a, t, tile_begin + 1, tile_end, threadIdx.x, pf_slot, pf_which);
      publish(pf_slot, pf_which, 1);
    }
    __syncthreads();
    // Tile 1's copies go out in iteration 0, once Q and tile 0 have landed: issued beside them,
    // they split the HBM rate with the bytes the first tile waits on (H100 A/B, session 51:
    // -2.3% at b = 128, -2.0% prefill; +0.1-0.2 us at b = 1-8, where the split items are short).
    if (owner) fetch_slot(a, t, tile_begin + 2, tile_end, threadIdx.x, pf_slot, pf_which);

    for (int it = 0; it < n; ++it) {
      if (it == 0)
        cp_async_wait<0>();  // Q and tile 0: the only groups in flight
      else
        cp_async_wait<4>();  // tile it (and Q) landed for this thread's copies; it + 1's may not
      wgmma::fence_proxy_async();  // cp.async data -> tensor-core reads
      // Only this warpgroup reads its panels: its own barrier (ids 1..4 are row_group_sync's).
      asm volatile("bar.sync %0, 128;\n" ::"r"(5 + cg) : "memory");
      if (it == 0) copy_tile(1, 1);
      if (owner) {
        publish(pf_slot, pf_which, it + 2);
        fetch_slot(a, t, tile_begin + it + 3, tile_end, threadIdx.x, pf_slot, pf_which);
      }
      uint8_t* kt = sK + (it & 1) * kTileN * kRowBytes;
      const uint32_t k_base = smem_u32(kt);
      scores_softmax(it, k_base);
      pv_issue<R, true>(acc, p_base, k_base, rg, cg, lane);
      const bool more = it + 2 < n;
      const RowRef* refs2 = sRefs + (it & 1) * kTileN;  // tile it + 2's (published above)
      auto refill = [&](int r) {
        if (more) load_rows_bf16_half(refs2, a.q, kt, wtid, cg, r);
        cp_async_commit();
      };
      wgmma::wait<3>();
      refill(0);
      wgmma::wait<2>();
      refill(1);
      wgmma::wait<1>();
      refill(2);
      wgmma::wait<0>();
      refill(3);
      wgmma::fence_operands(reinterpret_cast<float(&)[G::OT * 4]>(acc[0][0]));
    }
  } else {
    // Tile `it` of this split lives in buffer it % 2 with its row references in sRefs[it % 2]
    // and its validity flags in sValid[it % 3]. Threads 0..63 own one list entry each: they
    // fetch a tile's slots two iterations before its copies and resolve them one iteration
    // before, so the copies of tile it + 1 go out right after iteration it's barrier, from
    // references published before it (one barrier a tile for the copies, not two). The flags of
    // tile it + 2, published during iteration it, need a third buffer: tile it's softmax still
    // reads its own.
    // Prologue: tile 0 published and its copies issued (the Q copies join its group), then tile
    // 1 published (visible at the loop's first barrier) and tile 2's slots fetched, under tile
    // 0's copies.
    if (owner) {
      fetch_slot(a, t, tile_begin, tile_end, threadIdx.x, pf_slot, pf_which);
      publish(pf_slot, pf_which, 0);
    }
    __syncthreads();
    if (n > 0) load_tile_bf16<kThreads>(sRefs, a.q, sK, threadIdx.x);
    cp_async_commit();
    if (owner) {
      fetch_slot(a, t, tile_begin + 1, tile_end, threadIdx.x, pf_slot, pf_which);
      publish(pf_slot, pf_which, 1);
      fetch_slot(a, t, tile_begin + 2, tile_end, threadIdx.x, pf_slot, pf_which);
    }

    for (int it = 0; it < n; ++it) {
      const int stage = it % kStages;
      cp_async_wait<kStages - 2>();  // tile `it` (and Q) landed for this thread's copies
      __syncthreads();  // ... and everyone's; all warps are done with tile it-1
      uint8_t* kt = sK + stage * kTileN * kRowBytes;
      const int ahead = it + 1;  // the tile whose copies are issued now
      if (ahead < n)
        load_tile_bf16<kThreads>(sRefs + (ahead & 1) * kTileN, a.q,
                                 sK + (ahead % kStages) * kTileN * kRowBytes, threadIdx.x);
      cp_async_commit();
      // (Into tile it's reference buffer: its copies were issued before the barrier above.)
      if (owner) {
        publish(pf_slot, pf_which, it + 2);
        fetch_slot(a, t, tile_begin + it + 3, tile_end, threadIdx.x, pf_slot, pf_which);
      }
      const uint32_t k_base = smem_u32(kt);
      scores_softmax(it, k_base);
      pv_issue<R>(acc, p_base, k_base, rg, cg, lane);
      pv_wait<R>(acc);
    }
  }
  cp_async_wait<0>();

  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);
}

// FP8 cache: each list entry's row goes global -> registers of the kP threads that own it one
// tile ahead, and is dequantised (exactly, ~2.5 instructions a value) into a bf16 tile that all
// heads of the CTA share. With two tiles (32+ heads) the dequantisation of tile it+1 runs while
// the tensor cores do tile it's P V (wgmma is asynchronous); one tile (16 heads) waits for P V
// but leaves room for a second CTA on the SM.
template <int R>
__global__ void __launch_bounds__(Geom<R>::kThreads, Smem<R, true>::kCtasPerSm)
    sparse_mla_fp8_kernel(const KernelArgs a) {
  using G = Geom<R>;
  using S = Smem<R, true>;
  constexpr int kP = G::kThreads / kTileN;  // threads per list entry
  constexpr int kTileBytes = kTileN * kRowBytes;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  [[maybe_unused]] const auto [sQ, sK, sP, sRed, sRefs, sValid, sXchg] =
      smem_tiles<R, true>(smem_raw);
  const WorkItem w = work_item<R>(a);
  await_earlier_kernels();  // (a programmatic launch: launch.cuh)
  const auto& [t, head0, split, tile_begin, tile_end, n, lane, rg, cg, g, q4] = w;
  const int e = threadIdx.x / kP, q = threadIdx.x % kP;  // this thread's list entry and part
  float sinks[2];
  load_sinks(a, w, sinks);

  load_q<R>(a, t, head0, sQ);
  cp_async_commit();

  // Entries travel down a pipeline: tile j's slot is fetched at iteration j-4, resolved and its
  // row prefetched into L2 at j-3, loaded into registers at j-2 and dequantised at j-1.
  // Prologue: tile 0 dequantised, tile 1 in registers, tile 2 prefetched, tile 3's slot fetched.
  Fp8Rows<kP> rows;
  int32_t slots[4], slot_pf;
  int whiches[4], which_pf;
#pragma unroll
  for (int j = 0; j < 4; ++j) fetch_slot(a, t, tile_begin + j, tile_end, e, slots[j], whiches[j]);
  const RowRef ref0 = resolve<true>(a, slots[0], whiches[0]);
  const RowRef ref1 = resolve<true>(a, slots[1], whiches[1]);
  RowRef ref_load = resolve<true>(a, slots[2], whiches[2]);  // the next register loads
  slot_pf = slots[3];
  which_pf = whiches[3];
  load_fp8_row(rows, ref0, q);
  prefetch_fp8_row<kP>(ref1, q);
  store_fp8_row(rows, sK, e, q);
  if (q == 0) sValid[e] = rows.valid;
  cp_async_wait<0>();
  if constexpr (G::kWgmma) wgmma::fence_proxy_async();  // Q, tile 0 -> tensor-core reads
  load_fp8_row(rows, ref1, q);
  // Tile 2's L2 prefetch goes out only now that Q and tile 0 have landed: issued beside them it
  // competes for the bandwidth the first tile waits on, with every CTA of a wave in this
  // prologue at once (H100 A/B, session 50: -2 to -3% at b >= 64).
  prefetch_fp8_row<kP>(ref_load, q);
  __syncthreads();

  float acc[G::OT][4];
#pragma unroll
  for (int j = 0; j < G::OT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  const uint32_t q_base = smem_u32(sQ);
  const uint32_t p_base = smem_u32(sP);

  for (int it = 0; it < n; ++it) {
    const int buf = S::kTiles == 2 ? (it & 1) : 0;
    const uint32_t k_base = smem_u32(sK + buf * kTileBytes);

    float s[G::NT][4];
    scores<R>(s, q_base, k_base, rg, cg, lane, sXchg);
    softmax_and_rescale<R>(s, acc, sValid + (it & 1) * kTileN, sRed + (it & 1) * (R * 16 * G::C),
                           sP, rg, cg, g, q4, a.scale_log2, m_run, l_run);
    pv_issue<R>(acc, p_base, k_base, rg, cg, lane);
    if (it + 1 < n) {
      // Tile it+1 from the registers into the other tile (or, with one tile, into this one once
      // every warp is past its P V), then the pipeline of later tiles advances.
      if constexpr (S::kTiles == 1) __syncthreads();
      store_fp8_row(rows, sK + (S::kTiles == 2 ? ((it + 1) & 1) : 0) * kTileBytes, e, q);
      if (q == 0) sValid[((it + 1) & 1) * kTileN + e] = rows.valid;
      // The proxy fence (dequantised tile -> wgmma reads) waits for this thread's outstanding
      // memory operations, so it goes before the next tile's loads are issued, not after.
      if constexpr (G::kWgmma) wgmma::fence_proxy_async();
      load_fp8_row(rows, ref_load, q);                     // tile it+2
      ref_load = resolve<true>(a, slot_pf, which_pf);      // tile it+3
      prefetch_fp8_row<kP>(ref_load, q);
      fetch_slot(a, t, tile_begin + it + 4, tile_end, e, slot_pf, which_pf);
    }
    pv_wait<R>(acc);
    __syncthreads();  // tile it+1 and its flags complete; everyone is done with tile it and P
  }

  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);
}

// ---- 16 heads over the FP8 cache: K in registers (sparse_mla_fp8_h16_kernel) -------------------
// The one-row-group FP8 kernel above spends half its time in S = QK^T with its mmas waiting for
// ldmatrix operands (Nsight Compute, session 12: 44% of the stall samples). Here no operand of
// either product but P goes through shared memory: warp w owns dims 64 w ..+64 of the 512 (warps
// 0..6: e4m3 dims with their one block scale, warp 7: the bf16 RoPE dims) for both products.
//   Raw rows: the tile's 64 FP8 rows and scale bytes land in shared memory by cp.async (double
//     buffer, one tile ahead); lane (g, c) of warp w takes entries 8 j + g (j = 0..7), dims
//     64 w + 16 c ..+16: one 16-byte load an entry, dequantised into 8 bf16 pairs.
//   S: the mma B operand (k = dims, n = entries) is exactly those pairs once the 16 dims of each
//     k-step are ordered so that lane c's logical k {2c, 2c+1, 2c+8, 2c+9} of step kk are its
//     physical dims 16 c + 4 kk + {0, 1, 2, 3}; Q's A fragments use the same order (held in
//     registers for the whole work item). Each warp's S is a partial over its 64 dims; the
//     partials meet in shared memory and warp w sums entries 8 w ..+8 over the 8 partials in a
//     fixed order.
//   Softmax: each warp masks and scales its 8 entries and writes their P (bf16) to shared memory
//     against the running row maxima; only a tile whose block maxima pass them (the first, and
//     rarely later ones) goes through the maxima exchange and a rewrite of P (`settle`).
//   P V: the same K registers, transposed 8 x 8 at a time by movmatrix, are the B operand (k =
//     entries, n = dims); n-block p of the 8 holds dims 64 w + 16 (n / 2) + 2 p + n % 2, so lane
//     (g, c) ends with O[g (+8)][64 w + 16 c ..+16]: contiguous, stored straight to global memory.
//     A tile's P V runs after the next tile's first barrier: two block barriers a tile.
// One CTA (8 warps) an SM: ~116 KB of shared memory and 229 registers a thread. H200, V4 decode
// shapes (bench/results/h200/sparse_mla_NOTES.md, session 13): 1.38x the one-tile kernel at 128
// tokens. Tried and slower: each row by one bulk (TMA-engine) copy two tiles ahead (-5%:
// a warp issues its lanes' bulk copies one at a time); 36 threads a row for the cp.asyncs (-2%).
// kE = 32 (session 14): the same kernel on 32-entry tiles (a lane holds K for 4 entries, warp w
// sums entries 8 (w % 4) ..+8 of one row half), 128 registers and ~62 KB: two CTAs an SM, so one
// CTA's barriers overlap the other's work. Per SM it does ~1.08x the 64-entry kernel's work, but
// its tiles cost more a CTA: the plan runs it for grids over one wave of the 64-entry one (H200,
// 16 heads, against the 64-entry kernel: 1.07x at 256 tokens and at 128 x 2, 0.83x at 128 split
// in two; against the one-tile kernel: 1.2x at 400-1024 tokens and at a 4096-token prefill).
template <int kE>  // entries a tile: 64 (one CTA an SM) or 32 (two)
struct H16Smem {
  static constexpr int kPartPitch = kE + 8;  // floats; 8 mod 32: float2 half-warps conflict-free
  static constexpr int kRaw = 0;                                 // [2][kE][576] raw rows
  static constexpr int kScale = kRaw + 2 * kE * kFp8Row;         // [2][kE][8] scale bytes
  static constexpr int kPart = kScale + 2 * kE * 8;              // [8 warps][16][kPartPitch] f32
  static constexpr int kP = kPart + 8 * 16 * kPartPitch * 4;     // [16][kE] bf16, swizzled
  static constexpr int kMax = kP + 16 * kE * 2;                  // [2][8 warps][16] f32
  static constexpr int kNeed = kMax + 2 * 8 * 16 * 4;            // [2][8 warps] int
  static constexpr int kRefs = kNeed + 2 * 8 * 4;                // [2][kE] RowRef
  static constexpr int kValid = kRefs + 2 * kE * 16;             // [3][kE] int
  static constexpr int kBytes = kValid + 3 * kE * 4;
  static constexpr int kAlloc = kBytes + 1024;
  static_assert(kAlloc * (64 / kE) <= 227 * 1024, "shared memory budget");
  static_assert(kRaw % 16 == 0 && kScale % 16 == 0 && kPart % 16 == 0 && kP % 16 == 0 &&
                    kRefs % 16 == 0 && kNeed % 16 == 0,
                "16-byte aligned regions");
};

// 16 bf16 values (two 16-byte chunks) as a lane's 8 packed pairs.
__device__ __forceinline__ void put_pairs(uint32_t (&k)[8], const uint4& lo, const uint4& hi) {
  k[0] = lo.x; k[1] = lo.y; k[2] = lo.z; k[3] = lo.w;
  k[4] = hi.x; k[5] = hi.y; k[6] = hi.z; k[7] = hi.w;
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 8 : 0)
               : "memory");
}

// The cp.asyncs of one raw tile (rows and scale bytes of the kE entries published in `refs`),
// 256 / kE threads a row (4 or 8): thread tid takes chunks q + T k of row tid / T (q = tid % T),
// so it reads its row reference once and its copies differ by immediates (36 threads a row, a
// chunk each: ~5x the issue, 2% slower). Skipped entries are zero-filled from `dummy` (any valid
// address).
template <int kE>
__device__ __forceinline__ void load_tile_fp8_raw(const RowRef* refs, const void* dummy,
                                                  uint8_t* raw, uint8_t* scales, int tid) {
  constexpr int T = 256 / kE, kShift = T == 4 ? 2 : 3;
  static_assert(T == 1 << kShift, "four or eight threads a row");
  const int e = tid >> kShift, q = tid & (T - 1);
  const RowRef ref = refs[e];
  const bool valid = ref.row != nullptr;
  // (The scale copy first: an address register is still being read by an issued copy, so
  // computing the scale's into it after the row copies waited for them.)
  if (q == 0) cp_async8(smem_u32(scales + e * 8), valid ? ref.scale : dummy, valid);
  const uint8_t* src = (valid ? ref.row : static_cast<const uint8_t*>(dummy)) + q * 16;
  const uint32_t dst = smem_u32(raw + e * kFp8Row + q * 16);
#pragma unroll
  for (int k = 0; k < kFp8Chunks / T; ++k) cp_async16(dst + 16 * T * k, src + 16 * T * k, valid);
  constexpr int kTail = kFp8Chunks % T;  // 36 chunks: none at 4 threads a row, 4 at 8
  if constexpr (kTail != 0) {
    constexpr int kLast = 16 * T * (kFp8Chunks / T);
    if (q < kTail) cp_async16(dst + kLast, src + kLast, valid);
  }
}

template <int kE>
__global__ void __launch_bounds__(256, 64 / kE) sparse_mla_fp8_h16_kernel(const KernelArgs a) {
  using S = H16Smem<kE>;
  constexpr int P = S::kPartPitch;
  constexpr int kJ = kE / 8;           // 8-entry blocks of a tile (a lane's K entries)
  constexpr int kKs = kE / 16;         // P V k-steps
  constexpr int kSub = 64 / kE;        // tiles of kE entries in one of the plan's 64-entry tiles
  constexpr int kRowB = kE * 2;        // bytes of a P row
  auto swz = [](int row) { return kE == 64 ? (row & 7) : ((row >> 1) & 3); };
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint8_t* sRaw = smem + S::kRaw;
  uint8_t* sScale = smem + S::kScale;
  float* sPart = reinterpret_cast<float*>(smem + S::kPart);
  uint8_t* sP = smem + S::kP;
  float* sMax = reinterpret_cast<float*>(smem + S::kMax);
  int* sNeed = reinterpret_cast<int*>(smem + S::kNeed);
  RowRef* sRefs = reinterpret_cast<RowRef*>(smem + S::kRefs);
  int* sValid = reinterpret_cast<int*>(smem + S::kValid);

  const WorkItem w = work_item<1>(a);
  await_earlier_kernels();  // (a programmatic launch: launch.cuh)
  const auto& [t, head0, split, tile_begin, tile_end, n64, lane, rg, warp, g, c] = w;
  const int n = n64 * kSub;
  float sinks[2];
  load_sinks(a, w, sinks);

  // Row references: threads 0..kE-1 own one list entry each; a tile's slots are fetched two
  // iterations before its copies and resolved (and its rows prefetched into L2) one iteration
  // before, into sRefs[tile % 2] and sValid[tile % 3] (as in the bf16 kernel).
  const bool owner = threadIdx.x < kE;
  auto publish = [&](int32_t slot, int which, int tile) {
    const RowRef ref = resolve<true>(a, slot, which);
    sRefs[(tile & 1) * kE + threadIdx.x] = ref;
    sValid[(tile % 3) * kE + threadIdx.x] = slot >= 0;
    if (ref.row != nullptr) {
#pragma unroll
      for (int off = 0; off < kFp8Row; off += 128)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ref.row + off));
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ref.scale));
    }
  };
  auto fetch = [&](int tile, int32_t& slot, int& which) {  // entry threadIdx.x of tile `tile`
    fetch_slot(a, t, tile_begin + tile / kSub, tile_end, (tile % kSub) * kE + threadIdx.x, slot,
               which);
  };
  int32_t pf_slot = -1;
  int pf_which = 0;
  if (owner) {
    fetch(0, pf_slot, pf_which);
    publish(pf_slot, pf_which, 0);
  }

  // Q: this lane's A fragments (rows g, g + 8; dims 64 warp + 16 c ..+16 in k-step order).
  uint32_t qa[4][4];
  {
    uint32_t pr[2][8];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = head0 + g + 8 * r;
      uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
      if (h < a.num_heads) {
        const __nv_bfloat16* src =
            a.q + t * a.q_stride_token + static_cast<int64_t>(h) * a.q_stride_head + warp * 64 +
            16 * c;
        lo = *reinterpret_cast<const uint4*>(src);
        hi = *reinterpret_cast<const uint4*>(src + 8);
      }
      put_pairs(pr[r], lo, hi);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      qa[kk][0] = pr[0][2 * kk];
      qa[kk][1] = pr[1][2 * kk];
      qa[kk][2] = pr[0][2 * kk + 1];
      qa[kk][3] = pr[1][2 * kk + 1];
    }
  }

  __syncthreads();  // tile 0's references
  if (n > 0) load_tile_fp8_raw<kE>(sRefs, a.q, sRaw, sScale, threadIdx.x);
  cp_async_commit();
  if (owner) {
    fetch(1, pf_slot, pf_which);
    publish(pf_slot, pf_which, 1);
    fetch(2, pf_slot, pf_which);
  }

  float acc[8][4];
#pragma unroll
  for (int p = 0; p < 8; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  const int prow = lane & 15, phi = lane >> 4;
  uint32_t pa[kKs];
#pragma unroll
  for (int m = 0; m < kKs; ++m)
    pa[m] = smem_u32(sP) + prow * kRowB + ((((2 * m) | phi) ^ swz(prow)) << 4);

  // This lane's K (entries 8 j + g, dims 64 warp + 16 c ..+16, as 8 bf16 pairs); after S, V.
  uint32_t kr[kJ][8];
  // O += P V over this warp's dims (P from shared memory, V in kr).
  auto pv_step = [&]() {
#pragma unroll
    for (int ks = 0; ks < kKs; ++ks) {
      uint32_t a0, a1, a2, a3;
      ldsm_x4(pa[ks], a0, a1, a2, a3);
#pragma unroll
      for (int p = 0; p < 8; ++p)
        mma_bf16(acc[p], a0, a1, a2, a3, kr[2 * ks][p], kr[2 * ks + 1][p]);
    }
  };

  // Lazy tile maxima: a tile's P is written against the running maxima m_run without waiting for
  // the other warps' block maxima; a warp whose block passes m_run + slack flags the tile
  // (sNeed). After the next barrier a flagged tile is settled as an exchange of the maxima would
  // have done it (the tile maxima from sMax, m_run moved, the lane's P rewritten from its kept
  // scores, l_run and O rescaled) behind one more barrier: the same arithmetic, so the same bits
  // as exchanging every tile, and unflagged tiles (all of them once the maxima have settled) need
  // two block barriers, not three (+2.6-4%).
  float s_keep[4] = {0.f, 0.f, 0.f, 0.f};
  float l_prev[2] = {0.f, 0.f};
  // kE = 32: warp w sums entries 8 (w % 4) ..+8 of rows g + 8 (w / 4) only (the other row's
  // scores stay -inf, so its P and sums are 0 and it writes no P there).
  const int blk = kE == 64 ? warp : (warp & 3);
  const int rh = kE == 64 ? 0 : (warp >> 2);
  auto write_p = [&](const float (&pv)[4], int col) {
    if (kE == 64 || rh == 0)
      *reinterpret_cast<uint32_t*>(sP + g * kRowB + (((col >> 3) ^ swz(g)) << 4) +
                                   (col & 7) * 2) = pack_bf16(pv[0], pv[1]);
    if (kE == 64 || rh == 1)
      *reinterpret_cast<uint32_t*>(sP + (g + 8) * kRowB + (((col >> 3) ^ swz(g + 8)) << 4) +
                                   (col & 7) * 2) = pack_bf16(pv[2], pv[3]);
  };
  auto settle = [&](int buf) {  // after a barrier; block-uniform
    const int4 f0 = *reinterpret_cast<const int4*>(sNeed + buf * 8);
    const int4 f1 = *reinterpret_cast<const int4*>(sNeed + buf * 8 + 4);
    if ((f0.x | f0.y | f0.z | f0.w | f1.x | f1.y | f1.z | f1.w) == 0) return;
    const float* mxs = sMax + buf * 128;
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rescale_rows' steps, the sum taken from before the tile
      float m = -INFINITY;
#pragma unroll
      for (int w2 = 0; w2 < 8; ++w2) m = fmaxf(m, mxs[w2 * 16 + g + 8 * r]);
      alpha[r] = 1.f;
      if (m > m_run[r] + kRescaleSlack) {
        alpha[r] = m_run[r] == -INFINITY ? 0.f : exp2_approx(m_run[r] - m);
        m_run[r] = m;
      }
      l_run[r] = l_prev[r] * alpha[r];
    }
    float pv[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      pv[x] = prob(s_keep[x], m_run[x >> 1]);
      l_run[x >> 1] += pv[x];
    }
    write_p(pv, 8 * blk + 2 * c);
    rescale_acc(acc, alpha);
    __syncthreads();  // the tile's P rewritten
  };

  for (int it = 0; it < n; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // tile it landed (everyone's copies), tile it+1's references published,
                      // every warp done with iteration it-1 up to its P (raw buffer (it+1) % 2,
                      // sPart, sMax)
    if (it + 1 < n)
      load_tile_fp8_raw<kE>(sRefs + ((it + 1) & 1) * kE, a.q, sRaw + ((it + 1) & 1) * kE * kFp8Row,
                            sScale + ((it + 1) & 1) * kE * 8, threadIdx.x);
    cp_async_commit();
    if (owner) {  // into tile it's reference buffer: its copies were issued before the barrier
      publish(pf_slot, pf_which, it + 2);
      fetch(it + 3, pf_slot, pf_which);
    }
    // Tile it-1's P V here rather than behind a fourth barrier: its P was complete at the one
    // above, and each warp finishes reading sP before the next barrier, ahead of P's rewrite.
    if (it > 0) {
      settle((it - 1) & 1);
      pv_step();
    }

    // ---- this lane's K: entries 8 j + g, dims 64 warp + 16 c ..+16, as 8 bf16 pairs ----
    const uint8_t* raw = sRaw + (it & 1) * kE * kFp8Row;
    const uint8_t* scl = sScale + (it & 1) * kE * 8;
    if (warp < 7) {
      uint4 x[kJ];
      uint32_t b[kJ];
      bool fast = true;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int e = 8 * j + g;
        x[j] = *reinterpret_cast<const uint4*>(raw + e * kFp8Row + warp * 64 + 16 * c);
        b[j] = scl[e * 8 + warp];
        fast = fast && b[j] <= 134u;
      }
      // (The exact slow route for the whole warp when any of its scales needs it: never for a
      // real cache, whose scales are far below 2^7; the tests plant some.)
      // (Two loops, not one with the choice inside: ptxas schedules that one differently.)
      if (__all_sync(0xffffffffu, fast)) {
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          uint4 lo, hi;
          dequant16_fast(x[j], b[j], lo, hi);
          put_pairs(kr[j], lo, hi);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          uint4 lo, hi;
          dequant16_slow(x[j], b[j], lo, hi);
          put_pairs(kr[j], lo, hi);
        }
      }
    } else {  // the RoPE dims, bf16 in the row's last 128 bytes
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const uint8_t* p = raw + (8 * j + g) * kFp8Row + 448 + 32 * c;
        put_pairs(kr[j], *reinterpret_cast<const uint4*>(p),
                  *reinterpret_cast<const uint4*>(p + 16));
      }
    }

    // ---- S partial over this warp's dims -> shared memory ----
    {
      float sacc[kJ][4];
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          mma_bf16(sacc[j], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], kr[j][2 * kk],
                   kr[j][2 * kk + 1]);
      }
      float* part = sPart + warp * 16 * P;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int col = 8 * j + 2 * c;
        *reinterpret_cast<float2*>(part + g * P + col) = make_float2(sacc[j][0], sacc[j][1]);
        *reinterpret_cast<float2*>(part + (g + 8) * P + col) = make_float2(sacc[j][2], sacc[j][3]);
      }
    }
    // K becomes V: each 8 x 8 block (entries 8 j.., this lane group's dims) transposed.
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int p = 0; p < 8; ++p) kr[j][p] = movmatrix_trans(kr[j][p]);
    __syncthreads();  // every partial written

    // ---- entries 8 warp ..+8: the summed scores, masked and scaled; their row maxima ----
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    const int col = 8 * blk + 2 * c;
    if constexpr (kE == 64) {
#pragma unroll
      for (int w2 = 0; w2 < 8; ++w2) {  // fixed order
        const float* pp = sPart + w2 * 16 * P;
        const float2 lo = *reinterpret_cast<const float2*>(pp + g * P + col);
        const float2 hi = *reinterpret_cast<const float2*>(pp + (g + 8) * P + col);
        s[0] += lo.x;
        s[1] += lo.y;
        s[2] += hi.x;
        s[3] += hi.y;
      }
    } else {
      float o0 = 0.f, o1 = 0.f;
#pragma unroll
      for (int w2 = 0; w2 < 8; ++w2) {  // fixed order
        const float2 v = *reinterpret_cast<const float2*>(sPart + w2 * 16 * P + (g + 8 * rh) * P +
                                                          col);
        o0 += v.x;
        o1 += v.y;
      }
      s[0] = s[2] = o0;
      s[1] = s[3] = o1;
    }
    const int* valid = sValid + (it % 3) * kE;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const bool v = valid[col + x] != 0;
      s[x] = v && (kE == 64 || rh == 0) ? s[x] * a.scale_log2 : -INFINITY;
      s[2 + x] = v && (kE == 64 || rh == 1) ? s[2 + x] * a.scale_log2 : -INFINITY;
      mx[0] = fmaxf(mx[0], s[x]);
      mx[1] = fmaxf(mx[1], s[2 + x]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float* mxs = sMax + (it & 1) * 128;
    if (c == 0) {
      mxs[warp * 16 + g] = mx[0];
      mxs[warp * 16 + g + 8] = mx[1];
    }
    const bool need = mx[0] > m_run[0] + kRescaleSlack || mx[1] > m_run[1] + kRescaleSlack;
    const bool any = __any_sync(0xffffffffu, need);
    if (lane == 0) sNeed[(it & 1) * 8 + warp] = any;
    float pv[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      s_keep[x] = s[x];
      pv[x] = prob(s[x], m_run[x >> 1]);
    }
    l_prev[0] = l_run[0];
    l_prev[1] = l_run[1];
#pragma unroll
    for (int x = 0; x < 4; ++x) l_run[x >> 1] += pv[x];  // settle's order
    write_p(pv, col);
  }
  if (n > 0) {
    __syncthreads();  // the last tile's P complete
    settle((n - 1) & 1);
    pv_step();
  }

  // ---- the row sums over the 8 warps, then O (rows g, g + 8; dims 64 warp + 16 c ..+16) ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  __syncthreads();  // every warp is past the loop: sMax is free
  if (c == 0) {
    sMax[warp * 16 + g] = l_run[0];
    sMax[warp * 16 + g + 8] = l_run[1];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r, h = head0 + row;
    float l = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < 8; ++w2) l += sMax[w2 * 16 + row];
    const float m = m_run[r];
    if (h >= a.num_heads) continue;
    const int d0 = warp * 64 + 16 * c;
    if (a.num_splits == 1) {
      const float inv = output_scale(l, m, sinks[r]);
      uint32_t o[8];
#pragma unroll
      for (int p = 0; p < 8; ++p) o[p] = pack_bf16(acc[p][2 * r] * inv, acc[p][2 * r + 1] * inv);
      __nv_bfloat16* dst =
          a.out + t * a.out_stride_token + static_cast<int64_t>(h) * a.out_stride_head + d0;
      *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(dst + 8) = make_uint4(o[4], o[5], o[6], o[7]);
      if (warp == 0 && c == 0)
        a.lse[t * a.lse_stride_token + h] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
    } else {
      const int64_t item = (static_cast<int64_t>(split) * a.num_tokens + t) * a.num_heads + h;
      float* o = a.part_o + item * kDim + d0;
#pragma unroll
      for (int p = 0; p < 8; p += 2)
        *reinterpret_cast<float4*>(o + 2 * p) =
            make_float4(acc[p][2 * r], acc[p][2 * r + 1], acc[p + 1][2 * r], acc[p + 1][2 * r + 1]);
      if (warp == 0 && c == 0) {
        a.part_m[item] = m;
        a.part_l[item] = l;
      }
    }
  }
}

// Merge the split partials of one (token, head) per warp, in split order.
__global__ void __launch_bounds__(128) sparse_mla_combine_kernel(const KernelArgs a) {
  await_earlier_kernels();  // (a programmatic launch under the split kernel's tail: launch.cuh)
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
  const float inv = output_scale(l, m, sink_logit(a, h));
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

template <int kE>
void launch_h16(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = H16Smem<kE>::kAlloc;
  ZI_CUDA_CHECK(cudaFuncSetAttribute(sparse_mla_fp8_h16_kernel<kE>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  launch_programmatic(sparse_mla_fp8_h16_kernel<kE>, grid, dim3(256), bytes, stream, a);
}

template <int R, bool kFp8>
void launch(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = Smem<R, kFp8>::kAlloc;
  static_assert(bytes * Smem<R, kFp8>::kCtasPerSm <= 227 * 1024, "shared memory budget");
  auto* kernel = kFp8 ? sparse_mla_fp8_kernel<R> : sparse_mla_bf16_kernel<R>;
  ZI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  launch_programmatic(kernel, grid, dim3(Geom<R>::kThreads), bytes, stream, a);
}

CacheView view_of(const SparseMlaCache& c) {
  const bool pow2 = c.block_size > 0 && (c.block_size & (c.block_size - 1)) == 0;
  int32_t shift = -1;
  if (pow2) for (shift = 0; (int64_t{1} << shift) < c.block_size; ++shift) {}
  return CacheView{static_cast<const uint8_t*>(c.data), c.indices, c.indices_stride,
                   c.block_stride_bytes, static_cast<uint32_t>(c.block_size), shift,
                   static_cast<int32_t>(c.topk)};
}

}  // namespace

SparseMlaCudaPlan sparse_mla_cuda_plan(int64_t num_tokens, int64_t num_heads, int64_t total_topk,
                                       int64_t num_sms, bool fp8, int h16) {
  SparseMlaCudaPlan plan;
  const int R = rows_per_cta(num_heads);
  const int64_t heads_per_cta = 16 * R;
  const int64_t items = num_tokens * ((num_heads + heads_per_cta - 1) / heads_per_cta);
  const int64_t ntiles = (total_topk + kTileN - 1) / kTileN;
  ZI_CHECK(h16 == -1 || h16 == 0 || h16 == 32 || h16 == 64,
           "sparse_mla_cuda_plan: h16 must be -1 (the plan chooses), 0, 32 or 64");
  if (fp8 && R == 1) {
    if (h16 >= 0) plan.h16 = h16;
    else plan.h16 = items <= num_sms ? 64 : 32;  // (H200, 16 heads: see sparse_mla_fp8_h16_kernel)
  }
  // CTAs that fit on an SM at once (registers, shared memory); split the list only while the
  // grid is under one wave of them.
  const int64_t per_sm = plan.h16 == 64 ? 1
                         : plan.h16 == 32 ? 2
                         : (fp8 && R == 1) ? Smem<1, true>::kCtasPerSm : 1;
  const int64_t slots = num_sms * per_sm;
  int64_t splits = 1;
  if (items > 0 && items < slots && ntiles > 1)
    splits = std::min<int64_t>(ntiles, std::max<int64_t>(1, slots / items));
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
    a.extra = CacheView{a.kv.data, a.kv.indices, 0, 0, 1, 0, 0};
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
  ZI_CHECK(plan.h16 == 0 || ((plan.h16 == 32 || plan.h16 == 64) && fp8 && R == 1),
           "sparse_mla_attention_cuda: plan.h16 must be 0, or 32 / 64 with at most 16 heads over "
           "the FP8 cache");
  const int64_t heads_per_cta = 16 * R;
  dim3 grid(static_cast<unsigned>(p.num_tokens),
            static_cast<unsigned>((p.num_heads + heads_per_cta - 1) / heads_per_cta),
            static_cast<unsigned>(plan.num_splits));
  auto s = static_cast<cudaStream_t>(stream);
  if (fp8) {
    if (plan.h16 == 64) launch_h16<64>(a, grid, s);
    else if (plan.h16 == 32) launch_h16<32>(a, grid, s);
    else if (R == 1) launch<1, true>(a, grid, s);
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
    launch_programmatic(sparse_mla_combine_kernel, cgrid, dim3(128), 0, s, a);
    ZI_CUDA_CHECK_LAUNCH("sparse_mla_combine");
  }
}

}  // namespace zi
