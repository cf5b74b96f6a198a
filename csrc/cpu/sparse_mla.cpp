// CPU twin of the sparse MLA attention kernel (see zeroinfer/sparse_mla.h for the math).
//
// Work item = (query token t, group of heads). Per item the key lists (main, then extra) are
// walked in chunks of kChunk valid slots: each key of a chunk is gathered and dequantized ONCE
// into a float scratch row and then used by every head of the group (the dequantization is
// shared across heads, as in the GPU kernels). Per head an online softmax keeps a running max
// m, a running sum l and a float accumulator o[512]:
//   m' = max(m, max_j s_j);  a = exp(m - m');  l = a*l + sum_j exp(s_j - m');
//   o  = a*o + sum_j exp(s_j - m') k_j
// and at the end out = o / (l + exp(sink - m)), lse = m + log(l).
//
// The conversion loops are plain loops the compiler vectorises. The two FMA micro-kernels
// (scores and PV) are register-blocked over 4 heads (and 4 keys for the scores) so each loaded
// key vector feeds several FMAs; they are written with the GCC/Clang vector extension (see
// below). Every output element is computed inside one work item, in an order that does not
// depend on the thread count, so results are deterministic.
#include "zeroinfer/sparse_mla.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "zeroinfer/numeric.h"
#include "zeroinfer/parallel.h"

namespace zi {
namespace {

constexpr int64_t D = kSparseMlaDim;
constexpr int kChunk = 64;          // valid keys gathered per step (64 x 2 KiB of float rows)
constexpr int kHeadBlock = 4;       // heads sharing each key load in the micro-kernels
constexpr int64_t kMaxGroup = 64;   // most heads per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e4m3fn -> float with integer masks instead of branches or float selects, so that GCC
// vectorises the dequantization loop; same values as zi::fp8e4m3_to_float. Normal codes move
// their exponent/mantissa bits into a float with the bias changed from 7 to 127; subnormal codes
// are m * 2^-9; S.1111.111 is NaN. No float subnormal is formed, so a flush-to-zero /
// denormals-are-zero FPU mode cannot change the result.
inline float e4m3_to_float_fast(uint32_t b) {
  const uint32_t mag = b & 0x7fu;
  const uint32_t normal = (mag << 20) + (120u << 23);
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(mag & 7u) * 0x1p-9f);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(mag < 8u);     // all ones or zero
  const uint32_t is_nan = 0u - static_cast<uint32_t>(mag == 0x7fu);
  uint32_t bits = (subnormal & is_sub) | (normal & ~is_sub);
  bits = (0x7fc00000u & is_nan) | (bits & ~is_nan);
  return std::bit_cast<float>(bits | ((b & 0x80u) << 24));
}

int64_t block_bytes(const SparseMlaCache& c) {
  switch (c.dtype) {
    case DType::kFloat32: return c.block_size * D * 4;
    case DType::kBFloat16: return c.block_size * D * 2;
    case DType::kUInt8: return c.block_size * kFp8KvBytesPerToken;
    default: return -1;
  }
}

void check_cache(const SparseMlaCache& c, int64_t num_tokens, const char* which) {
  const std::string w = which;
  ZI_CHECK(c.dtype == DType::kFloat32 || c.dtype == DType::kBFloat16 || c.dtype == DType::kUInt8,
           w + " dtype must be float32, bfloat16 or uint8 (FP8 layout), got " +
               dtype_name(c.dtype));
  ZI_CHECK(c.block_size >= 1, w + " block_size must be >= 1");
  ZI_CHECK(c.num_blocks >= 0, w + " num_blocks must be >= 0");
  ZI_CHECK(c.block_stride_bytes >= block_bytes(c), w + " block stride smaller than a block");
  ZI_CHECK(c.topk >= 0 && c.indices_stride >= c.topk, w + " indices topk/stride invalid");
  if (num_tokens > 0 && c.topk > 0) {
    ZI_CHECK(c.indices != nullptr, w + " indices pointer is null");
    ZI_CHECK(c.num_blocks == 0 || c.data != nullptr, w + " data pointer is null");
  }
}

// Float row of `slot`: a pointer into the cache for float32 caches, else `dst` filled with the
// converted / dequantized values.
inline const float* load_key(const SparseMlaCache& c, int64_t slot, float* dst) {
  const int64_t blk = slot / c.block_size, off = slot % c.block_size;
  const uint8_t* base = static_cast<const uint8_t*>(c.data) + blk * c.block_stride_bytes;
  if (c.dtype == DType::kFloat32) return reinterpret_cast<const float*>(base) + off * D;
  if (c.dtype == DType::kBFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(base) + off * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_float(src[d]);
    return dst;
  }
  const uint8_t* row = base + off * kFp8KvRowBytes;
  const uint8_t* scales = base + c.block_size * kFp8KvRowBytes + off * kFp8KvScaleBytes;
  for (int64_t g = 0; g < kSparseMlaNopeDim / kSparseMlaScaleGroup; ++g) {
    const float s = ue8m0_to_float(scales[g]);
    const uint8_t* src = row + g * kSparseMlaScaleGroup;
    float* out = dst + g * kSparseMlaScaleGroup;
    for (int64_t i = 0; i < kSparseMlaScaleGroup; ++i) out[i] = e4m3_to_float_fast(src[i]) * s;
  }
  const uint8_t* rope = row + kSparseMlaNopeDim;
  for (int64_t i = 0; i < kSparseMlaRopeDim; ++i) {
    const uint16_t h = static_cast<uint16_t>(rope[2 * i] | (rope[2 * i + 1] << 8));
    dst[kSparseMlaNopeDim + i] = bf16_to_float(h);
  }
  return dst;
}

// The two micro-kernels work on vectors of kVec floats (one register: 16 with AVX-512, 8 with
// AVX, else 4). They use the GCC/Clang vector extension, not intrinsics: written as plain scalar
// loops, GCC 12 vectorises these register-blocked nests across the key loop with gathers
// instead of along the contiguous 512 dims.
#if defined(__AVX512F__)
constexpr int kVec = 16;
#elif defined(__AVX__)
constexpr int kVec = 8;
#else
constexpr int kVec = 4;
#endif
using Vec = float __attribute__((vector_size(kVec * sizeof(float))));
constexpr int kAccVecs = 4;                 // output vectors per head kept in registers by PV
static_assert(D % (kVec * kAccVecs) == 0, "head dim must tile");

// Everything below is inlined into this file's kernels; no Vec crosses a real call boundary,
// so GCC's note about the vector-argument ABI (when built without -march=native) is moot.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

inline Vec load_vec(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(Vec));
  return v;
}
inline void store_vec(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(Vec)); }
// Sum of the lanes as a tree (log2(kVec) dependent steps instead of kVec - 1); for the blocks
// that hsum4 does not cover.
inline float hsum(Vec v) {
  float t[kVec];
  store_vec(t, v);
  for (int w = kVec / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

// The lane sums of four 16-lane vectors at once, in registers: each step adds the two halves
// of two vectors packed side by side; 13 shuffles/adds for the four sums instead of four
// separate trees. (A round trip through memory, as in hsum, stalls on store forwarding here.)
using Vec16 = float __attribute__((vector_size(16 * sizeof(float))));
inline void hsum4(Vec16 a, Vec16 b, Vec16 c, Vec16 d, float* out) {
#define ZI_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define ZI_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
  // ab = [a (8 partial sums) | b (8)], cd likewise
  const Vec16 ab = __builtin_shufflevector(a, b, ZI_LO8) + __builtin_shufflevector(a, b, ZI_HI8);
  const Vec16 cd = __builtin_shufflevector(c, d, ZI_LO8) + __builtin_shufflevector(c, d, ZI_HI8);
#undef ZI_LO8
#undef ZI_HI8
  // x = [a (4) | b (4) | c (4) | d (4)]
  const Vec16 x =
      __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
      __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const Vec16 y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15,
                                              12, 13);
  const Vec16 z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12,
                                              15, 14);
  out[0] = z[0];
  out[1] = z[4];
  out[2] = z[8];
  out[3] = z[12];
}

// s[h][j] = q_h . k_j for HB heads and KB keys; each loaded q / k vector feeds KB / HB FMAs.
template <int HB, int KB>
inline void dot_block(const float* q, const float* const* k, float* s, int s_stride) {
  Vec acc[HB][KB] = {};
  for (int64_t d = 0; d < D; d += kVec) {
    Vec kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = load_vec(k[j] + d);
    for (int h = 0; h < HB; ++h) {
      const Vec qv = load_vec(q + h * D + d);
      for (int j = 0; j < KB; ++j) acc[h][j] += qv * kv[j];
    }
  }
  for (int h = 0; h < HB; ++h) {
    if constexpr (KB == 4 && kVec == 16) {
      hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3], s + h * s_stride);
    } else {
      for (int j = 0; j < KB; ++j) s[h * s_stride + j] = hsum(acc[h][j]);
    }
  }
}

// o_h = alpha_h * o_h + sum_j p[h][j] k_j for HB heads, kAccVecs vectors of columns at a time
// kept in registers; each loaded key vector feeds HB FMAs.
template <int HB>
inline void pv_block(float* o, const float* alpha, const float* p, int p_stride,
                     const float* const* k, int n) {
  constexpr int64_t kCols = kVec * kAccVecs;
  for (int64_t c = 0; c < D; c += kCols) {
    Vec acc[HB][kAccVecs];
    for (int h = 0; h < HB; ++h)
      for (int v = 0; v < kAccVecs; ++v) acc[h][v] = load_vec(o + h * D + c + v * kVec) * alpha[h];
    for (int j = 0; j < n; ++j) {
      Vec kv[kAccVecs];
      for (int v = 0; v < kAccVecs; ++v) kv[v] = load_vec(k[j] + c + v * kVec);
      for (int h = 0; h < HB; ++h) {
        const float ph = p[h * p_stride + j];
        for (int v = 0; v < kAccVecs; ++v) acc[h][v] += ph * kv[v];
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int v = 0; v < kAccVecs; ++v) store_vec(o + h * D + c + v * kVec, acc[h][v]);
  }
}

// One block of HB heads against one chunk of n keys: scores, online-softmax update, PV.
template <int HB>
void chunk_heads(const float* q, float* o, float* m, float* l, const float* const* k, int n,
                 float scale) {
  float s[HB][kChunk];
  int j = 0;
  for (; j + 4 <= n; j += 4) dot_block<HB, 4>(q, k + j, &s[0][j], kChunk);
  for (; j < n; ++j) dot_block<HB, 1>(q, k + j, &s[0][j], kChunk);
  float alpha[HB];
  for (int h = 0; h < HB; ++h) {
    float mx = kNegInf;
    for (int i = 0; i < n; ++i) {
      s[h][i] *= scale;
      mx = std::max(mx, s[h][i]);
    }
    const float m_new = std::max(m[h], mx);
    // m_new is finite (n >= 1 valid key, finite inputs); a = 0 on the first chunk (m = -inf).
    alpha[h] = std::exp(m[h] - m_new);
    float sum = 0.f;
    for (int i = 0; i < n; ++i) {
      s[h][i] = std::exp(s[h][i] - m_new);
      sum += s[h][i];
    }
    l[h] = l[h] * alpha[h] + sum;
    m[h] = m_new;
  }
  pv_block<HB>(o, alpha, &s[0][0], kChunk, k, n);
}

#pragma GCC diagnostic pop

void chunk_all_heads(const float* q, float* o, float* m, float* l, int64_t nh,
                     const float* const* k, int n, float scale) {
  int64_t h = 0;
  for (; h + kHeadBlock <= nh; h += kHeadBlock)
    chunk_heads<kHeadBlock>(q + h * D, o + h * D, m + h, l + h, k, n, scale);
  switch (nh - h) {
    case 3: chunk_heads<3>(q + h * D, o + h * D, m + h, l + h, k, n, scale); break;
    case 2: chunk_heads<2>(q + h * D, o + h * D, m + h, l + h, k, n, scale); break;
    case 1: chunk_heads<1>(q + h * D, o + h * D, m + h, l + h, k, n, scale); break;
    default: break;
  }
}

// Per-thread scratch, grown on demand and reused across calls (no allocation per key).
struct Scratch {
  std::vector<float> q, o, keys, m, l;
  void reserve(int64_t heads) {
    if (static_cast<int64_t>(q.size()) < heads * D) {
      q.resize(heads * D);
      o.resize(heads * D);
      m.resize(heads);
      l.resize(heads);
    }
    if (keys.size() < static_cast<size_t>(kChunk * D)) keys.resize(kChunk * D);
  }
};

void run_item(const SparseMlaParams& p, int64_t t, int64_t h0, int64_t nh, Scratch& sc) {
  sc.reserve(nh);
  float* q = sc.q.data();
  float* o = sc.o.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t src = t * p.q_stride_token + (h0 + h) * p.q_stride_head;
    if (p.q_dtype == DType::kFloat32) {
      std::memcpy(q + h * D, static_cast<const float*>(p.q) + src, D * sizeof(float));
    } else {
      const uint16_t* qs = static_cast<const uint16_t*>(p.q) + src;
      for (int64_t d = 0; d < D; ++d) q[h * D + d] = bf16_to_float(qs[d]);
    }
    m[h] = kNegInf;
    l[h] = 0.f;
  }
  std::fill(o, o + nh * D, 0.f);

  const float* rows[kChunk];
  int n = 0;
  const SparseMlaCache* caches[2] = {&p.kv, &p.extra_kv};
  const int num_caches = p.has_extra ? 2 : 1;
  for (int ci = 0; ci < num_caches; ++ci) {
    const SparseMlaCache& c = *caches[ci];
    const int64_t num_slots = c.num_blocks * c.block_size;
    const int32_t* idx = c.indices + t * c.indices_stride;
    for (int64_t i = 0; i < c.topk; ++i) {
      const int64_t slot = idx[i];
      if (slot == -1) continue;
      ZI_CHECK(slot >= 0 && slot < num_slots,
               "slot " + std::to_string(slot) + " outside [-1, " + std::to_string(num_slots) +
                   ") in " + (ci == 0 ? "indices" : "extra_indices"));
      rows[n] = load_key(c, slot, sc.keys.data() + n * D);
      if (++n == kChunk) {
        chunk_all_heads(q, o, m, l, nh, rows, n, p.softmax_scale);
        n = 0;
      }
    }
  }
  if (n > 0) chunk_all_heads(q, o, m, l, nh, rows, n, p.softmax_scale);

  for (int64_t h = 0; h < nh; ++h) {
    const int64_t hh = h0 + h;
    float* oh = o + h * D;
    if (l[h] > 0.f) {
      float denom = l[h];
      if (p.attn_sink != nullptr) denom += std::exp(p.attn_sink[hh] - m[h]);
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
      p.lse[t * p.lse_stride_token + hh] = m[h] + std::log(l[h]);
    } else {  // no valid key: out = 0, lse = -inf (with or without a sink)
      std::fill(oh, oh + D, 0.f);
      p.lse[t * p.lse_stride_token + hh] = kNegInf;
    }
    const int64_t dst = t * p.out_stride_token + hh * p.out_stride_head;
    if (p.q_dtype == DType::kFloat32) {
      std::memcpy(static_cast<float*>(p.out) + dst, oh, D * sizeof(float));
    } else {
      uint16_t* od = static_cast<uint16_t*>(p.out) + dst;
      for (int64_t d = 0; d < D; ++d) od[d] = float_to_bf16(oh[d]);
    }
  }
}

}  // namespace

void sparse_mla_attention_cpu(const SparseMlaParams& p) {
  ZI_CHECK(p.q_dtype == DType::kFloat32 || p.q_dtype == DType::kBFloat16,
           std::string("q dtype must be float32 or bfloat16, got ") + dtype_name(p.q_dtype));
  ZI_CHECK(p.num_tokens >= 0 && p.num_heads >= 1, "need num_tokens >= 0 and num_heads >= 1");
  ZI_CHECK(p.q_stride_head >= D && p.out_stride_head >= D, "head strides must be >= 512");
  ZI_CHECK(p.q_stride_token >= p.num_heads * D && p.out_stride_token >= p.num_heads * D,
           "token strides must cover all heads");
  ZI_CHECK(p.lse_stride_token >= p.num_heads, "lse token stride must be >= num_heads");
  ZI_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.f,
           "softmax_scale must be finite and > 0");
  check_cache(p.kv, p.num_tokens, "kv_cache");
  if (p.has_extra) {
    check_cache(p.extra_kv, p.num_tokens, "extra_kv_cache");
    const bool fp8 = p.kv.dtype == DType::kUInt8;
    ZI_CHECK((p.extra_kv.dtype == DType::kUInt8) == fp8,
             "kv_cache and extra_kv_cache must both use the FP8 layout or neither");
  }
  if (p.num_tokens == 0) return;
  ZI_CHECK(p.q != nullptr && p.out != nullptr && p.lse != nullptr, "null q/out/lse pointer");

  // Head groups: as large as possible (dequantization is shared within a group) while giving
  // every thread a couple of work items, so decode (T = 1, H = 64) still uses all threads.
  const int64_t want_items = 2 * static_cast<int64_t>(num_threads());
  int64_t group = std::min(p.num_heads, kMaxGroup);
  while (group > 2 * kHeadBlock &&
         p.num_tokens * ((p.num_heads + group - 1) / group) < want_items)
    group = (group + 1) / 2;
  group = std::min(p.num_heads, (group + kHeadBlock - 1) / kHeadBlock * kHeadBlock);
  const int64_t groups_per_token = (p.num_heads + group - 1) / group;

  parallel_for(p.num_tokens * groups_per_token, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / groups_per_token;
      const int64_t h0 = (item % groups_per_token) * group;
      run_item(p, t, h0, std::min(group, p.num_heads - h0), scratch);
    }
  });
}

}  // namespace zi
