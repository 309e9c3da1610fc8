#include "moe/core/dtype.h"

namespace moe::core {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    case DType::kI8: return "I8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

std::optional<DType> DTypeFromName(std::string_view name) {
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "F32") return DType::kF32;
  if (name == "I8") return DType::kI8;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  return std::nullopt;
}

float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void ConvertToFloat(const void* src, DType src_type, float* dst, int64_t n) {
  switch (src_type) {
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kI8: {
      const auto* s = static_cast<const int8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::kI32: {
      const auto* s = static_cast<const int32_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kI64: {
      const auto* s = static_cast<const int64_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
  }
}

}  // namespace moe::core
