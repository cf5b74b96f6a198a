// CPU twin of the RoPE kernel (contract in zeroinfer/rope.h): the same per-pair function. Built
// with -ffp-contract=off (CMakeLists.txt): every product and sum rounds on its own, as in torch.
#include "zeroinfer/parallel.h"
#include "zeroinfer/rope.h"

namespace zi {

void rope_rotate_cpu(const RopeParams& p) {
  ZI_CHECK(p.dim % 2 == 0 && p.half_rope >= 1 && 2 * p.half_rope <= p.dim,
           "rope_rotate: need an even d and 1 <= r / 2 <= d / 2");
  rope_dispatch(p.dtype, p.table_dtype, [&](auto type, auto table) {
    using T = decltype(type);
    using C = decltype(table);
    const int64_t pairs = p.dim / 2;
    parallel_for(p.num_tokens * p.heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t v = begin; v < end; ++v)
        for (int64_t i = 0; i < pairs; ++i) rope_pair<T, C>(p, v / p.heads, v % p.heads, i);
    });
  });
}

}  // namespace zi
