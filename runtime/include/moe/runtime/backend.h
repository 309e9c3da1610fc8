// The Backend interface: the operations the model forward is written over. The forward in
// model.cc calls only these, so it knows nothing of where they run; the CPU backend
// (backend_cpu.h) is the reference, and a CUDA backend implements the same operations.
//
// Conventions: activations are fp32, row-major, in memory the backend allocated ("device"
// memory: host memory for the CPU backend). Arguments named host_* are host arrays. All
// operations are queued in order on the backend's one stream and may run asynchronously; a
// CopyToHost waits for everything before it. A Backend is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/tensor.h"

namespace moe::runtime {

// fp32 memory owned by a backend; released when destroyed.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual float* data() = 0;
  virtual int64_t size() const = 0;  // in floats
};

// A weight in the form the backend computes with (for the CPU backend, a view of the mapped
// checkpoint when its dtype is bf16 or f32). The checkpoint must outlive it.
class DeviceWeight {
 public:
  virtual ~DeviceWeight() = default;
  const core::Shape& shape() const { return shape_; }
  int64_t rows() const { return shape_[0]; }
  int64_t cols() const { return shape_.size() > 1 ? shape_[1] : 1; }

 protected:
  core::Shape shape_;
};

class KvCache;

// One sequence's slice of a batch: its new tokens are consecutive rows of the batch.
struct SequenceChunk {
  int64_t first_position = 0;  // position of the chunk's first token in its sequence
  int32_t num_tokens = 0;
  std::vector<int32_t> block_table;  // KV blocks holding positions [0, first_position+num_tokens)
};

struct AttentionArgs {
  const float* q = nullptr;  // [tokens x num_heads*head_dim], RoPE applied
  const float* k = nullptr;  // [tokens x num_kv_heads*head_dim], RoPE applied
  const float* v = nullptr;  // [tokens x num_kv_heads*head_dim]
  float* out = nullptr;      // [tokens x num_heads*head_dim]
  int64_t num_tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 1.0f;
  const SequenceChunk* seqs = nullptr;  // host array, in row order
  int num_seqs = 0;
  KvCache* cache = nullptr;
  int layer = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // True when the backend computes on the host's CPU cores (the CPU backend): then the expert
  // pool's threads must not stay awake between MoE layers, they would take the cores from it.
  virtual bool ComputesOnHostCores() const { return false; }

  // kInvalidArgument for a dtype the backend cannot compute with.
  virtual absl::StatusOr<std::unique_ptr<DeviceWeight>> PrepareWeight(const core::TensorView& host) = 0;
  // kResourceExhausted when the device is out of memory.
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int64_t num_floats) = 0;
  virtual void CopyToHost(const float* src, float* host_dst, int64_t n) = 0;
  virtual void CopyFromHost(const float* host_src, float* dst, int64_t n) = 0;

  // out[i] = table[host_ids[i]] (table is [vocab x hidden]).
  virtual void Embed(const DeviceWeight& table, const int32_t* host_ids, int64_t n, float* out) = 0;
  // Per row of [rows x cols]: x * rsqrt(mean(x^2) + eps) * w. `out` may equal `x`.
  virtual void RmsNorm(const float* x, const DeviceWeight& w, float eps, int64_t rows, int64_t cols,
                       float* out) = 0;
  // out[rows x N] = x[rows x K] . w^T (+ bias), with w [N x K]; fp32 accumulation.
  virtual void Linear(const float* x, int64_t rows, const DeviceWeight& w, const DeviceWeight* bias,
                      float* out) = 0;
  // Rotates the first rotary_dim dims of every head (NeoX half-split layout), in place, by
  // angle position * host_inv_freq[i] (fp32, as transformers computes it);
  // x is [rows x heads*head_dim], host_inv_freq[rotary_dim / 2], host_positions[rows].
  virtual void Rope(float* x, int64_t rows, int heads, int head_dim, int rotary_dim, const float* host_inv_freq,
                    const int32_t* host_positions) = 0;
  // Writes the new k/v rows into the cache, then causal attention of each query over its
  // sequence's cached keys (GQA: query head h reads kv head h / (num_heads / num_kv_heads)).
  virtual void Attention(const AttentionArgs& args) = 0;
  // out = silu(gate) * up, elementwise over n values.
  virtual void SiluMul(const float* gate, const float* up, int64_t n, float* out) = 0;
  // acc += x over n values.
  virtual void Add(float* acc, const float* x, int64_t n) = 0;
  // out[i] = src[host_rows[i]] for i < n; rows of `cols` values.
  virtual void GatherRows(const float* src, int64_t cols, const int32_t* host_rows, int64_t n,
                          float* out) = 0;
  // out[host_rows[i]] += host_scales[i] * src[i] for i < n (rows may repeat only across calls).
  virtual void ScatterAddRows(const float* src, int64_t cols, const int32_t* host_rows,
                              const float* host_scales, int64_t n, float* out) = 0;
  // x[r] *= sigmoid(gate[r]) for each row r of [rows x cols].
  virtual void ScaleRowsBySigmoid(float* x, int64_t rows, int64_t cols, const float* gate) = 0;
};

}  // namespace moe::runtime
