// Token sampling from one row of logits: greedy, temperature, top-k, top-p, min-p, with a
// seeded generator per sequence (same seed, same tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "absl/status/status.h"

namespace moe::runtime {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off; keep the smallest set whose probability reaches top_p
  float min_p = 0.0f;        // 0: off; drop tokens below min_p * p(best)
  std::optional<uint64_t> seed;

  bool greedy() const { return temperature == 0.0f; }
  // kInvalidArgument naming the field: negative or NaN temperature, top_p outside (0, 1],
  // negative top_k, min_p outside [0, 1].
  absl::Status Validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Picks a token from logits[vocab]. Greedy ties go to the lowest id.
  int32_t Sample(const float* logits, int vocab);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

// Index of the largest value; ties go to the lowest index.
int32_t ArgMax(const float* values, int n);

}  // namespace moe::runtime
