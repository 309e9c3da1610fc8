// The expert pool's worker threads: a oneTBB arena of one slot per thread, each thread pinned to
// one CPU when asked, the Crew that keeps them awake between calls, and CrewLoops, the crew lent
// to other host work (the CPU backend's operations) as HostThreads.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "moe/experts/host_threads.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/global_control.h"
#include "oneapi/tbb/parallel_for.h"
#include "oneapi/tbb/partitioner.h"
#include "oneapi/tbb/task_arena.h"
#include "oneapi/tbb/task_group.h"

namespace moe::experts::internal {

// The CPUs this process may run on (its affinity mask), in increasing order; empty if the mask
// cannot be read.
std::vector<int> AllowedCpus();

// One step of a wait on other threads of the arena: a spin while the awaited work is likely
// microseconds away, then yielding the core between checks (to whatever else runs there).
inline void Relax(int spins) {
  if (spins < 4096) {
    _mm_pause();
  } else {
    sched_yield();
  }
}

// Waits until `flag` holds `value`: spinning, since the awaited work is running on another thread
// of the arena and takes microseconds, then yielding the core in case that thread shares it.
inline void SpinUntil(const std::atomic<int64_t>& flag, int64_t value) {
  for (int spins = 0; flag.load(std::memory_order_acquire) < value; ++spins) Relax(spins);
}

// The arena's threads as one crew for the pool's calls. Submit posts the call (Post); one crew
// thread runs it (the lead), or the caller in Wait if none has; the lead's Broadcast runs the
// schedule's worker on every thread that joins (the work is shared through atomic counters, so
// any number may take part, late ones finding nothing left). After a call the crew threads linger
// for ExpertPoolOptions::linger_us, spinning, and start the next one the moment it is posted.
// Left to the task scheduler instead, they slept between calls and woke late: on the 32-core
// machine a 1-token int8 call took 0.26 ms back to back, but 0.31-0.33 ms with 300 us of other
// work between calls and 0.38 ms with 1 ms (`moeserve bench experts --gap-us`), the threads
// idle for 45% of the call before their first work; lingering, 0.26-0.28 ms.
//
// The same crew runs other host work's parallel loops (Run, for CrewLoops): the driving thread
// opens a broadcast itself, with no call posted. While held (Hold), between the loops of one step
// of that work, the threads linger up to kHeldLinger whatever linger_us says.
//
// Thread-safety: Post, Finish, Run, Hold and Park come from one thread outside the arena (the
// pool's caller, the driver), one at a time: Post, then Finish; Run finishes a posted call first;
// Park only with no call posted. Broadcast comes from the lead only, inside the posted call (or
// from Run). Everything else the threads share goes through atomics, deliberately: a lock or a
// condition variable would put the lingering threads to sleep, which is what the crew exists to
// avoid.
class Crew {
 public:
  // `arena` must outlive the crew; `workers` is the arena's threads besides the caller's slot.
  Crew(tbb::task_arena& arena, int workers, int64_t linger_us)
      : arena_(arena), workers_(workers), linger_(std::chrono::microseconds(std::max<int64_t>(0, linger_us))) {}

  // Posts a call; `lead` runs once, on a crew thread or in Finish. From outside the arena.
  void Post(std::function<void()> lead);

  // Returns once the posted call has run: the caller runs it if no crew thread has taken it,
  // and otherwise helps with its work. Returns at once when no call is posted.
  void Finish();

  // From the lead: runs worker() on this thread and every crew thread that joins, and returns
  // once all of them have left it. With `bring_in` (inside the arena only), brings in the
  // arena's other threads that are not lingering.
  template <typename F>
  void Broadcast(F& worker, bool bring_in = true) {
    work_ = [](void* f) { (*static_cast<F*>(f))(); };
    work_arg_ = &worker;
    entry_.store(kOpen | 1);  // the lead takes part
    round_.fetch_add(1);
    for (int missing = bring_in ? workers_ - resident_.load() : 0; missing > 0; --missing) {
      group_.run([this] { Resident(); });
    }
    worker();
    for (int spins = 0;; ++spins) {  // close it once the others are done
      int64_t alone = kOpen | 1;
      if (entry_.compare_exchange_weak(alone, 0)) break;
      Relax(spins);
    }
  }

  // From the driver, with no call posted (one is finished first): runs worker() on this thread
  // and every crew thread that joins, as Broadcast does. When the whole crew lingers the driver
  // opens the broadcast from outside the arena: entering it would pin and unpin this thread
  // (two system calls) for every loop. Otherwise it enters to bring the sleeping threads in.
  template <typename F>
  void Run(F& worker) {
    Finish();
    if (resident_.load(std::memory_order_acquire) >= workers_) {
      // A thread that stops lingering meanwhile is missed: the work is shared through counters,
      // so the others do its part.
      Broadcast(worker, /*bring_in=*/false);
    } else {
      arena_.execute([&] { Broadcast(worker); });
    }
  }

  // While held, the threads linger up to kHeldLinger after each round instead of linger_us.
  void Hold(bool held) { held_.store(held, std::memory_order_relaxed); }

  // Sends the lingering threads away and waits for them (before other work in the arena, and
  // before the pool goes). No call may be in flight.
  void Park();

  // How long held threads wait for the next round: far longer than the gaps between one step's
  // operations (the longest are serial host work of a long prefill, a few milliseconds), and a
  // bound on the spinning of a driver that never says its step is over.
  static constexpr std::chrono::milliseconds kHeldLinger{50};

 private:
  static constexpr int64_t kOpen = int64_t{1} << 40;

  bool TryLead();
  // Takes part in the open broadcast, if there is one.
  bool TryJoin();
  // A crew thread: runs what is posted, then lingers for the next post until linger_ has passed
  // without one (or Park).
  void Resident();

  tbb::task_arena& arena_;
  tbb::task_group group_;  // the crew threads' tasks
  const int workers_;      // the arena's threads besides the caller's slot
  const std::chrono::steady_clock::duration linger_;
  std::function<void()> lead_;
  bool posted_ = false;  // a call posted and not yet finished; the driver's only
  void (*work_)(void*) = nullptr;
  void* work_arg_ = nullptr;
  // Each on its own cache line: the lingering threads keep reading round_, which the others'
  // updates would otherwise take from them.
  alignas(64) std::atomic<uint64_t> round_{0};  // bumped by each Post and Broadcast
  alignas(64) std::atomic<bool> lead_pending_{false};
  alignas(64) std::atomic<bool> lead_done_{false};
  // The open broadcast: kOpen while threads may join, plus the threads in it.
  alignas(64) std::atomic<int64_t> entry_{0};
  alignas(64) std::atomic<int> resident_{0};  // crew threads in Resident()
  std::atomic<bool> stop_{false};
  std::atomic<bool> held_{false};
};

// The crew lent as HostThreads (see there): each loop is a broadcast whose threads take chunks of
// the range, in order, from one counter.
//
// Thread-safety: as HostThreads; the driver is the crew's (the pool's caller).
class CrewLoops final : public HostThreads {
 public:
  // `crew` must outlive this; `threads`: the crew's threads and the driver.
  CrewLoops(Crew& crew, int threads) : crew_(crew), threads_(threads) {}

  int size() const override { return threads_; }
  void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t begin, int64_t end)> body) override;
  void Rest() override { crew_.Hold(false); }

 private:
  // Chunks a loop is cut into per thread: a few, so that uneven work (attention's causal rows)
  // evens out, at one update of a shared counter each.
  static constexpr int64_t kChunksPerThread = 4;

  Crew& crew_;
  const int threads_;
};

class PinningObserver;

// The pool's threads: an arena of `threads` slots (the caller's among them), its crew, and, with
// `pin`, each thread that enters the arena pinned to cpus[slot % cpus.size()]. Raises oneTBB's
// limit on parallelism when `threads` is more than it allows by default.
//
// Thread-safety: made and destroyed on one thread, with the crew parked; crew() as the Crew says;
// OnEachThread from outside the arena, with the crew parked (its threads would hold the slots).
class WorkerThreads {
 public:
  WorkerThreads(int threads, int64_t linger_us, bool pin, const std::vector<int>& cpus);
  ~WorkerThreads();
  WorkerThreads(const WorkerThreads&) = delete;
  WorkerThreads& operator=(const WorkerThreads&) = delete;

  tbb::task_arena& arena() { return arena_; }
  Crew& crew() { return crew_; }

  // Runs f(t) for t in [0, threads), each on its own thread of the arena (the measurements'
  // parallel loops).
  template <typename F>
  void OnEachThread(int threads, F&& f) {
    arena_.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<int>(0, threads, 1),
          [&](const tbb::blocked_range<int>& r) {
            for (int t = r.begin(); t < r.end(); ++t) f(t);
          },
          tbb::static_partitioner());
    });
  }

 private:
  // Declared in the order they are made (the limit and the pinning before the arena first runs
  // anything) and go in reverse.
  tbb::task_arena arena_;
  Crew crew_;
  std::unique_ptr<tbb::global_control> control_;
  std::unique_ptr<PinningObserver> observer_;
};

}  // namespace moe::experts::internal
