// HostThreads: a set of threads that runs another component's parallel loops. The expert pool
// lends its pinned crew through it (ExpertPool::host_threads) so that the CPU backend's operations
// (Linears, attention, norms) and the pool's routed experts run on one set of threads, one per
// core: with two sets on the same cores, either one set sleeps while the other works and pays its
// wake-up at every MoE layer, or both stay awake and fight over the cores.
#pragma once

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace moe::experts {

// Thread-safety: ParallelFor and Rest come from one thread at a time, the one that drives the
// owner (for the pool's crew, the thread that calls ExpertPool::Submit and Wait), never from
// inside a loop's body. A body runs on that thread and on the crew's, several at once.
class HostThreads {
 public:
  virtual ~HostThreads() = default;

  // Threads that take part in a loop, the caller's included.
  virtual int size() const = 0;

  // Calls body(begin, end) over disjoint ranges that cover [0, n), each at least `grain` long but
  // the last, on the caller and the crew, and returns once all are done. Which thread runs which
  // range is not fixed, so a body's result must not depend on it. A call of the owner's that is in
  // flight (a pool call between Submit and Wait) is finished first: the crew does one thing at a
  // time. A call from inside a body runs inline on its thread.
  //
  // After a loop the threads stay awake (spinning, then yielding their cores) until Rest, so that
  // the next loop and the pool's next call start at once: the operations of one step follow each
  // other within microseconds.
  virtual void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t begin, int64_t end)> body) = 0;

  // The step is over: from now on the threads keep the owner's own linger time (for the pool,
  // ExpertPoolOptions::linger_us) and then sleep.
  virtual void Rest() = 0;
};

}  // namespace moe::experts
