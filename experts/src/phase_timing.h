// Where the expert pool's calls spend their time, for benchmarks (ExpertPool::PhaseReport): the
// wall time of each named phase of a call, and the threads' time in its parallel phase by kind
// of work.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "oneapi/tbb/task_arena.h"

namespace moe::experts::internal {

// Kinds of work in a call's parallel phase (sort and experts), timed for the bench's --phases.
enum class Work { kSort, kInput, kGateUp, kSilu, kIntermediate, kDown, kReduce };
inline constexpr int kWorkKinds = 7;

// Thread-safety: a Timed may run on any thread of the pool's arena, each adding to its own slot's
// counters (on its own cache line), and only between StartWork and EndWork. The other methods come
// from one thread at a time: the thread that runs a call's set-up (outside the parallel phase),
// or the pool's caller between calls.
class PhaseTimes {
 public:
  // `threads`: the arena's slots.
  explicit PhaseTimes(int threads) : thread_times_(threads) {}

  // Times one piece of work on the calling thread: a few TSC reads, cheap enough for every work
  // item of a call.
  class Timed {
   public:
    Timed(PhaseTimes& times, Work work) : times_(times), work_(work), t0_(__rdtsc()) {}
    ~Timed() {
      const int slot = tbb::this_task_arena::current_thread_index();
      if (slot < 0 || slot >= static_cast<int>(times_.thread_times_.size())) return;
      ThreadTimes& t = times_.thread_times_[slot];
      const uint64_t t1 = __rdtsc();
      t.ticks[static_cast<int>(work_)] += t1 - t0_;
      t.first = std::min(t.first, t0_);
      t.last = std::max(t.last, t1);
    }

   private:
    PhaseTimes& times_;
    Work work_;
    uint64_t t0_;
  };

  void StartPhases() { phase_start_ = std::chrono::steady_clock::now(); }
  // Ends the running phase as `name` and starts the next.
  void EndPhase(const char* name);
  // Around the parallel phase: its ticks, and each thread's idle ticks before its first and after
  // its last piece of work.
  void StartWork();
  void EndWork();
  // A call that completed, of those the means are over.
  void CountCall() { ++calls_; }

  // "set-up 0.012, sort and experts 0.250 ms/call; thread time in the sort and experts phase:
  // sort 2.1%, ..., idle 5.0% (...)": means per call since the last Reset.
  std::string Report() const;
  void Reset();

 private:
  // Thread time in the parallel phase by kind of work, per arena slot, in TSC ticks (only shares
  // are reported), and the span of the thread's work in the current phase.
  struct alignas(64) ThreadTimes {
    uint64_t ticks[kWorkKinds] = {};
    uint64_t first = ~uint64_t{0}, last = 0;
  };

  // Wall time per named phase, in order of first appearance.
  std::vector<std::pair<std::string, double>> phases_;
  int64_t calls_ = 0;
  std::chrono::steady_clock::time_point phase_start_;
  std::vector<ThreadTimes> thread_times_;
  // The parallel phase's ticks, and the idle ticks before each thread's first and after its last
  // piece of work, summed over threads.
  uint64_t work_start_ = 0, work_ticks_ = 0, idle_before_ = 0, idle_after_ = 0;
};

}  // namespace moe::experts::internal
