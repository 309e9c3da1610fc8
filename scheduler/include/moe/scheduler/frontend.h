// Frontend: the gRPC server of the client API (moeserve.v1.Generation), plus the standard
// grpc.health.v1.Health service and server reflection, in front of an Engine.
//
// Thread-safety: Start, port and Shutdown from one thread; the handlers run on gRPC's threads.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "moe/runtime/model.h"
#include "moe/scheduler/engine.h"

namespace moe::scheduler {

struct FrontendOptions {
  std::string listen = "127.0.0.1:50051";  // port 0 picks a free one (see port())
  SchedulerConfig scheduler;
  std::string placement;  // reported by GetModelInfo: where routed experts run
  std::string metrics_listen;  // HOST:PORT of the Prometheus endpoint (GET /metrics); "" for none
};

class Frontend {
 public:
  // The model must outlive the frontend. kUnavailable if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Frontend>> Start(runtime::Model& model, const FrontendOptions& options);
  ~Frontend();

  int port() const;
  int metrics_port() const;  // 0 without a metrics endpoint
  Engine& engine();
  // Stops accepting calls, ends the live ones, returns when the server is down.
  void Shutdown();
  // Blocks until Shutdown() (from another thread or a signal handler's thread).
  void Wait();

  class Impl;

 private:
  explicit Frontend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::scheduler
