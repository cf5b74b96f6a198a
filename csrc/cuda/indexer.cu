// CUDA indexer scores (contract in zeroinfer/indexer.h), two kernels:
//
// * bf16 keys with d a multiple of 16, d <= 128 (V4's index keys: 128): tensor cores. A CTA
//   streams 64-entry tiles of one token's sequence (cp.async, two stages, rows padded so the
//   fragment loads hit distinct banks); each of its 4 warps owns 16 heads as mma.sync's M, the
//   entries are N, the channels K. q goes in as bf16, split in two (hi + lo, both bf16) when it
//   is not bf16-exact, so the products keep float32's precision; the model's q is bf16-exact on
//   the GPU and takes one MMA. Then w_h * relu per head and the sum over heads in a fixed tree
//   (the thread's two heads, a butterfly over the warp's 8 row groups, the warps in order). The
//   MMA's own summation order is not the CPU twin's chain, so these bits are not the CPU's -
//   but they are a function of the row's inputs alone: batch-invariant, and deterministic.
// * anything else (float32 keys, other d): CUDA cores in the contract's exact order, the CPU
//   twin's bits. A CTA scores 128 entries of one token, one entry a thread, in passes of 32
//   heads x 32 channels staged in shared memory (keys transposed with a padded stride).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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
constexpr int kTcEntries = 64;            // entries a stage: 8 n-tiles of 8
constexpr int kTcWarps = 4;               // 16 heads a warp: 64 heads a head group
constexpr int kTcThreads = 32 * kTcWarps;
constexpr int kTcMaxDim = 128;
constexpr int kTcPitch = kTcMaxDim + 8;   // bf16 a smem row: 272 bytes, rows 4 banks apart

__device__ __forceinline__ uint32_t pack_bf16(float lo_half, float hi_half) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo_half, hi_half);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// KS = d / 16 k-steps. One CTA: token blockIdx.x, tiles [blockIdx.y * per_cta, + per_cta).
template <int KS>
__global__ void __launch_bounds__(kTcThreads, 1) indexer_scores_tc_kernel(IndexerScoresParams p,
                                                                       int per_cta) {
  __shared__ __align__(16) uint16_t rows[2][kTcEntries][kTcPitch];
  __shared__ float red[kTcWarps][kTcEntries];
  __shared__ bool bad[2][kTcEntries];
  constexpr int d = 16 * KS;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
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

  // Stage loads: row r = tid / 2 of the tile, half of its 16-byte chunks each.
  const uint16_t* keys = static_cast<const uint16_t*>(p.keys);
  auto load_tile = [&](int buf, int64_t tile) {
    const int r = tid >> 1;
    const int64_t s = tile * kTcEntries + r;
    const int64_t off = s < visible ? indexer_key_offset(p, t, s) : -1;
    if ((tid & 1) == 0) bad[buf][r] = s < visible && off < 0;
    const uint16_t* src = keys + (off < 0 ? 0 : off);
#pragma unroll
    for (int ch = (tid & 1) * KS; ch < (tid & 1) * KS + KS; ++ch)  // d / 8 chunks a row
      cp_async16(smem_u32(&rows[buf][r][ch * 8]), src + ch * 8, off >= 0);
  };

  // Whether q needs its low half: any element not exact in bf16 (the whole token's q).
  const float* q = p.q + t * p.heads * p.dim;
  bool inexact = false;
  for (int64_t e = tid; e < p.heads * d; e += kTcThreads) {
    const float v = q[e];
    inexact |= __bfloat162float(__float2bfloat16_rn(v)) != v;
  }
  const bool need_lo = __syncthreads_or(inexact);

  const int groups = static_cast<int>((p.heads + 16 * kTcWarps - 1) / (16 * kTcWarps));
  uint32_t a_hi[KS][4], a_lo[KS][4];
  float w_g = 0.f, w_8 = 0.f;  // the weights of this thread's heads g and g + 8
  // The A fragments (q of the warp's 16 heads of `group`) and the heads' weights.
  auto load_a = [&](int group) {
    const int64_t hg = static_cast<int64_t>(group) * 16 * kTcWarps + warp * 16 + g;
    const bool ok_g = hg < p.heads, ok_8 = hg + 8 < p.heads;
    w_g = ok_g ? p.weights[t * p.heads + hg] : 0.f;
    w_8 = ok_8 ? p.weights[t * p.heads + hg + 8] : 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // a0: (g, 2c), a1: (g + 8, 2c), a2 / a3: channels + 8
        const int64_t h = hg + (j & 1) * 8;
        const int i = ks * 16 + (j >> 1) * 8 + 2 * c;
        const bool ok = j & 1 ? ok_8 : ok_g;
        const float x0 = ok ? q[h * p.dim + i] : 0.f, x1 = ok ? q[h * p.dim + i + 1] : 0.f;
        a_hi[ks][j] = pack_bf16(x0, x1);
        const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&a_hi[ks][j]);
        a_lo[ks][j] = pack_bf16(x0 - __low2float(hi), x1 - __high2float(hi));
      }
    }
  };
  if (groups == 1) load_a(0);

  load_tile(0, tile0);
  cp_async_commit();
  for (int64_t tile = tile0; tile < live1; ++tile) {
    const int buf = static_cast<int>((tile - tile0) & 1);
    if (tile + 1 < live1) load_tile(buf ^ 1, tile + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    // (Read now: the next stage's load rewrites these flags once the barriers below are passed.)
    const bool row_bad = tid < kTcEntries && bad[buf][tid];
    float total = 0.f;  // entry tid's sum over the head groups so far (tid < 64)
    for (int group = 0; group < groups; ++group) {
      if (groups > 1) load_a(group);
      float acc[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const uint16_t* row = &rows[buf][nt * 8 + g][ks * 16 + 2 * c];
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(row);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(row + 8);
          mma_bf16(acc[nt], a_hi[ks], b0, b1);
          if (need_lo) mma_bf16(acc[nt], a_lo[ks], b0, b1);
        }
      }
      // w_h * relu per head, summed: the thread's two heads, then the warp's 8 row groups.
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = w_g * relu_keep_nan(acc[nt][e]) + w_8 * relu_keep_nan(acc[nt][2 + e]);
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (g == 0) red[warp][nt * 8 + 2 * c + e] = v;
        }
      }
      __syncthreads();
      if (tid < kTcEntries) {
        float sum = red[0][tid];
#pragma unroll
        for (int w = 1; w < kTcWarps; ++w) sum += red[w][tid];
        total += sum;
      }
      __syncthreads();  // red is rewritten by the next group; the stage's rows by the next load
    }
    const int64_t s = tile * kTcEntries + tid;
    if (tid < kTcEntries && s < p.num_entries)
      out[s] = s >= visible ? neg_inf : row_bad ? __int_as_float(0x7fc00000) : total * p.scale;
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
  indexer_scores_tc_kernel<KS><<<grid, kTcThreads, 0, stream>>>(p, static_cast<int>(per_cta));
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
  indexer_dispatch(p.key_dtype, [&](auto type) {
    indexer_scores_kernel<decltype(type)>
        <<<grid, kEntries, 0, s>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("indexer_scores");
}

}  // namespace zi
