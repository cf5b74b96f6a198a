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
  def(m, "mhc_collapse",
      [](bool cuda, int64_t num_tokens, int32_t streams, int64_t dim, int dtype, uintptr_t pre,
         uintptr_t x_in, uintptr_t x_out, uintptr_t stream) {
        MhcCollapseParams p{num_tokens, streams, dim, static_cast<DType>(dtype),
                            as_ptr<const float>(pre), as_ptr<const void>(x_in),
                            as_ptr<void>(x_out)};
        py::gil_scoped_release nogil;
        if (!cuda) {
          mhc_collapse_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        mhc_collapse_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
  def(m, "mhc_mix",
      [](bool cuda, int64_t num_tokens, int32_t streams, int64_t dim, int dtype, uintptr_t post,
         uintptr_t comb, uintptr_t x_in, uintptr_t block, uintptr_t y_out, uintptr_t stream) {
        MhcMixParams p{num_tokens, streams, dim, static_cast<DType>(dtype),
                       as_ptr<const float>(post), as_ptr<const float>(comb),
                       as_ptr<const void>(x_in), as_ptr<const void>(block), as_ptr<void>(y_out)};
        py::gil_scoped_release nogil;
        if (!cuda) {
          mhc_mix_cpu(p);
          return;
        }
#ifdef ZEROINFER_WITH_CUDA
        mhc_mix_cuda(p, as_ptr<void>(stream));
#else
        (void)stream;
        throw std::runtime_error("zeroinfer._C was built without CUDA");
#endif
      });
}

}  // namespace zi::bindings
