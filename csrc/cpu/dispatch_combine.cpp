// CPU twin of MoE dispatch / combine (contract in zeroinfer/dispatch_combine.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "zeroinfer/dispatch_combine.h"
#include "zeroinfer/numeric.h"
#include "zeroinfer/parallel.h"

namespace zi {
namespace {

size_t element_size(DType d) {
  switch (d) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kUInt8: case DType::kFloat8E4M3: return 1;
    case DType::kInt64: return 8;
  }
  return 0;
}

int64_t load_id(const void* ids, DType dt, int64_t i) {
  return dt == DType::kInt64 ? static_cast<const int64_t*>(ids)[i]
                             : static_cast<const int32_t*>(ids)[i];
}

float load_float(const void* base, DType dt, int64_t i) {
  return dt == DType::kFloat32 ? static_cast<const float*>(base)[i]
                               : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

}  // namespace

int64_t moe_dispatch_capacity(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t tile) {
  // Only a non-empty expert gets a padded segment, and at most T*k experts are non-empty.
  const int64_t pairs = num_tokens * topk;
  return pairs + std::min(num_experts, pairs) * (tile - 1);
}

void moe_dispatch_cpu(const MoeDispatchParams& p) {
  const int64_t n = p.num_tokens * p.topk;
  std::vector<int64_t> count(p.num_experts, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = load_id(p.topk_ids, p.ids_dtype, i);
    ZI_CHECK(e >= -1 && e < p.num_experts, "topk id out of range");
    if (e >= 0) ++count[e];
  }
  std::vector<int64_t> cursor(p.num_experts);
  int64_t off = 0;
  for (int64_t e = 0; e < p.num_experts; ++e) {
    p.expert_offsets[e] = static_cast<int32_t>(off);
    p.expert_counts[e] = static_cast<int32_t>(count[e]);
    cursor[e] = off;
    off += (count[e] + p.tile - 1) / p.tile * p.tile;
  }
  p.expert_offsets[p.num_experts] = static_cast<int32_t>(off);
  ZI_CHECK(off <= p.capacity, "dispatch capacity exceeded");

  std::fill(p.row_token, p.row_token + p.capacity, -1);
  // (token, slot) order inside each segment: a serial pass is the simplest stable ordering and
  // costs O(T*k), negligible next to the gather below.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = load_id(p.topk_ids, p.ids_dtype, i);
    if (e < 0) {
      p.token_row[i] = -1;
      continue;
    }
    const int64_t row = cursor[e]++;
    p.token_row[i] = static_cast<int32_t>(row);
    p.row_token[row] = static_cast<int32_t>(i / p.topk);
  }

  const size_t row_bytes = static_cast<size_t>(p.hidden) * element_size(p.x_dtype);
  const auto* src = static_cast<const uint8_t*>(p.x);
  auto* dst = static_cast<uint8_t*>(p.sorted_x);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<size_t>(row_bytes, 1));
  parallel_for(off, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t t = p.row_token[r];
      if (t >= 0) std::memcpy(dst + r * row_bytes, src + t * row_bytes, row_bytes);
    }
  });
}

void moe_combine_cpu(const MoeCombineParams& p) {
  const int64_t d = p.hidden;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(d, 1));
  parallel_for(p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < p.topk; ++j) {
        const int32_t v = p.token_row[t * p.topk + j];
        if (v < 0) continue;
        const int64_t r = p.routed ? t * p.topk + j : v;
        ZI_CHECK(r < p.rows, "token_row out of range");
        const float w = load_float(p.weights, p.weights_dtype, t * p.topk + j);
        if (p.expert_out_dtype == DType::kFloat32) {
          const float* src = static_cast<const float*>(p.expert_out) + r * d;
          for (int64_t i = 0; i < d; ++i) acc[i] += w * src[i];
        } else {
          const uint16_t* src = static_cast<const uint16_t*>(p.expert_out) + r * d;
          for (int64_t i = 0; i < d; ++i) acc[i] += w * bf16_to_float(src[i]);
        }
      }
      if (p.out_dtype == DType::kFloat32) {
        std::memcpy(static_cast<float*>(p.out) + t * d, acc.data(), d * sizeof(float));
      } else {
        uint16_t* o = static_cast<uint16_t*>(p.out) + t * d;
        for (int64_t i = 0; i < d; ++i) o[i] = float_to_bf16(acc[i]);
      }
    }
  });
}

}  // namespace zi
