// Test helpers for backend tests: every backend this build has, and host<->device copies.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/dtype.h"
#include "moe/core/status.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/backend.h"
#include "moe/runtime/device.h"

namespace moe::runtime::testing_util {

// kCpuOnPoolThreads: the CPU backend with an expert pool's threads lent to it (the test lends them).
enum class BackendKind { kCpu, kCpuOnPoolThreads, kCuda };

inline std::string BackendKindName(BackendKind k) {
  return k == BackendKind::kCpu ? "cpu" : k == BackendKind::kCpuOnPoolThreads ? "cpu_on_pool_threads" : "cuda";
}

// The backend, or a status saying why it is absent (no GPU: the test skips).
inline absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(BackendKind kind) {
  if (kind != BackendKind::kCuda) return CreateBackend(Device{Device::Kind::kCpu, 0}, 2);
  if (CudaDeviceCount() == 0) return absl::UnavailableError("no GPU visible");
  return CreateBackend(Device{Device::Kind::kCuda, 0});
}

// A small int8 expert pool of `threads` threads (zero weights), whose threads a test lends to a
// CPU backend (Backend::UseHostThreads).
inline std::unique_ptr<experts::ExpertPool> TinyPool(int threads) {
  constexpr int64_t kSize = 16;
  static const std::vector<uint16_t> zeros(kSize * kSize);  // bf16 zeros
  experts::ExpertPoolOptions options;
  options.format = experts::ExpertFormat::kInt8;
  options.threads = threads;
  options.progress = false;
  auto pool = experts::ExpertPool::Create(experts::ExpertShape{1, 2, 1, kSize, kSize}, options,
                                          [](int, int) -> absl::StatusOr<experts::ExpertWeights> {
                                            const core::TensorView w{zeros.data(), core::DType::kBF16, {kSize, kSize}};
                                            return experts::ExpertWeights{w, w, w};
                                          });
  return pool.ok() ? std::move(*pool) : nullptr;
}

inline std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// `v` as bytes of `dtype` (bf16, f32, or int32 from the float values).
inline std::vector<uint8_t> HostTensor(const std::vector<float>& v, core::DType dtype) {
  std::vector<uint8_t> out(v.size() * core::DTypeSize(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == core::DType::kBF16) {
      const uint16_t b = core::FloatToBf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else if (dtype == core::DType::kI32) {
      const int32_t n = static_cast<int32_t>(v[i]);
      std::memcpy(out.data() + 4 * i, &n, 4);
    } else {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    }
  }
  return out;
}

inline absl::StatusOr<std::unique_ptr<DeviceBuffer>> Upload(Backend& b, const std::vector<float>& v, int64_t rows,
                                                            int64_t cols, core::DType dtype) {
  MOE_ASSIGN_OR_RETURN(auto buffer, b.Allocate(dtype, rows, cols));
  const std::vector<uint8_t> bytes = HostTensor(v, dtype);
  b.CopyFromHost(bytes.data(), buffer->tensor());
  MOE_RETURN_IF_ERROR(b.Synchronize());
  return buffer;
}

inline absl::StatusOr<std::vector<float>> Download(Backend& b, const Tensor& t) {
  std::vector<uint8_t> bytes(t.bytes());
  b.CopyToHost(t, bytes.data());
  MOE_RETURN_IF_ERROR(b.Synchronize());
  std::vector<float> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype == core::DType::kBF16) {
      uint16_t v;
      std::memcpy(&v, bytes.data() + 2 * i, 2);
      out[i] = core::Bf16ToFloat(v);
    } else if (t.dtype == core::DType::kI32) {
      int32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out[i] = static_cast<float>(v);
    } else {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    }
  }
  return out;
}

}  // namespace moe::runtime::testing_util
