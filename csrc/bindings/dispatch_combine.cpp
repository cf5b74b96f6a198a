#include "registry.h"
#include "zeroinfer/dispatch_combine.h"

namespace py = pybind11;

namespace zi::bindings {

void register_dispatch_combine(py::module_& m) {
  def(m, "moe_dispatch_capacity", &moe_dispatch_capacity, py::arg("num_tokens"), py::arg("topk"),
        py::arg("num_experts"), py::arg("tile"));
  def(m,
      "moe_dispatch",
      [](bool cuda, uintptr_t x, int x_dtype, uintptr_t ids, int ids_dtype, int64_t num_tokens,
         int64_t hidden, int64_t topk, int64_t num_experts, int64_t tile, int64_t capacity,
         uintptr_t sorted_x, uintptr_t row_token, uintptr_t token_row, uintptr_t counts,
         uintptr_t offsets, uintptr_t workspace, uintptr_t stream) {
        MoeDispatchParams p{as_ptr<const void>(x), static_cast<DType>(x_dtype),
                            as_ptr<const void>(ids), static_cast<DType>(ids_dtype), num_tokens,
                            hidden, topk, num_experts, tile, capacity, as_ptr<void>(sorted_x),
                            as_ptr<int32_t>(row_token), as_ptr<int32_t>(token_row),
                            as_ptr<int32_t>(counts), as_ptr<int32_t>(offsets)};
        py::gil_scoped_release nogil;
        if (!cuda) {
          moe_dispatch_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        moe_dispatch_cuda(p, as_ptr<void>(workspace), as_ptr<void>(stream));
#else
        (void)workspace, (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
  def(m,
      "moe_combine",
      [](bool cuda, uintptr_t expert_out, int expert_out_dtype, uintptr_t token_row,
         uintptr_t weights, int weights_dtype, int64_t rows, int64_t num_tokens, int64_t hidden,
         int64_t topk, uintptr_t out, int out_dtype, bool routed, uintptr_t stream) {
        MoeCombineParams p{as_ptr<const void>(expert_out), static_cast<DType>(expert_out_dtype),
                           as_ptr<const int32_t>(token_row), as_ptr<const void>(weights),
                           static_cast<DType>(weights_dtype), rows, num_tokens, hidden, topk,
                           as_ptr<void>(out), static_cast<DType>(out_dtype), routed};
        py::gil_scoped_release nogil;
        if (!cuda) {
          moe_combine_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        moe_combine_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
#ifdef ZEROINFER_WITH_CUDA
  def(m, "moe_dispatch_workspace_bytes", &moe_dispatch_workspace_bytes, py::arg("num_tokens"),
        py::arg("topk"), py::arg("num_experts"));
#endif
}

}  // namespace zi::bindings
