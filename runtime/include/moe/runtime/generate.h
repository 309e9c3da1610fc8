// One prompt, one sequence, start to end: prefill the prompt in one step, then decode one
// token per step with the KV cache. The building block of `moeserve generate` and of the
// numerics tests; the scheduler batches many sequences instead.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/model.h"
#include "moe/runtime/speculative.h"
#include "moe/runtime/sampler.h"

namespace moe::runtime {

struct GenerateOptions {
  int max_new_tokens = 16;
  SamplingParams sampling;
  bool stop_at_eos = true;         // stop after a token of spec.eos_token_ids
  bool prompt_logits = false;      // return the logits of every prompt position
  bool step_logits = false;        // return the logits each new token was sampled from
  int block_size = 16;
  // Speculative decoding: kNgram drafts from the sequence's own n-grams, kMtp from `mtp_head`
  // (draft needs an executor with a draft model, which Generate has not). The tokens are those of
  // decoding without drafts; only the steps taken change. Off while step_logits is asked for.
  SpeculativeConfig speculative;
  // With kMtp: the model's MTP head (a Model loaded with ModelOptions::nextn_head from the same
  // checkpoint), not owned. Not with prompt_logits.
  Model* mtp_head = nullptr;
};

struct GenerateResult {
  std::vector<int32_t> generated_ids;
  std::vector<std::vector<float>> prompt_logits;  // [prompt positions][vocab] if asked
  std::vector<std::vector<float>> step_logits;    // [generated][vocab] if asked
  double prefill_seconds = 0;
  double decode_seconds = 0;  // for generated tokens after the first
  int decode_steps = 0;       // steps after the prefill
  int spec_drafts = 0;        // of them, steps that carried drafts
  int draft_tokens = 0;       // drafts carried
  int accepted_draft_tokens = 0;
};

// kInvalidArgument for an empty prompt, a token outside the vocabulary, bad sampling
// parameters, or a prompt plus max_new_tokens beyond the model's context.
absl::StatusOr<GenerateResult> Generate(Model& model, const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options);

}  // namespace moe::runtime
