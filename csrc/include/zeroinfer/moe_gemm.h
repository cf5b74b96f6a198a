// MXFP4 grouped GEMM for the routed experts of DeepSeek-V4 (W4A16 / W4A8 / W4A32).
//
// Per expert e: Y_e = A_e @ W_eᵀ with W_e[n, k] = e2m1(nibble(e,n,k)) * 2^(w_scale[e,n,k/32]-127),
// accumulated in float32, optionally followed by the V4 clipped SwiGLU over the concatenated
// gate ‖ up halves of N. The rows of A that belong to expert e come in one of two layouts:
//   contiguous: A [m, k], expert e owns rows [offsets[e], offsets[e] + count_e)  (moe_dispatch)
//   masked:     A [E, cap, k], expert e owns rows [0, masked_m[e]) of A[e]  (per-expert capacity)
//   routed:     out row i (of m) takes expert route_ids[i] and A row i / route_div: the router's
//               top-k ids [T, k] read directly, no dispatch (decode; A [T, k] rows with
//               route_div = k, or [T*k] rows with route_div = 1)
// Output rows that belong to no expert are never written.
//
// W4A8 (float8 activations, k a multiple of 128): the weights take part as e4m3 with the UE8M0
// scale folded in, relative to a per-(row, 128-k block) base b = the largest of the block's four
// scale bytes: W[n, k] = q * 2^(b-133), q = e2m1 * 2^(s-b+6) rounded to e4m3 (exact while
// s >= b - 14; below that q falls under 2^-6 and is rounded half-to-even to a multiple of 2^-9,
// possibly to 0). b = 255 (NaN) makes the whole block NaN. This is what lets a GPU kernel run the
// 128-k block as one float8 tensor-core chain with one float32 rescale (the CPU twin and the
// reference follow the same rule). The CUDA kernel may fold rows relative to one base for the
// whole row instead (Mxfp4CudaGemmParams::row_base) where that gives the same results.
#pragma once

#include <algorithm>
#include <cstdint>

#include "zeroinfer/common.h"

namespace zi {

struct Mxfp4GemmParams {
  // Activations, row-major, dtype a_dtype. Contiguous layout: [m, k]; masked layout: [num_experts,
  // cap, k]. Row stride k elements.
  const void* a = nullptr;
  // kFloat32, kBFloat16 or kFloat8E4M3 (W4A8: then a_scale is required).
  DType a_dtype = DType::kFloat32;
  // Float8 activations only: float32 per-token scales, row-major [rows of a, k/128] (contiguous:
  // [m, k/128]; masked: [num_experts, cap, k/128]); a_real[r, k] = a[r, k] * a_scale[r, k/128].
  // nullptr for float activations.
  const float* a_scale = nullptr;
  // Packed e2m1 weights [num_experts, n, k/2] bytes (checkpoint I8 viewed as raw bytes): byte j of
  // a row holds element 2j in its LOW nibble and element 2j+1 in its HIGH nibble.
  const uint8_t* w = nullptr;
  // UE8M0 block scales [num_experts, n, k/32] bytes, one per 32 consecutive k: value 2^(byte-127).
  const uint8_t* w_scale = nullptr;
  // Contiguous layout: int32 [num_experts + 1], nondecreasing, offsets[num_experts] <= m; expert
  // e's segment is [offsets[e], offsets[e+1]). nullptr selects the masked layout.
  const int32_t* expert_offsets = nullptr;
  // Contiguous layout, optional: int32 [num_experts], rows actually used at the start of each
  // segment (0 <= counts[e] <= segment size; segments may be padded to a tile). nullptr: whole
  // segments.
  const int32_t* expert_counts = nullptr;
  // Masked layout: int32 [num_experts], 0 <= masked_m[e] <= cap valid rows of A[e]. Must be nullptr
  // in the contiguous layout.
  const int32_t* masked_m = nullptr;
  // Routed layout (expert_offsets and masked_m nullptr): int32 [m], the expert of output row i
  // (a value outside [0, num_experts), e.g. -1 for an expert on another rank: row i is not
  // written); its activations are row i / route_div of A (A has m / route_div rows).
  const int32_t* route_ids = nullptr;
  int64_t route_div = 1;
  // Output, row-major, dtype out_dtype: [m, n_out] (contiguous) or [num_experts, cap, n_out]
  // (masked), n_out = fuse_swiglu ? n/2 : n. Only rows owned by an expert are written.
  void* out = nullptr;
  // kFloat32 or kBFloat16 (rounded to nearest even).
  DType out_dtype = DType::kFloat32;
  int64_t num_experts = 0;  // E >= 1: leading dim of w, w_scale, masked_m/counts, offsets (E+1)
  int64_t m = 0;            // contiguous layout: rows of a and out; routed: rows of out
  int64_t cap = 0;          // masked layout: rows per expert in a and out; ignored if contiguous
  int64_t n = 0;            // weight rows per expert (even with fuse_swiglu: gate, then up rows)
  int64_t k = 0;            // reduction length: a multiple of 32 (of 128 for float8 activations)
  // V4 gate/up GEMM (w1 ‖ w3 along n): out[r, c] = silu(min(g, λ)) * clamp(u, -λ, λ) for c < n/2,
  // g = Y[r, c], u = Y[r, c + n/2]; without a limit silu(g) * u.
  bool fuse_swiglu = false;
  bool has_swiglu_limit = false;  // only with fuse_swiglu
  float swiglu_limit = 0.f;       // λ, finite and > 0 when has_swiglu_limit
};

// CPU twin: parallel over (expert, tile of output columns) with zi::parallel_for. Throws
// std::invalid_argument on inconsistent parameters (the Python layer validates first).
void mxfp4_grouped_gemm_cpu(const Mxfp4GemmParams& p);

// ---- CUDA (sm_90a) ------------------------------------------------------------------------------
// The CUDA kernels read the weights in a one-time REPACKED layout (zeroinfer.ops.mxfp4_prepack),
// not the checkpoint layout above:
//   packed uint8 [num_experts, n_pad / 64, k_pad / 128, kMxfp4GroupStrips, kMxfp4StageBlocks,
//                 kMxfp4BlockBytes]
// i.e. per expert, per 64-row group and per 128-k stage, the group's 4 strips of 16 rows x 2
// blocks: every tile (64 or 128 rows) reads a stage as one or two contiguous 4,352-byte runs.
// (Stored strip by strip along k, a stage was four 1,088-byte pieces a quarter of the expert
// apart; the contiguous runs are 1-6% faster on the decode tiles, bench/results/h200/
// moe_gemm_NOTES.md session 24.)
// One block = 16 weight rows x 64 k: 512 bytes of e2m1 values in mma-fragment order (lane L's 16
// bytes at L*16 hold exactly its A-fragment values for the 4 k16 / 2 k32 steps of the block, bit
// layout per activation type so that each decodes cheaply)
// followed by the block's 32 UE8M0 scale bytes (8 lane groups x 4). n_pad is a multiple of
// kMxfp4PackRows, k_pad of kMxfp4PackK; padding rows/columns hold zero weights (scale byte 127).
// With gate_up_interleaved (for fuse_swiglu) each 16-row block holds gate rows 8b..8b+7 followed by
// up rows n/2 + 8b..8b+7, so a thread holds both halves of its SwiGLU pair. The exact bit layout
// is documented (and built) in python/zeroinfer/ops/moe_gemm.py (_block_maps).
constexpr int kMxfp4BlockBytes = 544;
constexpr int kMxfp4GroupStrips = 4;  // 16-row strips of a 64-row group
constexpr int kMxfp4StageBlocks = 2;  // 64-k blocks of a 128-k stage
constexpr int kMxfp4PackRows = 128;
constexpr int kMxfp4PackK = 128;
// W4A8 row bases (Mxfp4CudaGemmParams::row_base): the window of B, 133 +- 32, keeps the scaled
// accumulators within 2^32 of the per-stage ones (real checkpoints' bytes sit well inside it,
// ~110..130); 0 (the "none" mark) and 255 (NaN) lie outside it. A row's bytes must lie within
// kMxfp4RowBaseSpread of B, and the rows one decision covers are those of one float8 warpgroup.
// Spread 11, not the rule's exact range 14: within 11 no weight is an e4m3 subnormal under either
// base (0.5 * 2^(s-B+6) >= 2^-6), and the float8 wgmma does not scale chains with subnormal inputs
// exactly (H200, session 8, bench/probe_w4a8_row_base_spread.py: a spread of 14 changed 0-2 of
// ~1.2 x 10^5 outputs by 8e-8..2e-6; none at spreads 0, 4, 11 and 12).
constexpr int kMxfp4RowBaseMin = 101;
constexpr int kMxfp4RowBaseMax = 165;
constexpr int kMxfp4RowBaseSpread = 11;
constexpr int kMxfp4RowBaseGroup = 64;

struct Mxfp4CudaGemmParams {
  // Activations: kBFloat16 (W4A16) or kFloat8E4M3 (W4A8, with a_scale), layout as in
  // Mxfp4GemmParams (row stride k).
  const void* a = nullptr;
  DType a_dtype = DType::kBFloat16;
  const float* a_scale = nullptr;
  // a_scale[r, kb] is at a_scale + r * a_scale_row_stride + kb * a_scale_k_stride (elements; r the
  // flat row, expert * cap + slot when masked). Row-major [rows, k/128] is (k/128, 1); the wide
  // float8 tile copies a stage's scales of 256 consecutive rows at once, which a token-contiguous
  // ("MN-major", (1, rows)) a_scale makes one coalesced read instead of 256 strided ones.
  // Both must be set (>= 0) for float8.
  int64_t a_scale_row_stride = -1;
  int64_t a_scale_k_stride = -1;
  const uint8_t* w_packed = nullptr;  // see above
  // W4A8 only, optional: uint8 [num_experts, n_pad], one base per packed row (zeroinfer.ops.
  // mxfp4_prepack makes it; the values are trusted, and any value is memory safe). 0 or nullptr:
  // the per-stage bases b of the W4A8 rule. Nonzero: B = the row's largest scale byte, with
  // every scale byte s of the row >= B - 11 and B in [kMxfp4RowBaseMin, kMxfp4RowBaseMax]. The
  // row then folds relative to B at every stage: q' = e2m1 * 2^(s-B+6) = q * 2^(b-B), exact like
  // q, and no e4m3 subnormal under either base (s - B >= -11); the stage's wgmma partial is
  // 2^(b-B) times the per-stage one (a power-of-two scale of every product, all in float32's
  // normal range: nonzero products of e4m3 values are >= 2^-18); the kernel keeps acc' = fma(partial', a_scale, acc') = acc * 2^(133-B) and
  // multiplies by 2^(B-133) once at the end: a float32 multiply per output and stage less.
  // A power-of-two scale commutes with float32 rounding while nothing leaves the normal range,
  // so the results are bitwise those of the per-stage bases unless a running sum x of the row
  // (an fma's exact result) comes within 2^|133-B| <= 2^32 of that range's ends, i.e. only if
  // 0 < |x| < 2^-94 or |x| >= 2^96 (one path then rounds a subnormal or overflows where the
  // other does not). A 64-row group (kMxfp4RowBaseGroup, one warpgroup's rows) is all nonzero or
  // all 0, so a warpgroup takes one branch.
  const uint8_t* row_base = nullptr;
  int64_t n_pad = 0;                  // packed rows per expert (multiple of kMxfp4PackRows)
  int64_t k_pad = 0;                  // packed k (multiple of kMxfp4PackK), >= k
  bool gate_up_interleaved = false;   // must equal fuse_swiglu
  bool fp8_layout = false;            // bit layout for float8 activations (must match a_dtype)
  // Some scale byte is > 128 (2^(s-1) no longer fits bf16 when folded with the e2m1 decode bias):
  // the bf16 path then scales in two exact steps. Always safe to set.
  bool wide_scales = true;
  const int32_t* expert_offsets = nullptr;  // as in Mxfp4GemmParams (read on the device)
  const int32_t* expert_counts = nullptr;
  const int32_t* masked_m = nullptr;
  // Routed layout as in Mxfp4GemmParams: bf16 activations, m <= kMxfp4RoutedMaxRows, the decode
  // tiles only (1, 3). Every CTA reads the ids and builds the same stable (row order) expert
  // sort in shared memory that moe_dispatch would write out, so no dispatch launch precedes the
  // GEMM: at batch-1 decode that launch is ~9 us of a ~52 us MoE layer (H100,
  // dispatch_combine_NOTES.md session 26).
  const int32_t* route_ids = nullptr;
  int64_t route_div = 1;
  void* out = nullptr;
  DType out_dtype = DType::kBFloat16;
  int64_t num_experts = 0;
  int64_t m = 0;
  int64_t cap = 0;
  int64_t n = 0;  // logical weight rows per expert
  int64_t k = 0;  // logical reduction length (multiple of 32; of 128 for float8)
  bool fuse_swiglu = false;
  bool has_swiglu_limit = false;
  float swiglu_limit = 0.f;
  // 0: the plan from the shapes (mxfp4_cuda_plan); 1: small-M tile (64 weight rows x 32 tokens,
  // decode); 2: wide wgmma tile (128 x 128: large experts); 3: tiny-M tile (64 x 8, decode with
  // <= 8 rows per expert: 7 CTAs per SM); 4: wgmma tile (128 x 64: experts of a few tens of
  // rows). bf16 runs 1 and 3 on mma.sync. Float8 runs on wgmma at every tile (Hopper's
  // float8 mma.sync rounds differently). A tile other than 0 runs every expert. Every tile gives
  // bitwise the same result.
  int tile = 0;
  // The float8 tiny tile's stage loop: 0 chosen by the device (mxfp4_fp8_tiny_plain_loop), 1 the
  // plain loop (3 stages ahead), 2 the skewed loop (the wgmma chain of a stage under the wait
  // for the next; 2 ahead). Bitwise the same results; tests and A/B runs force each.
  int fp8_tiny_loop = 0;
  // The activations again (same layout and dtype) with each 16-k group's bf16 pairs in the
  // packed weights' k-slot order (slot pair q <- real pair 0,2,4,6,1,3,5,7): what the wgmma tile
  // reads for bf16. Required exactly when the plan runs tile 4 on bf16 activations
  // (zeroinfer.ops makes it in one pass); the float8 wgmma tile reads `a`.
  const void* a_kslot = nullptr;
  // Set by mxfp4_grouped_gemm_cuda for each launch of a split plan: a launch computes only the
  // experts with rows_lo <= rows < rows_hi (rows read on the device).
  int32_t rows_lo = 0;
  int32_t rows_hi = INT32_MAX;
};

// How the CUDA kernel covers the experts, from the shapes only (never from device values, so no
// host synchronisation): up to kMaxLaunches launches, launch i running tile[i] on the experts that
// turn out (on the device) to hold from_rows[i] <= rows < from_rows[i + 1] rows (the last one: no
// upper bound); each launch skips the others' experts. A tier is added only where some expert can
// reach it (m rows in all) and the work is large enough to pay for an extra launch, which costs
// ~2-3 us when it finds nothing to do. Which tile where, measured on the H200
// (bench/results/h200/moe_gemm_NOTES.md):
//   tiny (3)   for experts with <= 8 rows: 8-token tiles, 7 CTAs an SM;
//   small (1)  for 9 .. 32 (bf16) / 31 (float8) rows: 32-token tiles, so an expert of 32 rows
//              streams its weights once instead of four times through tiny tiles (skewed
//              decode: 32 tokens on 6 experts 81 -> see the notes);
//   wgmma (4)  from 33 (bf16) / 32 (float8) rows: 64-token wgmma tiles (bf16 at 48 rows: 1.25x
//              the 128-token tile, 1.6x the small one);
//   wide (2)   from 65 (bf16) / 129 (float8) rows: bf16 128-token tiles two CTAs an SM (1.27x
//              the 64-token tile at 96 rows); float8 256-token warp-specialised tiles (against
//              tile 4, session 16: 0.71x at 96 rows, 1.13-1.16x at 192, 1.05-1.10x at 384; from
//              129 rows tile 4 needs 3 tiles an expert where the wide tile needs one).
// The base tile follows the average rows per active expert (contiguous: m / E, i.e. tiny below
// 4; masked: the capacity decides alone, one launch). The tiers above it: small from 64 rows in
// all, wgmma from 256 (bf16 also pays a k-slot copy of the activations there), wide from 512
// (bf16) / 1024 (float8).
struct Mxfp4CudaPlan {
  static constexpr int kMaxLaunches = 4;
  int launches = 1;
  int tile[kMaxLaunches] = {1, 0, 0, 0};
  int64_t from_rows[kMaxLaunches] = {0, 0, 0, 0};
};

// The routed layout's largest m (its row map lives in every CTA's shared memory, 2 bytes a row,
// and one warp walks the ids 32 at a time): 42 tokens of top-6 routing.
constexpr int64_t kMxfp4RoutedMaxRows = 256;

// routed: the routed layout, which the decode tiles (tiny, small) run alone.
inline Mxfp4CudaPlan mxfp4_cuda_plan(bool fp8, bool masked, int64_t m, int64_t num_experts,
                                     int64_t cap, int requested, bool routed = false) {
  Mxfp4CudaPlan plan;
  if (requested != 0) {
    plan.tile[0] = requested;
    return plan;
  }
  constexpr int64_t kSmallRows = 9;     // the tiny tile holds 8 tokens
  constexpr int64_t kSmallMinM = 64;    // fewest rows in all for a small-tile tier launch
  constexpr int64_t kTinyBaseAvg = 4;   // the base tile is tiny below this many rows an expert
  // The base tile from the average over all E experts (tiny below 4: at 4 most active experts
  // hold <= 8 rows).
  const int64_t avg = m / (num_experts > 0 ? num_experts : 1);
  if (routed) {  // tiny, plus small for experts of >= kSmallRows rows where m allows one
    plan.tile[0] = avg < kTinyBaseAvg ? 3 : 1;
    if (plan.tile[0] == 3 && m >= kSmallMinM) {
      plan.tile[1] = 1;
      plan.from_rows[1] = kSmallRows;
      plan.launches = 2;
    }
    return plan;
  }
  const int64_t wgmma_rows = fp8 ? 32 : 33;
  const int64_t wide_rows = fp8 ? 129 : 65;
  const int64_t wide_min_m = fp8 ? 1024 : 512;
  // Tiers by the rows an expert holds: (first row count, tile, fewest rows in all for the tier
  // to be worth its own launch).
  struct Tier {
    int64_t from;
    int tile;
    int64_t min_m;
  };
  const Tier tiers[4] = {{0, 3, 0}, {kSmallRows, 1, kSmallMinM}, {wgmma_rows, 4, 256},
                         {wide_rows, 2, wide_min_m}};
  auto tier_of = [&](int64_t rows) {
    int i = 0;
    while (i + 1 < 4 && rows >= tiers[i + 1].from) ++i;
    return i;
  };
  if (masked) {  // every expert is cap rows wide: one tile
    plan.tile[0] = tiers[tier_of(cap)].tile;
    return plan;
  }
  // The base tile from the average, then a launch for each higher tier some expert can reach.
  const int base = avg < kTinyBaseAvg ? 0 : std::max(1, tier_of(avg));
  plan.tile[0] = tiers[base].tile;
  for (int i = base + 1; i < 4; ++i) {
    if (m < tiers[i].from || m < tiers[i].min_m) continue;
    plan.tile[plan.launches] = tiers[i].tile;
    plan.from_rows[plan.launches] = tiers[i].from;
    ++plan.launches;
  }
  return plan;
}

inline bool mxfp4_plan_uses(const Mxfp4CudaPlan& plan, int tile) {
  for (int i = 0; i < plan.launches; ++i)
    if (plan.tile[i] == tile) return true;
  return false;
}

// Largest num_experts the CUDA kernel takes (its per-CTA schedule lives in shared memory).
constexpr int64_t kMxfp4CudaMaxExperts = 2048;

// Launches on `stream` (a cudaStream_t); no host synchronisation, no allocation. Row counts are
// read on the device (clamped into range, so bad routing values cannot fault).
void mxfp4_grouped_gemm_cuda(const Mxfp4CudaGemmParams& p, void* stream);

// Whether the float8 tiny tile runs its plain stage loop on the current device (requested: as
// Mxfp4CudaGemmParams::fp8_tiny_loop; 0 asks the device).
bool mxfp4_fp8_tiny_plain_loop(int requested);

}  // namespace zi
