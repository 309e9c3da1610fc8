// Kernel selection, activation preparation and the portable kernels.
#include "moe/experts/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "moe/core/dtype.h"

namespace moe::experts {

const char* KernelName(KernelKind k) {
  switch (k) {
    case KernelKind::kPortable: return "portable";
    case KernelKind::kAvx512: return "avx512";
    case KernelKind::kAvx512Bf16: return "avx512bf16";
    case KernelKind::kVnni: return "vnni";
    case KernelKind::kAmx: return "amx";
  }
  return "?";
}

absl::StatusOr<KernelKind> ParseKernel(const std::string& name) {
  for (KernelKind k : {KernelKind::kPortable, KernelKind::kAvx512, KernelKind::kAvx512Bf16, KernelKind::kVnni,
                       KernelKind::kAmx}) {
    if (name == KernelName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("expert kernel '", name, "' is not one of portable, avx512, avx512bf16, vnni, amx"));
}

std::vector<KernelKind> KernelsFor(ExpertFormat format) {
  if (format == ExpertFormat::kBF16) {
    return {KernelKind::kPortable, KernelKind::kAvx512, KernelKind::kAvx512Bf16, KernelKind::kAmx};
  }
  if (format == ExpertFormat::kInt8) return {KernelKind::kPortable, KernelKind::kVnni, KernelKind::kAmx};
  return {KernelKind::kPortable, KernelKind::kVnni, KernelKind::kAmx};
}

std::string KernelUnsupportedReason(KernelKind kind, ExpertFormat format, const core::CpuFeatures& cpu) {
  const auto& list = KernelsFor(format);
  if (std::find(list.begin(), list.end(), kind) == list.end()) {
    return absl::StrCat("no ", KernelName(kind), " kernel for ", FormatName(format));
  }
  const bool avx512 = cpu.avx512f && cpu.avx512bw && cpu.avx512vl;
  switch (kind) {
    case KernelKind::kPortable: return "";
    case KernelKind::kAvx512: return avx512 ? "" : "needs AVX-512 (F, BW, VL)";
    case KernelKind::kAvx512Bf16: return avx512 && cpu.avx512_bf16 ? "" : "needs AVX-512 BF16";
    case KernelKind::kVnni: return avx512 && cpu.avx512_vnni ? "" : "needs AVX-512 VNNI";
    case KernelKind::kAmx:
      if (!cpu.amx_tile) return "needs AMX tiles";
      if (format == ExpertFormat::kBF16 && !cpu.amx_bf16) return "needs AMX-BF16";
      if (format != ExpertFormat::kBF16 && !cpu.amx_int8) return "needs AMX-INT8";
      return internal::EnableAmxForProcess() ? "" : "the OS refused AMX tile data (arch_prctl)";
  }
  return "unknown kernel";
}

MatmulKernel GetKernel(KernelKind kind, ExpertFormat format) {
  switch (kind) {
    case KernelKind::kPortable: return internal::MatmulPortable;
    case KernelKind::kAvx512: return format == ExpertFormat::kBF16 ? internal::MatmulAvx512Bf16F32 : nullptr;
    case KernelKind::kAvx512Bf16: return format == ExpertFormat::kBF16 ? internal::MatmulAvx512Bf16Dp : nullptr;
    case KernelKind::kVnni:
      if (format == ExpertFormat::kInt8) return internal::MatmulVnniInt8;
      if (format == ExpertFormat::kInt4) return internal::MatmulVnniInt4;
      return nullptr;
    case KernelKind::kAmx:
      if (format == ExpertFormat::kBF16) return internal::MatmulAmxBf16;
      if (format == ExpertFormat::kInt8) return internal::MatmulAmxInt8;
      if (format == ExpertFormat::kInt4) return internal::MatmulAmxInt4;
      return nullptr;
  }
  return nullptr;
}

SwiGluKernel GetSwiGluKernel(KernelKind kind, ExpertFormat format) {
  if (kind != KernelKind::kAmx) return nullptr;
  if (format == ExpertFormat::kInt8) return internal::SwiGluAmxInt8;
  if (format == ExpertFormat::kInt4) return internal::SwiGluAmxInt4;
  return nullptr;
}

absl::Status PrepareThreadForKernel(KernelKind kind) {
  if (kind != KernelKind::kAmx) return absl::OkStatus();
  if (!internal::EnableAmxForProcess()) {
    return absl::FailedPreconditionError("the OS refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)");
  }
  internal::ConfigureAmxTiles();
  return absl::OkStatus();
}

absl::Status Activations::Grow(core::AlignedBuffer& buffer, size_t bytes) {
  if (buffer.size() >= bytes) return absl::OkStatus();
  auto grown = core::AlignedBuffer::Allocate(bytes, 64);
  if (!grown.ok()) return grown.status();
  buffer = std::move(*grown);
  return absl::OkStatus();
}

namespace {

#define MOE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

MOE_CLONES float AbsMax(const float* x, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(x[i]));
  return m;
}

// q[i] = round-to-nearest-even(x[i] * inv), clamped to [-127, 127]; sums[g] += q over groups.
MOE_CLONES void QuantizeRow(const float* x, int64_t n, float inv, int group, int8_t* q, int32_t* sums) {
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    int32_t sum = 0;
    const int64_t g1 = std::min<int64_t>(n, g0 + group);
    for (int64_t i = g0; i < g1; ++i) {
      const float v = std::min(127.0f, std::max(-127.0f, x[i] * inv));
      const int32_t r = static_cast<int32_t>(__builtin_roundevenf(v));
      q[i] = static_cast<int8_t>(r);
      sum += r;
    }
    sums[g0 / group] = sum;
  }
}

MOE_CLONES void ToBf16(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < n; ++i) {
    hi[i] = core::FloatToBf16(x[i]);
    if (lo != nullptr) lo[i] = core::FloatToBf16(x[i] - core::Bf16ToFloat(hi[i]));
  }
}

// e^x for x in about [-87, 88]: 2^(x log2 e) split into 2^n (exponent bits) and 2^f, f in
// [-0.5, 0.5], by a degree-6 polynomial; relative error about 1e-7. Vectorizes, unlike expf.
inline float FastExp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float t = x * 1.44269504088896341f;
  const float n = __builtin_roundevenf(t);
  const float f = t - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6182458e-3f;
  p = p * f + 5.5503361e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314720e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  static const bool avx512 = core::GetCpuFeatures().avx512f;
  if (avx512) return internal::SiluMulAvx512(gate, up, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + FastExp(-gate[i])) * up[i];
}

// One compiled copy (per CPU), so every caller rounds the same way.
MOE_CLONES void SumScaledRows(const float* const* rows, const float* weights, int count, int64_t n, float* dst) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    float acc[16] = {};
    for (int i = 0; i < count; ++i) {
      const float* src = rows[i] + c;
      __builtin_prefetch(src + 256);  // 1 KB ahead in each row: the rows are seldom in L2
      const float w = weights[i];
      for (int j = 0; j < 16; ++j) acc[j] += w * src[j];
    }
    for (int j = 0; j < 16; ++j) dst[c + j] = acc[j];
  }
  for (; c < n; ++c) {
    float acc = 0;
    for (int i = 0; i < count; ++i) acc += weights[i] * rows[i][c];
    dst[c] = acc;
  }
}

absl::Status Activations::Prepare(const float* x, int64_t m, int64_t k, int64_t k_pad, KernelKind kind,
                                  ExpertFormat format, int sum_group) {
  std::vector<const float*> rows(m);
  for (int64_t r = 0; r < m; ++r) rows[r] = x + r * k;
  return Prepare(rows.data(), m, k, k_pad, kind, format, sum_group);
}

absl::Status Activations::Prepare(const float* const* x, int64_t m, int64_t k, int64_t k_pad, KernelKind kind,
                                  ExpertFormat format, int sum_group) {
  if (absl::Status s = Reset(m, k, k_pad, kind, format, sum_group); !s.ok()) return s;
  FillRows(x, 0, m);
  return absl::OkStatus();
}

absl::Status Activations::Reset(int64_t m, int64_t k, int64_t k_pad, KernelKind kind, ExpertFormat format,
                                int sum_group) {
  // Only AMX reads whole tiles of rows; the other kernels read exactly m rows.
  const bool amx = kind == KernelKind::kAmx;
  m_ = m;
  m_pad_ = amx ? (m + 31) / 32 * 32 : m;
  k_ = k;
  k_pad_ = k_pad;
  format_ = format;
  sum_group_ = sum_group;
  const int64_t rows = std::max<int64_t>(m_pad_, 1), ld = stride();
  if (format == ExpertFormat::kBF16) {
    with_bf16_ = kind == KernelKind::kAvx512Bf16 || amx;
    with_lo_ = amx;
    if (absl::Status s = Grow(f32_, rows * ld * sizeof(float)); !s.ok()) return s;
    if (with_bf16_) {
      if (absl::Status s = Grow(bf16_, rows * ld * 2); !s.ok()) return s;
    }
    if (with_lo_) {
      if (absl::Status s = Grow(bf16_lo_, rows * ld * 2); !s.ok()) return s;
    }
    const size_t pad = (m_pad_ - m) * ld;
    std::memset(f32_.as<float>() + m * ld, 0, pad * sizeof(float));
    if (with_bf16_) std::memset(bf16_.as<uint16_t>() + m * ld, 0, pad * 2);
    if (with_lo_) std::memset(bf16_lo_.as<uint16_t>() + m * ld, 0, pad * 2);
    return absl::OkStatus();
  }
  // int8 / int4: symmetric per-token quantization, and sums per group for the offset
  // correction; the padding columns and rows are zero.
  if (absl::Status s = Grow(i8_, rows * ld); !s.ok()) return s;
  groups_ = k_pad_ / sum_group;
  i8_scale_.assign(m_pad_, 1.0f);
  i8_sum_.assign(m_pad_ * groups_, 0);
  std::memset(i8_.as<int8_t>() + m * ld, 0, (m_pad_ - m) * ld);
  return absl::OkStatus();
}

void Activations::FillRows(const float* const* x, int64_t r0, int64_t r1) {
  const int64_t ld = stride();
  if (format_ == ExpertFormat::kBF16) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = f32_.as<float>() + r * ld;
      std::memcpy(row, x[r], k_ * sizeof(float));
      std::fill(row + k_, row + ld, 0.0f);
      if (with_bf16_) {
        ToBf16(row, ld, bf16_.as<uint16_t>() + r * ld, with_lo_ ? bf16_lo_.as<uint16_t>() + r * ld : nullptr);
      }
    }
    return;
  }
  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  const bool avx512 = cpu.avx512f && cpu.avx512bw && cpu.avx512vl;
  for (int64_t r = r0; r < r1; ++r) {
    // The next row's lines are requested while this one is quantized: rows are seldom in the
    // caches, and the hardware prefetchers stop at each page boundary. (At 4096 tokens on the
    // 32-core machine the sort's share of the thread time, quantization included, went from
    // 3.5-3.7% to 2.5-3.3%: a small gain, within the noise of the call times.)
    if (r + 1 < r1) {
      const char* next = reinterpret_cast<const char*>(x[r + 1]);
      for (int64_t b = 0; b < k_ * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(next + b);
    }
    const float amax = avx512 ? internal::AbsMaxAvx512(x[r], k_) : AbsMax(x[r], k_);
    const float scale = amax > 0 ? amax / 127.0f : 1.0f;
    i8_scale_[r] = scale;
    int8_t* qr = i8_.as<int8_t>() + r * ld;
    std::memset(qr + k_, 0, ld - k_);
    if (avx512) {
      internal::QuantizeRowAvx512(x[r], k_, 1.0f / scale, sum_group_, qr, i8_sum_.data() + r * groups_);
    } else {
      QuantizeRow(x[r], k_, 1.0f / scale, sum_group_, qr, i8_sum_.data() + r * groups_);
    }
  }
}

absl::Status Activations::Gather(const Activations& src, const int32_t* rows, int64_t m, KernelKind kind) {
  if (src.format_ == ExpertFormat::kBF16) {
    return absl::InvalidArgumentError("Activations::Gather: bf16 rows are prepared from the floats");
  }
  if (absl::Status s = Reset(m, src.k_, src.k_pad_, kind, src.format_, src.sum_group_); !s.ok()) return s;
  const int64_t ld = stride();
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(i8_.as<int8_t>() + r * ld, src.i8(rows[r]), ld);
    i8_scale_[r] = src.i8_scale_[rows[r]];
    std::copy_n(src.i8_sum_.data() + rows[r] * groups_, groups_, i8_sum_.data() + r * groups_);
  }
  return absl::OkStatus();
}

namespace internal {

// The reference for every kernel: the same products as the fast kernels, one at a time.
void MatmulPortable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const MatrixLayout& l = w.layout;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = w.block(b);
    for (int64_t m = 0; m < a.m(); ++m) {
      float* out = y + m * ldy + (b - b0) * 16;
      for (int r = 0; r < 16; ++r) {
        const int64_t n = b * 16 + r;
        switch (l.format) {
          case ExpertFormat::kBF16: {
            const uint16_t* wb = reinterpret_cast<const uint16_t*>(block);
            const float* x = a.f32(m);
            float acc = 0;
            for (int64_t k = 0; k < l.k_pad; ++k) acc += x[k] * core::Bf16ToFloat(wb[(k / 2) * 32 + r * 2 + k % 2]);
            out[r] = acc;
            break;
          }
          case ExpertFormat::kInt8: {
            const int8_t* x = a.i8(m);
            int32_t acc = 0;
            for (int64_t k = 0; k < l.k_pad; ++k) acc += block[(k / 4) * 64 + r * 4 + k % 4] * x[k];
            acc -= 128 * a.i8_sum(m, 0);
            out[r] = static_cast<float>(acc) * w.scales()[n] * a.i8_scale(m);
            break;
          }
          case ExpertFormat::kInt4: {
            const int8_t* x = a.i8(m);
            float acc = 0;
            for (int64_t g = 0; g < l.groups(); ++g) {
              int32_t part = 0;
              for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) {
                const int64_t i = (k % 4) + r * 4;  // position among the 64 values of line k / 4
                const uint8_t byte = block[(k / 4) * 32 + i % 32];
                part += (i < 32 ? (byte & 0x0F) : (byte >> 4)) * x[k];
              }
              part -= 8 * a.i8_sum(m, g);
              acc += static_cast<float>(part) * w.block_scales(b, g)[r];
            }
            out[r] = acc * a.i8_scale(m);
            break;
          }
        }
      }
    }
  }
}

}  // namespace internal
}  // namespace moe::experts
