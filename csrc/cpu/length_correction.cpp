// CPU twin of the length-correction kernel (contract in zeroinfer/length_correction.h).
#include <algorithm>

#include "zeroinfer/length_correction.h"
#include "zeroinfer/parallel.h"

namespace zi {

void correct_lengths_cpu(const LengthCorrectionParams& p) {
  parallel_for(p.num_rows, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t start = p.cu_q[i], q_opt = p.cu_q[i + 1] - p.cu_q[i];
      int32_t prev = p.remap[i];
      if (prev >= p.num_prev_rows) prev = -1;
      if (prev < 0) {
        p.q_len[i] = q_opt;
        p.k_len[i] = p.k_len_in[i];
        std::copy_n(p.positions_in + start, q_opt, p.positions + start);
        std::copy_n(p.input_ids_in + start, q_opt, p.input_ids + start);
        continue;
      }
      const int32_t delta = p.prev_num_accepted[prev] - p.assumed_accepted[i];
      const int32_t q = std::max<int32_t>(
          0, std::min<int32_t>({q_opt, p.prev_num_next[prev], static_cast<int32_t>(p.prev_width)}));
      p.q_len[i] = q;
      p.k_len[i] = p.k_len_in[i] + delta - (q_opt - q);
      const int32_t* next = p.prev_next_tokens + static_cast<int64_t>(prev) * p.prev_width;
      for (int32_t j = 0; j < q_opt; ++j) {
        p.positions[start + j] = j < q ? p.positions_in[start + j] + delta : -1;
        p.input_ids[start + j] = j < q ? next[j] : 0;
      }
    }
  });
}

}  // namespace zi
