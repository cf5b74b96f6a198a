#include <cstdio>

#include "check.cuh"
#include "zeroinfer/cuda_runtime.h"

namespace zi::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string device_description(int index) {
  cudaDeviceProp prop{};
  ZI_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  char buf[320];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %d SMs, %.1f GiB, %.2f TB/s HBM peak)", prop.name,
                prop.major, prop.minor, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0),
                peak_memory_bytes_per_s(index) / 1e12);
  return buf;
}

double peak_memory_bytes_per_s(int index) {
  int clock_khz = 0, bus_bits = 0;
  ZI_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, index));
  ZI_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, index));
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0);
}

}  // namespace zi::cuda
