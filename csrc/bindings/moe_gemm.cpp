// _C.mxfp4_grouped_gemm_cpu: pointers (data_ptr() ints, 0 = absent), sizes and zi::DType codes.
// python/zeroinfer/ops/moe_gemm.py validates every argument before calling this.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "registry.h"
#include "zeroinfer/moe_gemm.h"

namespace py = pybind11;

namespace zi::bindings {

void register_moe_gemm(py::module_& m) {
  def(m,
      "mxfp4_grouped_gemm_cpu",
      [](uintptr_t a, int a_dtype, uintptr_t a_scale, uintptr_t w, uintptr_t w_scale,
         uintptr_t expert_offsets, uintptr_t expert_counts, uintptr_t masked_m, uintptr_t out,
         int out_dtype, int64_t num_experts, int64_t m_rows, int64_t cap, int64_t n, int64_t k,
         bool fuse_swiglu, std::optional<double> swiglu_limit) {
        Mxfp4GemmParams p;
        p.a = as_ptr<const void>(a);
        p.a_dtype = static_cast<DType>(a_dtype);
        p.a_scale = as_ptr<const float>(a_scale);
        p.w = as_ptr<const uint8_t>(w);
        p.w_scale = as_ptr<const uint8_t>(w_scale);
        p.expert_offsets = as_ptr<const int32_t>(expert_offsets);
        p.expert_counts = as_ptr<const int32_t>(expert_counts);
        p.masked_m = as_ptr<const int32_t>(masked_m);
        p.out = as_ptr<void>(out);
        p.out_dtype = static_cast<DType>(out_dtype);
        p.num_experts = num_experts;
        p.m = m_rows;
        p.cap = cap;
        p.n = n;
        p.k = k;
        p.fuse_swiglu = fuse_swiglu;
        p.has_swiglu_limit = swiglu_limit.has_value();
        p.swiglu_limit = swiglu_limit ? static_cast<float>(*swiglu_limit) : 0.f;
        py::gil_scoped_release nogil;
        mxfp4_grouped_gemm_cpu(p);
      },
      "MXFP4 grouped GEMM, CPU twin (see zeroinfer.ops.mxfp4_grouped_gemm; no validation of "
      "tensor sizes here)",
      py::arg("a"), py::arg("a_dtype"), py::arg("a_scale"), py::arg("w"), py::arg("w_scale"),
      py::arg("expert_offsets"), py::arg("expert_counts"), py::arg("masked_m"), py::arg("out"),
      py::arg("out_dtype"), py::arg("num_experts"), py::arg("m"), py::arg("cap"), py::arg("n"),
      py::arg("k"), py::arg("fuse_swiglu"), py::arg("swiglu_limit"));
}

}  // namespace zi::bindings
