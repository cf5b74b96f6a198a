// CPU twin of the indexer scores (contract in zeroinfer/indexer.h). Built with -ffp-contract=off
// (CMakeLists.txt): every product and sum rounds on its own, in the contract's order, so the
// results are the CUDA kernel's bits. Entries go 32 at a time, each with its own dot chain: the
// compiler vectorises across them without reordering any one chain (32 lanes keep several vector
// chains in flight: 10x the speed of 8 on this CPU, faster than torch's BLAS path at decode).
#include <limits>
#include <vector>

#include "zeroinfer/indexer.h"
#include "zeroinfer/parallel.h"

namespace zi {

namespace {

constexpr int64_t kLanes = 32;

template <class K>
void score_row(const IndexerScoresParams& p, int64_t t, std::vector<float>& kt) {
  const K* keys = static_cast<const K*>(p.keys);
  const float* q = p.q + t * p.heads * p.dim;
  const float* w = p.weights + t * p.heads;
  float* out = p.out + t * p.num_entries;
  const int64_t visible = indexer_visible(p, t);
  for (int64_t s0 = 0; s0 < visible; s0 += kLanes) {
    const int64_t lanes = visible - s0 < kLanes ? visible - s0 : kLanes;
    bool bad[kLanes] = {};
    for (int64_t j = 0; j < kLanes; ++j) {  // kt[i * 8 + j]: channel i of entry s0 + j
      const int64_t off = j < lanes ? indexer_key_offset(p, t, s0 + j) : -1;
      bad[j] = off < 0;
      for (int64_t i = 0; i < p.dim; ++i)
        kt[i * kLanes + j] = off < 0 ? 0.f : to_float(keys[off + i]);
    }
    float acc[kLanes] = {};
    for (int64_t h = 0; h < p.heads; ++h) {
      float dot[kLanes] = {};
      const float* qh = q + h * p.dim;
      for (int64_t i = 0; i < p.dim; ++i)
        for (int64_t j = 0; j < kLanes; ++j)
          dot[j] = add_rn(dot[j], mul_rn(qh[i], kt[i * kLanes + j]));
      for (int64_t j = 0; j < kLanes; ++j) acc[j] = indexer_head_term(acc[j], w[h], dot[j]);
    }
    for (int64_t j = 0; j < lanes; ++j)
      out[s0 + j] = bad[j] ? std::numeric_limits<float>::quiet_NaN() : mul_rn(acc[j], p.scale);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t s = visible; s < p.num_entries; ++s) out[s] = neg_inf;
}

}  // namespace

void indexer_scores_cpu(const IndexerScoresParams& p) {
  ZI_CHECK(p.heads >= 1 && p.dim >= 1 && p.block_size >= 1 && p.num_entries >= 0,
           "indexer_scores: bad sizes");
  ZI_CHECK(p.num_entries <= p.table_stride * p.block_size,
           "indexer_scores: more entries than the table covers");
  dispatch_float_or_bf16(p.key_dtype, "indexer_scores: keys must be float32 or bfloat16",
                         [&](auto type) {
    using K = decltype(type);
    parallel_for(p.num_tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kt(p.dim * kLanes);
      for (int64_t t = begin; t < end; ++t) score_row<K>(p, t, kt);
    });
  });
}

}  // namespace zi
