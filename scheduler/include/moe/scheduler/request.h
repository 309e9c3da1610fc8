// A generation request as the scheduler sees it, and what it reports back per step.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "moe/runtime/sampler.h"

namespace moe::scheduler {

using Clock = std::chrono::steady_clock;

class TokenGrammar;  // structured_output.h

struct StoppingParams {
  int max_new_tokens = 16;
  int min_new_tokens = 0;  // eos and stop tokens are ignored before this many tokens
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

struct Request {
  std::string id;
  std::vector<int32_t> prompt;
  runtime::SamplingParams sampling;
  StoppingParams stopping;
  int logprobs = 0;  // with each token: its log-probability and this many top alternatives
  std::optional<Clock::time_point> deadline;
  // Structured outputs: every token follows this grammar, and the request ends when its bytes are
  // a whole sentence that cannot go on (null: unconstrained). Such a request carries no drafts.
  std::shared_ptr<const TokenGrammar> grammar;
  // Speculative decoding for this request: at most this many drafts a step (0: none); unset: the
  // server's setting. Never more than the server's n_max (SchedulerConfig::max_draft).
  std::optional<int> max_draft;
};

// Speculative decoding's counts, for one step of a request or its whole life.
struct DraftCounts {
  int drafts = 0;        // verify steps that carried drafts
  int draft_tokens = 0;  // drafts carried
  int accepted = 0;      // of them, kept (each a token served without a step of its own)
};

// kStopString: the text pipeline matched a stop string and ended the request (Engine::Finish).
enum class FinishReason { kLength, kEos, kStopToken, kStopString, kAborted, kDeadline, kError };
const char* FinishReasonName(FinishReason reason);

// What one step did for one request: tokens appended, and whether it ended.
struct Output {
  std::string id;
  std::vector<int32_t> new_tokens;
  std::vector<runtime::TokenLogprobs> logprobs;  // one per new token when the request asked
  std::optional<FinishReason> finished;
  absl::Status error;  // set with kError
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;  // prompt tokens found in the prefix cache when the request started
  bool admitted = false;  // this step started working on the request (for queue-time metrics)
  DraftCounts step_drafts;  // this step's verify (at most one per request and step)
  DraftCounts drafts;       // with `finished`: the request's whole life
};

inline Output OutputFor(std::string id) {
  Output out;
  out.id = std::move(id);
  return out;
}

}  // namespace moe::scheduler
