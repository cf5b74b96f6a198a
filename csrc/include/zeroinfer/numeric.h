// Scalar number formats used by V4 checkpoints and caches, as host/device inline functions.
//   bf16      : upper 16 bits of an IEEE float (round-to-nearest-even when narrowing)
//   e4m3fn    : FP8, 1-4-3, bias 7, no inf, 0x7f/0xff = NaN, max 448
//   e2m1      : FP4, 1-2-1, values {0, .5, 1, 1.5, 2, 3, 4, 6} and negatives; two per byte,
//               element 2j in the LOW nibble of byte j (V4 checkpoints, HF _unpack_fp4)
//   ue8m0     : unsigned power-of-two scale, value 2^(byte-127); 0xff = NaN
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#define ZI_HD __host__ __device__ __forceinline__
#else
#define ZI_HD inline
#endif

namespace zi {

ZI_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

ZI_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

ZI_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

ZI_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
#if defined(__CUDA_ARCH__)
  // The same rounding in one cvt.rn.bf16.f32 (the integer form costs ~5 instructions: it made
  // the elementwise mhc_mix compute-bound).
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
#endif
}

// Products and sums rounded on their own, never contracted into a fused multiply-add (kernels that
// must give torch's separate ops' bits: mhc collapse / mix, RoPE). On the host this needs the
// file built with -ffp-contract=off (CMakeLists.txt); on the device the _rn intrinsics ensure it.
ZI_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ZI_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ZI_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Correctly rounded division and square root (the device's defaults are approximate).
ZI_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

ZI_HD float sqrt_rn(float v) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(v);
#else
  return std::sqrt(v);
#endif
}

// exp and log1p: the device's and the host's libm (they may differ in the last bit).
ZI_HD float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

ZI_HD float log1p_f(float x) {
#if defined(__CUDA_ARCH__)
  return log1pf(x);
#else
  return std::log1p(x);
#endif
}

// Storage of the elementwise kernels' arrays: float32, or bf16 as its bits. to_float widens a
// stored value, from_float<T> narrows a float to T (round to nearest even), round_to<T> is the
// float that storing in T keeps.
ZI_HD float to_float(float v) { return v; }
ZI_HD float to_float(uint16_t v) { return bf16_to_float(v); }
template <class T>
ZI_HD T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return float_to_bf16(v);
  }
}
template <class T>
ZI_HD float round_to(float v) {
  return to_float(from_float<T>(v));
}

ZI_HD float fp8e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu, man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_to_float(0x7fc00000u | sign);  // NaN
  if (exp == 0) {
    const float v = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

ZI_HD float e2m1_to_float(uint8_t nibble) {
  constexpr float kLut[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                              -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  return kLut[nibble & 0xfu];
}

ZI_HD float ue8m0_to_float(uint8_t b) {
  if (b == 0xffu) return bits_to_float(0x7fc00000u);
  if (b == 0) return 5.877471754111438e-39f;  // 2^-127: a float32 subnormal
  return bits_to_float(static_cast<uint32_t>(b) << 23);
}

}  // namespace zi
