#include "registry.h"
#include "zeroinfer/rope.h"

namespace py = pybind11;

namespace zi::bindings {

void register_rope(py::module_& m) {
  def(m, "rope_rotate",
      [](bool cuda, int64_t num_tokens, int64_t heads, int64_t dim, int64_t half_rope, int dtype,
         int table_dtype, bool inverse, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t out,
         uintptr_t stream) {
        RopeParams p{num_tokens, heads, dim, half_rope, static_cast<DType>(dtype),
                     static_cast<DType>(table_dtype), inverse, as_ptr<const void>(x),
                     as_ptr<const void>(cos), as_ptr<const void>(sin), as_ptr<void>(out)};
        py::gil_scoped_release nogil;
        if (!cuda) {
          rope_rotate_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        rope_rotate_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
}

}  // namespace zi::bindings
