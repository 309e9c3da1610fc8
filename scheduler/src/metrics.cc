#include "moe/scheduler/metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe::scheduler {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  absl::MutexLock lock(&mu_);
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::Render(const std::string& name, const std::string& help, std::string* out) const {
  absl::MutexLock lock(&mu_);
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    absl::StrAppend(out, name, "_bucket{le=\"", absl::StrFormat("%g", bounds_[i]), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_bucket{le=\"+Inf\"} ", count_, "\n", name, "_sum ", absl::StrFormat("%.9g", sum_), "\n",
                  name, "_count ", count_, "\n");
}

namespace {
std::vector<double> LatencyBounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
}  // namespace

Metrics::Metrics()
    : queue_seconds(LatencyBounds()),
      first_token_seconds(LatencyBounds()),
      inter_token_seconds(LatencyBounds()),
      request_seconds(LatencyBounds()),
      step_seconds(LatencyBounds()) {}

void Metrics::CountDrafts(const DraftCounts& step) {
  if (step.draft_tokens <= 0) return;
  spec_drafts += step.drafts;
  spec_draft_tokens += step.draft_tokens;
  spec_accepted_tokens += step.accepted;
  for (int i = 0; i < std::min(step.accepted, runtime::kMaxDraftTokens); ++i) ++spec_accepted_per_pos[i];
  int seen = spec_positions.load();
  const int positions = std::min(step.draft_tokens, runtime::kMaxDraftTokens);
  while (seen < positions && !spec_positions.compare_exchange_weak(seen, positions)) {
  }
}

void Metrics::CountRejected(absl::StatusCode code) {
  const int i = static_cast<int>(code);
  if (i >= 0 && i < kCodes) ++rejected_[i];
}

std::string Metrics::Render(const SchedulerStats& stats) const {
  std::string out;
  auto gauge = [&](const char* name, const char* help, double v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n", name, " ", v, "\n");
  };
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name, " ", v, "\n");
  };
  gauge("moeserve_requests_running", "Sequences in the running batch.", stats.running);
  gauge("moeserve_requests_waiting", "Requests waiting to start.", stats.waiting);
  gauge("moeserve_kv_blocks_used", "KV cache blocks held by sequences.", stats.blocks_used);
  gauge("moeserve_kv_blocks_free", "KV cache blocks free.", stats.blocks_free);
  gauge("moeserve_kv_blocks_cached", "Free KV cache blocks that keep a cached prefix (taken last).",
        stats.blocks_cached);
  counter("moeserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          static_cast<uint64_t>(stats.prefix_queried_tokens));
  counter("moeserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
          static_cast<uint64_t>(stats.prefix_hit_tokens));
  counter("moeserve_preemptions_total", "Sequences preempted for lack of KV blocks.", stats.preemptions);
  counter("moeserve_prompt_tokens_total", "Prompt tokens of finished requests.", prompt_tokens.load());
  counter("moeserve_generated_tokens_total", "Tokens generated.", generated_tokens.load());
  counter("moeserve_requests_finished_total", "Requests that ended normally.", requests_finished.load());
  counter("moeserve_requests_aborted_total", "Requests aborted or past their deadline.", requests_aborted.load());
  counter("moeserve_requests_failed_total", "Requests that ended in an error.", requests_failed.load());
  counter("moeserve_spec_decode_num_drafts", "Speculative decoding: verify steps of a sequence that carried drafts.",
          spec_drafts.load());
  counter("moeserve_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
          spec_draft_tokens.load());
  counter("moeserve_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens kept.",
          spec_accepted_tokens.load());
  absl::StrAppend(&out,
                  "# HELP moeserve_spec_decode_num_accepted_tokens_per_pos Speculative decoding: draft tokens kept at "
                  "each position of a draft (0 is the first).\n"
                  "# TYPE moeserve_spec_decode_num_accepted_tokens_per_pos counter\n");
  for (int i = 0; i < spec_positions.load(); ++i) {
    absl::StrAppend(&out, "moeserve_spec_decode_num_accepted_tokens_per_pos{position=\"", i, "\"} ",
                    spec_accepted_per_pos[i].load(), "\n");
  }
  absl::StrAppend(&out,
                  "# HELP moeserve_requests_rejected_total Requests refused before they ran, by status code.\n"
                  "# TYPE moeserve_requests_rejected_total counter\n");
  for (int i = 1; i < kCodes; ++i) {
    absl::StrAppend(&out, "moeserve_requests_rejected_total{code=\"",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(i)), "\"} ", rejected_[i].load(), "\n");
  }
  queue_seconds.Render("moeserve_queue_seconds", "Arrival to the first step working on the request.", &out);
  first_token_seconds.Render("moeserve_time_to_first_token_seconds", "Arrival to the first token.", &out);
  inter_token_seconds.Render("moeserve_inter_token_seconds", "Time between tokens of a request.", &out);
  request_seconds.Render("moeserve_request_seconds", "Arrival to the end of a request.", &out);
  step_seconds.Render("moeserve_step_seconds", "Time of one scheduler step.", &out);
  return out;
}

}  // namespace moe::scheduler
