// Token sampling from one row of logits: greedy, temperature, top-k, min-p, top-p and the
// repetition, presence and frequency penalties.
//
// Sampling is counter-based: the token drawn for a row depends only on its logits, its parameters
// and its SampleKey (seed, sequence, position), never on what was drawn before or in which
// process. So a restarted process, another worker or the GPU draws the same token for the same
// row. SampleToken here and SampleRows (runtime/src/cuda/sampling.cu) implement this algorithm:
//
//  1. Penalties: ApplyPenalties changes the logits l of the tokens seen before (the caller does
//     this on the CPU; SampleRows does it on the GPU).
//  2. temperature == 0: greedy, the argmax of l, ties to the lowest id.
//  3. z_i = l_i / temperature in fp32, clamped to the finite floats (a tiny temperature must not
//     overflow to an infinity, whose softmax is NaN).
//  4. K1 = the top_k entries by (z desc, id asc); every entry when top_k == 0 or >= vocab.
//  5. e_i = exp(z_i - max z) in fp32 (the best entry has e = 1 exactly) and q_i = e_i / S with
//     S the sum of e over K1: q is the softmax of z over K1.
//  6. min_p: K2 = {i in K1 : e_i >= min_p}. This is q_i >= min_p * max q without the rounding of
//     the division; with min_p == 0 it is all of K1.
//  7. top_p < 1: order K2 by (e desc, id asc), which is the order of q; keep entry i iff the sum
//     of q over the entries before i is < top_p. That is the smallest prefix whose mass reaches
//     top_p, so the first entry is always kept. q is not renormalised after min_p.
//  8. The token is the argmax over the kept set of z_i + g_i, ties to the lowest id, with the
//     Gumbel noise g_i = -log(-log(u_i)), u_i = core::SamplingUniform(seed, sequence, position, i)
//     capped at the largest float below 1 (the generator can round to exactly 1, whose noise
//     would be infinite). The Gumbel-max trick draws exactly from softmax(z) over the kept set
//     and needs no sort and no sequential scan, so the GPU draws every entry in parallel.
//
// Log-probabilities come from the raw logits, before the penalties and the filters
// (ComputeLogprobs).
//
// Where the two implementations may differ: exp and log round differently in the C library and
// in CUDA (an ulp or two), and S and the top-p prefix sums are added in double on the CPU and in
// 2^-45 fixed point on the GPU. So a token can differ when the two best Gumbel scores are within
// about 1e-6 of each other, or when an entry lies within about 1e-6 (relative) of the min_p or
// top_p boundary. Exact ties (equal z or equal e) are broken by id on both.
#pragma once

#include <cstdint>
#include <optional>
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
  // The request's seed. Unset: the caller picks one (the scheduler draws a random seed per
  // request); the sampler itself only ever sees a SampleKey.
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

// Which draw a row gets: the request's seed, the sequence within the request (0 unless a request
// asks for several completions) and the position in the sequence of the token being drawn.
struct SampleKey {
  uint64_t seed = 0;
  uint32_t sequence = 0;
  uint32_t position = 0;
};

// Applies the penalties of `params` to logits[vocab] in place, as vLLM does: the repetition
// penalty over prompt and output tokens (divides positive logits, multiplies negative ones), the
// presence and frequency penalties over the output tokens only. Token ids outside [0, vocab) are
// ignored.
void ApplyPenalties(const SamplingParams& params, const int32_t* prompt, int prompt_len, const int32_t* output,
                    int output_len, float* logits, int vocab);

// Draws one token from logits[vocab] (already penalised) by the algorithm above. `params` must
// pass Validate(); the logits must be finite (CheckLogitsFinite). Allocates O(vocab) scratch and
// runs in O(vocab) time plus O(k log k) for the k entries that a top-k or top-p filter keeps.
// Thread-safe: it keeps no state.
int32_t SampleToken(const float* logits, int vocab, const SamplingParams& params, const SampleKey& key);

// log-softmax of one row: the log-probability of `token`, and the `top` best alternatives
// (token, log-probability), best first, ties to the lowest id.
struct TokenLogprobs {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs ComputeLogprobs(const float* logits, int vocab, int32_t token, int top);

// kInternal when logits[rows x vocab] hold a NaN or an infinity: a broken model (its weights, or
// a config value such as rope_theta), whose tokens must not be served. The message names the
// first one's row (when there are several) and vocabulary index.
absl::Status CheckLogitsFinite(const float* logits, int64_t rows, int vocab);

// Index of the largest value; ties go to the lowest index.
int32_t ArgMax(const float* values, int n);

}  // namespace moe::runtime
