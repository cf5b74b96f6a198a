// One register_<family>(m) per kernel family; module.cpp calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace zi::bindings {

void register_sparse_mla(pybind11::module_& m);
void register_moe_gemm(pybind11::module_& m);
void register_dispatch_combine(pybind11::module_& m);
void register_length_correction(pybind11::module_& m);

// Pointers cross the boundary as Python ints (tensor.data_ptr()); 0 means "absent".
template <typename T>
inline T* as_ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace zi::bindings
