// Progress of a long job (writing a checkpoint, loading experts) on stderr: a line about twice a
// second with bytes done, percent and rate; rewritten in place on a terminal.
//
// Thread-safety: Add() from any thread; construction, Finish() and destruction from one. The
// reporting thread stops at Finish() or destruction.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moe::core {

// Where progress lines go besides stderr: a worker process streams them to its frontend. `line` is
// what stderr gets; `fraction` of the job is done (1 on the last line). Set before reporters start
// and cleared after they finish; the sink is called from their threads.
using ProgressSink = std::function<void(const std::string& line, double fraction)>;
void SetProgressSink(ProgressSink sink);

class ProgressReporter {
 public:
  // `label` starts each line ("loading experts"); nothing is printed when !enabled.
  ProgressReporter(std::string label, int64_t total_bytes, bool enabled = true);
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  void Add(int64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  // Stops reporting and prints the final line; returns the seconds since construction.
  double Finish();

 private:
  using Clock = std::chrono::steady_clock;
  void Run();
  void Print(bool last);

  const std::string label_;
  const int64_t total_;
  const bool enabled_;
  const bool tty_;
  const Clock::time_point start_;
  std::atomic<int64_t> done_{0};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ = false;
  double seconds_ = 0;
  std::thread thread_;
};

}  // namespace moe::core
