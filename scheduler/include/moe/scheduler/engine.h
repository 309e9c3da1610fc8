// Engine: runs the scheduler's loop on its own thread over an Executor (a model in this process,
// or workers); any thread may submit requests and read each request's results from its Stream.
//
// Thread-safety: all public methods of Engine and Stream may be called from any thread. The loop
// thread alone touches the scheduler, the streams map and the executor's Execute; Submit and
// Abort go through an inbox (guarded by mu_) that the loop drains before every step, so Submit
// answers within one step and Abort never waits for one.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "moe/runtime/executor.h"
#include "moe/scheduler/metrics.h"
#include "moe/scheduler/scheduler.h"

namespace moe::scheduler {

// One request's results as they come: deltas, then a last Output with `finished` set. The
// engine's loop pushes them and a reader takes them; every method may be called from any thread.
class Stream {
 public:
  // Waits up to `wait` for the next Output; false on timeout.
  bool Next(Output* out, std::chrono::milliseconds wait);
  Clock::time_point arrival() const { return arrival_; }
  // Times the engine recorded: when a step first worked on the request, and its first token.
  std::optional<Clock::time_point> admitted() const;
  std::optional<Clock::time_point> first_token() const;

 private:
  friend class Engine;
  // Records the output's times (and the metrics they feed) and queues it for the reader.
  // `step_start`: when the step that made `out` began (the end of a request's queue time).
  void Push(Output out, Clock::time_point step_start, Clock::time_point now, Metrics* metrics = nullptr);

  mutable absl::Mutex mu_;
  std::deque<Output> outputs_ ABSL_GUARDED_BY(mu_);
  const Clock::time_point arrival_ = Clock::now();
  std::optional<Clock::time_point> admitted_ ABSL_GUARDED_BY(mu_);
  std::optional<Clock::time_point> first_token_ ABSL_GUARDED_BY(mu_);
  std::optional<Clock::time_point> last_token_ ABSL_GUARDED_BY(mu_);
};

class Engine {
 public:
  // Starts the loop over `executor`. The scheduler's KV blocks, vocabulary and (when
  // config.eos_token_ids is empty) end-of-sequence ids come from the executor, whatever `config`
  // says. kInvalidArgument for a null executor or one without a KV cache.
  static absl::StatusOr<std::unique_ptr<Engine>> Start(std::unique_ptr<runtime::Executor> executor,
                                                       SchedulerConfig config);
  ~Engine();  // Stop()s

  // Stops the loop: live requests end as aborted with the error kUnavailable "server shutting
  // down", queued submissions and later Submits fail with kUnavailable. Returns how many
  // requests it cut off that way (0 when already stopped). The engine stays valid for callers
  // still holding it. Idempotent.
  int Stop();
  // From now on Submit fails with kUnavailable; live requests run on (a drain's first half).
  void StopAccepting();
  // Waits until no request is live or queued for the loop, or until `deadline`; true if idle.
  bool WaitIdle(Clock::time_point deadline);

  // Errors as Scheduler::Add: kInvalidArgument naming the field, kResourceExhausted when full.
  absl::StatusOr<std::shared_ptr<Stream>> Submit(Request request);
  // False if no live request has this id.
  bool Abort(const std::string& id);
  // As Abort, but the request ends as finished (kStopString): the text pipeline matched a stop
  // string, and what the engine would generate on is thrown away.
  bool FinishByStopString(const std::string& id);
  SchedulerStats stats() const;
  const SchedulerConfig& config() const { return config_; }
  // The executor's model; fixed for the engine's life.
  const runtime::ModelInfo& model_info() const { return executor_->model_info(); }
  // Counters and histograms of everything the engine served; Prometheus text with the stats.
  const Metrics& metrics() const { return metrics_; }
  std::string RenderMetrics() const { return metrics_.Render(stats()); }
  void CountRejected(absl::StatusCode code) { metrics_.CountRejected(code); }

 private:
  Engine(std::unique_ptr<runtime::Executor> executor, SchedulerConfig config);
  void Loop();

  struct PendingAdd;
  void DrainInbox();
  // What the loop waits for, and what WaitIdle waits for.
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<runtime::Executor> executor_;  // Execute on the loop thread only
  const SchedulerConfig config_;
  Scheduler scheduler_;                                     // loop thread only
  std::map<std::string, std::shared_ptr<Stream>> streams_;  // loop thread only (and Stop, after it)

  // Guards the inbox and what other threads read. Waiters use conditions, which the mutex
  // re-evaluates as it is released, so no one notifies.
  mutable absl::Mutex mu_;
  std::deque<PendingAdd*> adds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, FinishReason>> aborts_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> live_ ABSL_GUARDED_BY(mu_);  // ids the loop accepted and has not finished
  bool busy_ ABSL_GUARDED_BY(mu_) = false;           // the scheduler has work
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  // The loop took submissions from adds_ and has not yet made them live.
  bool inbox_in_hand_ ABSL_GUARDED_BY(mu_) = false;
  SchedulerStats stats_ ABSL_GUARDED_BY(mu_);
  Metrics metrics_;  // thread-safe itself
  std::thread thread_;
};

}  // namespace moe::scheduler
