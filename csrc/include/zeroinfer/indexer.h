// The lightning indexer's scores over the paged index-key cache (V4's CSA layers; DeepGEMM's
// "paged MQA logits"). Query token t belongs to sequence seq[t] and sees its first visible[t]
// compressed entries (clamped to [0, n]); for entry s of its sequence
//     score(t, s) = scale * sum_h w[t, h] * relu(q[t, h] . k(seq[t], s))     s < visible[t]
//     score(t, s) = -inf                                                     visible[t] <= s < n
// with k(b, s) the key in cache slot table[b, s / block] * block + s % block.
//
// Every sum runs in one fixed order - each dot over the d channels ascending from 0, then the
// heads ascending from 0, the final product by `scale` last - and every product and sum rounds on
// its own (numeric.h's mul_rn / add_rn; the CPU file is built with -ffp-contract=off). So a row's
// scores depend on its own inputs alone, whatever the batch around it (the top-k picked from
// them must not change with the batch: tests/model/test_batch_invariance.py), and the CPU twin
// and the CUDA kernel's CUDA-core form agree bitwise. The exception: bf16 keys with d a multiple
// of 16 up to 128 (V4's) run on tensor cores (csrc/cuda/indexer.cu), whose sums go in the MMA's
// own order - still one fixed order for every row whatever the batch, float32 accuracy, but not
// the CPU twin's bits. relu keeps NaN, as torch's does. A sequence index outside
// [0, num_seqs) or a negative cache block below visible[t] gives NaN, read from nowhere (the
// CUDA op cannot check the tables' values without a host synchronisation).
// Reference: zeroinfer.reference.indexer.
#pragma once

#include <cstdint>

#include "zeroinfer/common.h"
#include "zeroinfer/numeric.h"

namespace zi {

struct IndexerScoresParams {
  int64_t num_tokens;    // T
  int64_t heads;         // H
  int64_t dim;           // d
  int64_t num_entries;   // n: columns of out
  int64_t num_seqs;      // rows of table
  int64_t table_stride;  // elements between table rows (its blocks a sequence)
  int64_t block_size;    // entries a cache block
  DType key_dtype;       // float32 or bfloat16
  bool index64;          // seq and visible int64 (else int32)
  float scale;
  const float* q;        // [T, H, d]
  const float* weights;  // [T, H]
  const void* keys;      // [num_blocks, block_size, d]
  const int32_t* table;  // [num_seqs, table_stride]
  const void* seq;       // [T]
  const void* visible;   // [T]
  float* out;            // [T, n]
};

namespace indexer_detail {

ZI_HD int64_t index_at(const IndexerScoresParams& p, const void* v, int64_t t) {
  return p.index64 ? static_cast<const int64_t*>(v)[t] : static_cast<const int32_t*>(v)[t];
}

}  // namespace indexer_detail

// relu that keeps NaN (torch.relu's).
ZI_HD float relu_keep_nan(float x) { return x > 0.f || x != x ? x : 0.f; }

// One head's term of the score: acc + w * relu(dot), each step rounded.
ZI_HD float indexer_head_term(float acc, float w, float dot) {
  return add_rn(acc, mul_rn(w, relu_keep_nan(dot)));
}

// Entries token t sees: visible[t] clamped to [0, n].
ZI_HD int64_t indexer_visible(const IndexerScoresParams& p, int64_t t) {
  const int64_t v = indexer_detail::index_at(p, p.visible, t);
  return v < 0 ? 0 : v > p.num_entries ? p.num_entries : v;
}

// The element offset of entry s's key of token t's sequence in `keys`, or -1 where the sequence
// index or the cache block is out of range (s < visible[t], so s / block < table_stride).
ZI_HD int64_t indexer_key_offset(const IndexerScoresParams& p, int64_t t, int64_t s) {
  const int64_t b = indexer_detail::index_at(p, p.seq, t);
  if (b < 0 || b >= p.num_seqs) return -1;
  const int32_t block = p.table[b * p.table_stride + s / p.block_size];
  if (block < 0) return -1;
  return (static_cast<int64_t>(block) * p.block_size + s % p.block_size) * p.dim;
}

void indexer_scores_cpu(const IndexerScoresParams& p);
void indexer_scores_cuda(const IndexerScoresParams& p, void* stream);

}  // namespace zi
