// V4's MoE router after its linear layer, in one launch (it was ~12 torch calls a layer):
//   s[e]   = sqrt(softplus(logits[t, e]))          "sqrtsoftplus", each op rounded to the logits'
//                                                  dtype (HF computes the scores in it)
//   learned routing:  ids = the k experts of largest s[e] + bias[e] (float32; the bias chooses,
//                     it does not weigh), in descending order, ties to the lower expert index
//   hash routing:     ids = table[input_ids[t]]    (V4's first layers: a frozen token-id table)
//   w[j]   = s[ids[j]] / (sum_j s[ids[j]] + 1e-20) * scale     sum in slot order, in float32,
//                                                  then each step rounded to the logits' dtype
// softplus is torch's: x above 20 passes through, else log1p(exp(x)). A token's result depends
// on its own row alone (batch-invariant). The CPU twin and the CUDA kernel (a warp a token) run
// these operations in this order; only exp / log1p may differ by an ulp between the two.
// Reference: zeroinfer.reference.moe_route.
#pragma once

#include <cmath>
#include <cstdint>

#include "zeroinfer/common.h"
#include "zeroinfer/numeric.h"

namespace zi {

constexpr int kMoeRouteMaxExperts = 512;
constexpr int kMoeRouteMaxTopK = 16;

struct MoeRouteParams {
  int64_t num_tokens;         // T
  int32_t experts;            // E, 1..kMoeRouteMaxExperts
  int32_t k;                  // 1..min(E, kMoeRouteMaxTopK) (hash: the table's columns)
  DType dtype;                // of logits: float32 or bfloat16
  float scale;                // routed_scaling_factor
  const void* logits;         // [T, E], rows logits_stride apart
  const float* bias;          // [E] learned routing's selection bias, or null with a table
  const int64_t* table;       // [V, k] hash routing's expert table, or null
  const int64_t* input_ids;   // [T] the tokens (hash routing), values in [0, V)
  int64_t vocab;              // V (hash routing)
  int32_t* ids;               // [T, k] out
  float* weights;             // [T, k] out
  int64_t logits_stride;      // elements from one token's logits to the next (>= E)
};

// The score of a logit, rounded as torch rounds each op in the logits' dtype T.
template <class T>
ZI_HD float moe_route_score(T logit) {
  const float x = to_float(logit);
  const float sp = x > 20.f ? x : log1p_f(exp_f(x));
  return round_to<T>(sqrt_rn(round_to<T>(sp)));
}

// Whether selection key (a, ea) ranks before (b, eb): larger first (NaN largest, as torch.topk
// ranks it), equal keys by the lower expert index.
ZI_HD bool moe_route_before(float a, int ea, float b, int eb) {
  const bool na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || ea < eb);
  return a > b || (a == b && ea < eb);
}

// The weights of a token's k chosen experts from their scores s_j (slot order): the scores'
// sum in slot order makes the denominator, then each weight is its own score's (the CUDA kernel
// makes weight j on lane j).
template <class T>
ZI_HD float moe_route_denom(float sum) {
  return round_to<T>(add_rn(round_to<T>(sum), 1e-20f));
}

template <class T>
ZI_HD float moe_route_weight(float s, float denom, float scale) {
  return round_to<T>(mul_rn(round_to<T>(div_rn(s, denom)), scale));
}

// The sizes both implementations need (the op checks them first, with named errors).
inline void moe_route_check_sizes(const MoeRouteParams& p) {
  ZI_CHECK(p.experts >= 1 && p.experts <= kMoeRouteMaxExperts && p.k >= 1 &&
               p.k <= kMoeRouteMaxTopK && (p.table != nullptr || p.k <= p.experts),
           "moe_route: bad sizes");
}

void moe_route_cpu(const MoeRouteParams& p);
void moe_route_cuda(const MoeRouteParams& p, void* stream);

}  // namespace zi
