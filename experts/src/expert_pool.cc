#include "moe/experts/expert_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <tuple>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/dtype.h"
#include "moe/core/progress.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/global_control.h"
#include "oneapi/tbb/info.h"
#include "oneapi/tbb/parallel_for.h"
#include "oneapi/tbb/partitioner.h"
#include "oneapi/tbb/task_arena.h"
#include "oneapi/tbb/task_group.h"
#include "oneapi/tbb/task_scheduler_observer.h"

namespace moe::experts {
namespace {

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// Pins each thread that enters the arena to one CPU, by arena slot. A thread that joins from
// outside (the caller in Wait) gets its own affinity back when it leaves.
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

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) float SumFloats(const float* p,
                                                                                               size_t n) {
  float acc[16] = {};
  for (size_t i = 0; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += p[i + j];
  }
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

// Columns per quantized-sum group of the activations for a matrix.
int SumGroup(const MatrixLayout& l) {
  return l.format == ExpertFormat::kInt4 ? l.group : static_cast<int>(l.k_pad);
}

uint64_t ArenaKey(const ExpertShape& s, const ExpertPoolOptions& o) {
  const std::string text = absl::StrCat(o.model_id, "|", FormatName(o.format), "|", o.group, "|", s.num_layers, "|",
                                        s.num_experts, "|", s.hidden, "|", s.intermediate, "|layout1");
  return std::hash<std::string>{}(text);
}

// One step of a wait on other threads of the arena: a spin while the awaited work is likely
// microseconds away, then yielding the core between checks (to whatever else runs there).
void Relax(int spins) {
  if (spins < 4096) {
    _mm_pause();
  } else {
    sched_yield();
  }
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
class Crew {
 public:
  Crew(tbb::task_arena& arena, int workers, int64_t linger_us)
      : arena_(arena), workers_(workers), linger_(std::chrono::microseconds(std::max<int64_t>(0, linger_us))) {}

  // Posts a call; `lead` runs once, on a crew thread or in Finish. From outside the arena.
  void Post(std::function<void()> lead) {
    lead_ = std::move(lead);
    lead_done_.store(false);
    lead_pending_.store(true);
    round_.fetch_add(1);
    // Nobody lingering: start a crew thread (a sleeping worker is woken for it).
    if (resident_.load() == 0 && workers_ > 0) arena_.execute([&] { group_.run([this] { Resident(); }); });
  }

  // Returns once the posted call has run: the caller runs it if no crew thread has taken it,
  // and otherwise helps with its work.
  void Finish() {
    arena_.execute([&] {
      if (TryLead()) return;
      bool joined = false;
      for (int spins = 0; !lead_done_.load(std::memory_order_acquire); ++spins) {
        if (!joined) joined = TryJoin();
        Relax(spins);
      }
    });
  }

  // From the lead: runs worker() on this thread and every crew thread that joins, and returns
  // once all of them have left it. Brings in the arena's other threads that are not lingering.
  template <typename F>
  void Broadcast(F& worker) {
    work_ = [](void* f) { (*static_cast<F*>(f))(); };
    work_arg_ = &worker;
    entry_.store(kOpen | 1);  // the lead takes part
    round_.fetch_add(1);
    for (int missing = workers_ - resident_.load(); missing > 0; --missing) group_.run([this] { Resident(); });
    worker();
    for (int spins = 0;; ++spins) {  // close it once the others are done
      int64_t alone = kOpen | 1;
      if (entry_.compare_exchange_weak(alone, 0)) break;
      Relax(spins);
    }
  }

  // Sends the lingering threads away and waits for them (before other work in the arena, and
  // before the pool goes). No call may be in flight.
  void Park() {
    stop_.store(true);
    arena_.execute([&] { group_.wait(); });
    stop_.store(false);
  }

 private:
  static constexpr int64_t kOpen = int64_t{1} << 40;

  bool TryLead() {
    bool pending = true;
    if (!lead_pending_.compare_exchange_strong(pending, false)) return false;
    lead_();
    lead_done_.store(true, std::memory_order_release);
    return true;
  }

  // Takes part in the open broadcast, if there is one.
  bool TryJoin() {
    for (int64_t e = entry_.load(); e & kOpen;) {
      if (entry_.compare_exchange_weak(e, e + 1)) {
        work_(work_arg_);
        entry_.fetch_sub(1, std::memory_order_release);
        return true;
      }
    }
    return false;
  }

  // A crew thread: runs what is posted, then lingers for the next post until linger_ has passed
  // without one (or Park).
  void Resident() {
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
      const auto deadline = std::chrono::steady_clock::now() + linger_;
      for (int spins = 0; round_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed);
           ++spins) {
        if (spins % 256 == 0 && std::chrono::steady_clock::now() >= deadline) break;
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

  tbb::task_arena& arena_;
  tbb::task_group group_;  // the crew threads' tasks
  const int workers_;      // the arena's threads besides the caller's slot
  const std::chrono::steady_clock::duration linger_;
  std::function<void()> lead_;
  void (*work_)(void*) = nullptr;
  void* work_arg_ = nullptr;
  // Each on its own cache line: the lingering threads keep reading round_, which the others'
  // updates would otherwise take from them.
  alignas(64) std::atomic<uint64_t> round_{0};  // bumped by each Post and Broadcast
  alignas(64) std::atomic<bool> lead_pending_{false};
  alignas(64) std::atomic<bool> lead_done_{false};
  alignas(64) std::atomic<int64_t> entry_{0};   // the open broadcast: kOpen while threads may join, plus the threads in it
  alignas(64) std::atomic<int> resident_{0};    // crew threads in Resident()
  std::atomic<bool> stop_{false};
};

// Keeps the first error of a parallel job.
class FirstError {
 public:
  void Set(const absl::Status& s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = s;
    failed_.store(true);
  }
  bool failed() const { return failed_.load(); }
  absl::Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  absl::Status status_;
  std::atomic<bool> failed_{false};
};

}  // namespace

// Kinds of work in a call's parallel phase (sort and experts), timed for the bench's --phases.
enum Work { kSort, kInput, kGateUp, kSilu, kIntermediate, kDown, kReduce, kWorkKinds };
constexpr const char* kWorkNames[kWorkKinds] = {"sort", "input", "gate+up", "silu", "intermediate", "down", "reduce"};

class ExpertPool::Impl {
 public:
  Impl(int threads, int64_t linger_us) : arena(threads, 1), crew(arena, threads - 1, linger_us) {}

  tbb::task_arena arena;
  Crew crew;
  std::unique_ptr<tbb::global_control> control;
  std::unique_ptr<PinningObserver> observer;
  absl::Status result;
  uint64_t ticket = 0;
  std::vector<KernelKind> usable;  // kernels this CPU runs for the pool's format

  // Per-call scratch, grown as needed. Slots (token, choice) are ordered by expert ("positions").
  std::vector<int32_t> count, offset;
  std::vector<int32_t> slot_of;   // slot (token * k + choice) of each position
  std::vector<int32_t> token_of;  // token of each position
  // token_positions[t * k .. t * k + k): token t's positions in increasing order, the order in
  // which both schedules sum its expert rows.
  std::vector<int32_t> token_positions;
  std::vector<const float*> rows;  // input row of each position (unless gathered)
  // [sort chunk x expert]: the chunk's slots of each expert, then the chunk's first position in it.
  std::vector<int32_t> chunk_next;
  // Grown, never zero-filled: every row a call reads was written by it first.
  core::AlignedBuffer inter;       // [positions x I] floats
  core::AlignedBuffer expert_out;  // [positions x (H_pad + 16)] floats (decode schedule)
  Activations tokens_in;           // every token's input row, quantized once (batch schedule)
  std::vector<Activations> act_in, act_mid;  // per expert
  // Wall time per named phase of Run, in order of first appearance, for the bench.
  std::vector<std::pair<std::string, double>> phases;
  int64_t calls = 0;
  std::chrono::steady_clock::time_point phase_start;
  // Thread time in the parallel phase by kind of work, per arena slot, in TSC ticks (only shares
  // are reported); and the phase's ticks, and the idle ticks before each thread's first and after
  // its last piece of work, summed over threads.
  struct alignas(64) ThreadTimes {
    uint64_t ticks[kWorkKinds] = {};
    uint64_t first = ~uint64_t{0}, last = 0;
  };
  std::vector<ThreadTimes> thread_times;
  uint64_t work_start = 0, work_ticks = 0, idle_before = 0, idle_after = 0;

  // Times one piece of work on the calling thread.
  class Timed {
   public:
    Timed(Impl& impl, Work work) : impl_(impl), work_(work), t0_(__rdtsc()) {}
    ~Timed() {
      const int slot = tbb::this_task_arena::current_thread_index();
      if (slot < 0 || slot >= static_cast<int>(impl_.thread_times.size())) return;
      ThreadTimes& t = impl_.thread_times[slot];
      const uint64_t t1 = __rdtsc();
      t.ticks[work_] += t1 - t0_;
      t.first = std::min(t.first, t0_);
      t.last = std::max(t.last, t1);
    }

   private:
    Impl& impl_;
    Work work_;
    uint64_t t0_;
  };
  void StartWork() {
    for (ThreadTimes& t : thread_times) {
      t.first = ~uint64_t{0};
      t.last = 0;
    }
    work_start = __rdtsc();
  }
  void EndWork() {
    const uint64_t end = __rdtsc();
    work_ticks += end - work_start;
    for (const ThreadTimes& t : thread_times) {
      if (t.last == 0) {
        idle_before += end - work_start;
      } else {
        idle_before += t.first - work_start;
        idle_after += end - t.last;
      }
    }
  }

  // Runs f(t) for t in [0, threads), each on its own thread of the arena (the measurements'
  // parallel loops; the crew must be parked).
  template <typename F>
  void OnEachThread(int threads, F&& f) {
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<int>(0, threads, 1),
          [&](const tbb::blocked_range<int>& r) {
            for (int t = r.begin(); t < r.end(); ++t) f(t);
          },
          tbb::static_partitioner());
    });
  }

  void StartPhases() { phase_start = std::chrono::steady_clock::now(); }
  // Ends the running phase as `name` and starts the next.
  void EndPhase(const char* name) {
    const auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - phase_start).count();
    phase_start = now;
    for (auto& [n, total] : phases) {
      if (n == name) {
        total += secs;
        return;
      }
    }
    phases.emplace_back(name, secs);
  }
};

ExpertPool::~ExpertPool() {
  if (impl_ == nullptr) return;
  if (in_flight_) impl_->crew.Finish();
  impl_->crew.Park();
}

absl::StatusOr<std::unique_ptr<ExpertPool>> ExpertPool::Create(const ExpertShape& shape,
                                                               const ExpertPoolOptions& options,
                                                               const ExpertWeightSource& source) {
  if (shape.num_layers <= 0 || shape.num_experts <= 0 || shape.hidden <= 0 || shape.intermediate <= 0 ||
      shape.top_k <= 0 || shape.top_k > shape.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("expert pool: bad shape: ", shape.num_layers, " layers, ",
                                                   shape.num_experts, " experts, top-", shape.top_k, ", hidden ",
                                                   shape.hidden, ", intermediate ", shape.intermediate));
  }
  std::unique_ptr<ExpertPool> pool(new ExpertPool());
  pool->shape_ = shape;
  pool->options_ = options;
  const int64_t inter_pad = (shape.intermediate + 15) / 16 * 16;
  auto gate_up = MakeLayout(options.format, 2 * inter_pad, shape.hidden, options.group);
  if (!gate_up.ok()) return gate_up.status();
  auto down = MakeLayout(options.format, shape.hidden, shape.intermediate, options.group);
  if (!down.ok()) return down.status();
  pool->gate_up_ = *gate_up;
  pool->down_ = *down;
  pool->expert_bytes_ = gate_up->bytes() + down->bytes();

  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  if (options.kernel.has_value()) {
    const std::string why = KernelUnsupportedReason(*options.kernel, options.format, cpu);
    if (!why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("expert kernel ", KernelName(*options.kernel), " for ",
                                                        FormatName(options.format), ": ", why, " (this CPU: ",
                                                        cpu.ToString(), ")"));
    }
  }
  const std::vector<int> cpus = AllowedCpus();
  pool->threads_ = options.threads > 0 ? options.threads : std::max<int>(1, static_cast<int>(cpus.size()));
  pool->impl_ = std::make_unique<Impl>(pool->threads_, options.linger_us);
  Impl& impl = *pool->impl_;
  for (KernelKind k : KernelsFor(options.format)) {
    if (KernelUnsupportedReason(k, options.format, cpu).empty()) impl.usable.push_back(k);
  }
  if (pool->threads_ > tbb::info::default_concurrency()) {
    impl.control = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                         pool->threads_);
  }
  if (options.pin_threads) impl.observer = std::make_unique<PinningObserver>(impl.arena, cpus);
  impl.act_in.resize(shape.num_experts);
  impl.thread_times.resize(pool->threads_);
  impl.act_mid.resize(shape.num_experts);
  if (absl::Status s = pool->Load(source); !s.ok()) return s;
  return pool;
}

PackedMatrix ExpertPool::GateUp(int layer, int expert) const {
  const int64_t index = static_cast<int64_t>(layer) * shape_.num_experts + expert;
  return PackedMatrix{gate_up_, arena_->data() + index * expert_bytes_};
}

PackedMatrix ExpertPool::Down(int layer, int expert) const {
  const int64_t index = static_cast<int64_t>(layer) * shape_.num_experts + expert;
  return PackedMatrix{down_, arena_->data() + index * expert_bytes_ + gate_up_.bytes()};
}

absl::Status ExpertPool::Load(const ExpertWeightSource& source) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t jobs = static_cast<int64_t>(shape_.num_layers) * shape_.num_experts;
  const size_t bytes = static_cast<size_t>(jobs * expert_bytes_);
  if (!options_.shm_name.empty()) {
    auto arena = HostArena::OpenShared(options_.shm_name, ArenaKey(shape_, options_), bytes);
    if (!arena.ok()) return arena.status();
    arena_ = std::move(*arena);
    if (arena_->attached()) {
      load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return absl::OkStatus();
    }
  } else {
    auto arena = HostArena::CreatePrivate(bytes);
    if (!arena.ok()) return arena.status();
    arena_ = std::move(*arena);
  }

  const int64_t h = shape_.hidden, inter = shape_.intermediate;
  core::ProgressReporter progress(absl::StrCat("loading ", FormatName(options_.format), " experts"),
                                  jobs * 3 * h * inter * 2, options_.progress);
  FirstError error;
  std::atomic<int64_t> read{0};
  impl_->arena.execute([&] {
    tbb::parallel_for(int64_t{0}, jobs, [&](int64_t job) {
      if (error.failed()) return;
      const int layer = static_cast<int>(job / shape_.num_experts);
      const int expert = static_cast<int>(job % shape_.num_experts);
      auto w = source(layer, expert);
      if (!w.ok()) return error.Set(w.status());
      const core::Shape io = {inter, h}, oi = {h, inter};
      if (w->gate.shape != io || w->up.shape != io || w->down.shape != oi) {
        return error.Set(absl::InvalidArgumentError(absl::StrCat(
            "MoE layer ", layer, " expert ", expert, ": gate ", core::ShapeString(w->gate.shape), ", up ",
            core::ShapeString(w->up.shape), ", down ", core::ShapeString(w->down.shape), "; expected gate and up ",
            core::ShapeString(io), ", down ", core::ShapeString(oi))));
      }
      // Fused gate+up: 16 gate rows, then the same 16 up rows, block after block.
      const PackedMatrix gu = GateUp(layer, expert);
      auto gate_up_row = [&](int64_t n) -> std::pair<const core::TensorView*, int64_t> {
        const int64_t unit = (n / 32) * 16 + n % 16;
        return {(n / 16) % 2 == 0 ? &w->gate : &w->up, unit};
      };
      if (w->gate.dtype == core::DType::kBF16 && w->up.dtype == core::DType::kBF16) {
        // bf16 rows go in as they are, without a row of floats in between.
        PackRowsBf16(
            gate_up_,
            [&](int64_t n) -> const uint16_t* {
              const auto [src, unit] = gate_up_row(n);
              return unit < inter ? static_cast<const uint16_t*>(src->data) + unit * h : nullptr;
            },
            const_cast<uint8_t*>(gu.data));
      } else {
        PackRows(
            gate_up_,
            [&](int64_t n, float* dst) {
              const auto [src, unit] = gate_up_row(n);
              if (unit >= inter) {
                std::fill(dst, dst + h, 0.0f);
                return;
              }
              const int64_t elem = core::DTypeSize(src->dtype);
              core::ConvertToFloat(static_cast<const uint8_t*>(src->data) + unit * h * elem, src->dtype, dst, h);
            },
            const_cast<uint8_t*>(gu.data));
      }
      const PackedMatrix d = Down(layer, expert);
      error.Set(PackMatrix(w->down, down_, const_cast<uint8_t*>(d.data)));
      const int64_t n = w->gate.bytes() + w->up.bytes() + w->down.bytes();
      read += n;
      progress.Add(n);
    });
  });
  progress.Finish();
  // From the start, the arena's creation included: a shared-memory one gets its pages then, if
  // ever it is filled in advance.
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  loaded_bytes_ = read.load();
  if (error.failed()) return error.status();
  arena_->Publish();
  return absl::OkStatus();
}

absl::Status ExpertPool::SetKernel(std::optional<KernelKind> kernel) {
  if (kernel.has_value()) {
    const std::string why = KernelUnsupportedReason(*kernel, options_.format, core::GetCpuFeatures());
    if (!why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert kernel ", KernelName(*kernel), " for ", FormatName(options_.format), ": ", why));
    }
  }
  options_.kernel = kernel;
  return absl::OkStatus();
}

KernelKind ExpertPool::KernelFor(int64_t tokens) const {
  if (options_.kernel.has_value()) return *options_.kernel;
  auto usable = [&](KernelKind k) {
    return std::find(impl_->usable.begin(), impl_->usable.end(), k) != impl_->usable.end();
  };
  switch (options_.format) {
    case ExpertFormat::kBF16:
      // AMX (with split activations) where there are enough tokens to fill its tiles.
      if (tokens >= 16 && usable(KernelKind::kAmx)) return KernelKind::kAmx;
      return usable(KernelKind::kAvx512) ? KernelKind::kAvx512 : KernelKind::kPortable;
    case ExpertFormat::kInt8:
    case ExpertFormat::kInt4: {
      // On the 32-core machine (1024-token calls at most: `moeserve bench experts`), int8 AMX was
      // 1.00-1.01x VNNI at 16 tokens per expert and 1.07-1.19x at 32; int4 AMX 0.90x at 16 and
      // 1.13-1.17x at 32, as each AMX step of an int4 group costs what a step of int8 does.
      const int64_t amx_from = options_.format == ExpertFormat::kInt8 ? 16 : 24;
      if (tokens >= amx_from && usable(KernelKind::kAmx)) return KernelKind::kAmx;
      return usable(KernelKind::kVnni) ? KernelKind::kVnni : KernelKind::kPortable;
    }
  }
  return KernelKind::kPortable;
}

absl::StatusOr<ExpertPool::Ticket> ExpertPool::Submit(int layer, const float* hidden, int64_t num_tokens,
                                                      const int32_t* topk_ids, const float* topk_weights, float* out) {
  if (in_flight_) return absl::FailedPreconditionError("expert pool: a call is already in flight; Wait first");
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert pool: ", num_tokens, " tokens"));
  }
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("expert pool: MoE layer ", layer, " outside [0, ", shape_.num_layers, ")"));
  }
  for (int64_t i = 0; i < num_tokens * shape_.top_k; ++i) {
    if (topk_ids[i] < 0 || topk_ids[i] >= shape_.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert pool: expert id ", topk_ids[i], " of token ",
                                                     i / shape_.top_k, " outside [0, ", shape_.num_experts, ")"));
    }
  }
  in_flight_ = true;
  const Ticket ticket{next_ticket_++};
  impl_->ticket = ticket.id;
  impl_->crew.Post([this, layer, hidden, num_tokens, topk_ids, topk_weights, out] {
    impl_->result = Run(layer, hidden, num_tokens, topk_ids, topk_weights, out);
  });
  return ticket;
}

absl::Status ExpertPool::Wait(const Ticket& ticket) {
  if (!in_flight_ || ticket.id != impl_->ticket) {
    return absl::FailedPreconditionError("expert pool: no call in flight for this ticket");
  }
  impl_->crew.Finish();
  in_flight_ = false;
  return impl_->result;
}

absl::Status ExpertPool::Compute(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                                 const float* topk_weights, float* out) {
  auto ticket = Submit(layer, hidden, num_tokens, topk_ids, topk_weights, out);
  if (!ticket.ok()) return ticket.status();
  return Wait(*ticket);
}

namespace {

// Waits until `flag` holds `value`: spinning, since the awaited work is running on another thread
// of the arena and takes microseconds, then yielding the core in case that thread shares it.
void SpinUntil(const std::atomic<int64_t>& flag, int64_t value) {
  for (int spins = 0; flag.load(std::memory_order_acquire) < value; ++spins) Relax(spins);
}

// Blocks per work item of a batch call: about eight items per thread over the `active` experts'
// matrices of `blocks` blocks, in whole gate+up pairs. Down items are at most kDownItemBlocks.
int64_t BatchItemBlocks(int64_t active, int64_t blocks, int threads) {
  return std::max<int64_t>(2, (active * blocks / (8 * threads) + 1) / 2 * 2);
}
constexpr int64_t kDownItemBlocks = 16;

}  // namespace

// One call: the slots sorted by expert (in Impl's scratch), the active experts, and the steps
// both schedules are made of.
struct ExpertPool::Call {
  Call(ExpertPool& pool, int layer, int64_t num_tokens, const float* topk_weights, float* out)
      : pool(pool),
        s(*pool.impl_),
        layer(layer),
        num_tokens(num_tokens),
        topk_weights(topk_weights),
        out(out),
        h(pool.shape_.hidden),
        inter(pool.shape_.intermediate),
        out_ld(pool.down_.n_pad + 16) {}

  ExpertPool& pool;
  Impl& s;
  int layer;
  int64_t num_tokens;
  const float* topk_weights;
  float* out;
  const float* hidden = nullptr;
  const int32_t* topk_ids = nullptr;
  std::vector<const float*> token_rows;  // hidden's rows, to quantize every token once (gather)
  std::vector<int> active;
  bool uniform = true;  // every active expert has the same token count
  const int64_t h, inter;
  // Row strides of the products are padded by one cache line: a power-of-two stride would put
  // every token's row in the same few L1 sets.
  const int64_t out_ld;
  float* inter_rows = nullptr;
  float* out_rows = nullptr;
  FirstError error;
  // An expert's input activations are prepared by the first work item that needs them (the
  // others wait: the preparing thread is running). With one token every expert reads the same
  // row, so they are prepared once, in expert `shared`'s slot. With `gather`, the rows were
  // quantized once per token (s.tokens_in) and are copied from there.
  std::unique_ptr<std::atomic<int64_t>[]> in_state;  // per expert: 0, 1 being prepared, 2 ready
  int shared = -1;
  bool gather = false;

  float WeightOf(int64_t pos) const { return topk_weights[s.slot_of[pos]]; }

  // Ordering the (token, choice) slots by expert, a counting sort in chunks of tokens that the
  // threads share: every thread of a schedule starts in SortSlots, which returns once every slot
  // has its position. First each chunk's slots per expert are counted (and, with `gather`, its
  // tokens quantized); the thread that counts the last chunk derives the offsets and active
  // experts and runs `plan` (the schedule's set-up, which needs them) while the others wait;
  // then each chunk lists its tokens' positions while each range of experts fills the
  // per-position arrays. Positions within an expert follow the token order, as in a serial sort.
  // (A serial sort took 0.14-0.22 ms of a 6 ms call at 1024 tokens on the 32-core machine, and
  // 0.63-0.83 ms at 4096, the other threads idle once the tokens were quantized.)
  static constexpr int64_t kSortTokens = 32;  // tokens per chunk
  int64_t sort_chunks = 1, expert_ranges = 1;
  std::atomic<int64_t> next_count{0}, counted{0}, planned{0}, next_place{0}, placed{0};

  template <typename Plan>
  void SortSlots(Plan&& plan) {
    for (int64_t q; (q = next_count.fetch_add(1)) < sort_chunks;) {
      CountChunk(q);
      if (counted.fetch_add(1, std::memory_order_acq_rel) + 1 == sort_chunks) {
        PlanPositions();
        plan();
        planned.store(1, std::memory_order_release);
      }
    }
    SpinUntil(planned, 1);  // the planning thread is running: it counted the last chunk
    const int num_experts = pool.shape_.num_experts;
    const int64_t items = sort_chunks + expert_ranges;
    for (int64_t q; (q = next_place.fetch_add(1)) < items;) {
      if (q < sort_chunks) {
        PlaceChunk(q);
      } else {
        const int64_t g = q - sort_chunks;
        PlaceExperts(static_cast<int>(g * num_experts / expert_ranges),
                     static_cast<int>((g + 1) * num_experts / expert_ranges));
      }
      placed.fetch_add(1, std::memory_order_acq_rel);
    }
    SpinUntil(placed, items);  // likewise: every item was claimed by a running thread
  }

  void CountChunk(int64_t q) {
    Impl::Timed timed(s, kSort);
    const int num_experts = pool.shape_.num_experts, k = pool.shape_.top_k;
    const int64_t t0 = q * kSortTokens, t1 = std::min(num_tokens, t0 + kSortTokens);
    int32_t* n = s.chunk_next.data() + q * num_experts;
    std::fill(n, n + num_experts, 0);
    for (int64_t i = t0 * k; i < t1 * k; ++i) ++n[topk_ids[i]];
    if (gather) s.tokens_in.FillRows(token_rows.data(), t0, t1);
  }

  void PlanPositions() {
    Impl::Timed timed(s, kSort);
    const int num_experts = pool.shape_.num_experts;
    s.count.assign(num_experts, 0);
    s.offset.assign(num_experts + 1, 0);
    for (int64_t q = 0; q < sort_chunks; ++q) {
      for (int e = 0; e < num_experts; ++e) s.count[e] += s.chunk_next[q * num_experts + e];
    }
    for (int e = 0; e < num_experts; ++e) s.offset[e + 1] = s.offset[e] + s.count[e];
    std::vector<int32_t> next(s.offset.begin(), s.offset.end() - 1);
    for (int64_t q = 0; q < sort_chunks; ++q) {
      for (int e = 0; e < num_experts; ++e) {
        int32_t& n = s.chunk_next[q * num_experts + e];
        const int32_t slots = n;
        n = next[e];
        next[e] += slots;
      }
    }
    for (int e = 0; e < num_experts; ++e) {
      if (s.count[e] == 0) continue;
      uniform = uniform && (active.empty() || s.count[e] == s.count[active[0]]);
      active.push_back(e);
    }
    shared = num_tokens == 1 && !active.empty() ? active[0] : -1;
  }

  // Lists the positions of chunk q's tokens, each token's in increasing order (the order both
  // schedules sum in).
  void PlaceChunk(int64_t q) {
    Impl::Timed timed(s, kSort);
    const int k = pool.shape_.top_k;
    const int64_t t0 = q * kSortTokens, t1 = std::min(num_tokens, t0 + kSortTokens);
    int32_t* next = s.chunk_next.data() + q * pool.shape_.num_experts;
    for (int64_t t = t0; t < t1; ++t) {
      int32_t* mine = s.token_positions.data() + t * k;
      for (int j = 0; j < k; ++j) {
        const int32_t pos = next[topk_ids[t * k + j]]++;
        int x = j;
        for (; x > 0 && mine[x - 1] > pos; --x) mine[x] = mine[x - 1];
        mine[x] = pos;
      }
    }
  }

  // Fills the per-position arrays of experts [e0, e1), from a scan of every slot: each thread
  // writes its own range of positions. (Written by token chunks instead, each cache line of them
  // would be written by the chunks of about eight threads; on the 32-core machine either way
  // took the same time within the noise, quantization being most of the sort's share.)
  void PlaceExperts(int e0, int e1) {
    Impl::Timed timed(s, kSort);
    const int k = pool.shape_.top_k;
    absl::InlinedVector<int32_t, 16> next(s.offset.begin() + e0, s.offset.begin() + e1);
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        const int e = topk_ids[t * k + j];
        if (e < e0 || e >= e1) continue;
        const int32_t pos = next[e - e0]++;
        s.slot_of[pos] = static_cast<int32_t>(t * k + j);
        s.token_of[pos] = static_cast<int32_t>(t);
        if (!gather) s.rows[pos] = hidden + t * h;
      }
    }
  }

  MatmulKernel KernelOf(int e) const { return GetKernel(pool.KernelFor(s.count[e]), pool.options_.format); }

  // Prepares expert e's input activations unless another thread has started to; true if this
  // call did.
  bool StartInput(int e) {
    const int slot = shared >= 0 ? shared : e;
    int64_t expected = 0;
    if (!in_state[slot].compare_exchange_strong(expected, 1)) return false;
    Impl::Timed timed(s, kInput);
    if (gather) {
      error.Set(s.act_in[slot].Gather(s.tokens_in, s.token_of.data() + s.offset[slot], s.count[slot],
                                      pool.KernelFor(s.count[slot])));
    } else {
      error.Set(s.act_in[slot].Prepare(s.rows.data() + s.offset[slot], s.count[slot], h, pool.gate_up_.k_pad,
                                       pool.KernelFor(s.count[slot]), pool.options_.format,
                                       SumGroup(pool.gate_up_)));
    }
    in_state[slot].store(2, std::memory_order_release);
    return true;
  }

  const Activations& Input(int e) {
    const int slot = shared >= 0 ? shared : e;
    if (!StartInput(e)) {
      Impl::Timed timed(s, kInput);
      SpinUntil(in_state[slot], 2);
    }
    return s.act_in[slot];
  }

  // Gate and up blocks alternate in the fused matrix: one kernel call over blocks [b0, b1)
  // yields both, then SiLU(gate) * up goes into the intermediate rows. A kernel with a fused
  // form (AMX int8) applies the SiLU as it finishes each pass, while the tiles compute the next
  // (at 1024 tokens on the 32-core machine the separate SiLU took 9% of the thread time, and
  // the call was 0-6% slower). Otherwise long ranges go in pieces whose products stay in L2
  // until the SiLU reads them.
  void GateUp(int e, const Activations& act, int64_t b0, int64_t b1) {
    const int64_t m = s.count[e], base = s.offset[e];
    const PackedMatrix w = pool.GateUp(layer, e);
    if (const SwiGluKernel fused = GetSwiGluKernel(pool.KernelFor(m), pool.options_.format); fused != nullptr) {
      Impl::Timed timed(s, kGateUp);
      fused(w, act, b0, b1, inter, inter_rows + base * inter + b0 / 2 * 16, inter);
      return;
    }
    const MatmulKernel kernel = KernelOf(e);
    const int64_t piece = std::max<int64_t>(2, 4096 / m / 2 * 2);  // blocks: at most 256 KB of products
    thread_local std::vector<float> tmp;
    for (int64_t p0 = b0; p0 < b1; p0 += piece) {
      const int64_t p1 = std::min(b1, p0 + piece), ld = (p1 - p0) * 16 + 16;
      if (tmp.size() < static_cast<size_t>(m * ld)) tmp.resize(m * ld);
      {
        Impl::Timed timed(s, kGateUp);
        kernel(w, act, p0, p1, tmp.data(), ld);
      }
      Impl::Timed timed(s, kSilu);
      for (int64_t b = p0; b < p1; b += 2) {
        const int64_t unit = b / 2 * 16, n = std::min<int64_t>(16, inter - unit);
        if (n <= 0) continue;
        const float* pair = tmp.data() + (b - p0) * 16;
        for (int64_t i = 0; i < m; ++i) SiluMul(pair + i * ld, pair + i * ld + 16, n, inter_rows + (base + i) * inter + unit);
      }
    }
  }

  // Input, then GateUp, unless the call has failed (or fails preparing the input).
  void InputAndGateUp(int e, int64_t b0, int64_t b1) {
    if (error.failed()) return;
    const Activations& act = Input(e);
    if (!error.failed()) GateUp(e, act, b0, b1);
  }

  void PrepareMid(int e) {
    Impl::Timed timed(s, kIntermediate);
    error.Set(s.act_mid[e].Prepare(inter_rows + s.offset[e] * inter, s.count[e], inter, pool.down_.k_pad,
                                   pool.KernelFor(s.count[e]), pool.options_.format, SumGroup(pool.down_)));
  }

  void Down(int e, int64_t b0, int64_t b1) {
    Impl::Timed timed(s, kDown);
    KernelOf(e)(pool.Down(layer, e), s.act_mid[e], b0, b1, out_rows + s.offset[e] * out_ld + b0 * 16, out_ld);
  }

  // out[t][c0, c1) = the weighted sum of token t's expert rows, in the order of their positions
  // (by expert), the order the batch schedule sums in too.
  void Reduce(int64_t t, int64_t c0, int64_t c1) {
    Impl::Timed timed(s, kReduce);
    const int k = pool.shape_.top_k;
    const int32_t* pos = s.token_positions.data() + t * k;
    absl::InlinedVector<const float*, 16> rows(k);
    absl::InlinedVector<float, 16> weights(k);
    for (int i = 0; i < k; ++i) {
      rows[i] = out_rows + pos[i] * out_ld + c0;
      weights[i] = WeightOf(pos[i]);
    }
    SumScaledRows(rows.data(), weights.data(), k, c1 - c0, out + t * h + c0);
  }
};

absl::Status ExpertPool::Run(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                             const float* topk_weights, float* out) {
  Impl& s = *impl_;
  s.StartPhases();
  const int num_experts = shape_.num_experts, k = shape_.top_k;
  Call c(*this, layer, num_tokens, topk_weights, out);
  const int64_t slots = num_tokens * k;

  for (auto [buffer, floats] : {std::pair{&s.inter, slots * c.inter}, std::pair{&s.expert_out, slots * c.out_ld}}) {
    if (buffer->size() >= static_cast<size_t>(floats) * sizeof(float)) continue;
    auto grown = core::AlignedBuffer::Allocate(static_cast<size_t>(floats) * sizeof(float));
    if (!grown.ok()) return grown.status();
    *buffer = std::move(*grown);
  }
  c.inter_rows = s.inter.as<float>();
  c.out_rows = s.expert_out.as<float>();

  // Batch schedule with int8/int4: every token's input row is quantized once (while the slots
  // are counted), and each expert's rows are gathered from there.
  const bool batch = num_tokens > options_.decode_max_tokens;
  c.hidden = hidden;
  c.topk_ids = topk_ids;
  if (batch && options_.format != ExpertFormat::kBF16) {
    if (absl::Status st = s.tokens_in.Reset(num_tokens, c.h, gate_up_.k_pad, KernelKind::kVnni, options_.format,
                                            SumGroup(gate_up_));
        !st.ok()) {
      return st;
    }
    c.token_rows.resize(num_tokens);
    for (int64_t t = 0; t < num_tokens; ++t) c.token_rows[t] = hidden + t * c.h;
    c.gather = true;
  }
  c.sort_chunks = std::max<int64_t>(1, (num_tokens + Call::kSortTokens - 1) / Call::kSortTokens);
  c.expert_ranges = c.sort_chunks == 1 ? 1 : std::min<int64_t>(num_experts, threads_);
  s.chunk_next.resize(c.sort_chunks * num_experts);
  s.slot_of.resize(slots);
  s.token_of.resize(slots);
  s.token_positions.resize(slots);
  if (!c.gather) s.rows.resize(slots);
  c.in_state.reset(new std::atomic<int64_t>[num_experts]);
  for (int e = 0; e < num_experts; ++e) c.in_state[e].store(0, std::memory_order_relaxed);
  s.EndPhase("set-up");

  s.StartWork();
  if (batch) {
    RunBatch(c);
  } else {
    RunDecode(c);
  }
  s.EndWork();
  s.EndPhase("sort and experts");
  if (c.error.failed()) return c.error.status();
  ++s.calls;
  return absl::OkStatus();
}

// Decode schedule: few tokens, so the call is bound by streaming the active experts' weights.
// The gate+up block pairs of all active experts, concatenated, are cut into a few contiguous
// units per thread (long sequential streams, few starts), and so are the down block pairs;
// threads claim units in order. An expert's intermediate activations are prepared by the thread
// that completes its last gate+up unit; a down unit waits for its experts (they are in progress
// on running threads, since every gate+up unit is claimed before any down unit). Then a reduce
// over (token, column) chunks once every down unit is done.
void ExpertPool::RunDecode(Call& c) {
  const int64_t pairs1 = gate_up_.blocks() / 2, pairs2 = (down_.blocks() + 1) / 2;
  const int64_t units = static_cast<int64_t>(threads_) * std::max(1, options_.decode_units_per_thread);
  constexpr int64_t kReduceColumns = 512;
  const int64_t col_chunks = (c.h + kReduceColumns - 1) / kReduceColumns, chunks3 = c.num_tokens * col_chunks;
  std::atomic<int64_t> next1{0}, next2{0}, next3{0}, done2{0};
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[shape_.num_experts]);   // gate+up pairs to go
  std::unique_ptr<std::atomic<int64_t>[]> ready(new std::atomic<int64_t>[shape_.num_experts]);  // 1: act_mid prepared
  int64_t n_active = 0, units1 = 0, units2 = 0;  // set by plan, once the slots are counted
  auto plan = [&] {
    n_active = static_cast<int64_t>(c.active.size());
    units1 = std::min(units, n_active * pairs1);
    units2 = std::min(units, n_active * pairs2);
    for (int64_t i = 0; i < n_active; ++i) {
      left[i].store(pairs1, std::memory_order_relaxed);
      ready[i].store(0, std::memory_order_relaxed);
    }
  };
  // Runs f(expert index, first pair, end pair) over the concatenated pairs of unit u.
  auto for_unit = [&](int64_t u, int64_t units_n, int64_t pairs, auto&& f) {
    const int64_t total = n_active * pairs;
    for (int64_t q = u * total / units_n, q1 = (u + 1) * total / units_n; q < q1;) {
      const int64_t i = q / pairs, end = std::min(q1, (i + 1) * pairs);
      f(i, q - i * pairs, end - i * pairs);
      q = end;
    }
  };
  auto worker = [&] {
    c.SortSlots(plan);
    for (int64_t u; (u = next1.fetch_add(1)) < units1;) {
      for_unit(u, units1, pairs1, [&](int64_t i, int64_t p0, int64_t p1) {
        const int e = c.active[i];
        c.InputAndGateUp(e, 2 * p0, 2 * p1);
        if (left[i].fetch_sub(p1 - p0) == p1 - p0) {
          if (!c.error.failed()) c.PrepareMid(e);
          ready[i].store(1, std::memory_order_release);
        }
      });
    }
    for (int64_t u; (u = next2.fetch_add(1)) < units2;) {
      for_unit(u, units2, pairs2, [&](int64_t i, int64_t p0, int64_t p1) {
        SpinUntil(ready[i], 1);
        if (!c.error.failed()) c.Down(c.active[i], 2 * p0, std::min(2 * p1, down_.blocks()));
      });
      done2.fetch_add(1, std::memory_order_release);
    }
    if (next3.load() >= chunks3) return;
    SpinUntil(done2, units2);
    for (int64_t r; (r = next3.fetch_add(1)) < chunks3;) {
      const int64_t c0 = r % col_chunks * kReduceColumns;
      c.Reduce(r / col_chunks, c0, std::min(c.h, c0 + kReduceColumns));
    }
  };
  impl_->crew.Broadcast(worker);
}

// Batch schedule: many tokens per expert, so the kernels' arithmetic matters, and so does the
// memory traffic besides the weights.
//  1. (int8, int4) Every token's input row is quantized once, in parallel (with the counting of
//     the slots, Call::SortSlots); an expert's input rows are gathered from there (a copy of
//     int8 rows) instead of quantizing each token again for each of its k experts.
//  2. Every thread runs one loop over three queues, claimed with atomic counters, first come
//     first served in this order of preference:
//     - down items of at most 16 blocks, released per expert by the thread that finishes the
//       expert's gate+up and prepares its intermediate activations;
//     - reduce tasks (a token's columns, up to 128 blocks), queued by the thread that writes
//       the last of the token's k expert rows for them;
//     - gate+up items in expert order, about 8 per thread over the layer, the last experts'
//       four times finer, so that the call does not end on a long item. An expert's first
//       item also gathers the input rows of the expert two ahead, which the next items need
//       soon (a claimed item whose input is still being gathered waits for it).
//     Down projections and sums thus overlap the other experts' gate+up, and at the end of the
//     call every thread shares the last experts' down items and the sums, most of which only
//     become ready then (a token is done when the last of its experts is). When the last
//     writer did its own sums, threads were idle 5-9% of a 1024-token call at its end on the
//     32-core machine; with the queue, 0.2%.
//  3. Each sum runs in position (expert) order, as the decode schedule's reduce: the result
//     does not depend on the timing.
// (Splitting the down projection by output columns instead, each thread running every expert
// for its columns and summing in place, saves the expert-row buffer but was 15-50% slower at
// 1024 tokens on the 32-core machine: each thread then reads 128 short weight streams, and every
// expert's activations. With per-expert down items of 8 blocks run in expert order along each
// chain of output columns, adding in place, it was still 13-17% slower: the chains lag behind
// the gate+up and the adds read lines last written by other cores; see README.md.)
void ExpertPool::RunBatch(Call& c) {
  const int num_experts = shape_.num_experts;
  struct Item {
    int64_t index;  // in c.active
    int64_t b0, b1;
  };
  constexpr int64_t kReduceBlocks = 128;
  const int64_t gu_blocks = gate_up_.blocks(), down_blocks = down_.blocks();
  // The queues, set up by plan once the slots are counted (the other threads wait for it).
  int64_t n_active = 0;
  std::vector<Item> stage1;  // gate+up items
  // Per expert: its gate+up items to go.
  std::unique_ptr<std::atomic<int>[]> remaining(new std::atomic<int>[num_experts]);
  int64_t chunk2 = 0, per_expert = 0, total_down = 0, reduce_blocks = 0, col_chunks = 0, total_reduce = 0;
  std::unique_ptr<std::atomic<int>[]> items_left;  // [expert x reduce chunk]: down items to go
  std::unique_ptr<std::atomic<int>[]> rows_left;   // [token x reduce chunk]: expert rows to go
  // Released experts, in release order: slot i is valid once released[i] is set.
  std::vector<int> release_order(num_experts);
  std::unique_ptr<std::atomic<int>[]> released(new std::atomic<int>[num_experts]);
  // Reduce tasks (token * col_chunks + chunk) whose k expert rows are written, in that order.
  std::vector<int64_t> reduce_order;
  std::unique_ptr<std::atomic<int>[]> reduce_ready;
  auto plan = [&] {
    n_active = static_cast<int64_t>(c.active.size());
    auto chunk_for = [&](int64_t blocks) {
      return c.uniform ? int64_t{2} : BatchItemBlocks(n_active, blocks, threads_);
    };
    // Gate+up items, expert after expert; the last experts' (about one item per thread) are cut
    // four times finer.
    const int64_t chunk1 = chunk_for(gu_blocks);
    const int64_t fine1 = std::max<int64_t>(2, chunk1 / 4 / 2 * 2);
    const int64_t tail_experts = std::min<int64_t>(n_active, (threads_ * chunk1 + gu_blocks - 1) / gu_blocks);
    for (int64_t i = 0; i < n_active; ++i) {
      const int e = c.active[i];
      const int64_t chunk = i < n_active - tail_experts ? chunk1 : fine1;
      int items = 0;
      for (int64_t b = 0; b < gu_blocks; b += chunk, ++items) stage1.push_back({i, b, std::min(gu_blocks, b + chunk)});
      remaining[e].store(items, std::memory_order_relaxed);
      released[i].store(0, std::memory_order_relaxed);
    }
    // Down items: the same cut for every expert, released expert by expert.
    chunk2 = std::min(kDownItemBlocks, chunk_for(down_blocks));
    per_expert = (down_blocks + chunk2 - 1) / chunk2;
    total_down = n_active * per_expert;
    // A token's columns are summed in reduce chunks of several down items, so that a chunk's
    // last writer is found with one count per expert and chunk plus one per token and chunk.
    // (Whole rows of 2048 columns were 1-10% faster than chunks of 1024 in three paired rounds.)
    reduce_blocks = chunk2 * std::max<int64_t>(1, kReduceBlocks / chunk2);
    col_chunks = (down_blocks + reduce_blocks - 1) / reduce_blocks;
    items_left.reset(new std::atomic<int>[num_experts * col_chunks]);
    for (int e : c.active) {
      for (int64_t r = 0; r < col_chunks; ++r) {
        const int64_t first = r * reduce_blocks / chunk2, end = std::min(per_expert, (r + 1) * reduce_blocks / chunk2);
        items_left[e * col_chunks + r].store(static_cast<int>(end - first), std::memory_order_relaxed);
      }
    }
    total_reduce = c.num_tokens * col_chunks;
    rows_left.reset(new std::atomic<int>[total_reduce]);
    for (int64_t i = 0; i < total_reduce; ++i) rows_left[i].store(shape_.top_k, std::memory_order_relaxed);
    reduce_order.resize(total_reduce);
    reduce_ready.reset(new std::atomic<int>[total_reduce]);
    for (int64_t i = 0; i < total_reduce; ++i) reduce_ready[i].store(0, std::memory_order_relaxed);
  };
  std::atomic<int64_t> next_gu{0}, next_release{0}, next_down{0};
  std::atomic<int64_t> next_push{0}, next_reduce{0};

  auto run_down = [&](int64_t d) {
    const int e = release_order[d / per_expert];
    const int64_t b0 = d % per_expert * chunk2, b1 = std::min(down_blocks, b0 + chunk2);
    if (!c.error.failed()) c.Down(e, b0, b1);
    Impl::Timed timed(c.s, kReduce);
    const int64_t chunk = b0 / reduce_blocks;
    if (items_left[e * col_chunks + chunk].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int32_t pos = c.s.offset[e]; pos < c.s.offset[e + 1]; ++pos) {
      const int64_t task = c.s.token_of[pos] * col_chunks + chunk;
      if (rows_left[task].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      const int64_t slot = next_push.fetch_add(1, std::memory_order_relaxed);
      reduce_order[slot] = task;
      reduce_ready[slot].store(1, std::memory_order_release);
    }
  };
  auto run_reduce = [&](int64_t r) {
    if (c.error.failed()) return;
    const int64_t task = reduce_order[r], t = task / col_chunks, chunk = task % col_chunks;
    c.Reduce(t, chunk * reduce_blocks * 16, std::min(c.h, (chunk + 1) * reduce_blocks * 16));
  };
  // Claims the next item of a queue whose slot i holds an item once ready[i] is set.
  auto claim = [](std::atomic<int64_t>& next, int64_t total, int64_t per_slot, const std::atomic<int>* ready,
                  int64_t* item) {
    for (int64_t cur = next.load(std::memory_order_relaxed); cur < total;) {
      if (ready[cur / per_slot].load(std::memory_order_acquire) == 0) return false;
      if (next.compare_exchange_weak(cur, cur + 1, std::memory_order_relaxed)) {
        *item = cur;
        return true;
      }
    }
    return false;
  };
  auto worker = [&] {
    c.SortSlots(plan);
    for (;;) {
      int64_t d;
      if (claim(next_down, total_down, per_expert, released.get(), &d)) {
        run_down(d);
        continue;
      }
      if (claim(next_reduce, total_reduce, 1, reduce_ready.get(), &d)) {
        run_reduce(d);
        continue;
      }
      if (next_gu.load(std::memory_order_relaxed) < static_cast<int64_t>(stage1.size())) {
        const int64_t g = next_gu.fetch_add(1);
        if (g < static_cast<int64_t>(stage1.size())) {
          const Item& it = stage1[g];
          const int e = c.active[it.index];
          // The first item of each expert also prepares the input of the expert two ahead, so
          // that the items of one expert, claimed at nearly the same time, seldom wait for it.
          if (it.b0 == 0 && it.index + 2 < n_active) c.StartInput(c.active[it.index + 2]);
          c.InputAndGateUp(e, it.b0, it.b1);
          if (remaining[e].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            if (!c.error.failed()) c.PrepareMid(e);
            const int64_t slot = next_release.fetch_add(1);
            release_order[slot] = e;
            released[slot].store(1, std::memory_order_release);
          }
          continue;
        }
      }
      if (next_reduce.load(std::memory_order_relaxed) >= total_reduce) return;
      _mm_pause();  // the last items are running on other threads
    }
  };
  impl_->crew.Broadcast(worker);
}

std::string ExpertPool::PhaseReport() const {
  const Impl& s = *impl_;
  const double n = std::max<int64_t>(s.calls, 1) / 1e3;  // ms per call
  std::string text;
  for (const auto& [name, secs] : s.phases) absl::StrAppendFormat(&text, "%s%s %.3f", text.empty() ? "" : ", ", name, secs / n);
  text += " ms/call";
  if (s.work_ticks == 0) return text;
  // Shares of the parallel phase's thread time (phase time x threads).
  const double total = static_cast<double>(s.work_ticks) * static_cast<double>(s.thread_times.size());
  text += "; thread time in the sort and experts phase:";
  double busy = 0;
  for (int w = 0; w < kWorkKinds; ++w) {
    uint64_t ticks = 0;
    for (const Impl::ThreadTimes& t : s.thread_times) ticks += t.ticks[w];
    if (ticks == 0) continue;
    busy += ticks / total;
    absl::StrAppendFormat(&text, " %s %.1f%%,", kWorkNames[w], 100 * ticks / total);
  }
  absl::StrAppendFormat(&text, " idle %.1f%% (%.1f%% before a thread's first work, %.1f%% after its last)",
                        100 * (1 - busy), 100 * s.idle_before / total, 100 * s.idle_after / total);
  return text;
}

void ExpertPool::ResetPhases() {
  Impl& s = *impl_;
  s.calls = 0;
  s.phases.clear();
  for (Impl::ThreadTimes& t : s.thread_times) t = Impl::ThreadTimes{};
  s.work_ticks = s.idle_before = s.idle_after = 0;
}

double ExpertPool::MeasureReadBandwidth(size_t bytes, int repeats) {
  if (in_flight_) return 0.0;
  impl_->crew.Park();  // the lingering threads would hold the arena's slots
  const size_t n = bytes / sizeof(float);
  // Large, so on huge pages like the arena (AlignedBuffer from 4 MiB): the same kind of reads.
  auto buffer = core::AlignedBuffer::Allocate(n * sizeof(float));
  if (!buffer.ok()) return 0.0;
  float* data = buffer->as<float>();
  const size_t chunk = (n / threads_ + 15) / 16 * 16;
  auto each_chunk = [&](auto&& f) {
    impl_->OnEachThread(threads_, [&](int t) {
      const size_t b = std::min(n, static_cast<size_t>(t) * chunk), e = std::min(n, b + chunk);
      f(data + b, e - b);
    });
  };
  each_chunk([](float* p, size_t len) { std::fill(p, p + len, 1.0f); });  // fault the pages in first
  // The same loads and prefetch streams as the kernels, so the bound is at least as strong.
  const bool avx512 = core::GetCpuFeatures().avx512f;
  double best = 0;
  std::atomic<float> sink{0};
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    each_chunk([&](float* p, size_t len) {
      const float v = avx512 ? internal::SumAvx512(p, static_cast<int64_t>(len)) : SumFloats(p, len);
      sink.store(sink.load() + v);
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(n * sizeof(float)) / secs / 1e9);
  }
  return best;
}

ExpertPool::KernelStream ExpertPool::MeasureKernelStream(int64_t tokens, int repeats) {
  KernelStream best;
  if (in_flight_ || tokens < 1) return best;
  impl_->crew.Park();  // as MeasureReadBandwidth
  const KernelKind kind = KernelFor(tokens);
  const ExpertFormat format = options_.format;
  const int64_t h = shape_.hidden, inter = shape_.intermediate;
  const int64_t matrices = static_cast<int64_t>(shape_.num_layers) * shape_.num_experts;
  const int64_t gu_item = BatchItemBlocks(shape_.num_experts, gate_up_.blocks(), threads_);
  const int64_t down_item = std::min(kDownItemBlocks, BatchItemBlocks(shape_.num_experts, down_.blocks(), threads_));
  const MatmulKernel matmul = GetKernel(kind, format);
  const SwiGluKernel swiglu = GetSwiGluKernel(kind, format);
  // Each thread's own activations (the same values on every thread) and result rows.
  struct Scratch {
    Activations in, mid;
    std::vector<float> y_gate_up, y_down;
  };
  std::vector<Scratch> scratch(threads_);
  std::vector<float> x(static_cast<size_t>(tokens) * std::max(h, inter));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001) - 1000) / 1000;
  const int64_t ld_gate_up = swiglu != nullptr ? inter : gate_up_.n_pad + 16, ld_down = h + 16;
  std::atomic<bool> failed{false};
  impl_->OnEachThread(threads_, [&](int t) {
    Scratch& s = scratch[t];
    absl::Status st = PrepareThreadForKernel(kind);
    if (st.ok()) st = s.in.Prepare(x.data(), tokens, h, gate_up_.k_pad, kind, format, SumGroup(gate_up_));
    if (st.ok()) st = s.mid.Prepare(x.data(), tokens, inter, down_.k_pad, kind, format, SumGroup(down_));
    if (!st.ok()) failed = true;
    s.y_gate_up.assign(static_cast<size_t>(tokens) * ld_gate_up, 0.0f);
    s.y_down.assign(static_cast<size_t>(tokens) * ld_down, 0.0f);
  });
  if (failed) return best;
  auto run = [&](int t, bool gate_up, bool down) {
    Scratch& s = scratch[t];
    for (int64_t i = t; i < matrices; i += threads_) {
      const int layer = static_cast<int>(i / shape_.num_experts), e = static_cast<int>(i % shape_.num_experts);
      if (gate_up) {
        const PackedMatrix w = GateUp(layer, e);
        for (int64_t b0 = 0; b0 < gate_up_.blocks(); b0 += gu_item) {
          const int64_t b1 = std::min(gate_up_.blocks(), b0 + gu_item);
          if (swiglu != nullptr) {
            swiglu(w, s.in, b0, b1, inter, s.y_gate_up.data() + b0 / 2 * 16, ld_gate_up);
          } else {
            matmul(w, s.in, b0, b1, s.y_gate_up.data() + b0 * 16, ld_gate_up);
          }
        }
      }
      if (down) {
        const PackedMatrix w = Down(layer, e);
        for (int64_t b0 = 0; b0 < down_.blocks(); b0 += down_item) {
          matmul(w, s.mid, b0, std::min(down_.blocks(), b0 + down_item), s.y_down.data() + b0 * 16, ld_down);
        }
      }
    }
  };
  for (int r = 0; r < repeats; ++r) {
    for (auto [gate_up, down, gbps] : {std::tuple{true, false, &best.gate_up_gbps},
                                       std::tuple{false, true, &best.down_gbps}, std::tuple{true, true, &best.all_gbps}}) {
      const double bytes = static_cast<double>(matrices) * ((gate_up ? gate_up_.bytes() : 0) + (down ? down_.bytes() : 0));
      const auto t0 = std::chrono::steady_clock::now();
      impl_->OnEachThread(threads_, [&, gate_up = gate_up, down = down](int t) { run(t, gate_up, down); });
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      *gbps = std::max(*gbps, bytes / secs / 1e9);
    }
  }
  return best;
}

std::string ExpertPool::Describe() const {
  return absl::StrFormat("%s experts: %d layers x %d, %.2f GB in %s, %d %sthreads", FormatName(options_.format),
                         shape_.num_layers, shape_.num_experts, arena_->size() / 1e9, arena_->page_kind(), threads_,
                         options_.pin_threads ? "pinned " : "");
}

}  // namespace moe::experts
