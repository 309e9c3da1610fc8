// Engine: runs the scheduler's loop on its own thread over an in-process model; any thread may
// submit requests and read each request's results from its Stream.
//
// Thread-safety: all public methods may be called from any thread. The loop thread alone touches
// the scheduler; Submit and Abort go through an inbox it drains before every step, so Submit
// answers within one step and Abort never waits for one.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "absl/status/statusor.h"
#include "moe/runtime/model.h"
#include "moe/scheduler/metrics.h"
#include "moe/scheduler/scheduler.h"

namespace moe::scheduler {

// One request's results as they come: deltas, then a last Output with `finished` set.
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
  void Push(Output out, Clock::time_point now, Metrics* metrics = nullptr);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Output> outputs_;
  Clock::time_point arrival_ = Clock::now();
  std::optional<Clock::time_point> admitted_, first_token_, last_token_;
};

class Engine {
 public:
  // Allocates the KV cache (config.num_blocks blocks of config.block_size) and starts the loop.
  // kResourceExhausted when the cache does not fit.
  static absl::StatusOr<std::unique_ptr<Engine>> Start(runtime::Model& model, SchedulerConfig config);
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
  SchedulerStats stats() const;
  const SchedulerConfig& config() const { return config_; }
  // Counters and histograms of everything the engine served; Prometheus text with the stats.
  const Metrics& metrics() const { return metrics_; }
  std::string RenderMetrics() const { return metrics_.Render(stats()); }
  void CountRejected(absl::StatusCode code) { metrics_.CountRejected(code); }

 private:
  Engine(runtime::Model& model, SchedulerConfig config, std::unique_ptr<runtime::KvCache> cache);
  void Loop();

  struct PendingAdd;
  void DrainInbox();

  runtime::Model& model_;
  const SchedulerConfig config_;
  std::unique_ptr<runtime::KvCache> cache_;
  std::unique_ptr<ModelExecutor> executor_;
  Scheduler scheduler_;                                     // loop thread only
  std::map<std::string, std::shared_ptr<Stream>> streams_;  // loop thread only

  mutable std::mutex mu_;  // guards the inbox and what other threads read
  std::condition_variable work_;
  std::condition_variable idle_;  // notified when live_ or the inbox shrinks
  std::deque<PendingAdd*> adds_;
  std::vector<std::string> aborts_;
  std::set<std::string> live_;  // ids the loop accepted and has not finished
  bool busy_ = false;           // the scheduler has work
  bool stop_ = false;
  bool accepting_ = true;
  bool inbox_in_hand_ = false;  // the loop took submissions from adds_ and has not yet made them live
  SchedulerStats stats_;
  Metrics metrics_;
  std::thread thread_;
};

}  // namespace moe::scheduler
