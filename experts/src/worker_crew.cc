#include "worker_crew.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <utility>

#include "oneapi/tbb/info.h"
#include "oneapi/tbb/task_scheduler_observer.h"

namespace moe::experts::internal {

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

void Crew::Post(std::function<void()> lead) {
  lead_ = std::move(lead);
  posted_ = true;
  lead_done_.store(false);
  lead_pending_.store(true);
  round_.fetch_add(1);
  // Nobody lingering: start a crew thread (a sleeping worker is woken for it).
  if (resident_.load() == 0 && workers_ > 0) arena_.execute([&] { group_.run([this] { Resident(); }); });
}

void Crew::Finish() {
  if (!posted_) return;
  posted_ = false;
  arena_.execute([&] {
    if (TryLead()) return;
    bool joined = false;
    for (int spins = 0; !lead_done_.load(std::memory_order_acquire); ++spins) {
      if (!joined) joined = TryJoin();
      Relax(spins);
    }
  });
}

void Crew::Park() {
  stop_.store(true);
  arena_.execute([&] { group_.wait(); });
  stop_.store(false);
}

bool Crew::TryLead() {
  bool pending = true;
  if (!lead_pending_.compare_exchange_strong(pending, false)) return false;
  lead_();
  lead_done_.store(true, std::memory_order_release);
  return true;
}

bool Crew::TryJoin() {
  for (int64_t e = entry_.load(); e & kOpen;) {
    if (entry_.compare_exchange_weak(e, e + 1)) {
      work_(work_arg_);
      entry_.fetch_sub(1, std::memory_order_release);
      return true;
    }
  }
  return false;
}

void Crew::Resident() {
  resident_.fetch_add(1);
  uint64_t seen = ~uint64_t{0};
  for (;;) {
    const uint64_t round = round_.load();
    if (round != seen) {
      seen = round;
      TryLead();
      TryJoin();
      continue;
    }
    // Held (between the loops of a step), the threads wait longer; Hold(false) shortens the wait
    // of those already waiting.
    const auto since = std::chrono::steady_clock::now();
    for (int spins = 0; round_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed);
         ++spins) {
      if (spins % 256 == 0) {
        const auto linger = held_.load(std::memory_order_relaxed)
                                ? std::max<std::chrono::steady_clock::duration>(linger_, kHeldLinger)
                                : linger_;
        if (std::chrono::steady_clock::now() - since >= linger) break;
      }
      Relax(spins);
    }
    if (round_.load() != seen && !stop_.load()) continue;
    resident_.fetch_sub(1);
    // A post that came as this thread was leaving saw it still here: stay for it.
    if (round_.load() != seen && !stop_.load()) {
      resident_.fetch_add(1);
      continue;
    }
    return;
  }
}

namespace {
// Set while a thread runs a CrewLoops body: a loop started from there runs inline.
thread_local bool in_crew_loop = false;
}  // namespace

void CrewLoops::ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body) {
  if (n <= 0) return;
  if (in_crew_loop) {
    body(0, n);
    return;
  }
  crew_.Finish();  // a pool call in flight: the crew does one thing at a time
  const int64_t chunk = std::max<int64_t>({grain, 1, n / (threads_ * kChunksPerThread)});
  if (threads_ == 1 || n <= chunk) {
    body(0, n);
    return;
  }
  crew_.Hold(true);
  alignas(64) std::atomic<int64_t> next{0};
  auto worker = [&] {
    in_crew_loop = true;
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) {
      body(begin, std::min(n, begin + chunk));
    }
    in_crew_loop = false;
  };
  crew_.Run(worker);
}

// Pins each thread that enters the arena to one CPU, by arena slot. A thread that joins from
// outside (the caller in Wait) gets its own affinity back when it leaves.
//
// Thread-safety: oneTBB calls the callbacks on the entering and leaving threads, any number at
// once; each keeps what it saved in thread-local storage, and cpus_ is read-only.
class PinningObserver : public tbb::task_scheduler_observer {
 public:
  PinningObserver(tbb::task_arena& arena, std::vector<int> cpus)
      : tbb::task_scheduler_observer(arena), cpus_(std::move(cpus)) {
    observe(true);
  }
  ~PinningObserver() override { observe(false); }

  void on_scheduler_entry(bool worker) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot < 0 || cpus_.empty()) return;
    if (!worker) saved_valid_ = pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_) == 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus_[slot % cpus_.size()], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  void on_scheduler_exit(bool worker) override {
    if (!worker && saved_valid_) pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
  }

 private:
  std::vector<int> cpus_;
  static thread_local cpu_set_t saved_;
  static thread_local bool saved_valid_;
};
thread_local cpu_set_t PinningObserver::saved_;
thread_local bool PinningObserver::saved_valid_ = false;

WorkerThreads::WorkerThreads(int threads, int64_t linger_us, bool pin, const std::vector<int>& cpus)
    : arena_(threads, 1), crew_(arena_, threads - 1, linger_us) {
  if (threads > tbb::info::default_concurrency()) {
    control_ = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, threads);
  }
  if (pin) observer_ = std::make_unique<PinningObserver>(arena_, cpus);
}

WorkerThreads::~WorkerThreads() = default;

}  // namespace moe::experts::internal
