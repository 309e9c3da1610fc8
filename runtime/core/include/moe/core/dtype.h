// Element types of weights and activations, and the scalar conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace moe::core {

// kF8E4M3 (OCP fp8 e4m3, "fn": no infinities, max 448): the KV cache with --kv-cache-dtype fp8,
// and FP8 checkpoints' weights (read with their block scales: runtime's fp8_source.h).
enum class DType { kBF16, kF16, kF32, kI8, kI32, kI64, kF8E4M3 };

// Bytes per element.
constexpr int64_t DTypeSize(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI8:
    case DType::kF8E4M3:
      return 1;
    case DType::kI64:
      return 8;
  }
  return 0;
}

// The safetensors spelling: "BF16", "F16", "F32", "I8", "I32", "I64", "F8_E4M3".
const char* DTypeName(DType t);
std::optional<DType> DTypeFromName(std::string_view name);

// bfloat16: the top 16 bits of an IEEE float.
inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE half precision to float (subnormals, infinities and NaN included).
float F16ToFloat(uint16_t h);

// fp8 e4m3 (fn) to float; 0x7f and 0xff are NaN.
float F8E4M3ToFloat(uint8_t v);
// Round to nearest even, saturating to +-448 (as CUDA's __nv_cvt_float_to_fp8 with
// __NV_SATFINITE does); NaN stays NaN.
uint8_t FloatToF8E4M3(float f);
// The largest finite fp8 e4m3 value.
inline constexpr float kF8E4M3Max = 448.0f;

// Converts `n` elements of type `src_type` to float.
void ConvertToFloat(const void* src, DType src_type, float* dst, int64_t n);

}  // namespace moe::core
