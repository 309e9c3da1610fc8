// Frontend: the gRPC server of the client API (moeserve.v1.Generation), plus the standard
// grpc.health.v1.Health service (per service name) and server reflection (v1 and v1alpha), and
// the HTTP listener (the OpenAI API, /metrics, /health, /ready), in front of an Engine over an
// Executor. Both APIs take text prompts and chat messages through one TextModel.
//
// Thread-safety: Create, set_scheduler, Serve, Start, Drain and Shutdown from one thread (the
// owner's); port, http_port, engine and Wait from any thread once Serve returned; the handlers
// run on gRPC's and the HTTP server's threads, many at once.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/executor.h"
#include "moe/scheduler/engine.h"
#include "moe/scheduler/security.h"

namespace moe::scheduler {

class StructuredOutputs;  // structured_output.h

struct FrontendOptions {
  std::string listen = "127.0.0.1:50051";  // port 0 picks a free one (see port())
  SchedulerConfig scheduler;               // its KV blocks and vocabulary come from the executor
  std::string placement;                   // reported by GetModelInfo: where routed experts run
  std::string http_listen;                 // HOST:PORT of the HTTP listener (/metrics, /health, /ready); "" for none
  int64_t max_request_bytes = 4 << 20;     // larger gRPC messages and HTTP bodies are refused
  bool request_log = false;                // one JSON line per request on stderr
  TlsFiles tls;                            // PEM files for gRPC and HTTP; a client CA asks clients for certificates
  // With keys, gRPC calls need `authorization: Bearer KEY` metadata and HTTP an Authorization
  // header (UNAUTHENTICATED / 401 otherwise); health and metrics stay open unless protect_metrics.
  std::shared_ptr<const ApiKeys> api_keys;
  bool protect_metrics = false;
  // Web pages that may call the HTTP API from a browser (HttpServerOptions::allowed_origins);
  // none by default.
  std::vector<std::string> allowed_origins;
  // The text side (tokenizer, chat template, parsers) is read from the model folder at Serve;
  // empty model_dir: token ids only.
  std::string model_dir;
  std::string served_model_name;   // the model's id in the OpenAI API; "": model_dir's basename
  std::string chat_template_file;  // replaces the model's chat template
  std::string tokenizer_dir;       // replaces the model's tokenizer (--tokenizer)
  std::string tool_call_parser;    // "": the model type's default; "none": tool calls stay content
  std::string reasoning_parser;    // same
};

class Frontend {
 public:
  // Checks the options and starts the HTTP listener with /health answering 503 "loading", so a
  // load balancer sees the process while the model loads. kInvalidArgument for a malformed
  // address, a port outside 0..65535 or bad TLS files; kUnavailable if the address is in use.
  static absl::StatusOr<std::unique_ptr<Frontend>> Create(const FrontendOptions& options);
  // Loads the text model, starts the engine over `executor` and the gRPC server; health turns
  // SERVING. Errors as Create, TextModel::Load and Engine::Start. What `executor` holds (a ModelExecutor's model) must
  // outlive the frontend, or its Shutdown; a failed Serve has already destroyed the executor.
  absl::Status Serve(std::unique_ptr<runtime::Executor> executor);
  // Before Serve: the scheduler's settings and the placement, when they depend on the model
  // (loaded after Create, so that /health reports the load).
  void set_scheduler(const SchedulerConfig& scheduler, std::string placement);
  // Create, then Serve.
  static absl::StatusOr<std::unique_ptr<Frontend>> Start(std::unique_ptr<runtime::Executor> executor,
                                                         const FrontendOptions& options);
  ~Frontend();

  int port() const;
  int http_port() const;  // 0 without an HTTP listener
  // After Serve: one line on what text requests get (tokenizer, chat template, parsers).
  std::string DescribeText() const;
  Engine& engine();  // after Serve
  // After Serve: the structured outputs both APIs compile their grammars with (one cache, so a
  // caller asking for a request's response_format gets the grammar that request used, and its
  // mask counters); null when the model has no tokenizer.
  StructuredOutputs* structured_outputs();
  // A graceful stop: health turns NOT_SERVING, new requests get UNAVAILABLE, the running ones
  // have `grace` to finish; then the rest end with UNAVAILABLE "server shutting down" and the
  // servers stop. Returns how many requests were cut off. `cut_short`, when given, is asked
  // every 50 ms; true ends the grace at once (a second SIGTERM or SIGINT).
  int Drain(std::chrono::milliseconds grace, const std::function<bool()>& cut_short = nullptr);
  // A deployment's workers, after Serve: while they are restarted (ready false) gRPC health turns
  // NOT_SERVING and /health and /ready answer 503 "restarting"; requests still queue for them.
  void SetWorkersReady(bool ready);
  // Lines /metrics adds after the engine's (Prometheus text), e.g. the workers' restarts; called
  // on the HTTP server's threads.
  void set_extra_metrics(std::function<std::string()> render);
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
