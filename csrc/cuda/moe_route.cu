// CUDA MoE router (contract in zeroinfer/moe_route.h): a warp a token, 4 tokens a CTA. Lane l
// scores experts l, l + 32, ..; each of the k picks is a warp argmax over the (key, expert)
// pairs in the contract's order (5 shuffle steps), and lane 0 makes the weights from the
// chosen scores in slot order - the CPU twin's operations, so the same bits but for exp / log1p.
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/moe_route.h"

namespace zi {
namespace {

constexpr int kWarps = 4;
constexpr int kPerLane = kMoeRouteMaxExperts / 32;

template <class T>
__global__ void __launch_bounds__(32 * kWarps) moe_route_kernel(MoeRouteParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;  // (whole warps)
  const int lane = threadIdx.x & 31;
  constexpr unsigned kAll = 0xffffffffu;
  const T* logits = static_cast<const T*>(p.logits) + t * p.logits_stride;
  float s[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    s[i] = e < p.experts ? moe_route_score<T>(logits[e]) : 0.f;
  }
  // The score of expert e, from the lane that holds it (every lane asks for the same e).
  auto score_of = [&](int e) {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (i == (e >> 5)) v = s[i];
    return __shfl_sync(kAll, v, e & 31);
  };
  int chosen[kMoeRouteMaxTopK];
  bool ok = true;  // a hash row's ids are experts and the token id indexes the table
  if (p.table) {
    const int64_t tok = p.input_ids[t];
    ok = tok >= 0 && tok < p.vocab;
    for (int j = 0; j < p.k; ++j) {
      const int64_t e = ok ? p.table[tok * p.k + j] : -1;
      ok = ok && e >= 0 && e < p.experts;
      chosen[j] = static_cast<int>(e);
    }
  } else {
    float key[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      key[i] = e < p.experts ? add_rn(s[i], p.bias[e]) : 0.f;
    }
    unsigned picked = 0;  // bit i: expert lane + 32 i taken
    for (int j = 0; j < p.k; ++j) {
      int best = -1;
      float best_key = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e < p.experts && !(picked >> i & 1u) &&
            (best < 0 || moe_route_before(key[i], e, best_key, best))) {
          best = e;
          best_key = key[i];
        }
      }
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) {
        const float o_key = __shfl_xor_sync(kAll, best_key, off);
        const int o_e = __shfl_xor_sync(kAll, best, off);
        if (o_e >= 0 && (best < 0 || moe_route_before(o_key, o_e, best_key, best))) {
          best = o_e;
          best_key = o_key;
        }
      }
      if ((best & 31) == lane) picked |= 1u << (best >> 5);
      chosen[j] = best;
    }
  }
  float w[kMoeRouteMaxTopK];
  for (int j = 0; j < p.k; ++j) w[j] = score_of(ok ? chosen[j] : 0);
  if (lane == 0) {
    moe_route_weights<T>(w, p.k, p.scale);
    for (int j = 0; j < p.k; ++j) {
      p.ids[t * p.k + j] = ok ? chosen[j] : -1;
      p.weights[t * p.k + j] = ok ? w[j] : __int_as_float(0x7fc00000);
    }
  }
}

}  // namespace

void moe_route_cuda(const MoeRouteParams& p, void* stream) {
  ZI_CHECK(p.experts >= 1 && p.experts <= kMoeRouteMaxExperts && p.k >= 1 &&
               p.k <= kMoeRouteMaxTopK && (p.table != nullptr || p.k <= p.experts),
           "moe_route: bad sizes");
  if (p.num_tokens == 0) return;
  const int64_t blocks = (p.num_tokens + kWarps - 1) / kWarps;
  ZI_CHECK(blocks <= 0x7fffffff, "moe_route: too many tokens for one launch");
  dispatch_float_or_bf16(p.dtype, "moe_route: logits must be float32 or bfloat16",
                         [&](auto type) {
    moe_route_kernel<decltype(type)><<<static_cast<unsigned>(blocks), 32 * kWarps, 0,
                                       static_cast<cudaStream_t>(stream)>>>(p);
  });
  ZI_CUDA_CHECK_LAUNCH("moe_route");
}

}  // namespace zi
