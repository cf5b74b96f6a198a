#include "registry.h"
#include "zeroinfer/moe_route.h"

namespace py = pybind11;

namespace zi::bindings {

void register_moe_route(py::module_& m) {
  def(m, "moe_route",
      [](bool cuda, int64_t tokens, int experts, int k, int dtype, float scale, uintptr_t logits,
         int64_t logits_stride, uintptr_t bias, uintptr_t table, uintptr_t input_ids,
         int64_t vocab, uintptr_t ids, uintptr_t weights, uintptr_t stream) {
        MoeRouteParams p{tokens, experts, k, static_cast<DType>(dtype), scale,
                         as_ptr<const void>(logits), as_ptr<const float>(bias),
                         as_ptr<const int64_t>(table), as_ptr<const int64_t>(input_ids), vocab,
                         as_ptr<int32_t>(ids), as_ptr<float>(weights), logits_stride};
        py::gil_scoped_release nogil;
        if (!cuda) {
          moe_route_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        moe_route_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
}

}  // namespace zi::bindings
