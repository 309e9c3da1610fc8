// The serving load generator: N concurrent clients each run Generate streams back to back
// against a moeserve.v1.Generation server; per request it records the time to the first token,
// the time per output token after it, the gaps between tokens and the whole latency.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::bench {

struct ServingBenchOptions {
  std::string target;  // HOST:PORT
  int concurrency = 1;
  int requests = 16;      // in all
  int prompt_len = 32;
  int output_len = 32;
  int vocab = 512;        // prompt token ids are drawn below this
  // Prompts that repeat a random run of this many tokens (text that repeats itself, where n-gram
  // drafts pay); 0: random throughout.
  int prompt_period = 0;
  std::string csv;        // per-request rows, when set
  // Structured outputs: GenerateRequest.response_format (OpenAI's object as JSON text), "" for none.
  std::string response_format;
};

struct LatencyStats {
  double mean = 0, p50 = 0, p99 = 0;
};

struct ServingBenchResult {
  int concurrency = 0;
  int requests = 0;
  int failed = 0;
  double seconds = 0;
  double output_tokens_per_second = 0;
  LatencyStats ttft_ms, tpot_ms, itl_ms, e2e_ms;
  // Speculative decoding, from the final messages' usage: verify steps with drafts, drafts, kept.
  int64_t spec_drafts = 0, draft_tokens = 0, accepted_draft_tokens = 0;
};

absl::StatusOr<ServingBenchResult> RunServingBench(const ServingBenchOptions& options);

// `moeserve bench serve`: one RunServingBench per entry of `concurrency`, each of `requests`
// requests (0: 4 per stream, at least 8), the rest as `options` says. Prints a line per run on
// `out` as it goes, or with `json` one JSON array of rows once every run is done. Errors:
// RunServingBench's (the lines of the runs before stay printed).
// Multi-turn chat, as coding agents and chat clients drive a server: `concurrency` conversations
// share one system prompt (prompt_len tokens: the system prompt and tools); each turn adds
// turn_len user tokens, asks for output_len tokens and keeps them, so the history grows every turn.
// Per turn: the mean time to first token and the prompt tokens the server found cached.
struct MultiTurnRow {
  int turn = 0;
  int history_tokens = 0;  // the prompt of this turn
  double ttft_ms = 0;      // mean over the conversations
  double cached_tokens = 0;
};
absl::StatusOr<std::vector<MultiTurnRow>> RunMultiTurnBench(const ServingBenchOptions& options, int turns,
                                                            int turn_len);
// Prints the rows of one server or, given both, of a server with the prefix cache on and one with it
// off side by side, with the ratio of their TTFTs.
void PrintMultiTurn(const std::vector<MultiTurnRow>& on, const std::vector<MultiTurnRow>* off, bool json,
                    std::ostream& out);

absl::Status RunServingSweep(ServingBenchOptions options, const std::vector<int>& concurrency, int requests, bool json,
                             std::ostream& out);

// `moeserve bench serve --response-format`: per concurrency, the same load unconstrained and then
// constrained by `response_format`, their output tokens/s and the ratio. `mask_counters`, when
// given (a server in this process), reads the grammar's masks computed so far and the seconds
// they took (TokenGrammar::masks_computed, mask_seconds): each constrained run reports the masks
// it computed (states not cached before), the time of one, and that time per output token.
struct MaskCounters {
  int64_t computed = 0;
  double seconds = 0;
};
absl::Status RunStructuredSweep(ServingBenchOptions options, const std::vector<int>& concurrency, int requests,
                                const std::function<MaskCounters()>& mask_counters, bool json, std::ostream& out);

}  // namespace moe::bench
