// V4's RoPE on the last r channels of each d-vector, interleaved pairs (2i, 2i+1), as HF computes
// it: cos / sin (in the activations' dtype or float32) and the channels widened to float32,
//     even' = even * cos - odd * sin,   odd' = odd * cos + even * sin
// every product and difference rounded on its own (no fused multiply-adds: numeric.h's mul_rn /
// add_rn / sub_rn, the CPU file built with -ffp-contract=off), then cast back; the first d - r
// channels copied.
// `inverse` rotates by -angle (the attention output's de-rotation): bitwise the same as passing
// -sin, since a - (-b) == a + b exactly. So the CPU twin, the CUDA kernel and the torch form
// agree bitwise; one launch in place of ~12 torch calls a use (five uses a layer at decode).
// Reference: zeroinfer.reference.rope.
#pragma once

#include <cstdint>

#include "zeroinfer/common.h"
#include "zeroinfer/numeric.h"

namespace zi {

struct RopeParams {
  int64_t num_tokens;   // T
  int64_t heads;        // vectors a token (the product of x's middle dims; 1 for [T, d])
  int64_t dim;          // d
  int64_t half_rope;    // r / 2 pairs, 1 <= r <= d
  DType dtype;          // of x and out: float32 or bfloat16
  DType table_dtype;    // of cos and sin: float32 or bfloat16
  bool inverse;         // rotate by -angle
  const void* x;        // [T, heads, d]
  const void* cos;      // [T, r / 2]
  const void* sin;      // [T, r / 2]
  void* out;            // [T, heads, d] out
};

// Output pair `i` (0 <= i < d / 2) of vector (t, h): a rotated pair in the last r channels, else
// two copied channels. (d is even whenever r is: the callers check it.)
template <class T, class C>
ZI_HD void rope_pair(const RopeParams& p, int64_t t, int64_t h, int64_t i) {
  const int64_t base = (t * p.heads + h) * p.dim;
  const T* x = static_cast<const T*>(p.x) + base;
  T* out = static_cast<T*>(p.out) + base;
  const int64_t first = p.dim / 2 - p.half_rope;  // the first rotated pair
  if (i < first) {
    out[2 * i] = x[2 * i];
    out[2 * i + 1] = x[2 * i + 1];
    return;
  }
  const int64_t j = t * p.half_rope + (i - first);
  const float c = to_float(static_cast<const C*>(p.cos)[j]);
  const float s = to_float(static_cast<const C*>(p.sin)[j]);
  const float even = to_float(x[2 * i]), odd = to_float(x[2 * i + 1]);
  if (p.inverse) {
    out[2 * i] = from_float<T>(add_rn(mul_rn(even, c), mul_rn(odd, s)));
    out[2 * i + 1] = from_float<T>(sub_rn(mul_rn(odd, c), mul_rn(even, s)));
  } else {
    out[2 * i] = from_float<T>(sub_rn(mul_rn(even, c), mul_rn(odd, s)));
    out[2 * i + 1] = from_float<T>(add_rn(mul_rn(odd, c), mul_rn(even, s)));
  }
}

// Calls f(T{}, C{}) for the storage types of x and of the tables (float, or bf16 bits).
template <class F>
void rope_dispatch(DType dtype, DType table_dtype, F&& f) {
  auto ok = [](DType d) { return d == DType::kFloat32 || d == DType::kBFloat16; };
  ZI_CHECK(ok(dtype) && ok(table_dtype), "rope_rotate: x, cos and sin must be float32 or bfloat16");
  auto with_table = [&](auto type) {
    if (table_dtype == DType::kFloat32) {
      f(type, float{});
    } else {
      f(type, uint16_t{});
    }
  };
  if (dtype == DType::kFloat32) {
    with_table(float{});
  } else {
    with_table(uint16_t{});
  }
}

void rope_rotate_cpu(const RopeParams& p);
void rope_rotate_cuda(const RopeParams& p, void* stream);

}  // namespace zi
