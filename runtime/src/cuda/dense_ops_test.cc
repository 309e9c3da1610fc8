// The dense kernels of ops.h against plain double-precision references. Every output buffer is
// poisoned with NaN (all bits set) before a run, with a poisoned tail after it that must stay
// untouched; every size runs from a 16-byte aligned base (the vector paths) and from a base one
// element off (the scalar paths).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_status.h"
#include "cuda/ops.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::runtime::cuda {
namespace {

#define ASSERT_CUDA(call)                                                                    \
  do {                                                                                       \
    const cudaError_t cuda_error_ = (call);                                                  \
    ASSERT_EQ(cuda_error_, cudaSuccess) << #call << ": " << cudaGetErrorString(cuda_error_); \
  } while (0)

constexpr int kRows[] = {1, 3, 33, 257};
constexpr int kCols[] = {7, 128, 2048, 5120};
constexpr size_t kTail = 64;  // poisoned elements after every output

// A device array of `size` elements starting `offset` elements into its allocation, with kTail
// poisoned elements after it.
template <typename T>
class DeviceArray {
 public:
  DeviceArray(size_t size, size_t offset) : size_(size), offset_(offset) {
    ok_ = cudaMalloc(&base_, (offset + size + kTail) * sizeof(T)) == cudaSuccess;
    if (ok_) ok_ = cudaMemset(base_, 0xff, (offset + size + kTail) * sizeof(T)) == cudaSuccess;
  }
  ~DeviceArray() { (void)cudaFree(base_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  bool ok() const { return ok_; }
  T* get() const { return static_cast<T*>(base_) + offset_; }
  bool Upload(const std::vector<T>& host) const {
    return cudaMemcpy(get(), host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess;
  }
  // The elements, then the tail.
  bool Download(std::vector<T>* host, std::vector<T>* tail) const {
    host->resize(size_);
    tail->resize(kTail);
    return cudaMemcpy(host->data(), get(), size_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess &&
           cudaMemcpy(tail->data(), get() + size_, kTail * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess;
  }

 private:
  void* base_ = nullptr;
  size_t size_, offset_;
  bool ok_ = false;
};

template <typename T>
bool AllBitsSet(const std::vector<T>& v) {
  return std::all_of(v.begin(), v.end(), [](const T& x) {
    T all;
    std::memset(&all, 0xff, sizeof(T));
    return std::memcmp(&x, &all, sizeof(T)) == 0;
  });
}

// Normal samples kept away from zero, so that a kernel that drops a term cannot pass.
float Nonzero(std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  float v = dist(rng);
  if (std::abs(v) < 0.01f * scale) v = v < 0 ? -0.01f * scale : 0.01f * scale;
  return v;
}

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng, float scale) {
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = core::FloatToBf16(Nonzero(rng, scale));
  return v;
}

std::vector<float> RandomF32(size_t n, std::mt19937& rng, float scale, float shift = 0.0f) {
  std::vector<float> v(n);
  for (float& x : v) x = shift + Nonzero(rng, scale);
  return v;
}

// Within one bf16 ulp of the exact value: rounding takes up to half an ulp, which is up to
// 2^-8 of the value, and the fp32 arithmetic before it a little more.
bool NearBf16(uint16_t got, double want) {
  const double g = core::Bf16ToFloat(got);
  return std::abs(g - want) <= std::abs(want) / 128.0;
}

void SyncAndCheck() {
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
}

std::string Where(int rows, int cols, size_t offset) {
  return "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) + " offset=" + std::to_string(offset);
}

TEST(CudaDenseOpsTest, EmbedCopiesTheTokensRows) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  constexpr int kVocab = 1000;
  for (int tokens : kRows) {
    for (int hidden : kCols) {
      for (size_t offset : {0, 1}) {
        SCOPED_TRACE(Where(tokens, hidden, offset));
        std::mt19937 rng(tokens * 7919 + hidden + offset);
        const std::vector<uint16_t> table = RandomBf16(size_t{kVocab} * hidden, rng, 1.0f);
        std::vector<int32_t> ids(tokens);
        std::uniform_int_distribution<int32_t> pick(0, kVocab - 1);
        for (int32_t& id : ids) id = pick(rng);
        ids[0] = kVocab - 1;  // the last row too
        DeviceArray<uint16_t> d_table(table.size(), offset);
        DeviceArray<int32_t> d_ids(ids.size(), 0);
        DeviceArray<float> d_x(size_t{1} * tokens * hidden, offset);
        ASSERT_TRUE(d_table.ok() && d_ids.ok() && d_x.ok());
        ASSERT_TRUE(d_table.Upload(table) && d_ids.Upload(ids));
        Embed(d_table.get(), d_ids.get(), tokens, hidden, d_x.get(), nullptr);
        SyncAndCheck();
        std::vector<float> x, tail;
        ASSERT_TRUE(d_x.Download(&x, &tail));
        EXPECT_TRUE(AllBitsSet(tail)) << "wrote past the end";
        int bad = 0;
        for (int t = 0; t < tokens; ++t) {
          for (int i = 0; i < hidden; ++i) {
            const float want = core::Bf16ToFloat(table[size_t{1} * ids[t] * hidden + i]);
            if (x[size_t{1} * t * hidden + i] != want && ++bad <= 3) {
              ADD_FAILURE() << "x[" << t << "][" << i << "] = " << x[size_t{1} * t * hidden + i] << ", want " << want;
            }
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

void CheckAddRmsNorm(int rows, int cols, size_t offset, bool with_delta) {
  SCOPED_TRACE(Where(rows, cols, offset) + (with_delta ? " with delta" : " without delta"));
  std::mt19937 rng(rows * 131 + cols * 7 + offset + with_delta);
  const size_t n = size_t{1} * rows * cols;
  const std::vector<float> x = RandomF32(n, rng, 2.0f);
  const std::vector<float> delta = RandomF32(n, rng, 1.0f);
  const std::vector<float> w = RandomF32(cols, rng, 0.2f, 1.0f);
  constexpr float kEps = 1e-6f;
  DeviceArray<float> d_x(n, offset), d_delta(n, offset), d_w(cols, offset);
  DeviceArray<uint16_t> d_out(n, offset);
  ASSERT_TRUE(d_x.ok() && d_delta.ok() && d_w.ok() && d_out.ok());
  ASSERT_TRUE(d_x.Upload(x) && d_delta.Upload(delta) && d_w.Upload(w));
  AddRmsNorm(d_x.get(), with_delta ? d_delta.get() : nullptr, d_w.get(), kEps, rows, cols, d_out.get(), nullptr);
  SyncAndCheck();
  std::vector<float> x_after, x_tail;
  std::vector<uint16_t> out, out_tail;
  ASSERT_TRUE(d_x.Download(&x_after, &x_tail) && d_out.Download(&out, &out_tail));
  EXPECT_TRUE(AllBitsSet(out_tail)) << "out written past the end";
  int bad_x = 0, bad_out = 0;
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < cols; ++i) {
      const size_t at = size_t{1} * r * cols + i;
      // The residual add is one fp32 addition, so it must match exactly.
      const float sum = with_delta ? x[at] + delta[at] : x[at];
      if (std::memcmp(&sum, &x_after[at], sizeof(float)) != 0 && ++bad_x <= 3) {
        ADD_FAILURE() << "x[" << r << "][" << i << "] = " << x_after[at] << ", want " << sum;
      }
      ss += double(sum) * sum;
    }
    const double inv = 1.0 / std::sqrt(ss / cols + kEps);
    for (int i = 0; i < cols; ++i) {
      const size_t at = size_t{1} * r * cols + i;
      const double sum = with_delta ? double(x[at] + delta[at]) : double(x[at]);
      const double want = double(w[i]) * sum * inv;
      if (!NearBf16(out[at], want) && ++bad_out <= 3) {
        ADD_FAILURE() << "out[" << r << "][" << i << "] = " << core::Bf16ToFloat(out[at]) << ", want " << want;
      }
    }
  }
  EXPECT_EQ(bad_x, 0);
  EXPECT_EQ(bad_out, 0);
}

TEST(CudaDenseOpsTest, AddRmsNormMatchesThePlainReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (int rows : kRows) {
    for (int cols : kCols) {
      for (size_t offset : {0, 1}) {
        for (bool with_delta : {false, true}) CheckAddRmsNorm(rows, cols, offset, with_delta);
      }
    }
  }
}

TEST(CudaDenseOpsTest, AddRmsNormCoversEveryRowWidthOfItsKernels) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  // Each side of 1, 2, 4 and 8 warps per row, the largest register-held row, and the loop
  // kernel beyond it.
  for (int cols : {4, 1020, 1024, 1028, 2052, 4096, 4100, 7168, 8188, 8192, 8196, 12288}) {
    for (int rows : {1, 9, 33}) CheckAddRmsNorm(rows, cols, 0, true);
  }
}

TEST(CudaDenseOpsTest, SiluMulMatchesThePlainReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (int rows : kRows) {
    for (int width : kCols) {
      for (size_t offset : {0, 1}) {
        SCOPED_TRACE(Where(rows, width, offset));
        std::mt19937 rng(rows * 31 + width + offset);
        const size_t n = size_t{1} * rows * width;
        const std::vector<uint16_t> gate_up = RandomBf16(2 * n, rng, 3.0f);
        DeviceArray<uint16_t> d_in(2 * n, offset), d_out(n, offset);
        ASSERT_TRUE(d_in.ok() && d_out.ok());
        ASSERT_TRUE(d_in.Upload(gate_up));
        SiluMul(d_in.get(), rows, width, d_out.get(), nullptr);
        SyncAndCheck();
        std::vector<uint16_t> out, tail;
        ASSERT_TRUE(d_out.Download(&out, &tail));
        EXPECT_TRUE(AllBitsSet(tail)) << "wrote past the end";
        int bad = 0;
        for (int r = 0; r < rows; ++r) {
          for (int i = 0; i < width; ++i) {
            const double g = core::Bf16ToFloat(gate_up[size_t{2} * r * width + i]);
            const double u = core::Bf16ToFloat(gate_up[size_t{2} * r * width + width + i]);
            const double want = g / (1.0 + std::exp(-g)) * u;
            const uint16_t got = out[size_t{1} * r * width + i];
            if (!NearBf16(got, want) && ++bad <= 3) {
              ADD_FAILURE() << "out[" << r << "][" << i << "] = " << core::Bf16ToFloat(got) << ", want " << want;
            }
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

TEST(CudaDenseOpsTest, AddSharedExpertMatchesThePlainReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (int rows : kRows) {
    for (int cols : kCols) {
      for (size_t offset : {0, 1}) {
        for (bool gated : {false, true}) {
          SCOPED_TRACE(Where(rows, cols, offset) + (gated ? " gated" : " ungated"));
          std::mt19937 rng(rows * 17 + cols + offset * 3 + gated);
          const size_t n = size_t{1} * rows * cols;
          const std::vector<float> out0 = RandomF32(n, rng, 1.0f);
          const std::vector<float> shared = RandomF32(n, rng, 1.0f);
          const std::vector<float> gate = RandomF32(rows, rng, 2.0f);
          DeviceArray<float> d_out(n, offset), d_shared(n, offset), d_gate(rows, 0);
          ASSERT_TRUE(d_out.ok() && d_shared.ok() && d_gate.ok());
          ASSERT_TRUE(d_out.Upload(out0) && d_shared.Upload(shared) && d_gate.Upload(gate));
          AddSharedExpert(d_out.get(), d_shared.get(), gated ? d_gate.get() : nullptr, rows, cols, nullptr);
          SyncAndCheck();
          std::vector<float> out, tail;
          ASSERT_TRUE(d_out.Download(&out, &tail));
          EXPECT_TRUE(AllBitsSet(tail)) << "wrote past the end";
          int bad = 0;
          for (int r = 0; r < rows; ++r) {
            const double s = gated ? 1.0 / (1.0 + std::exp(-double(gate[r]))) : 1.0;
            for (int i = 0; i < cols; ++i) {
              const size_t at = size_t{1} * r * cols + i;
              const double want = double(out0[at]) + s * shared[at];
              const double tol = 1e-6 * (std::abs(double(out0[at])) + std::abs(double(shared[at])));
              if (!(std::abs(out[at] - want) <= tol) && ++bad <= 3) {
                ADD_FAILURE() << "out[" << r << "][" << i << "] = " << out[at] << ", want " << want;
              }
            }
          }
          EXPECT_EQ(bad, 0);
        }
      }
    }
  }
}

TEST(CudaDenseOpsTest, GatherRowsCopiesTheNamedRows) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  constexpr int kSrcRows = 300;
  for (int n : kRows) {
    for (int cols : kCols) {
      for (size_t offset : {0, 1}) {
        SCOPED_TRACE(Where(n, cols, offset));
        std::mt19937 rng(n * 5 + cols + offset);
        const std::vector<float> src = RandomF32(size_t{kSrcRows} * cols, rng, 1.0f);
        std::vector<int32_t> rows(n);
        std::uniform_int_distribution<int32_t> pick(0, kSrcRows - 1);
        for (int32_t& r : rows) r = pick(rng);  // repeats allowed
        rows[n - 1] = kSrcRows - 1;
        DeviceArray<float> d_src(src.size(), offset), d_out(size_t{1} * n * cols, offset);
        DeviceArray<int32_t> d_rows(rows.size(), 0);
        ASSERT_TRUE(d_src.ok() && d_out.ok() && d_rows.ok());
        ASSERT_TRUE(d_src.Upload(src) && d_rows.Upload(rows));
        GatherRows(d_src.get(), cols, d_rows.get(), n, d_out.get(), nullptr);
        SyncAndCheck();
        std::vector<float> out, tail;
        ASSERT_TRUE(d_out.Download(&out, &tail));
        EXPECT_TRUE(AllBitsSet(tail)) << "wrote past the end";
        int bad = 0;
        for (int i = 0; i < n; ++i) {
          if (std::memcmp(&out[size_t{1} * i * cols], &src[size_t{1} * rows[i] * cols], cols * sizeof(float)) != 0 &&
              ++bad <= 3) {
            ADD_FAILURE() << "row " << i << " is not source row " << rows[i];
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

TEST(CudaDenseOpsTest, EmptyCallsEnqueueNothing) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  Embed(nullptr, nullptr, 0, 2048, nullptr, nullptr);
  AddRmsNorm(nullptr, nullptr, nullptr, 1e-6f, 0, 2048, nullptr, nullptr);
  SiluMul(nullptr, 0, 768, nullptr, nullptr);
  AddSharedExpert(nullptr, nullptr, nullptr, 0, 2048, nullptr);
  GatherRows(nullptr, 2048, nullptr, 0, nullptr, nullptr);
  SyncAndCheck();
}

}  // namespace
}  // namespace moe::runtime::cuda
