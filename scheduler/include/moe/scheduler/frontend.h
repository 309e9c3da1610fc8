// Frontend: the gRPC server of the client API (moeserve.v1.Generation), plus the standard
// grpc.health.v1.Health service (per service name) and server reflection (v1 and v1alpha), and
// the HTTP listener (/metrics, /health, /ready), in front of an Engine.
//
// Thread-safety: Start, port, Drain and Shutdown from one thread; the handlers run on gRPC's
// and the HTTP server's threads.
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
  std::string http_listen;  // HOST:PORT of the HTTP listener (/metrics, /health, /ready); "" for none
  int64_t max_request_bytes = 4 << 20;  // larger gRPC messages are refused (RESOURCE_EXHAUSTED)
  bool request_log = false;  // one JSON line per request on stderr
};

class Frontend {
 public:
  // The model must outlive the frontend. kInvalidArgument for a malformed address or a port
  // outside 0..65535; kUnavailable if an address cannot be bound (in use: no port sharing).
  static absl::StatusOr<std::unique_ptr<Frontend>> Start(runtime::Model& model, const FrontendOptions& options);
  ~Frontend();

  int port() const;
  int http_port() const;  // 0 without an HTTP listener
  int metrics_port() const { return http_port(); }
  Engine& engine();
  // A graceful stop: health turns NOT_SERVING, new requests get UNAVAILABLE, the running ones
  // have `grace` to finish; then the rest end with UNAVAILABLE "server shutting down" and the
  // servers stop. Returns how many requests were cut off.
  int Drain(std::chrono::milliseconds grace);
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
