// Probe (not part of the build): the L2 -> SM read bandwidth of the H200, the ceiling of a GEMM
// tile's operand copies when its operands are re-read from L2 by many CTAs (the MoE W4A8
// prefill tile: bench/results/h200/moe_gemm_NOTES.md, session 15). Every SM's CTA streams a
// buffer that fits in L2 (after a warm-up pass), by 16-byte loads to registers and by cp.async
// into a shared-memory ring (the tile producers' way) and by bulk copies (the copy engine) on
// mbarriers. Build and run on the H200:
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc \
//        bench/probe_l2_bandwidth.cu -o /tmp/l2_probe && /tmp/l2_probe
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include "cuda/ptx.cuh"

using namespace zi;

// Each CTA reads `bytes_per_cta` starting at a CTA-dependent offset (wrapping in the buffer).
__global__ void __launch_bounds__(512) read_regs(const uint4* buf, int64_t n16, int64_t per_cta,
                                                 uint4* sink) {
  uint4 acc = {0, 0, 0, 0};
  const int64_t start = (blockIdx.x * 7919LL * 512) % n16;
  // eight independent loads in flight a thread
  for (int64_t i = threadIdx.x; i < per_cta; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint4* p = buf + (start + i + u * blockDim.x) % n16;
      asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(p));
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w;
    }
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[threadIdx.x] = acc;
}

// cp.async into a ring of 4 x 32 KB slots, `ahead` stages in flight (as the tile producers).
template <int kAhead>
__global__ void __launch_bounds__(256) read_cp_async(const uint8_t* buf, int64_t bytes,
                                                     int64_t stages, uint4* sink) {
  extern __shared__ __align__(1024) uint8_t ring[];
  constexpr int kSlot = 32768, kSlots = 4;
  const int64_t start = (blockIdx.x * 7919LL * 8192) % bytes;
  auto issue = [&](int64_t s) {
    const uint32_t dst = smem_u32(ring + (s % kSlots) * kSlot);
    for (int c = threadIdx.x; c < kSlot / 16; c += blockDim.x) {
      const int64_t off = (start + s * kSlot + c * 16) % bytes;
      cp_async16(dst + c * 16, buf + off, true);
    }
    cp_async_commit();
  };
  for (int s = 0; s < kAhead; ++s) issue(s);
  for (int64_t s = 0; s < stages; ++s) {
    issue(s + kAhead);
    cp_async_wait<kAhead>();
    __syncthreads();
  }
  cp_async_wait<0>();
  if (threadIdx.x == 0 && ring[5] == 0x7b && ring[77] == 0x11) sink[0] = uint4{1, 1, 1, 1};
}

// The copy engine: one thread issues each 32 KB stage as `kPieces` bulk copies completing on the
// slot's mbarrier; every thread waits on it (the consumers' side of a TMA ring).
template <int kPieces>
__global__ void __launch_bounds__(256) read_bulk(const uint8_t* buf, int64_t bytes, int64_t stages,
                                                 uint4* sink) {
  extern __shared__ __align__(1024) uint8_t ring[];
  __shared__ __align__(8) uint64_t bars[4];
  constexpr int kSlot = 32768, kSlots = 4, kPiece = kSlot / kPieces;
  const int64_t start = (blockIdx.x * 7919LL * 8192) % bytes;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&bars[i])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int64_t s) {
    if (threadIdx.x != 0) return;
    const uint32_t bar = smem_u32(&bars[s % kSlots]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kSlot)
                 : "memory");
    for (int c = 0; c < kPieces; ++c) {
      const int64_t off = (start + s * kSlot + c * kPiece) % bytes;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
          ::"r"(smem_u32(ring + (s % kSlots) * kSlot + c * kPiece)), "l"(buf + off), "r"(kPiece),
          "r"(bar)
          : "memory");
    }
  };
  auto landed = [&](int64_t s) {  // stage s's slot filled (its mbarrier's phase s / kSlots)
    const uint32_t bar = smem_u32(&bars[s % kSlots]), parity = (s / kSlots) & 1;
    asm volatile(
        "{\n.reg .pred done;\nW_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra W_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  };
  for (int s = 0; s < kSlots - 1; ++s) issue(s);
  for (int64_t s = 0; s < stages; ++s) {
    landed(s);
    __syncthreads();  // everyone done with slot s - 1 before it is refilled
    issue(s + kSlots - 1);
  }
  // drain the copies still in flight before the CTA exits
  for (int64_t s = stages; s < stages + kSlots - 1; ++s) landed(s);
  if (threadIdx.x == 0 && ring[5] == 0x7b && ring[77] == 0x11) sink[0] = uint4{1, 1, 1, 1};
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int l2 = 0;
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0);
  printf("SMs %d, L2 %d MB\n", sms, l2 >> 20);
  uint8_t* buf;
  uint4* sink;
  const int64_t max_bytes = 256LL << 20;
  cudaMalloc(&buf, max_bytes);
  cudaMemset(buf, 1, max_bytes);
  cudaMalloc(&sink, 4096);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int64_t mb : {8, 24, 256}) {
    const int64_t bytes = mb << 20, n16 = bytes / 16;
    const int64_t per_cta = 8LL << 20 >> 4;  // 8 MB a CTA in 16-byte loads
    read_regs<<<sms, 512>>>(reinterpret_cast<uint4*>(buf), n16, per_cta / 8, sink);
    cudaEventRecord(a);
    read_regs<<<sms, 512>>>(reinterpret_cast<uint4*>(buf), n16, per_cta, sink);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    printf("ld.global.cg, buffer %4lld MB: %6.2f TB/s\n", (long long)mb,
           sms * per_cta * 16.0 / (ms * 1e-3) / 1e12);
    const int64_t stages = 256;  // 8 MB a CTA
    auto cp = [&](auto kernel, const char* name) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 32768);
      kernel<<<sms, 256, 4 * 32768>>>(buf, bytes, stages / 8, sink);
      cudaEventRecord(a);
      kernel<<<sms, 256, 4 * 32768>>>(buf, bytes, stages, sink);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float t = 0.f;
      cudaEventElapsedTime(&t, a, b);
      printf("cp.async %-34s buffer %4lld MB: %6.2f TB/s\n", name, (long long)mb,
             sms * stages * 32768.0 / (t * 1e-3) / 1e12);
    };
    cp(read_cp_async<2>, "2 stages ahead");
    cp(read_cp_async<3>, "3 stages ahead");
    cp(read_bulk<1>, "-> bulk, one 32 KB copy a stage");
    cp(read_bulk<4>, "-> bulk, four 8 KB copies a stage");
    cp(read_bulk<32>, "-> bulk, 32 1 KB copies a stage");
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
  return 0;
}
