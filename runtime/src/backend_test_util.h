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
#include "moe/runtime/backend.h"
#include "moe/runtime/device.h"

namespace moe::runtime::testing_util {

enum class BackendKind { kCpu, kCuda };

inline std::vector<BackendKind> AllBackendKinds() { return {BackendKind::kCpu, BackendKind::kCuda}; }
inline std::string BackendKindName(BackendKind k) { return k == BackendKind::kCpu ? "cpu" : "cuda"; }

// The backend, or a status saying why it is absent (no GPU: the test skips).
inline absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(BackendKind kind) {
  if (kind == BackendKind::kCpu) return CreateBackend(Device{Device::Kind::kCpu, 0}, 2);
  if (CudaDeviceCount() == 0) return absl::UnavailableError("no GPU visible");
  return CreateBackend(Device{Device::Kind::kCuda, 0});
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
