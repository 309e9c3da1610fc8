// Device time per operation, for a benchmark's step budget (Backend::BeginOpTiming/EndOpTiming):
// a pair of events around each operation the backend queues, and the calibration of what a pair
// costs. Each timed step starts behind a hold of the stream longer than the host takes to queue a
// step, so its operations run back to back: their times are the device's, without the host's
// launch latency.
//
// Owned by the CUDA backend; used from its step thread only. Every call queues on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/backend.h"

namespace moe::runtime::cuda {

class OpTimer {
 public:
  OpTimer() = default;
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Starts timing (the events are made the first time).
  absl::Status Start();
  // Stops timing and sums the times by operation (waits for `stream`).
  absl::StatusOr<Backend::OpTiming> Finish(cudaStream_t stream);
  bool active() const { return active_; }
  // Whether another operation can be timed (at most Backend::kMaxTimedOperations).
  bool has_room() const { return active_ && timed_.size() < kTimedOps; }

  // The event before operation `op`; the first of a step holds the stream first. The first error
  // of the calls it makes, cudaSuccess when none.
  cudaError_t Before(std::string op, bool first_of_step, cudaStream_t stream);
  // The event after the operation Before named, if it has none yet.
  cudaError_t After(cudaStream_t stream);

 private:
  static constexpr int kTimedOps = Backend::kMaxTimedOperations;
  static constexpr int64_t kHoldNs = 8'000'000;
  struct TimedOp {
    std::string op;
    int start, end;  // indices into events_
    bool first_of_step;
  };
  bool active_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<TimedOp> timed_;
};

}  // namespace moe::runtime::cuda
