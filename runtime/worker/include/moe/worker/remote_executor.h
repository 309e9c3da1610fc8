// RemoteExecutor: the Executor of a frontend whose model runs in worker processes. Every step plan
// goes to every worker over its Execute stream (worker.proto), as what changed since the last
// step (step_codec.h); the rank that holds the logits answers with the tokens, the others with an
// empty result once their share of the step is done.
//
// When a worker is lost (its stream breaks, or its supervisor calls MarkBroken) the step in flight
// fails with kUnavailable at once, and later steps wait, up to heal_timeout, for the supervisor to
// restart the group and Reattach it; the frontend's queue meanwhile stays as it is. A step that
// finds the group still broken then fails with kUnavailable.
//
// Thread-safety: Execute from one thread at a time (the engine's); MarkBroken, Reattach, healthy,
// kv_capacity, model_info and Describe from any thread.
#pragma once

#include <grpcpp/security/credentials.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/runtime/executor.h"
#include "moe/worker/step_codec.h"

namespace moe::worker {

class RemoteExecutor final : public runtime::Executor {
 public:
  struct Options {
    std::vector<std::string> workers;  // HOST:PORT of each rank, rank order
    int logits_rank = 0;               // the rank whose results carry the tokens
    runtime::KvCapacity kv;            // the smallest cache of the ranks
    runtime::ModelInfo info;
    std::string description;
    absl::Duration heal_timeout = absl::Seconds(120);
    // Metadata every call to a worker carries (the control plane's secret).
    std::vector<std::pair<std::string, std::string>> call_metadata;
    // A step whose results have not all come back by then fails, and the group is marked broken
    // (a worker stopped or stuck: its stream stays open, so nothing else would notice). Zero: none.
    absl::Duration step_timeout = absl::ZeroDuration();
    // The channels' credentials (mutual TLS between nodes); null: plain TCP.
    std::shared_ptr<grpc::ChannelCredentials> credentials;
  };
  // Opens an Execute stream to every worker (which must be loaded). kUnavailable naming the worker
  // that cannot be reached.
  static absl::StatusOr<std::unique_ptr<RemoteExecutor>> Connect(const Options& options);
  ~RemoteExecutor() override;

  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override;
  runtime::KvCapacity kv_capacity() const override { return options_.kv; }
  // The worker group's generation: each restart empties the workers' caches. A plan that reaches
  // the new group carrying a chunk that starts on cached positions (planned before the scheduler
  // saw the restart) fails with kUnavailable instead of reading an empty cache.
  uint64_t cache_generation() const override;
  const runtime::ModelInfo& model_info() const override { return options_.info; }
  std::string Describe() const override { return options_.description; }

  // The group is lost: the step in flight fails at once (its streams are cancelled), and steps
  // wait for Reattach.
  void MarkBroken(const std::string& why);
  // The restarted group's workers (loaded again): new streams, empty mirrors; steps resume.
  // kUnavailable when a worker cannot be reached (the group stays broken).
  absl::Status Reattach(const std::vector<std::string>& workers);
  bool healthy() const;
  // Why the group is broken ("" while healthy).
  std::string broken_reason() const;

 private:
  class Group;  // the streams of one generation of workers
  explicit RemoteExecutor(const Options& options) : options_(options) {}
  // The step deadline's watch, on a thread of its own while step_timeout is set.
  void WatchSteps();

  const Options options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<Group> group_ ABSL_GUARDED_BY(mu_);
  std::string broken_ ABSL_GUARDED_BY(mu_);  // why, while broken
  // The step in flight: when it was sent, and the rank whose result is awaited (-1: none).
  absl::Time step_started_ ABSL_GUARDED_BY(mu_);
  int awaited_rank_ ABSL_GUARDED_BY(mu_) = -1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
  PlanEncoder encoder_;           // the engine thread's
  uint64_t generation_seen_ = 0;  // the engine thread's: the group its encoder's mirror belongs to
};

}  // namespace moe::worker
