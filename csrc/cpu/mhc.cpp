// CPU twin of the mHC kernels (contract in zeroinfer/mhc.h): the same per-token / per-element
// functions. Built with -ffp-contract=off (CMakeLists.txt): the collapse and mix round every
// product and sum on its own, as torch's separate ops do.
#include "zeroinfer/mhc.h"
#include "zeroinfer/parallel.h"

namespace zi {

void mhc_mixes_cpu(const MhcMixesParams& p) {
  ZI_CHECK(p.iters >= 1, "mhc_mixes: iters must be >= 1");
  mhc_dispatch_streams(p.streams, [&](auto n) {
    parallel_for(p.num_tokens, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) mhc_mixes_token<decltype(n)::value>(p, t);
    });
  });
}

void mhc_collapse_cpu(const MhcCollapseParams& p) {
  mhc_dispatch_apply(p.dtype, p.streams, [&](auto type, auto n) {
    using T = decltype(type);
    parallel_for(p.num_tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t d = 0; d < p.dim; ++d) mhc_collapse_elem<T, decltype(n)::value>(p, t, d);
    });
  });
}

void mhc_mix_cpu(const MhcMixParams& p) {
  mhc_dispatch_apply(p.dtype, p.streams, [&](auto type, auto n) {
    using T = decltype(type);
    parallel_for(p.num_tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t d = 0; d < p.dim; ++d) mhc_mix_elem<T, decltype(n)::value>(p, t, d);
    });
  });
}

}  // namespace zi
