// Activations: a call's input rows in the forms the kernels read (fp32 and bf16 rows, or int8
// rows quantized per token with their group sums).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe/core/dtype.h"
#include "moe/experts/kernels.h"
#include "target_clones.h"

namespace moe::experts {
namespace {

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

}  // namespace

absl::Status Activations::Grow(core::AlignedBuffer& buffer, size_t bytes) {
  if (buffer.size() >= bytes) return absl::OkStatus();
  auto grown = core::AlignedBuffer::Allocate(bytes, 64);
  if (!grown.ok()) return grown.status();
  buffer = std::move(*grown);
  return absl::OkStatus();
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
  if (TakesFloatActivations(format)) {
    with_bf16_ = kind == KernelKind::kAvx512Bf16 || amx;
    // fp8's avx512bf16 kernel takes the split activations too (kernels_fp8.cc).
    with_lo_ = amx || (format == ExpertFormat::kFp8 && kind == KernelKind::kAvx512Bf16);
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
  group_scaled_ = IsGgufFormat(format);
  gscale_groups_ = group_scaled_ ? (k_pad_ + kScaleGroup - 1) / kScaleGroup : 0;
  i8_gscale_.assign(m_pad_ * gscale_groups_, 1.0f);
  i8_scale_.assign(m_pad_, 1.0f);
  i8_sum_.assign(m_pad_ * groups_, 0);
  std::memset(i8_.as<int8_t>() + m * ld, 0, (m_pad_ - m) * ld);
  return absl::OkStatus();
}

void Activations::FillRows(const float* const* x, int64_t r0, int64_t r1) {
  const int64_t ld = stride();
  if (TakesFloatActivations(format_)) {
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
    if (group_scaled_) {
      // A scale per kScaleGroup columns; the sums stay per sum_group (which divides it).
      int8_t* qr = i8_.as<int8_t>() + r * ld;
      std::memset(qr + k_, 0, ld - k_);
      int32_t* sums = i8_sum_.data() + r * groups_;
      std::fill(sums, sums + groups_, 0);
      for (int64_t c = 0; c < k_; c += kScaleGroup) {
        const int64_t n = std::min<int64_t>(kScaleGroup, k_ - c);
        const float amax = AbsMax(x[r] + c, n);
        const float scale = amax > 0 ? amax / 127.0f : 1.0f;
        i8_gscale_[r * gscale_groups_ + c / kScaleGroup] = scale;
        QuantizeRow(x[r] + c, n, 1.0f / scale, sum_group_, qr + c, sums + c / sum_group_);
      }
      i8_scale_[r] = 1.0f;
      continue;
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
  if (TakesFloatActivations(src.format_)) {
    return absl::InvalidArgumentError("Activations::Gather: bf16 and fp8 rows are prepared from the floats");
  }
  if (absl::Status s = Reset(m, src.k_, src.k_pad_, kind, src.format_, src.sum_group_); !s.ok()) return s;
  const int64_t ld = stride();
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(i8_.as<int8_t>() + r * ld, src.i8(rows[r]), ld);
    i8_scale_[r] = src.i8_scale_[rows[r]];
    std::copy_n(src.i8_sum_.data() + rows[r] * groups_, groups_, i8_sum_.data() + r * groups_);
    std::copy_n(src.i8_gscale_.data() + rows[r] * gscale_groups_, gscale_groups_,
                i8_gscale_.data() + r * gscale_groups_);
  }
  return absl::OkStatus();
}

}  // namespace moe::experts
