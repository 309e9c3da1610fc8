// Helpers of the attention kernel tests (attention_test.cc, attention_timing_test.cc): device
// arrays with a guard region, and the metadata of a step as the scheduler builds it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/ops.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::runtime::cuda::attention_test_util {

inline constexpr unsigned char kPoisonByte = 0xff;  // NaN as bf16 and as fp32
inline constexpr uint16_t kBf16NaN = 0xffff;
inline constexpr unsigned char kGuardByte = 0x5a;
inline constexpr size_t kGuardBytes = 4096;

// Device memory of n elements followed by a guard region that must never be written.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes() + kGuardBytes) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << bytes() << " bytes failed";
      return;
    }
    p_ = static_cast<T*>(p);
    EXPECT_EQ(cudaMemset(reinterpret_cast<char*>(p_) + bytes(), kGuardByte, kGuardBytes), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  size_t bytes() const { return n_ * sizeof(T); }
  void Upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    EXPECT_EQ(cudaMemcpy(p_, v.data(), bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    EXPECT_EQ(cudaMemcpy(v.data(), p_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void Poison() { EXPECT_EQ(cudaMemset(p_, kPoisonByte, bytes()), cudaSuccess); }
  bool GuardIntact() const {
    std::vector<unsigned char> guard(kGuardBytes);
    EXPECT_EQ(
        cudaMemcpy(guard.data(), reinterpret_cast<const char*>(p_) + bytes(), kGuardBytes, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return std::all_of(guard.begin(), guard.end(), [](unsigned char b) { return b == kGuardByte; });
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

inline void ExpectNoCudaError(const std::string& where) {
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << where << ": launch";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where << ": execution";
}

inline std::vector<uint16_t> RandomBf16(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) {
    float f = dist(rng);
    if (f == 0.0f) f = 0.5f;  // never zeros: a zero hides a missing write
    x = core::FloatToBf16(f);
  }
  return v;
}

struct Shape {
  int num_heads;
  int kv_heads;
  int head_dim;
  int block_size;
  int group() const { return num_heads / kv_heads; }
};

struct SeqChunk {
  int first_position;
  int num_tokens;
};

// A step's metadata as the scheduler builds it, on the host.
struct HostStep {
  std::vector<SeqChunk> seqs;
  std::vector<int32_t> positions, row_seq, seq_start, seq_len, block_table;
  int num_tokens = 0;
  int max_blocks = 0;
  int max_q_len = 0;
  int max_kv_len = 0;
  int num_blocks = 0;    // physical blocks of the cache
  int unused_block = 0;  // owned by no sequence: the block tables' padding id

  int Block(int seq, int position, int block_size) const {
    return block_table[static_cast<size_t>(seq) * max_blocks + position / block_size];
  }
};

// Each sequence's blocks get shuffled physical ids, so no table is contiguous; the table has one
// padding column more than the longest sequence needs. `sparse`: only the blocks that hold this
// step's rows get ids of their own, the earlier ones the padding id (for positions far beyond
// what a test cache can hold; only the store kernel may run on such a step). max_kv_len: 0 for
// the longest sequence, else an upper bound as a captured graph would see it.
inline HostStep MakeStep(const std::vector<SeqChunk>& seqs, int block_size, bool sparse, std::mt19937& rng,
                         int max_kv_len = 0) {
  HostStep h;
  h.seqs = seqs;
  const int num_seqs = static_cast<int>(seqs.size());
  int owned = 0;
  for (const SeqChunk& c : seqs) {
    const int len = c.first_position + c.num_tokens;
    const int blocks = (len + block_size - 1) / block_size;
    owned += blocks - (sparse ? c.first_position / block_size : 0);
    h.max_blocks = std::max(h.max_blocks, blocks);
    h.max_q_len = std::max(h.max_q_len, c.num_tokens);
    h.max_kv_len = std::max(h.max_kv_len, len);
  }
  if (max_kv_len > 0) h.max_kv_len = max_kv_len;
  h.max_blocks += 1;
  h.num_blocks = owned + 2;
  std::vector<int> ids(h.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  h.unused_block = ids.back();
  h.block_table.assign(static_cast<size_t>(num_seqs) * h.max_blocks, h.unused_block);
  int next = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int len = seqs[s].first_position + seqs[s].num_tokens;
    const int blocks = (len + block_size - 1) / block_size;
    for (int b = sparse ? seqs[s].first_position / block_size : 0; b < blocks; ++b) {
      h.block_table[static_cast<size_t>(s) * h.max_blocks + b] = ids[next++];
    }
  }
  for (int s = 0; s < num_seqs; ++s) {
    h.seq_start.push_back(h.num_tokens);
    h.seq_len.push_back(seqs[s].first_position + seqs[s].num_tokens);
    for (int i = 0; i < seqs[s].num_tokens; ++i) {
      h.positions.push_back(seqs[s].first_position + i);
      h.row_seq.push_back(s);
      ++h.num_tokens;
    }
  }
  h.seq_start.push_back(h.num_tokens);
  return h;
}

// The step's metadata in device memory; `meta` points into it.
struct DeviceStep {
  explicit DeviceStep(const HostStep& h)
      : positions(h.positions.size()),
        row_seq(h.row_seq.size()),
        seq_start(h.seq_start.size()),
        seq_len(h.seq_len.size()),
        block_table(h.block_table.size()) {
    positions.Upload(h.positions);
    row_seq.Upload(h.row_seq);
    seq_start.Upload(h.seq_start);
    seq_len.Upload(h.seq_len);
    block_table.Upload(h.block_table);
    meta.positions = positions.get();
    meta.row_seq = row_seq.get();
    meta.seq_start = seq_start.get();
    meta.seq_len = seq_len.get();
    meta.block_table = block_table.get();
    meta.num_tokens = h.num_tokens;
    meta.num_seqs = static_cast<int>(h.seqs.size());
    meta.max_blocks = h.max_blocks;
    meta.max_q_len = h.max_q_len;
    meta.max_kv_len = h.max_kv_len;
  }
  DeviceArray<int32_t> positions, row_seq, seq_start, seq_len, block_table;
  StepMeta meta;
};

inline std::vector<SeqChunk> DecodeRows(const std::vector<int>& lengths) {
  std::vector<SeqChunk> seqs;
  for (int len : lengths) seqs.push_back({len - 1, 1});
  return seqs;
}

}  // namespace moe::runtime::cuda::attention_test_util
