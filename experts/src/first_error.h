// FirstError: the first error of a parallel job, which its other tasks check to stop early.
#pragma once

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace moe::experts::internal {

// Thread-safety: every method may be called from any thread. failed() reads an atomic without
// the lock, since the tasks check it between steps of the hot loops.
class FirstError {
 public:
  void Set(const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_) {
    if (s.ok()) return;
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = s;
    failed_.store(true);
  }
  bool failed() const { return failed_.load(); }
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> failed_{false};
};

}  // namespace moe::experts::internal
