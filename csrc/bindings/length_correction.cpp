#include "registry.h"
#include "zeroinfer/length_correction.h"

namespace py = pybind11;

namespace zi::bindings {

void register_length_correction(py::module_& m) {
  def(m, "correct_lengths",
        [](bool cuda, int64_t num_rows, int64_t num_prev_rows, int64_t prev_width,
           int64_t num_tokens, uintptr_t remap, uintptr_t assumed_accepted,
           uintptr_t prev_num_accepted, uintptr_t prev_next_tokens, uintptr_t prev_num_next,
           uintptr_t cu_q, uintptr_t k_len_in, uintptr_t positions_in, uintptr_t input_ids_in,
           uintptr_t q_len, uintptr_t k_len, uintptr_t positions, uintptr_t input_ids,
           uintptr_t stream) {
          LengthCorrectionParams p{num_rows, num_prev_rows, prev_width, num_tokens,
                                   as_ptr<const int32_t>(remap),
                                   as_ptr<const int32_t>(assumed_accepted),
                                   as_ptr<const int32_t>(prev_num_accepted),
                                   as_ptr<const int32_t>(prev_next_tokens),
                                   as_ptr<const int32_t>(prev_num_next),
                                   as_ptr<const int32_t>(cu_q), as_ptr<const int32_t>(k_len_in),
                                   as_ptr<const int32_t>(positions_in),
                                   as_ptr<const int32_t>(input_ids_in), as_ptr<int32_t>(q_len),
                                   as_ptr<int32_t>(k_len), as_ptr<int32_t>(positions),
                                   as_ptr<int32_t>(input_ids)};
          py::gil_scoped_release nogil;
          if (!cuda) {
            correct_lengths_cpu(p);
            return;
          }
#ifdef ZEROINFER_WITH_CUDA
          correct_lengths_cuda(p, as_ptr<void>(stream));
#else
          (void)stream;
          throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
        });
}

}  // namespace zi::bindings
