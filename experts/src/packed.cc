#include "moe/experts/packed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "moe/core/dtype.h"

namespace moe::experts {
namespace {

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Index of (n % 16, k) inside a block's int8 lines: line k / 4, byte (n % 16) * 4 + k % 4.
int64_t QuadIndex(int64_t r, int64_t k) { return (k / 4) * 64 + r * 4 + k % 4; }

}  // namespace

const char* FormatName(ExpertFormat f) {
  switch (f) {
    case ExpertFormat::kBF16: return "bf16";
    case ExpertFormat::kInt8: return "int8";
    case ExpertFormat::kInt4: return "int4";
  }
  return "?";
}

absl::StatusOr<ExpertFormat> ParseFormat(const std::string& name) {
  if (name == "bf16") return ExpertFormat::kBF16;
  if (name == "int8") return ExpertFormat::kInt8;
  if (name == "int4") return ExpertFormat::kInt4;
  return absl::InvalidArgumentError(absl::StrCat("expert format '", name, "' is not one of bf16, int8, int4"));
}

int64_t MatrixLayout::block_bytes() const {
  switch (format) {
    case ExpertFormat::kBF16: return 16 * k_pad * 2;
    case ExpertFormat::kInt8: return 16 * k_pad;
    case ExpertFormat::kInt4: return 16 * k_pad / 2;
  }
  return 0;
}

int64_t MatrixLayout::scale_bytes() const {
  switch (format) {
    case ExpertFormat::kBF16: return 0;
    case ExpertFormat::kInt8: return RoundUp(n_pad * 4, 64);
    case ExpertFormat::kInt4: return RoundUp(n_pad * groups() * 4, 64);
  }
  return 0;
}

absl::StatusOr<MatrixLayout> MakeLayout(ExpertFormat format, int64_t n, int64_t k, int group) {
  if (group != 32 && group != 64 && group != 128) {
    return absl::InvalidArgumentError(absl::StrCat("int4 group size ", group, " is not 32, 64 or 128"));
  }
  if (n <= 0 || k <= 0) return absl::InvalidArgumentError(absl::StrCat("bad matrix shape [", n, ", ", k, "]"));
  MatrixLayout l;
  l.format = format;
  l.n = n;
  l.k = k;
  l.group = group;
  l.n_pad = RoundUp(n, 16);
  l.k_pad = RoundUp(k, format == ExpertFormat::kInt4 ? std::max<int64_t>(64, group) : 64);
  return l;
}

absl::Status PackMatrix(const core::TensorView& w, const MatrixLayout& l, uint8_t* out) {
  if (w.rank() != 2 || w.dim(0) != l.n || w.dim(1) != l.k) {
    return absl::InvalidArgumentError(absl::StrCat("expert matrix has shape ", core::ShapeString(w.shape),
                                                   ", expected [", l.n, ", ", l.k, "]"));
  }
  const int64_t row_bytes = l.k * core::DTypeSize(w.dtype);
  PackRows(
      l,
      [&](int64_t n, float* dst) {
        core::ConvertToFloat(static_cast<const uint8_t*>(w.data) + n * row_bytes, w.dtype, dst, l.k);
      },
      out);
  return absl::OkStatus();
}

void PackRows(const MatrixLayout& l, const std::function<void(int64_t n, float* dst)>& source, uint8_t* out) {
  std::memset(out, 0, l.bytes());
  std::vector<float> row(l.k_pad, 0.0f);
  for (int64_t n = 0; n < l.n; ++n) {
    source(n, row.data());
    uint8_t* block = out + (n / 16) * l.block_bytes();
    const int64_t r = n % 16;
    switch (l.format) {
      case ExpertFormat::kBF16: {
        auto* b16 = reinterpret_cast<uint16_t*>(block);
        for (int64_t k = 0; k < l.k; ++k) b16[(k / 2) * 32 + r * 2 + k % 2] = core::FloatToBf16(row[k]);
        break;
      }
      case ExpertFormat::kInt8: {
        float amax = 0;
        for (int64_t k = 0; k < l.k; ++k) amax = std::max(amax, std::abs(row[k]));
        const float scale = amax > 0 ? amax / 127.0f : 1.0f;
        reinterpret_cast<float*>(out + l.weight_bytes())[n] = scale;
        for (int64_t k = 0; k < l.k_pad; ++k) {
          const int q = static_cast<int>(std::lrint(std::clamp(row[k] / scale, -127.0f, 127.0f)));
          block[QuadIndex(r, k)] = static_cast<uint8_t>(q + 128);
        }
        break;
      }
      case ExpertFormat::kInt4: {
        float* scales = reinterpret_cast<float*>(out + l.weight_bytes());
        for (int64_t g = 0; g < l.groups(); ++g) {
          float amax = 0;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) amax = std::max(amax, std::abs(row[k]));
          const float scale = amax > 0 ? amax / 7.0f : 1.0f;
          scales[((n / 16) * l.groups() + g) * 16 + r] = scale;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) {
            const int q = static_cast<int>(std::lrint(std::clamp(row[k] / scale, -8.0f, 7.0f)));
            const int64_t i = QuadIndex(r, k);  // position among the 64 values of line k / 4
            uint8_t& byte = block[(i / 64) * 32 + (i % 64) % 32];
            const uint8_t nibble = static_cast<uint8_t>(q + 8);
            byte |= (i % 64) < 32 ? nibble : static_cast<uint8_t>(nibble << 4);
          }
        }
        break;
      }
    }
  }
  // int4 padding rows/columns hold q = 0, i.e. the stored nibble 8; int8 padding stores 128.
  if (l.format == ExpertFormat::kInt8) {
    for (int64_t n = l.n; n < l.n_pad; ++n) {
      for (int64_t k = 0; k < l.k_pad; ++k) out[(n / 16) * l.block_bytes() + QuadIndex(n % 16, k)] = 128;
    }
  } else if (l.format == ExpertFormat::kInt4) {
    float* scales = reinterpret_cast<float*>(out + l.weight_bytes());
    for (int64_t n = 0; n < l.n_pad; ++n) {
      for (int64_t k = (n < l.n ? l.k : 0); k < l.k_pad; ++k) {
        const int64_t i = QuadIndex(n % 16, k);
        uint8_t& byte = out[(n / 16) * l.block_bytes() + (i / 64) * 32 + (i % 64) % 32];
        byte = (i % 64) < 32 ? static_cast<uint8_t>((byte & 0xF0) | 8) : static_cast<uint8_t>((byte & 0x0F) | 0x80);
      }
      if (n >= l.n) {
        for (int64_t g = 0; g < l.groups(); ++g) scales[((n / 16) * l.groups() + g) * 16 + n % 16] = 1.0f;
      }
    }
  }
}

float UnpackValue(const PackedMatrix& m, int64_t n, int64_t k) {
  const MatrixLayout& l = m.layout;
  if (n >= l.n_pad || k >= l.k_pad) return 0.0f;
  const uint8_t* block = m.block(n / 16);
  const int64_t r = n % 16;
  switch (l.format) {
    case ExpertFormat::kBF16:
      return core::Bf16ToFloat(reinterpret_cast<const uint16_t*>(block)[(k / 2) * 32 + r * 2 + k % 2]);
    case ExpertFormat::kInt8:
      return (static_cast<int>(block[QuadIndex(r, k)]) - 128) * m.scales()[n];
    case ExpertFormat::kInt4: {
      const int64_t i = QuadIndex(r, k);
      const uint8_t byte = block[(i / 64) * 32 + (i % 64) % 32];
      const int q = ((i % 64) < 32 ? (byte & 0x0F) : (byte >> 4)) - 8;
      return q * m.block_scales(n / 16, k / l.group)[r];
    }
  }
  return 0.0f;
}

}  // namespace moe::experts
