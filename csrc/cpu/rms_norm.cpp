// CPU twin of the RMS norms (contract in zeroinfer/rms_norm.h): the 256 lane sums and their
// pairwise fold exactly as the CUDA kernel's threads make them. The lane sums go a 256-element
// block at a time, all lanes together (lane j takes element j of each block: its own chain, in
// its own order, vectorised across the lanes). Built with -ffp-contract=off.
#include <algorithm>

#include "zeroinfer/parallel.h"
#include "zeroinfer/rms_norm.h"

namespace zi {

namespace {

template <class T>
void norm_row(const RmsNormParams& p, const T* x, T* y) {
  float lanes[kRmsNormLanes] = {};
  for (int64_t i0 = 0; i0 < p.dim; i0 += kRmsNormLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kRmsNormLanes, p.dim - i0));
    for (int j = 0; j < n; ++j) {
      const float v = to_float(x[i0 + j]);
      lanes[j] = add_rn(lanes[j], mul_rn(v, v));
    }
  }
  for (int h = kRmsNormLanes / 2; h >= 1; h /= 2)
    for (int j = 0; j < h; ++j) lanes[j] = add_rn(lanes[j], lanes[j + h]);
  const float r = rms_factor(lanes[0], p.dim, p.eps);
  const bool weighted = p.weight != nullptr;
  const float rt = round_to<T>(r);
  for (int64_t i = 0; i < p.dim; ++i)
    y[i] = from_float<T>(rms_scaled(to_float(x[i]), weighted, weighted ? p.weight[i] : 0.f, r, rt));
}

}  // namespace

void rms_norm_cpu(const RmsNormParams& p) {
  ZI_CHECK(p.dim >= 1, "rms_norm: need D >= 1");
  dispatch_float_or_bf16(p.dtype, "rms_norm: x must be float32 or bfloat16",
                         [&](auto type) {
    using T = decltype(type);
    const int64_t grain = std::max<int64_t>(1, 16384 / p.dim);
    parallel_for(p.rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        norm_row<T>(p, static_cast<const T*>(p.x) + row * p.x_stride,
                    static_cast<T*>(p.y) + row * p.dim);
    });
  });
}

}  // namespace zi
