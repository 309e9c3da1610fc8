#include "moe/core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_format.h"

namespace moe::core {
namespace {

absl::Mutex g_sink_mu(absl::kConstInit);
ProgressSink* g_sink ABSL_GUARDED_BY(g_sink_mu) = nullptr;

}  // namespace

void SetProgressSink(ProgressSink sink) {
  absl::MutexLock lock(&g_sink_mu);
  delete g_sink;
  g_sink = sink ? new ProgressSink(std::move(sink)) : nullptr;
}

ProgressReporter::ProgressReporter(std::string label, int64_t total_bytes, bool enabled)
    : label_(std::move(label)), total_(total_bytes), enabled_(enabled), tty_(::isatty(2)), start_(Clock::now()) {
  if (enabled_) thread_ = std::thread([this] { Run(); });
}

ProgressReporter::~ProgressReporter() { Finish(); }

double ProgressReporter::Finish() {
  if (finished_) return seconds_;
  finished_ = true;
  seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
  if (thread_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
    Print(true);
  }
  return seconds_;
}

void ProgressReporter::Run() {
  absl::MutexLock lock(&mu_);
  const auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopped), absl::Milliseconds(500))) Print(false);
}

void ProgressReporter::Print(bool last) {
  const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
  const double done = static_cast<double>(done_.load());
  // MB for small jobs, GB for real ones.
  const bool gb = total_ >= (1ll << 30);
  const double unit = gb ? 1e9 : 1e6;
  const std::string line =
      absl::StrFormat("%s: %.2f / %.2f %s (%.0f%%), %.2f GB/s", label_, done / unit, total_ / unit, gb ? "GB" : "MB",
                      100.0 * done / std::max<double>(total_, 1), done / 1e9 / std::max(secs, 1e-9));
  {
    absl::MutexLock lock(&g_sink_mu);
    if (g_sink != nullptr) (*g_sink)(line, last ? 1.0 : done / std::max<double>(total_, 1));
  }
  if (tty_) {
    std::fprintf(stderr, "\r%s%s", line.c_str(), last ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

}  // namespace moe::core
