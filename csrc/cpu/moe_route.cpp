// CPU twin of the MoE router (contract in zeroinfer/moe_route.h): a token at a time, its scores,
// then k passes picking the best unpicked expert, then the weights. Built with
// -ffp-contract=off.
#include "zeroinfer/moe_route.h"
#include "zeroinfer/parallel.h"

namespace zi {

namespace {

template <class T>
void route_token(const MoeRouteParams& p, int64_t t) {
  const T* logits = static_cast<const T*>(p.logits) + t * p.logits_stride;
  float s[kMoeRouteMaxExperts];
  for (int e = 0; e < p.experts; ++e) s[e] = moe_route_score<T>(logits[e]);
  int32_t* ids = p.ids + t * p.k;
  if (p.table) {  // (the op checked the token ids and the rows they pick)
    const int64_t* row = p.table + p.input_ids[t] * p.k;
    for (int j = 0; j < p.k; ++j) ids[j] = static_cast<int32_t>(row[j]);
  } else {
    float key[kMoeRouteMaxExperts];
    for (int e = 0; e < p.experts; ++e) key[e] = add_rn(s[e], p.bias[e]);
    bool picked[kMoeRouteMaxExperts] = {};
    for (int j = 0; j < p.k; ++j) {
      int best = -1;
      for (int e = 0; e < p.experts; ++e)
        if (!picked[e] && (best < 0 || moe_route_before(key[e], e, key[best], best))) best = e;
      picked[best] = true;
      ids[j] = best;
    }
  }
  float sum = 0.f;
  for (int j = 0; j < p.k; ++j) sum = add_rn(sum, s[ids[j]]);
  const float denom = moe_route_denom<T>(sum);
  for (int j = 0; j < p.k; ++j)
    p.weights[t * p.k + j] = moe_route_weight<T>(s[ids[j]], denom, p.scale);
}

}  // namespace

void moe_route_cpu(const MoeRouteParams& p) {
  moe_route_check_sizes(p);
  dispatch_float_or_bf16(p.dtype, "moe_route: logits must be float32 or bfloat16",
                         [&](auto type) {
    using T = decltype(type);
    parallel_for(p.num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) route_token<T>(p, t);
    });
  });
}

}  // namespace zi
