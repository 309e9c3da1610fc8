#include "moe/runtime/backend_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/kernels.h"
#include "moe/core/memory.h"
#include "moe/core/status.h"
#include "moe/runtime/kv_cache.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/blocked_range2d.h"
#include "oneapi/tbb/info.h"
#include "oneapi/tbb/parallel_for.h"
#include "oneapi/tbb/task_arena.h"

namespace moe::runtime {
namespace {

using core::DType;

class CpuBuffer : public DeviceBuffer {
 public:
  CpuBuffer(core::AlignedBuffer buffer, int64_t n) : buffer_(std::move(buffer)), n_(n) {}
  float* data() override { return buffer_.as<float>(); }
  int64_t size() const override { return n_; }

 private:
  core::AlignedBuffer buffer_;
  int64_t n_;
};

// bf16 or f32, in place in the mapped checkpoint, or an owned f32 copy.
class CpuWeight : public DeviceWeight {
 public:
  CpuWeight(const core::TensorView& view, core::AlignedBuffer owned) : owned_(std::move(owned)) {
    shape_ = view.shape;
    if (owned_.data() != nullptr) {
      dtype_ = DType::kF32;
      data_ = owned_.data();
    } else {
      dtype_ = view.dtype;
      data_ = view.data;
    }
  }
  DType dtype() const { return dtype_; }
  const float* f32() const { return static_cast<const float*>(data_); }
  const uint16_t* bf16() const { return static_cast<const uint16_t*>(data_); }
  // Row r as floats: a pointer into the weight, or into `scratch` after conversion.
  const float* RowF32(int64_t r, float* scratch) const {
    const int64_t k = cols();
    if (dtype_ == DType::kF32) return f32() + r * k;
    internal::Bf16RowToF32(bf16() + r * k, k, scratch);
    return scratch;
  }
  // Every element as floats: the weight itself (f32) or a converted copy in `storage`.
  const float* AllF32(std::vector<float>* storage) const {
    if (dtype_ == DType::kF32) return f32();
    const int64_t n = core::NumElements(shape_);
    storage->resize(n);
    internal::Bf16RowToF32(bf16(), n, storage->data());
    return storage->data();
  }
  float Dot(const float* x, int64_t r) const {
    const int64_t k = cols();
    return dtype_ == DType::kF32 ? internal::DotF32(x, f32() + r * k, k) : internal::DotBf16(x, bf16() + r * k, k);
  }

 private:
  core::AlignedBuffer owned_;
  DType dtype_ = DType::kF32;
  const void* data_ = nullptr;
};

const CpuWeight& AsCpu(const DeviceWeight& w) { return static_cast<const CpuWeight&>(w); }

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int threads) : arena_(threads) {}

  std::string name() const override { return absl::StrCat("cpu (", arena_.max_concurrency(), " threads)"); }
  bool ComputesOnHostCores() const override { return true; }

  absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareWeight(const core::TensorView& host) override {
    if (host.rank() < 1 || host.rank() > 2) {
      return absl::InvalidArgumentError(absl::StrCat("weights must be 1-D or 2-D, got ", core::ShapeString(host.shape)));
    }
    core::AlignedBuffer owned;
    switch (host.dtype) {
      case DType::kBF16:
      case DType::kF32:
        break;
      case DType::kF16: {
        MOE_ASSIGN_OR_RETURN(owned, core::AlignedBuffer::Allocate(host.numel() * sizeof(float)));
        core::ConvertToFloat(host.data, host.dtype, owned.as<float>(), host.numel());
        break;
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("dtype ", core::DTypeName(host.dtype), " is not a weight type (BF16, F16, F32)"));
    }
    return std::unique_ptr<DeviceWeight>(new CpuWeight(host, std::move(owned)));
  }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int64_t num_floats) override {
    auto buffer = core::AlignedBuffer::Allocate(std::max<int64_t>(num_floats, 1) * sizeof(float));
    if (!buffer.ok()) return buffer.status();
    return std::unique_ptr<DeviceBuffer>(new CpuBuffer(std::move(*buffer), num_floats));
  }

  void CopyToHost(const float* src, float* dst, int64_t n) override { std::memcpy(dst, src, n * sizeof(float)); }
  void CopyFromHost(const float* src, float* dst, int64_t n) override { std::memcpy(dst, src, n * sizeof(float)); }

  void Embed(const DeviceWeight& table, const int32_t* ids, int64_t n, float* out) override {
    const CpuWeight& t = AsCpu(table);
    const int64_t h = t.cols();
    for (int64_t i = 0; i < n; ++i) {
      const float* row = t.RowF32(ids[i], out + i * h);
      if (row != out + i * h) std::memcpy(out + i * h, row, h * sizeof(float));
    }
  }

  void RmsNorm(const float* x, const DeviceWeight& w, float eps, int64_t rows, int64_t cols, float* out) override {
    const CpuWeight& wt = AsCpu(w);
    std::vector<float> weight;
    const float* wr = wt.AllF32(&weight);
    For(rows, [&](int64_t r) {
      const float* xr = x + r * cols;
      float ss = internal::DotF32(xr, xr, cols);
      float inv = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
      float* o = out + r * cols;
      for (int64_t i = 0; i < cols; ++i) o[i] = wr[i] * (xr[i] * inv);
    });
  }

  void Linear(const float* x, int64_t rows, const DeviceWeight& w, const DeviceWeight* bias, float* out) override {
    const CpuWeight& wt = AsCpu(w);
    const int64_t n = wt.rows();
    const int64_t k = wt.cols();
    std::vector<float> bias_storage;
    const float* b = bias != nullptr ? AsCpu(*bias).AllF32(&bias_storage) : nullptr;
    // Each weight row is read once (converted once) and used for every token: bandwidth-bound
    // at one token, compute-bound (fp32 FMA) for long prefills.
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 16), [&](const tbb::blocked_range<int64_t>& range) {
        std::vector<float> scratch(rows > 1 ? k : 0);
        for (int64_t j = range.begin(); j < range.end(); ++j) {
          const float bj = b == nullptr ? 0.0f : b[j];
          if (rows == 1) {
            out[j] = wt.Dot(x, j) + bj;
            continue;
          }
          const float* wj = wt.RowF32(j, scratch.data());
          for (int64_t t = 0; t < rows; ++t) out[t * n + j] = internal::DotF32(x + t * k, wj, k) + bj;
        }
      });
    });
  }

  void Rope(float* x, int64_t rows, int heads, int head_dim, int rotary_dim, const float* inv_freq,
            const int32_t* positions) override {
    const int half = rotary_dim / 2;
    For(rows, [&](int64_t r) {
      std::vector<float> cos_v(half), sin_v(half);
      const float pos = static_cast<float>(positions[r]);
      for (int i = 0; i < half; ++i) {
        float angle = pos * inv_freq[i];
        cos_v[i] = std::cos(angle);
        sin_v[i] = std::sin(angle);
      }
      for (int h = 0; h < heads; ++h) {
        float* v = x + (r * heads + h) * head_dim;
        for (int i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cos_v[i] - b * sin_v[i];
          v[i + half] = b * cos_v[i] + a * sin_v[i];
        }
      }
    });
  }

  void Attention(const AttentionArgs& a) override {
    KvCache& cache = *a.cache;
    const int bs = cache.shape().block_size;
    const int d = a.head_dim;
    const int kv_width = a.num_kv_heads * d;
    // Where each row sits: its sequence and position.
    std::vector<int> row_seq(a.num_tokens);
    std::vector<int64_t> row_pos(a.num_tokens);
    for (int s = 0, row = 0; s < a.num_seqs; ++s) {
      for (int i = 0; i < a.seqs[s].num_tokens; ++i, ++row) {
        row_seq[row] = s;
        row_pos[row] = a.seqs[s].first_position + i;
      }
    }
    // Store the new keys and values first: a chunk's later tokens attend to its earlier ones.
    for (int64_t r = 0; r < a.num_tokens; ++r) {
      const SequenceChunk& seq = a.seqs[row_seq[r]];
      const int64_t p = row_pos[r];
      const int block = seq.block_table[p / bs];
      const int slot = static_cast<int>(p % bs);
      for (int h = 0; h < a.num_kv_heads; ++h) {
        std::memcpy(cache.k(a.layer, block) + (static_cast<int64_t>(h) * bs + slot) * d, a.k + r * kv_width + h * d,
                    d * sizeof(float));
        std::memcpy(cache.v(a.layer, block) + (static_cast<int64_t>(h) * bs + slot) * d, a.v + r * kv_width + h * d,
                    d * sizeof(float));
      }
    }
    const int group = a.num_heads / a.num_kv_heads;
    const int64_t q_width = static_cast<int64_t>(a.num_heads) * d;
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range2d<int64_t, int>(0, a.num_tokens, 0, a.num_heads),
                        [&](const tbb::blocked_range2d<int64_t, int>& range) {
        std::vector<float> scores;
        for (int64_t r = range.rows().begin(); r < range.rows().end(); ++r) {
          const SequenceChunk& seq = a.seqs[row_seq[r]];
          const int64_t len = row_pos[r] + 1;  // causal: positions 0..p
          scores.resize(len);
          for (int h = range.cols().begin(); h < range.cols().end(); ++h) {
            const int kvh = h / group;
            const float* q = a.q + r * q_width + static_cast<int64_t>(h) * d;
            float max_score = -INFINITY;
            for (int64_t p = 0; p < len; ++p) {
              const float* k = cache.k(a.layer, seq.block_table[p / bs]) + (static_cast<int64_t>(kvh) * bs + p % bs) * d;
              scores[p] = internal::DotF32(q, k, d) * a.scale;
              max_score = std::max(max_score, scores[p]);
            }
            float sum = 0;
            for (int64_t p = 0; p < len; ++p) {
              scores[p] = std::exp(scores[p] - max_score);
              sum += scores[p];
            }
            float* o = a.out + r * q_width + static_cast<int64_t>(h) * d;
            std::fill(o, o + d, 0.0f);
            const float inv = 1.0f / sum;
            for (int64_t p = 0; p < len; ++p) {
              const float* v = cache.v(a.layer, seq.block_table[p / bs]) + (static_cast<int64_t>(kvh) * bs + p % bs) * d;
              internal::Axpy(scores[p] * inv, v, d, o);
            }
          }
        }
      });
    });
  }

  void SiluMul(const float* gate, const float* up, int64_t n, float* out) override {
    ForChunks(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    });
  }

  void Add(float* acc, const float* x, int64_t n) override {
    ForChunks(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) acc[i] += x[i];
    });
  }

  void GatherRows(const float* src, int64_t cols, const int32_t* rows, int64_t n, float* out) override {
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * cols, src + rows[i] * cols, cols * sizeof(float));
  }

  void ScatterAddRows(const float* src, int64_t cols, const int32_t* rows, const float* scales, int64_t n,
                      float* out) override {
    for (int64_t i = 0; i < n; ++i) internal::Axpy(scales[i], src + i * cols, cols, out + rows[i] * cols);
  }

  void ScaleRowsBySigmoid(float* x, int64_t rows, int64_t cols, const float* gate) override {
    for (int64_t r = 0; r < rows; ++r) {
      const float s = 1.0f / (1.0f + std::exp(-gate[r]));
      for (int64_t i = 0; i < cols; ++i) x[r * cols + i] *= s;
    }
  }

 private:
  template <typename F>
  void For(int64_t n, F&& f) {
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n), [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t i = r.begin(); i < r.end(); ++i) f(i);
      });
    });
  }
  template <typename F>
  void ForChunks(int64_t n, F&& f) {
    if (n < (1 << 15)) {
      f(0, n);
      return;
    }
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14),
                        [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); });
    });
  }

  tbb::task_arena arena_;
};

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend(int threads) {
  if (threads <= 0) threads = tbb::info::default_concurrency();
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace moe::runtime
