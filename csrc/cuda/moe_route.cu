// CUDA MoE router (contract in zeroinfer/moe_route.h): a warp a token, 4 tokens a CTA. Lane l
// scores experts l, l + 32, ..; each of the k picks is a warp argmax over the (key, expert)
// pairs in the contract's order (5 shuffle steps), and lane j keeps pick j. Every lane sums the
// chosen scores in slot order (shuffles), lane j makes and writes weight j - the CPU twin's
// operations, so the same bits but for exp / log1p. No array is indexed by a runtime value, so
// nothing lives in local memory.
#include <cuda_runtime.h>

#include "check.cuh"
#include "zeroinfer/moe_route.h"

namespace zi {
namespace {

constexpr int kWarps = 4;

// kPerLane: experts a lane, 32 * kPerLane >= E (the launch picks the least of 2, 4, 8, 16: a
// lane's scores and its scan at every pick cost in proportion, the slots past E too).
template <class T, int kPerLane>
__global__ void __launch_bounds__(32 * kWarps) moe_route_kernel(MoeRouteParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;  // (whole warps)
  const int lane = threadIdx.x & 31;
  constexpr unsigned kAll = 0xffffffffu;
  const T* logits = static_cast<const T*>(p.logits) + t * p.logits_stride;
  // Every load first, the scores after: with a load inside each score's branch the compiler
  // issued them one by one, a round trip to memory each (15.0 -> 9.5 us a call on the H100 at
  // 1 to 512 tokens).
  T raw[kPerLane];
  float bias[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    const bool in = e < p.experts;
    raw[i] = in ? logits[e] : T{};
    bias[i] = in && p.bias ? p.bias[e] : 0.f;
  }
  float s[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    s[i] = lane + 32 * i < p.experts ? moe_route_score<T>(raw[i]) : 0.f;
  // Lane j < k's pick (an expert id, or -1 for a bad hash row) and whether the token's row is
  // good (hash routing: the token id indexes the table, its entries are experts).
  int mine = -1;
  bool ok = true;
  if (p.table) {
    const int64_t tok = p.input_ids[t];
    const bool tok_ok = tok >= 0 && tok < p.vocab;
    const int64_t e = tok_ok && lane < p.k ? p.table[tok * p.k + lane] : 0;
    ok = __all_sync(kAll, tok_ok && e >= 0 && e < p.experts);
    mine = lane < p.k ? static_cast<int>(e) : -1;
  } else {
    float key[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      key[i] = e < p.experts ? add_rn(s[i], bias[i]) : 0.f;
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
      if (lane == j) mine = best;
    }
  }
  // Lane j's chosen score: every lane reads slot i of its pick's lane, keeping i = pick / 32.
  const int src = ok && mine >= 0 ? mine : 0;
  float score = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const float v = __shfl_sync(kAll, s[i], src & 31);
    if (i == src >> 5) score = v;
  }
  float sum = 0.f;
  for (int j = 0; j < p.k; ++j) sum = add_rn(sum, __shfl_sync(kAll, score, j));
  if (lane < p.k) {
    p.ids[t * p.k + lane] = ok ? mine : -1;
    p.weights[t * p.k + lane] = ok ? moe_route_weight<T>(score, moe_route_denom<T>(sum), p.scale)
                                   : __int_as_float(0x7fc00000);
  }
}

}  // namespace

void moe_route_cuda(const MoeRouteParams& p, void* stream) {
  moe_route_check_sizes(p);
  if (p.num_tokens == 0) return;
  const int64_t blocks = (p.num_tokens + kWarps - 1) / kWarps;
  ZI_CHECK(blocks <= 0x7fffffff, "moe_route: too many tokens for one launch");
  const auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(blocks);
  dispatch_float_or_bf16(p.dtype, "moe_route: logits must be float32 or bfloat16",
                         [&](auto type) {
    using T = decltype(type);
    if (p.experts <= 64) {
      moe_route_kernel<T, 2><<<grid, 32 * kWarps, 0, s>>>(p);
    } else if (p.experts <= 128) {
      moe_route_kernel<T, 4><<<grid, 32 * kWarps, 0, s>>>(p);
    } else if (p.experts <= 256) {
      moe_route_kernel<T, 8><<<grid, 32 * kWarps, 0, s>>>(p);
    } else {
      static_assert(kMoeRouteMaxExperts == 16 * 32);
      moe_route_kernel<T, 16><<<grid, 32 * kWarps, 0, s>>>(p);
    }
  });
  ZI_CUDA_CHECK_LAUNCH("moe_route");
}

}  // namespace zi
