// V4's two RMS norms over the last dim D of x [rows, D], in one launch (each was ~7-9 torch
// calls; a decode step of the model made ~30 of them a layer group):
//   weighted:   y = cast(w * (x * r))        w float32 [D], the products in float32
//   unweighted: y = x * cast(r)              the factor cast to x's dtype, the product in it
// with r = 1 / sqrt(sum(x^2) / D + eps), x widened to float32 (HF's precision rules,
// python/zeroinfer/model/norm.py had the torch forms).
// The sum of squares runs in one fixed order: lane j of 256 sums elements j, j + 256, ...
// ascending, then the 256 lane sums fold pairwise (lane j += lane j + h for h = 128, 64, .., 1),
// every product and sum rounded on its own (numeric.h's *_rn; the CPU file built with
// -ffp-contract=off), the sqrt and the divisions correctly rounded. So a row's result depends on
// the row alone (batch invariance), and the CPU twin and the CUDA kernels (a warp a row up to
// 1024 elements, a CTA of 256 threads a row above: cuda/rms_norm.cu) agree bitwise; against
// torch's forms they differ in the last bits of the sum.
// Reference: zeroinfer.reference.rms_norm.
#pragma once

#include <cstdint>

#include "zeroinfer/common.h"
#include "zeroinfer/numeric.h"

namespace zi {

constexpr int kRmsNormLanes = 256;

struct RmsNormParams {
  int64_t rows;
  int64_t dim;          // D
  DType dtype;          // of x and y: float32 or bfloat16
  float eps;
  const void* x;        // [rows, D], rows x_stride apart
  const float* weight;  // [D], or null: the unweighted norm
  void* y;              // [rows, D] out
  int64_t x_stride;     // elements from one row of x to the next (>= D; D when contiguous)
};

// r from the folded sum of squares.
ZI_HD float rms_factor(float sum_sq, int64_t dim, float eps) {
  return div_rn(1.f, sqrt_rn(add_rn(div_rn(sum_sq, static_cast<float>(dim)), eps)));
}

// An output element before its cast to x's dtype, from x's element v: w * (v * r) weighted (w
// the weight's element), v * rt unweighted (rt = r rounded to x's dtype). The CPU twin and the
// CUDA rows element by element or 8 at a time use it; the CUDA CTA kernel's batches spell it out
// (csrc/cuda/rms_norm.cu says why).
ZI_HD float rms_scaled(float v, bool weighted, float w, float r, float rt) {
  return weighted ? mul_rn(w, mul_rn(v, r)) : mul_rn(v, rt);
}

// Element i of the output row.
template <class T>
ZI_HD void rms_apply(const RmsNormParams& p, const T* x, T* y, float r, int64_t i) {
  const bool weighted = p.weight != nullptr;
  y[i] = from_float<T>(rms_scaled(to_float(x[i]), weighted, weighted ? p.weight[i] : 0.f, r,
                                  round_to<T>(r)));
}

void rms_norm_cpu(const RmsNormParams& p);
void rms_norm_cuda(const RmsNormParams& p, void* stream);

}  // namespace zi
