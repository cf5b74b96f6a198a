// Error checking for CUDA code: every runtime call and every launch is checked, and a failure
// throws (the bindings turn it into a Python RuntimeError) instead of being lost.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace zi::cuda {

inline void check(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + " at " + file + ":" +
                             std::to_string(line) + ": " + cudaGetErrorString(err));
  }
}

}  // namespace zi::cuda

#define ZI_CUDA_CHECK(expr) ::zi::cuda::check((expr), #expr, __FILE__, __LINE__)
#define ZI_CUDA_CHECK_LAUNCH(name) ::zi::cuda::check(cudaGetLastError(), name, __FILE__, __LINE__)
