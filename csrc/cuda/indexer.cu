// CUDA indexer scores (contract in zeroinfer/indexer.h), two kernels:
//
// * bf16 keys with d a multiple of 16, d <= 128 (V4's index keys: 128): tensor cores. A CTA
//   streams 64-entry tiles of one token's sequence (cp.async, a 3-stage ring, rows padded so
//   ldmatrix hits distinct banks); the entries are mma.sync's M, the heads N (q's fragments
//   held in registers), the channels K; each of its 4 warps takes 32 entries x 32 heads. q goes
//   in as bf16, split in two (hi + lo, both bf16) when it is not bf16-exact, so the products
//   keep float32's precision; the model's q is bf16-exact on the GPU and takes one MMA. Then
//   w_h * relu per head and the sum over heads in a fixed tree (below). The MMA's own summation
//   order is not the CPU twin's chain, so these bits are not the CPU's - but they are a
//   function of the row's inputs alone: batch-invariant, and deterministic.
// * anything else (float32 keys, other d): CUDA cores in the contract's exact order, the CPU
//   twin's bits. A CTA scores 128 entries of one token, one entry a thread, in passes of 32
//   heads x 32 channels staged in shared memory (keys transposed with a padded stride).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "check.cuh"
#include "launch.cuh"
#include "ptx.cuh"
#include "zeroinfer/indexer.h"

namespace zi {
namespace {

constexpr int kEntries = 128;  // a CTA's entries, one a thread
constexpr int kPass = 32;      // heads, and channels, a pass

template <class K>
__global__ void __launch_bounds__(kEntries) indexer_scores_kernel(IndexerScoresParams p) {
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
        ks[lane][warp * 32 + r] = off >= 0 && lane < nc ? to_float(keys[off + i0 + lane]) : 0.f;
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


// ---- tensor cores -------------------------------------------------------------------------
// The keys are mma.sync's A (entries as M, rows of the staged tile through ldmatrix) and q its B
// (heads as N), so a warp holds its heads' q fragments in registers for the whole CTA and reads
// each key of its entries from shared memory once: 4 warps = 2 entry halves (32 entries, two
// m-tiles) x 2 head halves (32 heads, four n-tiles) of a 64-entry tile and a 64-head group.
// (Heads as M instead - the first form - had every warp read the whole tile: twice the
// shared-memory reads a tile, and 48 shuffles for its head sum against 8 here.)
constexpr int kTcEntries = 64;            // entries a stage: 2 halves x 2 m-tiles of 16
constexpr int kTcWarps = 4;
constexpr int kTcThreads = 32 * kTcWarps;
constexpr int kTcHeads = 64;              // heads a group: 2 halves x 4 n-tiles of 8
constexpr int kTcStages = 3;              // 64-entry tiles in flight + the one being scored
constexpr int kTcMaxDim = 128;
constexpr int kTcPitch = kTcMaxDim + 8;   // bf16 a smem row: 272 bytes, rows 4 banks apart,
                                          // so ldmatrix's 8 rows of a chunk hit 32 banks
constexpr int kTcRowsBytes = kTcStages * kTcEntries * kTcPitch * 2;
constexpr int kTcLoBytes = kTcHeads * kTcPitch * 2;  // q's low halves, [head][channel], if needed
constexpr int kTcSmemBytes = kTcRowsBytes + kTcLoBytes + 2 * kTcEntries * 4 +
                             kTcStages * kTcEntries;

__device__ __forceinline__ uint32_t pack_bf16(float lo_half, float hi_half) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo_half, hi_half);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// q's two floats at off (even), off + 1: one 8-byte load where q is 8-byte aligned (a contiguous
// view may start at any float).
__device__ __forceinline__ float2 q_pair(const float* q, bool ok, int64_t off, bool vec) {
  if (!ok) return make_float2(0.f, 0.f);
  return vec ? *reinterpret_cast<const float2*>(q + off) : make_float2(q[off], q[off + 1]);
}

// The bf16 B-fragment word of a pair (hi), and the residual of that rounding (lo): q = hi + lo
// to float32's precision, so the products keep q's precision.
__device__ __forceinline__ uint32_t hi_word(float2 x) { return pack_bf16(x.x, x.y); }
__device__ __forceinline__ uint32_t lo_word(float2 x) {
  const uint32_t hi = hi_word(x);
  const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&hi);
  return pack_bf16(x.x - __low2float(h), x.y - __high2float(h));
}

// KS = d / 16 k-steps. One CTA: token blockIdx.x, tiles [blockIdx.y * per_cta, + per_cta).
template <int KS>
__global__ void __launch_bounds__(kTcThreads) indexer_scores_tc_kernel(IndexerScoresParams p,
                                                                       int per_cta) {
  extern __shared__ __align__(16) uint8_t smem[];
  auto rows = reinterpret_cast<uint16_t(*)[kTcEntries][kTcPitch]>(smem);
  auto q_lo = reinterpret_cast<uint16_t(*)[kTcPitch]>(smem + kTcRowsBytes);
  auto red = reinterpret_cast<float(*)[kTcEntries]>(smem + kTcRowsBytes + kTcLoBytes);
  auto bad = reinterpret_cast<bool(*)[kTcEntries]>(smem + kTcRowsBytes + kTcLoBytes +
                                                   2 * kTcEntries * 4);  // red: [half][entry]
  constexpr int d = 16 * KS;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int eh = warp >> 1, hh = warp & 1;  // this warp's entry half and head half
  float* out = p.out + t * p.num_entries;
  const int64_t visible = indexer_visible(p, t);
  const int64_t tile0 = static_cast<int64_t>(blockIdx.y) * per_cta;
  const int64_t tiles_end = (p.num_entries + kTcEntries - 1) / kTcEntries;
  const int64_t tile1 = tile0 + per_cta < tiles_end ? tile0 + per_cta : tiles_end;
  const int64_t live_end = (visible + kTcEntries - 1) / kTcEntries;  // tiles with entries seen
  const int64_t live1 = tile1 < live_end ? tile1 : live_end;
  const float neg_inf = -__int_as_float(0x7f800000);
  // Tiles past what the token sees: -inf, nothing read.
  for (int64_t s = (tile0 > live1 ? tile0 : live1) * kTcEntries + tid;
       s < tile1 * kTcEntries && s < p.num_entries; s += kTcThreads)
    out[s] = neg_inf;
  if (tile0 >= live1) return;

  // Stage loads: row r = tid / 2 of the tile, half of its 16-byte chunks each; rows past what
  // the token sees, or of an unmapped block, zero-filled (their scores are -inf / NaN). The
  // row addresses are indexer_key_offset's, with the token's table row found once and a
  // power-of-two block size (V4's 64) taken by shifts; each row's table entry is read a tile
  // ahead of its copy (`blk`), so no copy waits on that load.
  const uint16_t* keys = static_cast<const uint16_t*>(p.keys);
  const int64_t seq = indexer_detail::index_at(p, p.seq, t);
  const bool seq_ok = seq >= 0 && seq < p.num_seqs;
  const int32_t* table_row = p.table + (seq_ok ? seq : 0) * p.table_stride;
  const bool pow2 = (p.block_size & (p.block_size - 1)) == 0;
  const int shift = pow2 ? __ffsll(p.block_size) - 1 : 0;
  const int r = tid >> 1;
  auto row_block = [&](int64_t tile) -> int32_t {  // row r's cache block in `tile`, or -1
    const int64_t e = tile * kTcEntries + r;
    if (!seq_ok || e >= visible) return -1;
    return table_row[pow2 ? e >> shift : e / p.block_size];
  };
  auto load_tile = [&](int buf, int64_t tile, int32_t blk) {
    const int64_t e = tile * kTcEntries + r;
    const int64_t in = pow2 ? e & (p.block_size - 1) : e % p.block_size;
    const int64_t off = blk < 0 ? -1 : (static_cast<int64_t>(blk) * p.block_size + in) * d;
    if ((tid & 1) == 0) bad[buf][r] = e < visible && off < 0;
    const uint16_t* src = keys + (off < 0 ? 0 : off);
#pragma unroll
    for (int ch = (tid & 1) * KS; ch < (tid & 1) * KS + KS; ++ch)  // d / 8 chunks a row
      cp_async16(smem_u32(&rows[buf][r][ch * 8]), src + ch * 8, off >= 0);
  };
  // The ring's first stages first: their latency then overlaps q's loads below.
#pragma unroll
  for (int i = 0; i < kTcStages - 1; ++i) {
    if (tile0 + i < live1) load_tile(i, tile0 + i, row_block(tile0 + i));
    cp_async_commit();
  }
  int32_t blk_next = row_block(tile0 + kTcStages - 1);

  // Whether q needs its low half: any element not exact in bf16 (the whole token's q).
  const float* q = p.q + t * p.heads * p.dim;
  const bool q_vec = (reinterpret_cast<uintptr_t>(q) & 7) == 0;
  const bool q_vec4 = (reinterpret_cast<uintptr_t>(q) & 15) == 0;
  auto exact = [](float2 v) {
    return __bfloat162float(__float2bfloat16_rn(v.x)) == v.x &&
           __bfloat162float(__float2bfloat16_rn(v.y)) == v.y;
  };
  const int groups = static_cast<int>((p.heads + kTcHeads - 1) / kTcHeads);
  // This warp's B fragments (q's bf16 high parts) of n-tile nt: head base + nt * 8 + g, channels
  // ks * 16 + 2c, +1 (b0) and + 8 (b1); and the weights of its accumulators' heads,
  // base + nt * 8 + 2c + e. The low parts go to shared memory (the entry-half-0 warps write
  // their head half's; registers for them would cost every call occupancy), used only if some
  // element of q is not bf16-exact (`inexact`: the values this thread loaded).
  uint32_t bq[KS][4][2];
  float wt[4][2];
  auto head_base = [&](int group) { return static_cast<int64_t>(group) * kTcHeads + hh * 32; };
  bool inexact = false;
  auto load_q = [&](int group) {
    const int64_t hb = head_base(group);
    // q's group, coalesced: 16 bytes a load, all of a thread's loads in flight together (one
    // trip to L2 for the CTA instead of one a fragment batch), its bf16 high halves staged in
    // q_lo's rows, the warps' B fragments read back by ldmatrix, then the low halves written
    // over them. (Rows of heads past H hold zeros.)
    __syncthreads();  // every warp is done with q_lo (the last group's low halves, or nothing)
    constexpr int kVecs = kTcHeads * d / 4 / kTcThreads;  // float4s a thread: d / 8
    constexpr int kBatch = kVecs < 8 ? kVecs : 8;          // in flight together
    // Float4 i of this thread: head hl of the group, channels k .. k + 3.
    auto vec_at = [&](int i, int& hl, int& k) -> float4 {
      const int f = tid + i * kTcThreads;
      hl = f / (d / 4);
      k = (f % (d / 4)) * 4;
      const int64_t h = static_cast<int64_t>(group) * kTcHeads + hl;
      const float* src = q + h * d + k;
      return h >= p.heads ? make_float4(0.f, 0.f, 0.f, 0.f)
             : q_vec4   ? *reinterpret_cast<const float4*>(src)
                        : make_float4(src[0], src[1], src[2], src[3]);
    };
    // word(x0, x1): the hi or lo words of a float4, stored at q_lo[hl][k]
    auto stage = [&](bool low) {
#pragma unroll 1
      for (int i0 = 0; i0 < kVecs; i0 += kBatch) {
        float4 v[kBatch];
        int hl[kBatch], k[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) v[i] = vec_at(i0 + i, hl[i], k[i]);
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const float2 x0 = make_float2(v[i].x, v[i].y), x1 = make_float2(v[i].z, v[i].w);
          if (!low) inexact |= !exact(x0) || !exact(x1);
          *reinterpret_cast<uint2*>(&q_lo[hl[i]][k[i]]) =
              low ? make_uint2(lo_word(x0), lo_word(x1)) : make_uint2(hi_word(x0), hi_word(x1));
        }
      }
    };
    stage(false);
    __syncthreads();
    // ldmatrix: lane l gives head row hh * 32 + nt * 8 + l % 8 at channels ks * 16 + (l / 8) * 8:
    // matrices b0, b1 of k-step ks and b0, b1 of ks + 1 (past d: the row's padding, unused).
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t h = hb + nt * 8 + 2 * c + e;
        wt[nt][e] = h < p.heads ? p.weights[t * p.heads + h] : 0.f;
      }
#pragma unroll
      for (int ks = 0; ks < KS; ks += 2) {
        uint32_t r0, r1, r2, r3;
        ldsm_x4(smem_u32(&q_lo[hh * 32 + nt * 8 + (lane & 7)][ks * 16 + (lane >> 3) * 8]), r0, r1,
                r2, r3);
        bq[ks][nt][0] = r0;
        bq[ks][nt][1] = r1;
        if (ks + 1 < KS) {
          bq[ks + 1][nt][0] = r2;
          bq[ks + 1][nt][1] = r3;
        }
      }
    }
    __syncthreads();  // every warp has its high halves: the low halves go over them (q again,
    stage(true);      // from L1 / L2: registers for them would cost every call occupancy)
    if (groups > 1) __syncthreads();  // (one group: the tile loop's barrier comes first)
  };
  // Whether q needs its low halves: any element not exact in bf16 (the whole token's q: one
  // group's loads cover it; with more groups a pass of its own).
  if (groups == 1) {
    load_q(0);
  } else {
    for (int64_t e = 2 * tid; e < p.heads * d; e += 2 * kTcThreads)  // (heads * d is even)
      inexact |= !exact(q_pair(q, true, e, q_vec));
  }
  const bool need_lo = __syncthreads_or(inexact);

  // ldmatrix row addresses: lane l gives row (l % 16) of the m-tile, chunk l / 16 of the k-step.
  const uint32_t a_lane = smem_u32(&rows[0][eh * 32 + (lane & 15)][(lane >> 4) * 8]);
  constexpr uint32_t kStageBytes = kTcEntries * kTcPitch * 2;
  for (int64_t tile = tile0; tile < live1; ++tile) {
    const int i = static_cast<int>(tile - tile0);
    const int buf = i % kTcStages;
    cp_async_wait<kTcStages - 2>();
    __syncthreads();  // tile i landed for all; every warp is done with tile i - 1 (and red)
    if (tile + kTcStages - 1 < live1) {
      load_tile((i + kTcStages - 1) % kTcStages, tile + kTcStages - 1, blk_next);
      blk_next = row_block(tile + kTcStages);
    }
    cp_async_commit();
    float part[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [m-tile][row g / g + 8]: over the groups
    for (int group = 0; group < groups; ++group) {
      if (groups > 1) load_q(group);
      float acc[2][4][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] =
                                           acc[mt][nt][3] = 0.f;
      // The A fragments a k-step ahead (two register sets), so each k-step's MMAs find their
      // ldmatrix done instead of waiting on it. The low halves' MMAs are a second instance of
      // the loop rather than a branch inside it, so the warp is provably converged at every
      // ldmatrix / mma.sync (no WARPSYNC between them).
      auto mma_tile = [&](auto lo_c) {
        constexpr bool kLo = decltype(lo_c)::value;
        uint32_t a[2][2][4];  // [k-step parity][m-tile]
        auto load_a = [&](int set, int ks) {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            ldsm_x4(a_lane + buf * kStageBytes + mt * 16 * kTcPitch * 2 + ks * 32,
                    a[set][mt][0], a[set][mt][1], a[set][mt][2], a[set][mt][3]);
        };
        load_a(0, 0);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          if (ks + 1 < KS) load_a((ks + 1) & 1, ks + 1);
          const uint32_t(&am)[2][4] = a[ks & 1];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
              mma_bf16(acc[mt][nt], am[mt], bq[ks][nt][0], bq[ks][nt][1]);
            if constexpr (kLo) {
              const uint16_t* lo = &q_lo[hh * 32 + nt * 8 + g][ks * 16 + 2 * c];
              const uint32_t l0 = *reinterpret_cast<const uint32_t*>(lo);
              const uint32_t l1 = *reinterpret_cast<const uint32_t*>(lo + 8);
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) mma_bf16(acc[mt][nt], am[mt], l0, l1);
            }
          }
        }
      };
      if (need_lo) {
        mma_tile(std::true_type{});
      } else {
        mma_tile(std::false_type{});
      }
      // w_h * relu per head, summed in a fixed tree: the thread's 8 heads (n-tiles in order,
      // then its column pair), the 4 lanes of a row, the groups in order; the two head halves
      // last (below).
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float v = 0.f;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) v += wt[nt][e] * relu_keep_nan(acc[mt][nt][2 * r + e]);
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          part[mt][r] += v;
        }
      }
    }
    // (Read now: a later refill rewrites these flags once the next barrier is passed.)
    const bool row_bad = tid < kTcEntries && bad[buf][tid];
    if (c == 0) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) red[hh][eh * 32 + mt * 16 + r * 8 + g] = part[mt][r];
    }
    __syncthreads();
    const int64_t s = tile * kTcEntries + tid;
    if (tid < kTcEntries && s < p.num_entries) {
      const float total = red[0][tid] + red[1][tid];
      out[s] = s >= visible ? neg_inf : row_bad ? __int_as_float(0x7fc00000) : total * p.scale;
    }
  }
  cp_async_wait<0>();
}

bool use_tensor_cores(const IndexerScoresParams& p) {
  return p.key_dtype == DType::kBFloat16 && p.dim % 16 == 0 && p.dim <= kTcMaxDim;
}

template <int KS>
void launch_tc(const IndexerScoresParams& p, cudaStream_t stream) {
  // Tiles a CTA: enough CTAs for ~8 an SM, and a CTA streaming several tiles where there are
  // many (its q fragments loaded once, its next tile in flight under the current one).
  const int64_t tiles = (p.num_entries + kTcEntries - 1) / kTcEntries;
  const int64_t want = static_cast<int64_t>(device_limits().sms) * 8;
  int64_t per_cta = (p.num_tokens * tiles + want - 1) / want;
  per_cta = per_cta < 1 ? 1 : per_cta > 16 ? 16 : per_cta;
  const int64_t chunks = (tiles + per_cta - 1) / per_cta;
  ZI_CHECK(p.num_tokens <= 0x7fffffff && chunks <= 65535,
           "indexer_scores: too many tokens or entries for one launch");
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(chunks));
  // (Every launch, as sparse_mla's: the attribute is per device, and setting it is cheap.)
  ZI_CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_tc_kernel<KS>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kTcSmemBytes));
  indexer_scores_tc_kernel<KS><<<grid, kTcThreads, kTcSmemBytes, stream>>>(
      p, static_cast<int>(per_cta));
}

}  // namespace

void indexer_scores_cuda(const IndexerScoresParams& p, void* stream) {
  ZI_CHECK(p.heads >= 1 && p.dim >= 1 && p.block_size >= 1 && p.num_entries >= 0,
           "indexer_scores: bad sizes");
  ZI_CHECK(p.num_entries <= p.table_stride * p.block_size,
           "indexer_scores: more entries than the table covers");
  if (p.num_tokens == 0 || p.num_entries == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (use_tensor_cores(p)) {
    switch (p.dim / 16) {
      case 1: launch_tc<1>(p, s); break;
      case 2: launch_tc<2>(p, s); break;
      case 3: launch_tc<3>(p, s); break;
      case 4: launch_tc<4>(p, s); break;
      case 5: launch_tc<5>(p, s); break;
      case 6: launch_tc<6>(p, s); break;
      case 7: launch_tc<7>(p, s); break;
      default: launch_tc<8>(p, s); break;
    }
    ZI_CUDA_CHECK_LAUNCH("indexer_scores");
    return;
  }
  const int64_t tiles = (p.num_entries + kEntries - 1) / kEntries;
  ZI_CHECK(p.num_tokens <= 0x7fffffff && tiles <= 65535,
           "indexer_scores: too many tokens or entries for one launch");
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(tiles));
  dispatch_float_or_bf16(p.key_dtype, "indexer_scores: keys must be float32 or bfloat16",
                         [&](auto type) {
    indexer_scores_kernel<decltype(type)>
        <<<grid, kEntries, 0, s>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("indexer_scores");
}

}  // namespace zi
