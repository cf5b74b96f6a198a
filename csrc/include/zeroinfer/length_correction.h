// Device-side length correction of the zero-overhead (one-round-ahead) scheduler.
//
// Round N+1 is laid out by the CPU before round N's sampled tokens are known. The CPU assumed
// that round N commits `assumed_accepted[i]` tokens for row i and reserved cu_q[i+1]-cu_q[i]
// token slots for it. Given round N's real results (still on the device), for each row i with
// p = remap[i] >= 0 (its row in round N):
//     delta  = prev_num_accepted[p] - assumed_accepted[i]
//     q_opt  = cu_q[i+1] - cu_q[i]
//     q      = min(q_opt, prev_num_next[p], prev_width)
//     q_len[i]  = q
//     k_len[i]  = k_len_in[i] + delta - (q_opt - q)
//     token j < q  : position += delta, input_id = prev_next_tokens[p][j]
//     token j >= q : position = -1, input_id = 0      (an unused slot; the model skips it)
// Rows with remap = -1 (fresh, or anything the CPU knows exactly) are copied unchanged with
// q_len = q_opt. A remap entry outside [-1, num_prev_rows) is treated as -1 (the Python layer
// rejects it before the call; the kernel only refuses to read out of bounds).
#pragma once

#include <cstdint>

namespace zi {

struct LengthCorrectionParams {
  int64_t num_rows;                   // R: rows of round N+1
  int64_t num_prev_rows;              // R_prev: rows of round N
  int64_t prev_width;                 // S: columns of prev_next_tokens
  int64_t num_tokens;                 // cu_q[R]
  const int32_t* remap;               // [R] row of round N, or -1
  const int32_t* assumed_accepted;    // [R] tokens the CPU assumed round N commits for row i
  const int32_t* prev_num_accepted;   // [R_prev] tokens round N really committed
  const int32_t* prev_next_tokens;    // [R_prev, S] next input tokens round N produced
  const int32_t* prev_num_next;       // [R_prev] valid entries per row of prev_next_tokens
  const int32_t* cu_q;                // [R + 1] token slot layout of round N+1 (fixed)
  const int32_t* k_len_in;            // [R] optimistic key lengths
  const int32_t* positions_in;        // [num_tokens] optimistic positions
  const int32_t* input_ids_in;        // [num_tokens] CPU-known input ids (fresh rows)
  int32_t* q_len;                     // [R] out
  int32_t* k_len;                     // [R] out
  int32_t* positions;                 // [num_tokens] out
  int32_t* input_ids;                 // [num_tokens] out
};

void correct_lengths_cpu(const LengthCorrectionParams& p);
void correct_lengths_cuda(const LengthCorrectionParams& p, void* stream);

}  // namespace zi
