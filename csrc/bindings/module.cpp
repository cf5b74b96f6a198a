// The single Python extension module zeroinfer._C. It does not link torch: the Python op layer
// (python/zeroinfer/ops) validates arguments and passes data pointers, sizes, dtype codes and
// the CUDA stream handle as plain integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "registry.h"
#include "zeroinfer/parallel.h"

#ifdef ZEROINFER_WITH_CUDA
#include "zeroinfer/cuda_runtime.h"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "zeroinfer kernels (CPU twins always; CUDA when built with nvcc)";
  m.attr("VERSION") = ZEROINFER_VERSION;
#ifdef ZEROINFER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  m.attr("CUDA_ARCHS") = ZEROINFER_CUDA_ARCHS_STR;
  m.def("cuda_device_count", &zi::cuda::device_count, "Usable CUDA devices (0 without a driver)");
  m.def("cuda_device_description", &zi::cuda::device_description, py::arg("index"));
#else
  m.attr("WITH_CUDA") = false;
  m.attr("CUDA_ARCHS") = "";
  m.def("cuda_device_count", [] { return 0; }, "Usable CUDA devices (CUDA not compiled: 0)");
  m.def("cuda_device_description", [](int) -> std::string {
    throw std::runtime_error("zeroinfer._C was built without CUDA");
  }, py::arg("index"));
#endif
  m.attr("WITH_ASCEND") = false;  // ascend/ builds a separate library when CANN is present
  m.def("num_threads", &zi::num_threads, "Threads the CPU kernels use (ZEROINFER_NUM_THREADS)");

  zi::bindings::register_sparse_mla(m);
  zi::bindings::register_moe_gemm(m);
  zi::bindings::register_dispatch_combine(m);
  zi::bindings::register_length_correction(m);
}
