// moeserve serve: the gRPC server of the client API in one process on the CPU backend.
#include <atomic>
#include <csignal>
#include <iostream>
#include <thread>

#include "absl/strings/str_format.h"
#include "commands.h"
#include "flags.h"
#include "moe/scheduler/frontend.h"

namespace moe::deploy {
namespace {

int Fail(const absl::Status& s, int code) {
  std::cerr << "moeserve serve: error: " << s.message() << "\n";
  return code;
}

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

}  // namespace

int ServeCommand(int argc, char** argv) {
  Flags flags("serve",
              "Serves a model over gRPC (moeserve.v1.Generation, grpc.health.v1.Health, reflection) from one\n"
              "process on the CPU backend, batching requests continuously. Stops on SIGINT or SIGTERM.");
  flags.Add("model", "DIR", "Hugging Face model directory");
  flags.Add("listen", "HOST:PORT", "address of the gRPC server", "127.0.0.1:50051");
  flags.Add("metrics", "HOST:PORT", "Prometheus metrics endpoint (GET /metrics); 'off' for none", "127.0.0.1:9090");
  flags.Add("max-seqs", "N", "sequences running at once", "64");
  flags.Add("max-queue", "N", "requests waiting; past it Generate fails at once with RESOURCE_EXHAUSTED", "256");
  flags.Add("max-batch-tokens", "N", "tokens per step (decode tokens first, then prefill chunks)", "2048");
  flags.Add("ctx", "N", "context: prompt plus max_new_tokens (default: the model's)");
  flags.Add("kv-cache-mb", "MB", "memory for the paged KV cache", "1024");
  flags.Add("threads", "N", "CPU threads for the backend; 0 uses every core", "0");
  AddExpertFlags(flags);
  flags.AddSwitch("help", "show this help");
  if (std::optional<int> exit_code = flags.ParseOrExit(argc, argv)) return *exit_code;
  auto model_dir = flags.Required("model");
  if (!model_dir.ok()) return Fail(model_dir.status(), 2);

  runtime::ModelOptions model_options;
  if (absl::Status s = ReadExpertFlags(flags, &model_options); !s.ok()) return Fail(s, 2);
  scheduler::FrontendOptions options;
  options.listen = flags.Get("listen");
  options.metrics_listen = flags.Get("metrics") == "off" ? "" : flags.Get("metrics");
  auto max_seqs = flags.Int("max-seqs");
  auto max_queue = flags.Int("max-queue");
  auto batch = flags.Int("max-batch-tokens");
  auto kv_mb = flags.Int("kv-cache-mb");
  auto threads = flags.Int("threads");
  for (const absl::Status& s : {max_seqs.status(), max_queue.status(), batch.status(), kv_mb.status(), threads.status()}) {
    if (!s.ok()) return Fail(s, 2);
  }
  if (*max_seqs <= 0 || *max_queue < 0 || *batch <= 0 || *kv_mb <= 0) {
    return Fail(absl::InvalidArgumentError("--max-seqs, --max-batch-tokens and --kv-cache-mb must be positive"), 2);
  }
  model_options.threads = static_cast<int>(*threads);
  auto model = runtime::Model::Load(*model_dir, model_options);
  if (!model.ok()) return Fail(model.status(), 1);
  const runtime::ModelSpec& spec = (*model)->spec();

  scheduler::SchedulerConfig& sc = options.scheduler;
  sc.max_seqs = static_cast<int>(*max_seqs);
  sc.max_queue = static_cast<int>(*max_queue);
  sc.max_batch_tokens = static_cast<int>(*batch);
  sc.context = spec.max_position_embeddings;
  if (flags.Has("ctx")) {
    auto ctx = flags.Int("ctx");
    if (!ctx.ok() || *ctx <= 0) return Fail(absl::InvalidArgumentError("--ctx must be a positive integer"), 2);
    sc.context = static_cast<int>(*ctx);
  }
  runtime::KvCacheShape kv;
  kv.num_layers = spec.num_layers;
  kv.num_blocks = 1;
  kv.block_size = sc.block_size;
  kv.num_kv_heads = spec.num_kv_heads;
  kv.head_dim = spec.head_dim;
  sc.num_blocks = static_cast<int>((*kv_mb << 20) / kv.bytes());
  if (runtime::BlocksFor(sc.context, sc.block_size) > sc.num_blocks) {
    std::cerr << absl::StrFormat(
        "moeserve serve: warning: --kv-cache-mb %d holds %d positions, less than the context of %d; requests "
        "longer than that are refused\n",
        *kv_mb, sc.num_blocks * sc.block_size, sc.context);
  }
  options.placement = (*model)->expert_pool() != nullptr ? (*model)->expert_pool()->Describe() : "reference path";

  auto frontend = scheduler::Frontend::Start(**model, options);
  if (!frontend.ok()) return Fail(frontend.status(), 1);
  std::cerr << absl::StrFormat("moeserve serve: %s\nmoeserve serve: %s; KV cache %d blocks of %d positions\n",
                               spec.Summary(), options.placement, sc.num_blocks, sc.block_size);
  std::cout << "serving on port " << (*frontend)->port() << std::endl;
  if ((*frontend)->metrics_port() != 0) {
    std::cerr << "moeserve serve: metrics on port " << (*frontend)->metrics_port() << " (GET /metrics)\n";
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::cerr << "moeserve serve: shutting down\n";
  (*frontend)->Shutdown();
  return 0;
}

}  // namespace moe::deploy
