// Programmatic dependent launches (sm_90): the kernel's CTAs may start while the kernel before
// it in the stream still runs, so its launch and set-up hide under that kernel's tail. Every
// kernel launched this way must call griddep_wait (ptx.cuh) before it reads anything an earlier
// kernel writes and before it writes anything an earlier kernel reads; its completion then also
// implies its predecessor's, so the stream's order holds for whatever follows.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "check.cuh"
#include "ptx.cuh"

namespace zi {

// The start of a programmatically launched kernel: wait for the kernels before it (their memory
// visible), then let the next programmatic launch start in turn. Before this, a kernel may touch
// only shared memory and its parameters.
__device__ __forceinline__ void await_earlier_kernels() {
  griddep_wait();
  griddep_launch_dependents();
}

// Per-device facts, queried once per device (the launch path stays free of attribute queries).
struct DeviceLimits {
  int sms = 0;
  int smem_optin = 0;
};

inline DeviceLimits device_limits() {
  constexpr int kMaxDevices = 64;
  static DeviceLimits cache[kMaxDevices];
  int dev = 0;
  ZI_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) dev = 0;
  DeviceLimits& d = cache[dev];
  if (d.sms == 0) {  // benign race: every writer stores the same values
    DeviceLimits q;
    ZI_CUDA_CHECK(cudaDeviceGetAttribute(&q.sms, cudaDevAttrMultiProcessorCount, dev));
    ZI_CUDA_CHECK(
        cudaDeviceGetAttribute(&q.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    d.smem_optin = q.smem_optin;
    d.sms = q.sms;
  }
  return d;
}

// cudaLaunchKernelEx with one launch attribute (programmatic, cooperative, ...); returns the
// launch's error for the caller to handle.
template <typename... Params, typename... Args>
cudaError_t launch_with(cudaLaunchAttribute attr, void (*kernel)(Params...), dim3 grid,
                        dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  ZI_CUDA_CHECK(launch_with(attr, kernel, grid, block, smem, stream, std::forward<Args>(args)...));
}

}  // namespace zi
