// MoE dispatch / combine on one device.
//
// dispatch: router top-k ids -> an expert-sorted row order. Expert e owns rows
//   [expert_offsets[e], expert_offsets[e] + expert_counts[e]); each expert's segment starts at
//   a multiple of `tile` (the grouped GEMM's M tile), so segments are padded up to the tile.
//   Inside a segment rows are in (token, k-slot) order: the order is a pure function of the
//   ids, whatever the thread count or GPU schedule (batch-invariant, deterministic).
//   Output sizes are fixed upper bounds (capacity = T*k + min(E, T*k)*(tile-1)), known without reading
//   the ids, so the GPU path never syncs with the host. Rows past a segment's count hold no
//   token: row_token = -1 there and their activation rows are NOT written.
//
// combine: out[t] = sum_{j=0..k-1} w[t,j] * expert_out[token_row[t,j]], summed in j order in
//   float32 (fixed order: batch-invariant). token_row = -1 (a dropped / non-local id) adds 0.
#pragma once

#include <cstdint>

#include "zeroinfer/common.h"

namespace zi {

struct MoeDispatchParams {
  const void* x;            // [T, D] activations, x_dtype, rows contiguous
  DType x_dtype;            // float32 | bfloat16 | float8_e4m3fn (raw 1-byte copy)
  const void* topk_ids;     // [T, k] ids_dtype; -1 = not routed here; else in [0, E)
  DType ids_dtype;          // int32 | int64
  int64_t num_tokens;       // T
  int64_t hidden;           // D
  int64_t topk;             // k
  int64_t num_experts;      // E
  int64_t tile;             // segment alignment (>= 1)
  int64_t capacity;         // rows of the outputs: T*k + min(E, T*k)*(tile-1)
  void* sorted_x;           // [capacity, D] x_dtype: row r = x[row_token[r]]
  int32_t* row_token;       // [capacity] source token of each row, -1 for padding
  int32_t* token_row;       // [T, k] row holding (t, j), -1 when topk_ids[t, j] == -1
  int32_t* expert_counts;   // [E] routed (t, j) pairs per expert
  int32_t* expert_offsets;  // [E + 1] tile-aligned segment starts; [E] = rows in use
};

struct MoeCombineParams {
  const void* expert_out;   // [rows, D] expert outputs in dispatch order
  DType expert_out_dtype;   // float32 | bfloat16
  // [T, k] from dispatch; with `routed`, the routing ids themselves: expert_out then has T*k rows
  // in (token, slot) order (mxfp4_grouped_gemm's routed layout), slot (t, j) reads row t*k + j,
  // or nothing where the id is < 0.
  const int32_t* token_row;
  const void* weights;      // [T, k] routing weights, weights_dtype
  DType weights_dtype;      // float32 | bfloat16
  int64_t rows;             // rows of expert_out (for bounds checks)
  int64_t num_tokens;       // T
  int64_t hidden;           // D
  int64_t topk;             // k
  void* out;                // [T, D] out_dtype
  DType out_dtype;          // float32 | bfloat16
  bool routed = false;
};

int64_t moe_dispatch_capacity(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t tile);

void moe_dispatch_cpu(const MoeDispatchParams& p);
void moe_combine_cpu(const MoeCombineParams& p);

// CUDA: `workspace` holds at least moe_dispatch_workspace_bytes(T, k, E) bytes (the caller
// allocates it, e.g. from torch's caching allocator); `stream` is a cudaStream_t.
int64_t moe_dispatch_workspace_bytes(int64_t num_tokens, int64_t topk, int64_t num_experts);
void moe_dispatch_cuda(const MoeDispatchParams& p, void* workspace, void* stream);
void moe_combine_cuda(const MoeCombineParams& p, void* stream);

}  // namespace zi
