// Host-side CUDA helpers with no CUDA headers in the interface, so bindings.cpp (plain C++)
// can ask about devices without including cuda_runtime.h.
#pragma once

#include <string>

namespace zi::cuda {

// 0 when there is no driver or no device (the error is cleared, nothing throws).
int device_count();

// "NVIDIA H200 (sm_90, 132 SMs)"-style description of device `index`.
std::string device_description(int index);

}  // namespace zi::cuda
