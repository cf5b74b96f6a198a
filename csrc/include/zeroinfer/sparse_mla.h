// Sparse MLA attention (DeepSeek-V4): every query head attends to ONE shared K=V head of 512
// dims over a list of cache slots per query token, optionally a second ("extra") cache with its
// own list, with an optional per-head attention sink in the softmax denominator.
//
//   s_hj  = softmax_scale * (q_h . k_j)                       float32 accumulation
//   out_h = sum_j exp(s_hj) k_j / (sum_j exp(s_hj) + exp(sink_h))
//   lse_h = log(sum_j exp(s_hj))                              (sink NOT included)
// j runs over the valid slots (!= -1) of both lists; a token with none gets out = 0, lse = -inf.
//
// The Python op (python/zeroinfer/ops/sparse_mla.py) validates every argument first; the
// ZI_CHECKs in the kernel are only a last line of defence.
#pragma once

#include <cstdint>

#include "zeroinfer/common.h"

namespace zi {

constexpr int64_t kSparseMlaDim = 512;         // K = V head dim: 448 NoPE + 64 RoPE values
constexpr int64_t kSparseMlaNopeDim = 448;     // FP8 (e4m3fn) part of the V4 FP8 layout
constexpr int64_t kSparseMlaRopeDim = 64;      // bf16 part of the V4 FP8 layout
constexpr int64_t kSparseMlaScaleGroup = 64;   // NoPE values per UE8M0 scale (7 groups)
constexpr int64_t kFp8KvRowBytes = 576;        // 448 e4m3 bytes + 64 bf16 (128 bytes)
constexpr int64_t kFp8KvScaleBytes = 8;        // 7 UE8M0 bytes + 1 pad byte
constexpr int64_t kFp8KvBytesPerToken = 584;   // kFp8KvRowBytes + kFp8KvScaleBytes

// One paged cache and the index list that selects its slots.
struct SparseMlaCache {
  // Base of the cache; block b starts at (const uint8_t*)data + b * block_stride_bytes.
  //   dtype kFloat32 / kBFloat16: block = [block_size, 512] values, token rows contiguous.
  //   dtype kUInt8 (V4 FP8 "MODEL1" layout), block = block_size * 584 bytes:
  //     bytes [t*576, t*576+448)          token t's 448 NoPE values, float8_e4m3fn
  //     bytes [t*576+448, t*576+576)      token t's 64 RoPE values, bfloat16 little-endian
  //     bytes [block_size*576 + t*8, +7)  7 UE8M0 scales (2^(byte-127)), NoPE value i uses i/64
  //     byte  block_size*576 + t*8 + 7    pad
  const void* data = nullptr;
  DType dtype = DType::kFloat32;     // kFloat32, kBFloat16 or kUInt8 (the FP8 layout above)
  int64_t num_blocks = 0;            // blocks in the cache; num_slots = num_blocks * block_size
  int64_t block_size = 0;            // tokens per block (>= 1)
  int64_t block_stride_bytes = 0;    // bytes between consecutive blocks (>= one block's bytes)
  // [num_tokens, topk] int32: row t at indices + t * indices_stride. Entry = slot =
  // block * block_size + offset in [0, num_slots), or -1 = skip. Duplicates count twice.
  const int32_t* indices = nullptr;
  int64_t topk = 0;                  // entries per row (any value >= 0)
  int64_t indices_stride = 0;        // elements between rows of indices (>= topk)
};

struct SparseMlaParams {
  // [num_tokens, num_heads, 512] in q_dtype; element (t, h, d) at t*q_stride_token +
  // h*q_stride_head + d (the 512 dims are contiguous).
  const void* q = nullptr;
  DType q_dtype = DType::kFloat32;   // kFloat32 or kBFloat16; out has the same dtype
  int64_t num_tokens = 0;            // T (may be 0)
  int64_t num_heads = 0;             // H (>= 1)
  int64_t q_stride_token = 0;        // elements
  int64_t q_stride_head = 0;         // elements (>= 512)

  SparseMlaCache kv;                 // main cache (V4: sliding-window cache)
  bool has_extra = false;            // whether extra_kv is used
  SparseMlaCache extra_kv;           // extra cache (V4: compressed entries); same dtype kind

  const float* attn_sink = nullptr;  // [num_heads] float32 logits, or nullptr for no sink
  float softmax_scale = 1.f;         // finite, > 0

  // [num_tokens, num_heads, 512] in q_dtype, written completely; (t, h, d) at
  // t*out_stride_token + h*out_stride_head + d.
  void* out = nullptr;
  int64_t out_stride_token = 0;      // elements
  int64_t out_stride_head = 0;       // elements (>= 512)
  // [num_tokens, num_heads] float32 natural-log sum of exp(scores), written completely;
  // (t, h) at t*lse_stride_token + h.
  float* lse = nullptr;
  int64_t lse_stride_token = 0;      // elements (>= num_heads)
};

// The CPU twin: parallel over (query token, group of heads) work items with zi::parallel_for.
// Throws std::invalid_argument (via ZI_CHECK) on inconsistent parameters or a slot out of range.
void sparse_mla_attention_cpu(const SparseMlaParams& p);

// ---- CUDA (sm_90a; built only with nvcc) -----------------------------------------------------
// The kernel takes q in bfloat16 and a bfloat16 or FP8-layout cache (the Python op routes other
// dtype combinations elsewhere). Each query token's list (main then extra) is cut into
// `num_splits` pieces of `tiles_per_split` 64-entry tiles when there are too few (token, head
// group) work items to fill the GPU; the pieces are merged by a second, deterministic kernel.
struct SparseMlaCudaPlan {
  int64_t num_splits = 1;
  int64_t tiles_per_split = 1;
  int64_t workspace_floats = 0;  // float32 scratch the caller allocates (0: none needed)
  int h16 = 0;  // up to 16 heads over the FP8 cache: the K-in-registers kernel's entries a tile
                // (64: one CTA an SM, 32: two); 0: not that kernel
};

// The plan depends on shapes only (never on device values), so launches need no host sync.
// fp8: the cache is in the FP8 layout (up to 16 heads then run the K-in-registers kernel: on
// 64-entry tiles for grids of up to one wave, on 32-entry tiles, two CTAs an SM, beyond). h16: -1
// chooses by the grid; 0 (the one-tile kernel) / 32 / 64 force the choice (tests run every kernel
// on one input).
SparseMlaCudaPlan sparse_mla_cuda_plan(int64_t num_tokens, int64_t num_heads, int64_t total_topk,
                                       int64_t num_sms, bool fp8 = false, int h16 = -1);

// Requirements (checked by the Python op): q rows, cache blocks and out rows 16-byte aligned
// (strides in elements multiples of 8, cache block stride a multiple of 16 bytes); `workspace`
// holds plan.workspace_floats floats; `stream` is a cudaStream_t.
void sparse_mla_attention_cuda(const SparseMlaParams& p, const SparseMlaCudaPlan& plan,
                               float* workspace, void* stream);

}  // namespace zi
