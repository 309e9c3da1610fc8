#include "cuda/op_timer.h"

#include <algorithm>
#include <map>

#include "cuda/cuda_status.h"
#include "cuda/gather.h"

namespace moe::runtime::cuda {

OpTimer::~OpTimer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

absl::Status OpTimer::Start() {
  if (events_.empty()) {
    events_.resize(2 * kTimedOps);
    for (cudaEvent_t& e : events_) MOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
  timed_.clear();
  active_ = true;
  return absl::OkStatus();
}

cudaError_t OpTimer::Before(std::string op, bool first_of_step, cudaStream_t stream) {
  if (first_of_step) HoldStream(kHoldNs, stream);
  const int i = static_cast<int>(timed_.size());
  timed_.push_back(TimedOp{std::move(op), 2 * i, -1, first_of_step});
  return cudaEventRecord(events_[2 * i], stream);
}

cudaError_t OpTimer::After(cudaStream_t stream) {
  if (timed_.empty() || timed_.back().end >= 0) return cudaSuccess;
  timed_.back().end = timed_.back().start + 1;
  return cudaEventRecord(events_[timed_.back().end], stream);
}

absl::StatusOr<Backend::OpTiming> OpTimer::Finish(cudaStream_t stream) {
  active_ = false;
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  Backend::OpTiming t;
  if (timed_.empty()) return t;
  std::map<std::string, Backend::OpTime> by_op;
  for (const TimedOp& op : timed_) {
    if (op.end < 0) continue;
    float ms = 0;
    MOE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[op.start], events_[op.end]));
    Backend::OpTime& o = by_op[op.op];
    o.op = op.op;
    o.seconds += ms / 1e3;
    ++o.calls;
    t.busy_seconds += ms / 1e3;
  }
  // The span of each step, from its first operation's start to its last one's end.
  size_t first = 0;
  for (size_t i = 0; i < timed_.size(); ++i) {
    const bool last_of_step = i + 1 == timed_.size() || timed_[i + 1].first_of_step;
    if (!last_of_step || timed_[i].end < 0) continue;
    float span = 0;
    MOE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&span, events_[timed_[first].start], events_[timed_[i].end]));
    t.span_seconds += span / 1e3;
    first = i + 1;
  }
  // Calibration: pairs of events around nothing, behind a hold, as the operations ran.
  constexpr int kPairs = 32;
  if (events_.size() >= 2 * kPairs) {
    HoldStream(kHoldNs / 4, stream);
    for (int i = 0; i < kPairs; ++i) {
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2 * i], stream));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2 * i + 1], stream));
    }
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    double total = 0;
    for (int i = 0; i < kPairs; ++i) {
      float ms = 0;
      MOE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]));
      total += ms / 1e3;
    }
    t.overhead_seconds_per_op = total / kPairs;
  }
  for (auto& [name, o] : by_op) t.ops.push_back(o);
  std::sort(t.ops.begin(), t.ops.end(),
            [](const Backend::OpTime& a, const Backend::OpTime& b) { return a.seconds > b.seconds; });
  return t;
}

}  // namespace moe::runtime::cuda
