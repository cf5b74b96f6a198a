#include "registry.h"
#include "zeroinfer/mhc.h"

namespace py = pybind11;

namespace zi::bindings {

void register_mhc(py::module_& m) {
  m.attr("MHC_MAX_STREAMS") = kMhcMaxStreams;
  def(m, "mhc_mixes",
      [](bool cuda, int64_t num_tokens, int32_t streams, int32_t iters, float eps, uintptr_t z,
         uintptr_t scale, uintptr_t base, uintptr_t pre, uintptr_t post, uintptr_t comb,
         uintptr_t stream) {
        MhcMixesParams p{num_tokens, streams, iters, eps, as_ptr<const float>(z),
                         as_ptr<const float>(scale), as_ptr<const float>(base),
                         as_ptr<float>(pre), as_ptr<float>(post), as_ptr<float>(comb)};
        py::gil_scoped_release nogil;
        if (!cuda) {
          mhc_mixes_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        mhc_mixes_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
}

}  // namespace zi::bindings
