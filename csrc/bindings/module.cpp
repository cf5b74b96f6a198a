// The single Python extension module zeroinfer._C. It does not link torch: the Python op layer
// (python/zeroinfer/ops) validates arguments and passes data pointers, sizes, dtype codes and
// the CUDA stream handle as plain integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <new>
#include <stdexcept>
#include <string>

#include "registry.h"
#include "zeroinfer/parallel.h"

#ifdef ZEROINFER_WITH_CUDA
#include "zeroinfer/cuda_runtime.h"
#endif

namespace py = pybind11;
using zi::bindings::def;

namespace {

// Test / diagnostic hooks for the exception boundary (tests/test_exceptions.py,
// bench/diag_exceptions.py). Not part of the API.
[[noreturn]] void throw_kind(const std::string& kind, const std::string& msg) {
  if (kind == "invalid_argument") throw std::invalid_argument(msg);
  if (kind == "out_of_range") throw std::out_of_range(msg);
  if (kind == "overflow_error") throw std::overflow_error(msg);
  if (kind == "bad_alloc") throw std::bad_alloc();
  if (kind == "runtime_error") throw std::runtime_error(msg);
  if (kind == "python") throw py::key_error(msg);
  if (kind == "int") throw 42;
  if (kind == "error_already_set") {
    py::gil_scoped_acquire gil;
    py::module_::import("zeroinfer_no_such_module_for_test");  // throws error_already_set
  }
  throw std::logic_error("unknown kind " + kind);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zeroinfer kernels (CPU twins always; CUDA when built with nvcc)";
  m.attr("VERSION") = ZEROINFER_VERSION;
#ifdef ZEROINFER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  m.attr("CUDA_ARCHS") = ZEROINFER_CUDA_ARCHS_STR;
  def(m, "cuda_device_count", &zi::cuda::device_count, "Usable CUDA devices (0 without a driver)");
  def(m, "cuda_device_description", &zi::cuda::device_description, py::arg("index"));
#else
  m.attr("WITH_CUDA") = false;
  m.attr("CUDA_ARCHS") = "";
  def(m, "cuda_device_count", [] { return 0; }, "Usable CUDA devices (CUDA not compiled: 0)");
  def(m, "cuda_device_description", [](int) -> std::string {
    throw std::runtime_error("zeroinfer._C was built without CUDA");
  }, py::arg("index"));
#endif
  m.attr("WITH_ASCEND") = false;  // ascend/ builds a separate library when CANN is present
  def(m, "num_threads", &zi::num_threads, "Threads the CPU kernels use (ZEROINFER_NUM_THREADS)");

  zi::bindings::register_sparse_mla(m);
  zi::bindings::register_moe_gemm(m);
  zi::bindings::register_dispatch_combine(m);
  zi::bindings::register_length_correction(m);
  zi::bindings::register_mhc(m);
  zi::bindings::register_rope(m);
  zi::bindings::register_indexer(m);
  zi::bindings::register_rms_norm(m);
  zi::bindings::register_moe_route(m);

  def(m, "_raise_for_test", [](const std::string& kind, const std::string& msg) {
    py::gil_scoped_release nogil;  // like the kernels: the throw unwinds a released-GIL scope
    throw_kind(kind, msg);
  }, py::arg("kind"), py::arg("msg"));
  def(m, "_throw_catch_inside", [](int n) {
    int caught = 0;  // throw and catch entirely inside _C: exercises only the C++ runtime
    for (int i = 0; i < n; ++i) {
      try {
        throw_kind("invalid_argument", "inside");
      } catch (const std::invalid_argument&) {
        ++caught;
      }
    }
    return caught;
  }, py::arg("n"));
  // Deliberately NOT guarded: the plain pybind11 path (its dispatcher + exception translators),
  // kept only so bench/diag_exceptions.py can tell which of the two paths crashes.
  m.def("_raise_unguarded", [](const std::string& msg) { throw std::invalid_argument(msg); },
        py::arg("msg"));
}
