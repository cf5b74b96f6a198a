// Host-side CUDA helpers with no CUDA headers in the interface, so bindings.cpp (plain C++)
// can ask about devices without including cuda_runtime.h.
#pragma once

#include <string>

namespace zi::cuda {

// 0 when there is no driver or no device (the error is cleared, nothing throws).
int device_count();

// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, 4.92 TB/s HBM peak)"-style description of device
// `index`.
std::string device_description(int index);

// Peak memory bandwidth of device `index` in bytes/s from its memory clock and bus width (DDR:
// two transfers a clock), the spec-sheet figure (H100 SXM 3.35e12, H200 4.9e12); 0 if the
// driver does not report them.
double peak_memory_bytes_per_s(int index);

}  // namespace zi::cuda
