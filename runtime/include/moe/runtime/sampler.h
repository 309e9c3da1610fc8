// Token sampling from one row of logits: greedy, temperature, top-k, top-p, min-p, with a
// seeded generator per sequence (same seed, same tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace moe::runtime {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off; keep the smallest set whose probability reaches top_p
  float min_p = 0.0f;        // 0: off; drop tokens below min_p * p(best)
  float repetition_penalty = 1.0f;  // 1: off; > 1 discourages every token of prompt and output
  float presence_penalty = 0.0f;    // subtracted once from each token already generated
  float frequency_penalty = 0.0f;   // subtracted per occurrence in the generated tokens
  std::optional<uint64_t> seed;

  bool greedy() const { return temperature == 0.0f; }
  bool penalized() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
  // kInvalidArgument naming the field: negative or NaN temperature, top_p outside (0, 1],
  // negative top_k, min_p outside [0, 1], repetition_penalty not positive, presence or
  // frequency penalty outside [-2, 2].
  absl::Status Validate() const;
};

// Applies the penalties of `params` to logits[vocab] in place, as vLLM does: the repetition
// penalty over prompt and output tokens (divides positive logits, multiplies negative ones), the
// presence and frequency penalties over the output tokens only.
void ApplyPenalties(const SamplingParams& params, const int32_t* prompt, int prompt_len, const int32_t* output,
                    int output_len, float* logits, int vocab);

// log-softmax of one row: the log-probability of `token`, and the `top` best alternatives
// (token, log-probability), best first.
struct TokenLogprobs {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs ComputeLogprobs(const float* logits, int vocab, int32_t token, int top);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Picks a token from logits[vocab]. Greedy ties go to the lowest id.
  int32_t Sample(const float* logits, int vocab);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

// kInternal when logits[rows x vocab] hold a NaN or an infinity: a broken model (its weights, or
// a config value such as rope_theta), whose tokens must not be served. The message names the
// first one's row (when there are several) and vocabulary index.
absl::Status CheckLogitsFinite(const float* logits, int64_t rows, int vocab);

// Index of the largest value; ties go to the lowest index.
int32_t ArgMax(const float* values, int n);

}  // namespace moe::runtime
