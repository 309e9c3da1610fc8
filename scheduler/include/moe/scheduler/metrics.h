// Serving metrics in the Prometheus text format (HttpServer serves them at GET /metrics).
//
// Thread-safety: every method of Histogram and Metrics, and every counter, may be used from any
// thread at once. A render reads each counter and histogram on its own, so it may see one
// request's end in one counter and not yet in another.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "moe/scheduler/scheduler.h"

namespace moe::scheduler {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // Appends the _bucket, _sum and _count lines of `name`.
  void Render(const std::string& name, const std::string& help, std::string* out) const;

 private:
  mutable absl::Mutex mu_;
  const std::vector<double> bounds_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Metrics {
  Metrics();
  std::atomic<uint64_t> prompt_tokens{0};
  std::atomic<uint64_t> generated_tokens{0};
  std::atomic<uint64_t> requests_finished{0};
  std::atomic<uint64_t> requests_aborted{0};
  std::atomic<uint64_t> requests_failed{0};
  // Speculative decoding, as vLLM names them: verify steps with drafts, drafts carried, drafts
  // kept, and drafts kept at each position (position i counts a step whose first i+1 drafts were
  // kept).
  std::atomic<uint64_t> spec_drafts{0};
  std::atomic<uint64_t> spec_draft_tokens{0};
  std::atomic<uint64_t> spec_accepted_tokens{0};
  std::atomic<uint64_t> spec_accepted_per_pos[runtime::kMaxDraftTokens] = {};
  std::atomic<int> spec_positions{0};  // positions drafted so far (rendered)
  void CountDrafts(const DraftCounts& step);
  Histogram queue_seconds, first_token_seconds, inter_token_seconds, request_seconds, step_seconds;

  // A request refused before it ran (bad request, full queue, missing API key, shutting down),
  // counted by its status code.
  void CountRejected(absl::StatusCode code);

  std::string Render(const SchedulerStats& stats) const;

 private:
  static constexpr int kCodes = 17;  // absl::StatusCode 0..16
  std::atomic<uint64_t> rejected_[kCodes] = {};
};

}  // namespace moe::scheduler
