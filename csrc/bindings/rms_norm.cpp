#include "registry.h"
#include "zeroinfer/rms_norm.h"

namespace py = pybind11;

namespace zi::bindings {

void register_rms_norm(py::module_& m) {
  def(m, "rms_norm",
      [](bool cuda, int64_t rows, int64_t dim, int64_t x_stride, int dtype, float eps,
         uintptr_t x, uintptr_t weight, uintptr_t y, uintptr_t stream) {
        RmsNormParams p{rows, dim, static_cast<DType>(dtype), eps, as_ptr<const void>(x),
                        as_ptr<const float>(weight), as_ptr<void>(y), x_stride};
        py::gil_scoped_release nogil;
        if (!cuda) {
          rms_norm_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        rms_norm_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
}

}  // namespace zi::bindings
