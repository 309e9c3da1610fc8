// Deadlines as poll(2) timeouts.
#pragma once

#include <climits>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe::comm::internal {

// Milliseconds from now to `deadline`, rounded up, for poll(2): 0 once it has passed, -1 (wait
// without end) for absl::InfiniteFuture().
inline int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

}  // namespace moe::comm::internal
