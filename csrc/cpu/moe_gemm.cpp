// CPU twin of the MXFP4 grouped GEMM (see zeroinfer/moe_gemm.h for the contract).
//
// Work item = (expert, tile of output columns), handed out by zi::parallel_for. A work item
//   1. dequantizes its weight rows ONCE into a thread-local float scratch [tile rows][k]
//      (with fuse_swiglu: the tile's gate rows c0.. followed by the matching up rows n/2 + c0..),
//   2. walks the expert's rows in blocks, converting each block of activations to float once
//      (f32 / bf16 / fp8 * a_scale) into a second scratch [block rows][k],
//   3. computes every dot product of the block against the tile with a register-blocked R x C
//      micro-kernel: R*C accumulators of 16 float lanes each, over contiguous k,
//   4. applies the epilogue (SwiGLU, bf16 rounding) and writes the block's output rows.
// Experts with no rows produce no work items, so their weights are never touched. Scratch is
// thread-local and only ever grows: no allocation per row or per call in the steady state.
//
// K order inside the scratches: within every 32-group the even elements come first, then the odd
// ones ([0,2,..,30, 1,3,..,31]). Weights are stored two per byte (even = low nibble), so this is
// the order in which a byte row unpacks with contiguous stores; activations are permuted the same
// way, and a dot product does not care about the order of its terms.
//
// Vector code: the micro-kernel uses GCC/Clang vector extensions (AVX-512, AVX2 or SSE as the
// target allows); dequantization and activation conversion have AVX-512 intrinsic paths (one
// vpermps per 16 nibbles) and portable scalar fallbacks (built with ZEROINFER_NATIVE=OFF or on
// CPUs without AVX-512BW).
#include "zeroinfer/moe_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "zeroinfer/numeric.h"
#include "zeroinfer/parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
// GCC 12 reports a false -Wmaybe-uninitialized inside the AVX-512 headers (_mm512_undefined_*).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define ZI_MOE_AVX512 1  // intrinsic fast paths for dequant / activation conversion
#else
#define ZI_MOE_AVX512 0  // portable scalar loops
#endif

namespace zi {
namespace {

constexpr int kLanes = 16;  // accumulator width (one AVX-512 register, two AVX2 ones)
constexpr int kMicroR = 4;  // activation rows per micro-kernel
constexpr int kMicroC = 4;  // weight rows per micro-kernel

// Vector types (GCC/Clang vector extensions; lowered to AVX-512, AVX2 or SSE as available).
// Functions taking/returning them are internal (anonymous namespace), so GCC's note that their
// ABI differs without AVX-512 does not matter.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float VecF __attribute__((vector_size(kLanes * 4)));
typedef float VecFU __attribute__((vector_size(kLanes * 4), aligned(4)));      // unaligned
typedef uint32_t VecU32U __attribute__((vector_size(kLanes * 4), aligned(2)));  // unaligned

inline VecF load(const float* p) { return *reinterpret_cast<const VecFU*>(p); }
inline void store(float* p, VecF v) { *reinterpret_cast<VecFU*>(p) = v; }

// ---- weights: one packed row (k/2 bytes + k/32 UE8M0 scales) -> k floats, permuted K order ----
// Per 32-group: the 16 low nibbles (even elements), then the 16 high nibbles (odd elements).
#if ZI_MOE_AVX512
// AVX-512: widen 16 bytes to 16 lanes; vpermps with the 16-entry e2m1 table decodes a nibble.
void dequant_row(const uint8_t* __restrict q, const uint8_t* __restrict sc, int64_t k,
                 float* __restrict dst) {
  const __m512 lut = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f,
                                    -1.5f, -2.f, -3.f, -4.f, -6.f);
  for (int64_t g = 0; g < k / 32; ++g) {
    const __m512 s = _mm512_set1_ps(ue8m0_to_float(sc[g]));
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16)));
    // vpermps reads only the low 4 bits of each index: the low nibble needs no mask.
    _mm512_storeu_ps(dst + g * 32, _mm512_mul_ps(_mm512_permutexvar_ps(b, lut), s));
    _mm512_storeu_ps(dst + g * 32 + 16,
                     _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), s));
  }
}
#else
void dequant_row(const uint8_t* __restrict q, const uint8_t* __restrict sc, int64_t k,
                 float* __restrict dst) {
  for (int64_t g = 0; g < k / 32; ++g) {
    const float s = ue8m0_to_float(sc[g]);
    const uint8_t* b = q + g * 16;
    float* d = dst + g * 32;
    for (int j = 0; j < 16; ++j) d[j] = e2m1_to_float(b[j] & 0xfu) * s;
    for (int j = 0; j < 16; ++j) d[16 + j] = e2m1_to_float(b[j] >> 4) * s;
  }
}
#endif

// W4A8: a dequantized row -> the weights as float8 activations use them (zeroinfer/moe_gemm.h):
// per 128-k block, groups whose scale is more than 14 binades under the block's largest are
// rounded to the e4m3 subnormal grid of that base (the others are exact already), a NaN base
// makes the block NaN. The permuted K order stays inside each 32-group, so blocks are intact.
void fold_w4a8_row(const uint8_t* __restrict sc, int64_t k, float* __restrict dst) {
  for (int64_t blk = 0; blk < k / 128; ++blk) {
    const uint8_t* s4 = sc + blk * 4;
    const int b = std::max(std::max(s4[0], s4[1]), std::max(s4[2], s4[3]));
    float* d = dst + blk * 128;
    if (b == 255) {
      std::fill(d, d + 128, std::nanf(""));
      continue;
    }
    for (int g = 0; g < 4; ++g) {
      if (b - s4[g] <= 14) continue;
      for (int i = 0; i < 32; ++i) {  // x = e2m1 * 2^(s-b+6) < 2^-6: half-to-even on 2^-9
        const float x = std::ldexp(d[g * 32 + i], 133 - b);
        d[g * 32 + i] = std::ldexp(std::nearbyint(x * 512.f) / 512.f, b - 133);
      }
    }
  }
}

// ---- activations: one row -> k floats in the same permuted K order ----------------------------
// bf16 (both paths): 32 bf16 = 16 u32 lanes holding (even | odd << 16); even = lane << 16,
// odd = lane & 0xffff0000 are exactly the float bits.
void convert_row_bf16(const uint16_t* __restrict x, int64_t k, float* __restrict dst) {
  for (int64_t g = 0; g < k / 32; ++g) {
    const VecU32U v = *reinterpret_cast<const VecU32U*>(x + g * 32);
    store(dst + g * 32, reinterpret_cast<VecF>(v << 16));
    store(dst + g * 32 + 16, reinterpret_cast<VecF>(v & 0xffff0000u));
  }
}

#if ZI_MOE_AVX512
void convert_row_f32(const float* __restrict x, int64_t k, float* __restrict dst) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t g = 0; g < k / 32; ++g) {
    const __m512 v0 = _mm512_loadu_ps(x + g * 32), v1 = _mm512_loadu_ps(x + g * 32 + 16);
    _mm512_storeu_ps(dst + g * 32, _mm512_permutex2var_ps(v0, even, v1));
    _mm512_storeu_ps(dst + g * 32 + 16, _mm512_permutex2var_ps(v0, odd, v1));
  }
}

// 16 e4m3fn bytes (in 32-bit lanes) -> floats: normal = bits ((b & 0x7f) << 20) + (120 << 23);
// exponent 0 = (b & 7) * 2^-9; 0x7f / 0xff = NaN; bit 7 = sign.
inline __m512 fp8_decode(__m512i b) {
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f));
  __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
  v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
  return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), v,
                              _mm512_set1_ps(std::nanf("")));
}

void convert_row_fp8(const uint8_t* __restrict x, const float* __restrict scale, int64_t k,
                     float* __restrict dst) {
  for (int64_t g = 0; g < k / 32; ++g) {
    const __m512 s = _mm512_set1_ps(scale[g / 4]);
    // 16 u16 lanes = (b[2j] | b[2j+1] << 8), widened to 32-bit lanes.
    const __m512i v =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * 32)));
    _mm512_storeu_ps(dst + g * 32,
                     _mm512_mul_ps(fp8_decode(_mm512_and_si512(v, _mm512_set1_epi32(0xff))), s));
    _mm512_storeu_ps(dst + g * 32 + 16, _mm512_mul_ps(fp8_decode(_mm512_srli_epi32(v, 8)), s));
  }
}
#else
void convert_row_f32(const float* __restrict x, int64_t k, float* __restrict dst) {
  for (int64_t g = 0; g < k / 32; ++g) {
    for (int j = 0; j < 16; ++j) dst[g * 32 + j] = x[g * 32 + 2 * j];
    for (int j = 0; j < 16; ++j) dst[g * 32 + 16 + j] = x[g * 32 + 2 * j + 1];
  }
}

void convert_row_fp8(const uint8_t* __restrict x, const float* __restrict scale, int64_t k,
                     float* __restrict dst) {
  for (int64_t g = 0; g < k / 32; ++g) {
    const float s = scale[g / 4];
    for (int j = 0; j < 16; ++j) dst[g * 32 + j] = fp8e4m3_to_float(x[g * 32 + 2 * j]) * s;
    for (int j = 0; j < 16; ++j)
      dst[g * 32 + 16 + j] = fp8e4m3_to_float(x[g * 32 + 2 * j + 1]) * s;
  }
}
#endif

void convert_row(const void* a_row, DType dt, const float* scale_row, int64_t k,
                 float* __restrict dst) {
  if (dt == DType::kFloat32)
    convert_row_f32(static_cast<const float*>(a_row), k, dst);
  else if (dt == DType::kBFloat16)
    convert_row_bf16(static_cast<const uint16_t*>(a_row), k, dst);
  else
    convert_row_fp8(static_cast<const uint8_t*>(a_row), scale_row, k, dst);
}

// out[r * ldo + c] = dot(a + r * k, w + c * k) for r < R, c < C; k is a multiple of kLanes.
// Each accumulator is a vector of kLanes independent partial sums (GCC/Clang vector extension:
// one AVX-512 register, or two AVX2 ones), so the R*C accumulators stay in registers and the
// k loop needs no reassociation; the lanes are summed once at the end.
template <int R, int C>
inline void micro_kernel(const float* __restrict a, const float* __restrict w, int64_t k,
                         float* __restrict out, int64_t ldo) {
  VecF acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = VecF{};
  for (int64_t kk = 0; kk < k; kk += kLanes) {
    VecF wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = load(w + c * k + kk);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const VecF av = load(a + r * k + kk);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] += av * wv[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += acc[r][c][l];
      out[r * ldo + c] = s;
    }
  }
}

template <int R>
inline void micro_row_block(const float* a, const float* w, int64_t k, int64_t cols, float* out,
                            int64_t ldo) {
  int64_t c = 0;
  for (; c + kMicroC <= cols; c += kMicroC) micro_kernel<R, kMicroC>(a, w + c * k, k, out + c, ldo);
  switch (cols - c) {
    case 3: micro_kernel<R, 3>(a, w + c * k, k, out + c, ldo); break;
    case 2: micro_kernel<R, 2>(a, w + c * k, k, out + c, ldo); break;
    case 1: micro_kernel<R, 1>(a, w + c * k, k, out + c, ldo); break;
    default: break;
  }
}

// out[rows][cols] (row stride ldo) = a[rows][k] · w[cols][k]ᵀ.
void block_gemm(const float* a, int64_t rows, const float* w, int64_t cols, int64_t k, float* out,
                int64_t ldo) {
  int64_t r = 0;
  for (; r + kMicroR <= rows; r += kMicroR)
    micro_row_block<kMicroR>(a + r * k, w, k, cols, out + r * ldo, ldo);
  switch (rows - r) {
    case 3: micro_row_block<3>(a + r * k, w, k, cols, out + r * ldo, ldo); break;
    case 2: micro_row_block<2>(a + r * k, w, k, cols, out + r * ldo, ldo); break;
    case 1: micro_row_block<1>(a + r * k, w, k, cols, out + r * ldo, ldo); break;
    default: break;
  }
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

size_t dtype_size(DType d) {
  switch (d) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    default: return 0;
  }
}

// Scratch reused across work items and calls (grown, never shrunk).
struct Scratch {
  std::vector<float> w, a, y;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

void grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

void mxfp4_grouped_gemm_cpu(const Mxfp4GemmParams& p) {
  const bool masked = p.masked_m != nullptr, routed = p.route_ids != nullptr;
  ZI_CHECK(int{masked} + int{routed} + int{p.expert_offsets != nullptr} == 1,
           "exactly one of expert_offsets / masked_m / route_ids must be given");
  ZI_CHECK(!routed || (p.route_div >= 1 && p.m % p.route_div == 0),
           "route_div must be >= 1 and divide m");
  ZI_CHECK(!(masked && p.expert_counts != nullptr), "expert_counts only with expert_offsets");
  ZI_CHECK(p.num_experts >= 1, "num_experts must be >= 1");
  ZI_CHECK(p.n >= 1 && p.k >= 32 && p.k % 32 == 0, "need n >= 1 and k a positive multiple of 32");
  ZI_CHECK(p.a_dtype == DType::kFloat32 || p.a_dtype == DType::kBFloat16 ||
               p.a_dtype == DType::kFloat8E4M3,
           std::string("unsupported activation dtype ") + dtype_name(p.a_dtype));
  ZI_CHECK(p.out_dtype == DType::kFloat32 || p.out_dtype == DType::kBFloat16,
           std::string("unsupported output dtype ") + dtype_name(p.out_dtype));
  const bool fp8 = p.a_dtype == DType::kFloat8E4M3;
  ZI_CHECK(fp8 == (p.a_scale != nullptr), "a_scale is required exactly for float8 activations");
  ZI_CHECK(!fp8 || p.k % 128 == 0, "float8 activations need k a multiple of 128");
  ZI_CHECK(!p.fuse_swiglu || p.n % 2 == 0, "fuse_swiglu needs an even n");
  ZI_CHECK(!p.has_swiglu_limit || (p.fuse_swiglu && std::isfinite(p.swiglu_limit) &&
                                   p.swiglu_limit > 0.f),
           "swiglu_limit must be finite, > 0 and only with fuse_swiglu");
  ZI_CHECK(masked ? p.cap >= 0 : p.m >= 0, "negative row count");

  const int64_t E = p.num_experts, k = p.k;
  const int64_t n_out = p.fuse_swiglu ? p.n / 2 : p.n;

  // Rows of each expert: [row0[e], row0[e] + cnt[e]) of a / out (flattened over experts if masked;
  // routed: of the row order `order`, the output rows sorted stably by expert).
  std::vector<int64_t> row0(E), cnt(E), order;
  if (routed) {
    for (int64_t i = 0; i < p.m; ++i) {
      const int64_t e = p.route_ids[i];
      if (e >= 0 && e < E) ++cnt[e];
    }
    for (int64_t e = 0, r = 0; e < E; r += cnt[e], ++e) row0[e] = r;
    order.resize(p.m);
    std::vector<int64_t> cursor(row0);
    for (int64_t i = 0; i < p.m; ++i) {
      const int64_t e = p.route_ids[i];
      if (e >= 0 && e < E) order[cursor[e]++] = i;
    }
  }
  for (int64_t e = 0; e < E && !routed; ++e) {
    if (masked) {
      const int64_t mm = p.masked_m[e];
      ZI_CHECK(mm >= 0 && mm <= p.cap, "masked_m[e] must be in [0, cap]");
      row0[e] = e * p.cap;
      cnt[e] = mm;
    } else {
      const int64_t lo = p.expert_offsets[e], hi = p.expert_offsets[e + 1];
      ZI_CHECK(lo >= 0 && lo <= hi && hi <= p.m, "expert_offsets must be nondecreasing in [0, m]");
      const int64_t c = p.expert_counts ? p.expert_counts[e] : hi - lo;
      ZI_CHECK(c >= 0 && c <= hi - lo, "expert_counts[e] must be in [0, segment size]");
      row0[e] = lo;
      cnt[e] = c;
    }
  }
  std::vector<int64_t> active;
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (cnt[e] > 0) {
      active.push_back(e);
      max_rows = std::max(max_rows, cnt[e]);
    }
  }
  if (active.empty()) return;
  ZI_CHECK(p.a && p.w && p.w_scale && p.out, "null data pointer");

  // Output columns per work item: the float weight tile (cols, or 2*cols with SwiGLU, rows of k
  // floats) stays within ~512 KiB so it lives in L2 while the expert's rows stream past it.
  const int64_t wrows_per_col = p.fuse_swiglu ? 2 : 1;
  int64_t tile = (int64_t{512} << 10) / (k * 4 * wrows_per_col);
  tile = std::clamp<int64_t>(tile, 8, 64) / 4 * 4;
  // Enough work items that every thread gets some, even for a single small expert.
  const int64_t want_items = 4 * num_threads();
  while (tile > 4 && static_cast<int64_t>(active.size()) * ((n_out + tile - 1) / tile) < want_items)
    tile /= 2;
  const int64_t tiles = (n_out + tile - 1) / tile;
  // Activation rows converted at a time: a block of ~128 KiB of floats.
  const int64_t block = std::clamp<int64_t>((int64_t{128} << 10) / (k * 4), 4, 64) / 4 * 4;

  const size_t a_elem = dtype_size(p.a_dtype);
  const int64_t groups = k / 32;
  const int64_t n_half = p.n / 2;

  auto run_item = [&](int64_t item) {
    const int64_t e = active[item / tiles];
    const int64_t c0 = (item % tiles) * tile;
    const int64_t tc = std::min(tile, n_out - c0);   // output columns of this item
    const int64_t wr = tc * wrows_per_col;            // weight rows in the scratch tile
    Scratch& s = scratch();
    grow(s.w, static_cast<size_t>(wr * k));
    grow(s.a, static_cast<size_t>(block * k));
    grow(s.y, static_cast<size_t>(block * wr));

    // 1. Dequantize the tile: gate/plain rows c0.., then (SwiGLU) up rows n/2 + c0..
    const uint8_t* wq = p.w + e * p.n * (k / 2);
    const uint8_t* ws = p.w_scale + e * p.n * groups;
    for (int64_t j = 0; j < wr; ++j) {
      const int64_t row = j < tc ? c0 + j : n_half + c0 + (j - tc);
      dequant_row(wq + row * (k / 2), ws + row * groups, k, s.w.data() + j * k);
      if (fp8) fold_w4a8_row(ws + row * groups, k, s.w.data() + j * k);
    }

    for (int64_t r0 = 0; r0 < cnt[e]; r0 += block) {
      const int64_t rb = std::min(block, cnt[e] - r0);
      const int64_t first = row0[e] + r0;  // global row index in a / out (routed: in order)
      auto out_row = [&](int64_t r) { return routed ? order[first + r] : first + r; };
      // 2. Activation rows -> float.
      for (int64_t r = 0; r < rb; ++r) {
        const int64_t row = routed ? out_row(r) / p.route_div : first + r;
        convert_row(static_cast<const char*>(p.a) + row * k * a_elem, p.a_dtype,
                    fp8 ? p.a_scale + row * (k / 128) : nullptr, k, s.a.data() + r * k);
      }
      // 3. All dot products of the block against the tile.
      block_gemm(s.a.data(), rb, s.w.data(), wr, k, s.y.data(), wr);
      // 4. Epilogue.
      for (int64_t r = 0; r < rb; ++r) {
        const float* y = s.y.data() + r * wr;
        float* of = nullptr;
        uint16_t* ob = nullptr;
        if (p.out_dtype == DType::kFloat32)
          of = static_cast<float*>(p.out) + out_row(r) * n_out + c0;
        else
          ob = static_cast<uint16_t*>(p.out) + out_row(r) * n_out + c0;
        for (int64_t c = 0; c < tc; ++c) {
          float v = y[c];
          if (p.fuse_swiglu) {
            float g = v, u = y[tc + c];
            if (p.has_swiglu_limit) {
              g = std::min(g, p.swiglu_limit);
              u = std::clamp(u, -p.swiglu_limit, p.swiglu_limit);
            }
            v = silu(g) * u;
          }
          if (of)
            of[c] = v;
          else
            ob[c] = float_to_bf16(v);
        }
      }
    }
  };

  parallel_for(static_cast<int64_t>(active.size()) * tiles, 1, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) run_item(i);
  });
}

}  // namespace zi
