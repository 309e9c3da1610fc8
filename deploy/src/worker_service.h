// The worker process's side of the control plane (proto/moeserve/v1/worker.proto): one rank of a
// deployment, holding its share of the model and its KV cache, running every step plan the
// frontend streams to it. `moeserve worker` serves it; the launcher starts and supervises it.
//
// Thread-safety: gRPC calls it from its threads. Init and Load run one at a time and before
// Execute; one Execute stream at a time; Health and Stats any time.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "moe/comm/communicator.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_executor.h"
#include "moe/worker/step_codec.h"
#include "moeserve/v1/worker.grpc.pb.h"

namespace moe::deploy {

class WorkerService final : public moeserve::v1::Worker::Service {
 public:
  // `shutdown` ends the process's server (called once Shutdown has answered). Every call must
  // carry `secret` (the control plane's) as kControlSecretMetadata: UNAUTHENTICATED otherwise.
  WorkerService(std::function<void()> shutdown, std::string secret)
      : shutdown_(std::move(shutdown)), secret_(std::move(secret)) {}
  ~WorkerService() override;

  grpc::Status Init(grpc::ServerContext* context, const moeserve::v1::InitRequest* request,
                    moeserve::v1::InitResponse* response) override;
  grpc::Status Load(grpc::ServerContext* context, const moeserve::v1::LoadRequest* request,
                    grpc::ServerWriter<moeserve::v1::LoadProgress>* writer) override;
  grpc::Status Execute(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<moeserve::v1::StepResult, moeserve::v1::StepRequest>* stream) override;
  grpc::Status Health(grpc::ServerContext* context, const moeserve::v1::WorkerHealthRequest* request,
                      moeserve::v1::WorkerHealthResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const moeserve::v1::WorkerStatsRequest* request,
                     moeserve::v1::WorkerStatsResponse* response) override;
  grpc::Status Shutdown(grpc::ServerContext* context, const moeserve::v1::ShutdownRequest* request,
                        moeserve::v1::ShutdownResponse* response) override;

 private:
  using State = moeserve::v1::WorkerHealthResponse::State;
  grpc::Status Authorize(const grpc::ServerContext& context) const;
  void SetState(State state, std::string detail);
  // One step: decoded, run, answered. A broken communicator ends the stream (the group must be
  // restarted); any other error fails that step only.
  bool RunStep(const moeserve::v1::StepRequest& request, moeserve::v1::StepResult* result);

  std::function<void()> shutdown_;
  const std::string secret_;
  absl::Mutex mu_;  // Init and Load, and the state
  State state_ ABSL_GUARDED_BY(mu_) = moeserve::v1::WorkerHealthResponse::STARTING;
  std::string detail_ ABSL_GUARDED_BY(mu_);
  moeserve::v1::InitRequest init_ ABSL_GUARDED_BY(mu_);
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  // Made by Init (Gloo) or Load (NCCL, on the backend's stream); outlive the model, which reads
  // the communicator in every step.
  std::unique_ptr<comm::Communicator> comm_;
  std::unique_ptr<runtime::Model> model_;
  std::unique_ptr<runtime::ModelExecutor> executor_;
  worker::PlanDecoder decoder_;
  std::atomic<bool> executing_{false};
  std::atomic<int64_t> steps_{0}, failed_steps_{0};
  std::atomic<double> step_seconds_{0};
  std::atomic<int32_t> live_sequences_{0};
};

}  // namespace moe::deploy
