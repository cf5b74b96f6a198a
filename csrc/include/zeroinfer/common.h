// Shared plumbing for every kernel family: the error type the bindings turn into Python
// exceptions, and the dtype codes Python passes across the torch-free boundary.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace zi {

// Dtype codes shared with python/zeroinfer/ops/_backend.py (keep the two in sync).
enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kUInt8 = 3,     // raw bytes: packed FP4 pairs, UE8M0 scales, the FP8 KV layout
  kInt32 = 4,
  kInt64 = 5,
  kFloat8E4M3 = 6,
};

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

// The Python layer validates every argument before calling into C++; these checks are the
// last line of defence (a bug in that layer must not become a silent out-of-bounds access).
[[noreturn]] inline void fail(const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << "zeroinfer internal check failed at " << file << ":" << line << ": " << msg;
  throw std::invalid_argument(os.str());
}

}  // namespace zi

#define ZI_CHECK(cond, msg)                                              \
  do {                                                                   \
    if (!(cond)) ::zi::fail(__FILE__, __LINE__, std::string(#cond ": ") + (msg)); \
  } while (0)

namespace zi {

// Calls f(T{}) for an array stored as float32 (T = float) or bfloat16 (T = uint16_t, its bits:
// zeroinfer/numeric.h's to_float / from_float); any other dtype fails with `what`.
template <class F>
void dispatch_float_or_bf16(DType dtype, const char* what, F&& f) {
  if (dtype == DType::kFloat32) {
    f(float{});
  } else {
    ZI_CHECK(dtype == DType::kBFloat16, what);
    f(uint16_t{});
  }
}

}  // namespace zi
