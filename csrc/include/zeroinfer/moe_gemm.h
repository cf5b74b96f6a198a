// MXFP4 grouped GEMM for the routed experts of DeepSeek-V4 (W4A16 / W4A8 / W4A32).
//
// Per expert e: Y_e = A_e @ W_eᵀ with W_e[n, k] = e2m1(nibble(e,n,k)) * 2^(w_scale[e,n,k/32]-127),
// accumulated in float32, optionally followed by the V4 clipped SwiGLU over the concatenated
// gate ‖ up halves of N. The rows of A that belong to expert e come in one of two layouts:
//   contiguous: A [m, k], expert e owns rows [offsets[e], offsets[e] + count_e)  (moe_dispatch)
//   masked:     A [E, cap, k], expert e owns rows [0, masked_m[e]) of A[e]  (per-expert capacity)
// Output rows that belong to no expert are never written.
#pragma once

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
  // Output, row-major, dtype out_dtype: [m, n_out] (contiguous) or [num_experts, cap, n_out]
  // (masked), n_out = fuse_swiglu ? n/2 : n. Only rows owned by an expert are written.
  void* out = nullptr;
  // kFloat32 or kBFloat16 (rounded to nearest even).
  DType out_dtype = DType::kFloat32;
  int64_t num_experts = 0;  // E >= 1: leading dim of w, w_scale, masked_m/counts, offsets (E+1)
  int64_t m = 0;            // contiguous layout: rows of a and out; ignored in the masked layout
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

}  // namespace zi
