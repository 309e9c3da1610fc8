// SampleRows against the CPU sampler (SampleToken, ApplyPenalties, ComputeLogprobs) on the same
// logits and keys: the same tokens, the same penalised logits, the same log-probabilities.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda/cuda_status.h"
#include "cuda/ops.h"
#include "gtest/gtest.h"
#include "moe/core/philox.h"
#include "moe/runtime/sampler.h"

namespace moe::runtime::cuda {
namespace {

// Device memory for one test, freed with it.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(std::max<size_t>(count, 1)) {
    EXPECT_EQ(cudaMalloc(&data_, count_ * sizeof(T)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return static_cast<T*>(data_); }
  void Upload(const std::vector<T>& host, cudaStream_t stream) {
    ASSERT_LE(host.size(), count_);
    ASSERT_EQ(cudaMemcpyAsync(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
              cudaSuccess);
  }
  std::vector<T> Download(size_t count, cudaStream_t stream) const {
    std::vector<T> host(count);
    EXPECT_EQ(cudaMemcpyAsync(host.data(), data_, count * sizeof(T), cudaMemcpyDeviceToHost, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t count_;
};

class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

struct Mix {
  std::string name;
  SamplingParams params;
  int logprobs = 0;
};

SamplingParams Params(float temperature, int top_k, float top_p, float min_p, float repetition = 1.0f,
                      float presence = 0.0f, float frequency = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.repetition_penalty = repetition;
  p.presence_penalty = presence;
  p.frequency_penalty = frequency;
  return p;
}

std::vector<Mix> Mixes() {
  return {
      {"greedy", Params(0, 0, 1, 0), 0},
      {"greedy_penalties_logprobs", Params(0, 0, 1, 0, 1.3f, 0.5f, 0.2f), 20},
      {"plain", Params(1, 0, 1, 0), 0},
      {"top_k_1", Params(0.7f, 1, 1, 0), 3},
      {"top_k_50", Params(0.8f, 50, 1, 0), 0},
      {"top_k_large", Params(1, 5000, 1, 0), 0},
      {"top_p_0.9", Params(1, 0, 0.9f, 0), 5},
      {"top_p_0.5", Params(1.2f, 0, 0.5f, 0), 0},
      {"min_p_0.05", Params(1, 0, 1, 0.05f), 0},
      {"combined", Params(0.9f, 40, 0.8f, 0.02f), 1},
      {"sampled_penalties", Params(1, 0, 0.95f, 0, 1.2f, -0.4f, 0.3f), 7},
      {"top_k_penalties", Params(0.6f, 20, 1, 0.1f, 0.8f, 1.5f, -0.5f), 0},
      {"tiny_temperature", Params(1e-30f, 0, 0.9f, 0), 2},
  };
}

// One row of a launch, with everything the CPU needs to redo it.
struct Row {
  std::vector<float> logits;
  SamplingParams params;
  SampleKey key;
  std::vector<int32_t> prompt, output;
  int logprobs = 0;
};

std::vector<float> RandomLogits(int vocab, std::mt19937_64& rng) {
  // Half the rows spread wide (a peaked softmax, as models give), a quarter narrow (mass over
  // much of the vocabulary), a quarter on a grid of 0.25 (many exact ties, at every threshold).
  const int kind = static_cast<int>(rng() % 4);
  std::normal_distribution<float> dist(0.0f, kind == 1 ? 0.5f : 3.0f);
  std::vector<float> logits(vocab);
  for (float& v : logits) v = kind == 3 ? std::round(dist(rng) * 4) / 4 : dist(rng);
  return logits;
}

std::vector<int32_t> RandomHistory(int vocab, int max_len, std::mt19937_64& rng) {
  std::vector<int32_t> ids(rng() % (max_len + 1));
  const int distinct = std::max(1, std::min(vocab, 12));  // repeats, so counts go above 1
  for (int32_t& t : ids) t = static_cast<int32_t>(rng() % 3 == 0 ? rng() % distinct : rng() % vocab);
  if (!ids.empty() && rng() % 4 == 0) ids[rng() % ids.size()] = static_cast<int32_t>(vocab + 3);  // ignored
  if (!ids.empty() && rng() % 4 == 0) ids[rng() % ids.size()] = -1;                               // ignored
  return ids;
}

Row RandomRow(int vocab, const Mix& mix, std::mt19937_64& rng) {
  Row row;
  row.logits = RandomLogits(vocab, rng);
  row.params = mix.params;
  row.key = SampleKey{rng(), static_cast<uint32_t>(rng() % 3), static_cast<uint32_t>(rng())};
  row.prompt = RandomHistory(vocab, 40, rng);
  row.output = RandomHistory(vocab, 25, rng);
  row.logprobs = mix.logprobs;
  return row;
}

struct DeviceResult {
  std::vector<int32_t> tokens, top_ids;
  std::vector<float> logprob, top_logprobs, logits;
};

constexpr int32_t kUntouchedId = 12345;
constexpr float kUntouchedLogprob = 7.0f;

// Buffers for up to `max_rows` rows of `vocab`, reused across launches (and by a captured graph).
class SamplingBuffers {
 public:
  SamplingBuffers(int max_rows, int vocab, int max_history)
      : vocab_(vocab),
        logits_(static_cast<size_t>(max_rows) * vocab),
        params_(max_rows),
        history_(max_history),
        workspace_(SamplingWorkspaceBytes(max_rows, vocab)),
        tokens_(max_rows),
        logprob_(max_rows),
        top_ids_(static_cast<size_t>(max_rows) * kMaxLogprobs),
        top_logprobs_(static_cast<size_t>(max_rows) * kMaxLogprobs) {
    // Garbage in the workspace (every slot looks tagged): SampleRows must not depend on it.
    EXPECT_EQ(cudaMemset(workspace_.get(), 0xff, SamplingWorkspaceBytes(max_rows, vocab)), cudaSuccess);
  }

  void Upload(const std::vector<Row>& rows, cudaStream_t stream) {
    std::vector<float> logits;
    std::vector<SampleParamsGpu> params;
    std::vector<int32_t> history;
    for (const Row& r : rows) {
      logits.insert(logits.end(), r.logits.begin(), r.logits.end());
      SampleParamsGpu p{};
      p.temperature = r.params.temperature;
      p.top_k = r.params.top_k;
      p.top_p = r.params.top_p;
      p.min_p = r.params.min_p;
      p.repetition_penalty = r.params.repetition_penalty;
      p.presence_penalty = r.params.presence_penalty;
      p.frequency_penalty = r.params.frequency_penalty;
      p.seed_lo = static_cast<uint32_t>(r.key.seed);
      p.seed_hi = static_cast<uint32_t>(r.key.seed >> 32);
      p.position = static_cast<int32_t>(r.key.position);
      p.sequence = static_cast<int32_t>(r.key.sequence);
      p.history_start = static_cast<int32_t>(history.size());
      p.prompt_len = static_cast<int32_t>(r.prompt.size());
      p.output_len = static_cast<int32_t>(r.output.size());
      p.logprobs = r.logprobs;
      params.push_back(p);
      history.insert(history.end(), r.prompt.begin(), r.prompt.end());
      history.insert(history.end(), r.output.begin(), r.output.end());
    }
    logits_.Upload(logits, stream);
    params_.Upload(params, stream);
    if (!history.empty()) history_.Upload(history, stream);
    const size_t slots = rows.size() * kMaxLogprobs;
    logprob_.Upload(std::vector<float>(rows.size(), kUntouchedLogprob), stream);
    top_ids_.Upload(std::vector<int32_t>(slots, kUntouchedId), stream);
    top_logprobs_.Upload(std::vector<float>(slots, kUntouchedLogprob), stream);
  }

  void Launch(int rows, cudaStream_t stream) {
    SampleRows(logits_.get(), rows, vocab_, params_.get(), history_.get(), workspace_.get(), tokens_.get(),
               logprob_.get(), top_ids_.get(), top_logprobs_.get(), stream);
  }

  DeviceResult Download(int rows, cudaStream_t stream) {
    DeviceResult out;
    out.tokens = tokens_.Download(rows, stream);
    out.logprob = logprob_.Download(rows, stream);
    out.top_ids = top_ids_.Download(static_cast<size_t>(rows) * kMaxLogprobs, stream);
    out.top_logprobs = top_logprobs_.Download(static_cast<size_t>(rows) * kMaxLogprobs, stream);
    out.logits = logits_.Download(static_cast<size_t>(rows) * vocab_, stream);
    return out;
  }

 private:
  int vocab_;
  DeviceArray<float> logits_;
  DeviceArray<SampleParamsGpu> params_;
  DeviceArray<int32_t> history_;
  DeviceArray<uint8_t> workspace_;
  DeviceArray<int32_t> tokens_;
  DeviceArray<float> logprob_;
  DeviceArray<int32_t> top_ids_;
  DeviceArray<float> top_logprobs_;
};

float GumbelScore(const std::vector<float>& penalized, const SamplingParams& p, const SampleKey& key, int32_t id) {
  const float kMax = std::numeric_limits<float>::max();
  const float z = std::clamp(penalized[id] / p.temperature, -kMax, kMax);
  const float u = std::min(core::SamplingUniform(key.seed, key.sequence, key.position, id), 0x1.fffffep-1f);
  return z - std::log(-std::log(u));
}

// A token that differs from the CPU's is excused when the CPU itself picks it with min_p or top_p
// moved by 1e-5 (an entry at a filter boundary, where exp's rounding decides), or when the two
// tokens' Gumbel scores are within 1e-5 (the GPU's log rounds differently).
bool MismatchExcused(const std::vector<float>& penalized, const SamplingParams& p, const SampleKey& key, int32_t cpu,
                     int32_t gpu, std::string* why) {
  const int vocab = static_cast<int>(penalized.size());
  if (gpu < 0 || gpu >= vocab) {
    *why = "token out of range";
    return false;
  }
  const float a = GumbelScore(penalized, p, key, cpu), b = GumbelScore(penalized, p, key, gpu);
  if (std::abs(a - b) <= 1e-5f * std::max(1.0f, std::abs(a))) {
    *why = "near tie";
    return true;
  }
  for (float f : {1.0f - 1e-5f, 1.0f + 1e-5f}) {
    SamplingParams moved = p;
    moved.top_p = std::min(1.0f, p.top_p * f);
    moved.min_p = std::min(1.0f, p.min_p * f);
    if (SampleToken(penalized.data(), vocab, moved, key) == gpu) {
      *why = "filter boundary";
      return true;
    }
  }
  *why = "cpu score " + std::to_string(a) + ", gpu score " + std::to_string(b);
  return false;
}

struct Tally {
  int draws = 0;
  int mismatches = 0;
};

// Checks one launch's results row by row against the CPU.
void ExpectMatchesCpu(const std::vector<Row>& rows, int vocab, const DeviceResult& got, const std::string& where,
                      Tally* tally) {
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row& row = rows[r];
    const std::string at = where + " row " + std::to_string(r);
    std::vector<float> penalized = row.logits;
    ApplyPenalties(row.params, row.prompt.data(), static_cast<int>(row.prompt.size()), row.output.data(),
                   static_cast<int>(row.output.size()), penalized.data(), vocab);
    int differ = 0;
    for (int i = 0; i < vocab; ++i) {
      differ += std::memcmp(&penalized[i], &got.logits[r * vocab + i], sizeof(float)) != 0;
    }
    EXPECT_EQ(differ, 0) << at << ": penalised logits differ from ApplyPenalties";

    const int32_t cpu = SampleToken(penalized.data(), vocab, row.params, row.key);
    const int32_t gpu = got.tokens[r];
    ++tally->draws;
    if (gpu != cpu) {
      ++tally->mismatches;
      std::string why;
      const bool excused = !row.params.greedy() && MismatchExcused(penalized, row.params, row.key, cpu, gpu, &why);
      EXPECT_TRUE(excused) << at << ": gpu token " << gpu << ", cpu token " << cpu << " (" << why << ")";
      if (excused) std::printf("%s: gpu %d, cpu %d excused (%s)\n", at.c_str(), gpu, cpu, why.c_str());
    }
    if (gpu < 0 || gpu >= vocab) continue;

    if (row.logprobs == 0) {
      EXPECT_EQ(got.logprob[r], kUntouchedLogprob) << at;
      EXPECT_EQ(got.top_ids[r * kMaxLogprobs], kUntouchedId) << at;
      continue;
    }
    const int n = std::min({row.logprobs, kMaxLogprobs, vocab});
    const TokenLogprobs want = ComputeLogprobs(row.logits.data(), vocab, gpu, n);
    EXPECT_NEAR(got.logprob[r], want.logprob, 1e-4) << at;
    for (int j = 0; j < kMaxLogprobs; ++j) {
      if (j < n) {
        EXPECT_EQ(got.top_ids[r * kMaxLogprobs + j], want.top[j].first) << at << " alternative " << j;
        EXPECT_NEAR(got.top_logprobs[r * kMaxLogprobs + j], want.top[j].second, 1e-4) << at << " alternative " << j;
      } else {
        EXPECT_EQ(got.top_ids[r * kMaxLogprobs + j], -1) << at << " alternative " << j;
      }
    }
  }
}

constexpr int kMaxHistory = 64 * 70;

TEST(CudaSamplingTest, MatchesTheCpuSamplerForEveryMix) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  Stream stream;
  Tally tally;
  const std::vector<Mix> mixes = Mixes();
  for (int vocab : {7, 1000, 151936}) {
    const int rounds = vocab < 100 ? 40 : vocab < 10000 ? 8 : 1;
    SamplingBuffers buffers(64, vocab, kMaxHistory);
    std::mt19937_64 rng(vocab);
    for (int rows : {1, 5, 64}) {
      // Each mix on every row, then all mixes side by side in one launch.
      for (size_t m = 0; m <= mixes.size(); ++m) {
        for (int round = 0; round < rounds; ++round) {
          std::vector<Row> batch;
          for (int r = 0; r < rows; ++r) {
            batch.push_back(RandomRow(vocab, mixes[m < mixes.size() ? m : r % mixes.size()], rng));
          }
          buffers.Upload(batch, stream.get());
          buffers.Launch(rows, stream.get());
          ASSERT_EQ(cudaGetLastError(), cudaSuccess);
          const DeviceResult got = buffers.Download(rows, stream.get());
          const std::string where = "vocab " + std::to_string(vocab) + ", " + std::to_string(rows) + " rows, " +
                                    (m < mixes.size() ? mixes[m].name : std::string("mixed")) + ", round " +
                                    std::to_string(round);
          ExpectMatchesCpu(batch, vocab, got, where, &tally);
          if (HasFailure()) return;  // one launch's worth of messages is enough
        }
      }
    }
  }
  std::printf("%d draws, %d differ from the CPU\n", tally.draws, tally.mismatches);
  EXPECT_LT(tally.mismatches * 1000, tally.draws);
}

// The token min_p keeps is near the top: exp(z - max z) >= min_p, on wide, narrow and tied rows;
// with min_p = 1 it is the argmax.
TEST(CudaSamplingTest, MinPKeepsOnlyEntriesNearTheTop) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const int vocab = 1000, rows = 64;
  Stream stream;
  SamplingBuffers buffers(rows, vocab, kMaxHistory);
  std::mt19937_64 rng(5);
  for (float min_p : {1.0f, 0.5f, 0.05f}) {
    for (int launch = 0; launch < 8; ++launch) {
      std::vector<Row> batch;
      for (int r = 0; r < rows; ++r) {
        batch.push_back(RandomRow(vocab, Mix{"min_p", Params(1, 0, 1, min_p), 0}, rng));
        batch.back().prompt.clear();
        batch.back().output.clear();
      }
      buffers.Upload(batch, stream.get());
      buffers.Launch(rows, stream.get());
      const DeviceResult got = buffers.Download(rows, stream.get());
      // The same rows greedy: the top entry that min_p measures against.
      std::vector<Row> greedy = batch;
      for (Row& row : greedy) row.params.temperature = 0;
      buffers.Upload(greedy, stream.get());
      buffers.Launch(rows, stream.get());
      const DeviceResult argmax = buffers.Download(rows, stream.get());
      for (int r = 0; r < rows; ++r) {
        const std::vector<float>& z = batch[r].logits;
        const int best = static_cast<int>(std::max_element(z.begin(), z.end()) - z.begin());
        const int32_t token = got.tokens[r];
        ASSERT_TRUE(token >= 0 && token < vocab) << token;
        const float e = std::exp(z[token] - z[best]);
        EXPECT_GE(e, min_p * (1 - 1e-5f))
            << "min_p " << min_p << ", launch " << launch << " row " << r << ": token " << token << " (z " << z[token]
            << ") against the top " << best << " (z " << z[best] << "); greedy on the GPU: " << argmax.tokens[r];
        EXPECT_EQ(argmax.tokens[r], best) << "launch " << launch << " row " << r;
      }
      if (HasFailure()) return;
    }
  }
}

TEST(CudaSamplingTest, ReplaysACapturedGraphWithNewLogitsAndPositions) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const int vocab = 1000, rows = 8;
  Stream stream;
  SamplingBuffers buffers(rows, vocab, kMaxHistory);
  std::mt19937_64 rng(77);
  const std::vector<Mix> mixes = Mixes();
  auto make_batch = [&] {
    std::vector<Row> batch;
    for (int r = 0; r < rows; ++r) batch.push_back(RandomRow(vocab, mixes[(r * 3 + 2) % mixes.size()], rng));
    return batch;
  };
  std::vector<Row> batch = make_batch();
  buffers.Upload(batch, stream.get());
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  buffers.Launch(rows, stream.get());
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  Tally tally;
  for (int step = 0; step < 6; ++step) {
    if (step > 0 && step % 2 == 0) {
      batch = make_batch();  // new logits, keys and histories in the same buffers
    } else if (step > 0) {
      for (Row& row : batch) ++row.key.position;  // the next token of the same sequences
    }
    buffers.Upload(batch, stream.get());
    ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
    const DeviceResult got = buffers.Download(rows, stream.get());
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ExpectMatchesCpu(batch, vocab, got, "graph replay " + std::to_string(step), &tally);

    // The same inputs again give the same bits: the sums do not depend on the atomics' order.
    buffers.Upload(batch, stream.get());
    ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
    const DeviceResult again = buffers.Download(rows, stream.get());
    EXPECT_EQ(again.tokens, got.tokens) << "step " << step;
    EXPECT_EQ(std::memcmp(again.logprob.data(), got.logprob.data(), rows * sizeof(float)), 0) << "step " << step;
  }
  EXPECT_EQ(tally.mismatches, 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(CudaSamplingTest, TiesAtTheTopKAndTopPBoundariesGoToTheLowerIds) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  // 64 equal logits, q = 1/64 each, so the kept set is the lowest ids and every draw is uniform
  // over it: 256 draws must hit every kept id and nothing else. Where the mass before an entry
  // equals top_p exactly (0.125 and 0.5) the entry is dropped: "< top_p", not "<=".
  struct Case {
    SamplingParams params;
    int kept;
  };
  const Case cases[] = {
      {Params(1, 0, 0.1f, 0), 7}, {Params(1, 0, 0.125f, 0), 8},   {Params(1, 0, 0.5f, 0), 32},
      {Params(1, 5, 1, 0), 5},    {Params(1, 12, 0.3f, 0.5f), 4},  // 0.3 of the 12 left by top_k
      {Params(1, 3, 0.5f, 0), 2},
  };
  const int vocab = 64, rows = 64;
  Stream stream;
  SamplingBuffers buffers(rows, vocab, kMaxHistory);
  for (const Case& c : cases) {
    std::set<int32_t> seen;
    for (int launch = 0; launch < 4; ++launch) {
      std::vector<Row> batch(rows);
      for (int r = 0; r < rows; ++r) {
        batch[r].logits.assign(vocab, 1.5f);
        batch[r].params = c.params;
        batch[r].key = SampleKey{99, 0, static_cast<uint32_t>(launch * rows + r)};
      }
      buffers.Upload(batch, stream.get());
      buffers.Launch(rows, stream.get());
      const DeviceResult got = buffers.Download(rows, stream.get());
      Tally tally;
      ExpectMatchesCpu(batch, vocab, got, "equal logits, kept " + std::to_string(c.kept), &tally);
      EXPECT_EQ(tally.mismatches, 0);
      seen.insert(got.tokens.begin(), got.tokens.end());
    }
    std::set<int32_t> want;
    for (int t = 0; t < c.kept; ++t) want.insert(t);
    EXPECT_EQ(seen, want) << "kept " << c.kept;
  }
}

TEST(CudaSamplingTest, AVocabularyAboveTheLimitGivesTokenMinusOne) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const int vocab = (1 << 18) + 1;
  Stream stream;
  SamplingBuffers buffers(1, vocab, 1);
  std::vector<Row> batch(1);
  batch[0].logits.assign(vocab, 0.0f);
  buffers.Upload(batch, stream.get());
  buffers.Launch(1, stream.get());
  EXPECT_EQ(buffers.Download(1, stream.get()).tokens[0], -1);
}

}  // namespace
}  // namespace moe::runtime::cuda
