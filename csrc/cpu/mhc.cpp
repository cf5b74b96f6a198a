// CPU twin of the mHC mixes kernel (contract in zeroinfer/mhc.h): the same per-token function.
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

}  // namespace zi
