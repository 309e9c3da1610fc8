#include "phase_timing.h"

#include "absl/strings/str_format.h"

namespace moe::experts::internal {
namespace {

constexpr const char* kWorkNames[kWorkKinds] = {"sort", "input", "gate+up", "silu", "intermediate", "down", "reduce"};

}  // namespace

void PhaseTimes::EndPhase(const char* name) {
  const auto now = std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(now - phase_start_).count();
  phase_start_ = now;
  for (auto& [n, total] : phases_) {
    if (n == name) {
      total += secs;
      return;
    }
  }
  phases_.emplace_back(name, secs);
}

void PhaseTimes::StartWork() {
  for (ThreadTimes& t : thread_times_) {
    t.first = ~uint64_t{0};
    t.last = 0;
  }
  work_start_ = __rdtsc();
}

void PhaseTimes::EndWork() {
  const uint64_t end = __rdtsc();
  work_ticks_ += end - work_start_;
  for (const ThreadTimes& t : thread_times_) {
    if (t.last == 0) {
      idle_before_ += end - work_start_;
    } else {
      idle_before_ += t.first - work_start_;
      idle_after_ += end - t.last;
    }
  }
}

std::string PhaseTimes::Report() const {
  const double n = std::max<int64_t>(calls_, 1) / 1e3;  // ms per call
  std::string text;
  for (const auto& [name, secs] : phases_) {
    absl::StrAppendFormat(&text, "%s%s %.3f", text.empty() ? "" : ", ", name, secs / n);
  }
  text += " ms/call";
  if (work_ticks_ == 0) return text;
  // Shares of the parallel phase's thread time (phase time x threads).
  const double total = static_cast<double>(work_ticks_) * static_cast<double>(thread_times_.size());
  text += "; thread time in the sort and experts phase:";
  double busy = 0;
  for (int w = 0; w < kWorkKinds; ++w) {
    uint64_t ticks = 0;
    for (const ThreadTimes& t : thread_times_) ticks += t.ticks[w];
    if (ticks == 0) continue;
    busy += ticks / total;
    absl::StrAppendFormat(&text, " %s %.1f%%,", kWorkNames[w], 100 * ticks / total);
  }
  absl::StrAppendFormat(&text, " idle %.1f%% (%.1f%% before a thread's first work, %.1f%% after its last)",
                        100 * (1 - busy), 100 * idle_before_ / total, 100 * idle_after_ / total);
  return text;
}

void PhaseTimes::Reset() {
  calls_ = 0;
  phases_.clear();
  for (ThreadTimes& t : thread_times_) t = ThreadTimes{};
  work_ticks_ = idle_before_ = idle_after_ = 0;
}

}  // namespace moe::experts::internal
