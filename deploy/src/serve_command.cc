// moeserve serve: the gRPC server of the client API and the HTTP listener, in one process on the
// CPU backend.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cluster_config.h"
#include "commands.h"
#include "control_secret.h"
#include "launcher.h"
#include "model_loading.h"
#include "moe/core/status.h"
#include "moe/runtime/model_executor.h"
#include "moe/scheduler/frontend.h"

namespace moe::deploy {
namespace {

constexpr int kMaxContext = 1 << 24;

int Fail(const absl::Status& s, int code) {
  std::cerr << "moeserve serve: error: " << s.message() << "\n";
  return code;
}

// SIGTERM and SIGINT received: the first drains, a second ends the drain at once.
std::atomic<int> g_signals{0};
void OnSignal(int) { g_signals.fetch_add(1); }

struct ServeFlags {
  std::string model, listen = "127.0.0.1:50051", http = "127.0.0.1:8080";
  int max_seqs = 64, max_queue = 256, max_batch_tokens = 2048, threads = 0;
  std::optional<int> ctx, max_prompt_tokens;
  int64_t kv_cache_mb = 1024, max_request_bytes = 4 << 20;
  int drain_seconds = 10;
  bool no_request_log = false;
  std::string prefix_cache = "on";
  std::string tls_cert, tls_key, tls_client_ca, api_key_file;
  std::vector<std::string> allowed_origins;
  std::string served_model_name, chat_template_file, tokenizer, tool_call_parser, reasoning_parser;
  bool api_key_protect_metrics = false;
  ExpertFlags experts;
  DeviceFlags device;
  SpecFlags spec;
  std::string config;  // a cluster file: the launcher
  int node = 0;
  const CLI::App* app = nullptr;  // the command, to ask which flags were given
};

// The cluster file's key for each flag of one-process serve; "" where a deployment has none yet.
// Every flag given beside --config but --node and --no-request-log is refused, naming it.
const std::map<std::string, std::string>& ClusterKeyOfFlag() {
  static const auto* keys = new std::map<std::string, std::string>{
      {"--model", "model"},
      {"--listen", "server.listen"},
      {"--http", "server.http"},
      {"--max-seqs", "scheduler.max_seqs"},
      {"--max-queue", "scheduler.max_queue"},
      {"--max-batch-tokens", "scheduler.max_batch_tokens"},
      {"--ctx", "scheduler.ctx"},
      {"--kv-cache-mb", "scheduler.kv_cache_mb"},
      {"--kv-cache-dtype", "scheduler.kv_cache_dtype"},
      {"--prefix-cache", "scheduler.prefix_cache"},
      {"--max-prompt-tokens", "scheduler.max_prompt_tokens"},
      {"--drain-seconds", "scheduler.drain_seconds"},
      {"--max-request-bytes", "server.max_request_bytes"},
      {"--tls-cert", "server.tls_cert"},
      {"--tls-key", "server.tls_key"},
      {"--tls-client-ca", "server.tls_client_ca"},
      {"--api-key-file", "server.api_key_file"},
      {"--allowed-origins", "server.allowed_origins"},
      {"--api-key-protect-metrics", "server.api_key_protect_metrics"},
      {"--served-model-name", "server.served_model_name"},
      {"--chat-template-file", "server.chat_template_file"},
      {"--tokenizer", "server.tokenizer"},
      {"--tool-call-parser", "server.tool_call_parser"},
      {"--reasoning-parser", "server.reasoning_parser"},
      {"--threads", "experts.cpu_pool.threads"},
      {"--expert-threads", "experts.cpu_pool.threads"},
      {"--expert-format", "experts.cpu_pool.dtype"},
      {"--expert-group", "experts.cpu_pool.group"},
      {"--expert-shm", "experts.cpu_pool.shm"},
      {"--cpu-moe", "experts.cpu_moe"},
      {"--n-cpu-moe", "experts.n_cpu_moe"},
      {"--override-tensor", "experts.rules"},
      {"--defer-experts", "experts.defer"},
      {"--gpu-experts-per-layer", "experts.gpu_cache.per_layer"},
      {"--gpu-experts-refresh-steps", "experts.gpu_cache.refresh_steps"},
      {"--expert-profile", "experts.gpu_cache.profile"},
      {"--device", "nodes[].gpus"},
      {"--spec-type", "speculative.type"},
      {"--spec-n-max", "speculative.n_max"},
      {"--spec-adaptive", "speculative.adaptive"},
      {"--draft-model", "speculative.model"},
      {"--draft-device", "speculative.device"},
  };
  return *keys;
}

// kInvalidArgument naming each flag given beside --config that the cluster file replaces.
absl::Status CheckFlagsBesideConfig(const CLI::App& app) {
  std::vector<std::string> refused;
  for (const CLI::Option* option : app.get_options()) {
    const std::string name = option->get_name();
    if (option->count() == 0 || name == "--config" || name == "--node" || name == "--no-request-log" ||
        name == "--help") {
      continue;
    }
    const auto it = ClusterKeyOfFlag().find(name);
    refused.push_back(it != ClusterKeyOfFlag().end() && !it->second.empty()
                          ? absl::StrCat(name, " (the cluster file's ", it->second, " key)")
                          : absl::StrCat(name, " (a deployment has no setting for it yet)"));
  }
  if (refused.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--config takes its settings from the cluster file, so it does not honour ",
                   absl::StrJoin(refused, ", "), "; set them in the file and drop the flags"));
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : INT64_MAX;
}

// The scheduler's KV blocks and context from the flags and the model: the context is the
// model's (or --ctx), and never more than the KV cache holds.
absl::Status PlanKvCache(const ServeFlags& flags, const runtime::ModelSpec& spec, runtime::Model& model,
                         scheduler::SchedulerConfig* sc) {
  const runtime::Backend& backend = model.backend();
  const int64_t kv_bytes = flags.kv_cache_mb << 20;
  if (backend.HostAddressable() && kv_bytes > PhysicalMemoryBytes()) {
    return absl::InvalidArgumentError(absl::StrFormat("--kv-cache-mb %d is more than this machine's %d MiB of memory",
                                                      flags.kv_cache_mb, PhysicalMemoryBytes() >> 20));
  }
  if (!backend.HostAddressable() && kv_bytes > backend.FreeMemoryBytes()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-cache-mb %d is more than the %d MiB %s has free with the model loaded", flags.kv_cache_mb,
                        backend.FreeMemoryBytes() >> 20, backend.name()));
  }
  const int64_t block_bytes = model.KvBlockBytes(sc->block_size);
  const int64_t blocks = kv_bytes / block_bytes;
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-cache-mb %d holds no KV block: one block of %d positions takes %d bytes for this model",
                        flags.kv_cache_mb, sc->block_size, block_bytes));
  }
  sc->num_blocks = static_cast<int>(std::min<int64_t>(blocks, kMaxContext / sc->block_size));
  const int64_t positions = static_cast<int64_t>(sc->num_blocks) * sc->block_size;
  if (flags.ctx) {
    if (*flags.ctx > spec.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--ctx %d is beyond the model's max_position_embeddings (%d); moeserve has no RoPE scaling yet, so "
          "positions past it would be computed wrong",
          *flags.ctx, spec.max_position_embeddings));
    }
    if (*flags.ctx > positions) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--ctx %d needs a KV cache of %d positions; --kv-cache-mb %d holds %d (raise --kv-cache-mb to %d)",
          *flags.ctx, *flags.ctx, flags.kv_cache_mb, positions,
          (runtime::BlocksFor(*flags.ctx, sc->block_size) * block_bytes + (1 << 20) - 1) >> 20));
    }
    sc->context = *flags.ctx;
  } else {
    sc->context = static_cast<int>(std::min<int64_t>(spec.max_position_embeddings, positions));
    if (sc->context < spec.max_position_embeddings) {
      std::cerr << absl::StrFormat(
          "moeserve serve: warning: --kv-cache-mb %d holds %d positions, less than the model's context of %d; the "
          "context is %d (raise --kv-cache-mb for more)\n",
          flags.kv_cache_mb, positions, spec.max_position_embeddings, sc->context);
    }
  }
  sc->max_prompt_tokens = flags.max_prompt_tokens.value_or(sc->context);
  if (sc->max_prompt_tokens > sc->context) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max-prompt-tokens %d is more than the context of %d", sc->max_prompt_tokens, sc->context));
  }
  return absl::OkStatus();
}

// The control plane's secret: MOESERVE_CONTROL_SECRET, else comm.secret_file, else (one node) a
// new one for this launch. Several nodes must share one, so they need one of the first two.
absl::StatusOr<std::string> ControlSecretFor(const ClusterConfig& c) {
  if (const char* env = std::getenv(kControlSecretEnv); env != nullptr && *env != '\0') {
    if (std::string(env).size() < 16) {
      return absl::InvalidArgumentError(
          absl::StrCat(kControlSecretEnv, " is shorter than 16 characters; use e.g. `openssl rand -hex 32`"));
    }
    return std::string(env);
  }
  if (!c.secret_file.empty()) {
    auto secret = ReadControlSecret(c.secret_file);
    if (!secret.ok()) return core::Annotate(secret.status(), absl::StrCat(c.path, ": comm.secret_file"));
    return secret;
  }
  if (c.nodes.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.path, ": comm.secret_file: the ", c.nodes.size(),
        " nodes share one control plane, so every node needs the same secret: set comm.secret_file to a file that "
        "holds it on each node (e.g. `openssl rand -hex 32 > FILE`), or ",
        kControlSecretEnv, " in each launcher's environment"));
  }
  return NewControlSecret();
}

// `serve --config FILE`: the deployment the cluster file describes, this node's share of it.
int RunServeConfig(const ServeFlags& flags) {
  if (!flags.model.empty()) {
    return Fail(absl::InvalidArgumentError("--config names the model (its model: key); drop --model"), 2);
  }
  if (flags.app != nullptr) {
    if (absl::Status s = CheckFlagsBesideConfig(*flags.app); !s.ok()) return Fail(s, 2);
  }
  auto config = LoadClusterConfig(flags.config);
  if (!config.ok()) return Fail(config.status(), 2);
  if (flags.node < 0 || flags.node >= static_cast<int>(config->nodes.size())) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("--node ", flags.node, ": ", flags.config, " lists ",
                                                config->nodes.size(), " nodes (0 to ", config->nodes.size() - 1, ")")),
        2);
  }
  if (absl::Status s = CheckThisMachine(*config, flags.node); !s.ok()) return Fail(s, 2);
  auto secret = ControlSecretFor(*config);
  if (!secret.ok()) return Fail(secret.status(), 2);
  LaunchOptions options;
  options.control_secret = *std::move(secret);
  options.node = flags.node;
  options.program = "/proc/self/exe";
  options.request_log = !flags.no_request_log;
  return RunCluster(*config, options);
}

int RunServe(const ServeFlags& flags) {
  if (!flags.config.empty()) return RunServeConfig(flags);
  if (flags.model.empty()) {
    return Fail(absl::InvalidArgumentError("--model DIR (one process) or --config FILE (a deployment) is required"), 2);
  }
  for (const auto& [address, flag] : {std::pair{flags.listen, "listen"}, std::pair{flags.http, "http"}}) {
    if (address == "off" && std::string(flag) == "http") continue;
    if (absl::Status s = CheckListenAddress(address, flag); !s.ok()) return Fail(s, 2);
  }
  runtime::ModelOptions model_options;
  model_options.threads = flags.threads;
  WarnIfMoreThreadsThanCores(flags.threads, "threads", "serve");
  if (absl::Status s = CheckModelFlags(flags.device, flags.experts, "serve"); !s.ok()) return Fail(s, 2);
  if (flags.spec.type == "mtp") {
    if (absl::Status s = CheckMtpHead(flags.model, "--spec-type mtp"); !s.ok()) return Fail(s, 2);
  }
  auto speculative = flags.spec.Config();
  if (!speculative.ok()) return Fail(speculative.status(), 2);
  if (speculative->type == runtime::SpecType::kDraft) {
    if (absl::Status s = CheckDraftVocabulary(flags.model, speculative->draft_model); !s.ok()) return Fail(s, 2);
  }
  // Declared before the frontend, which ends the executor that reads it.
  std::unique_ptr<runtime::Model> draft_model;
  // The largest step: the token budget, and a logit row for each sequence and draft at most.
  model_options.max_step_tokens = flags.max_batch_tokens;
  model_options.max_logit_rows = MaxLogitRows(flags.max_seqs, flags.max_batch_tokens, *speculative);
  if (flags.ctx) model_options.max_context = static_cast<int>(*flags.ctx);

  scheduler::FrontendOptions options;
  options.listen = flags.listen;
  options.http_listen = flags.http == "off" ? "" : flags.http;
  options.max_request_bytes = flags.max_request_bytes;
  options.request_log = !flags.no_request_log;
  options.tls = {flags.tls_cert, flags.tls_key, flags.tls_client_ca};
  if (!flags.api_key_file.empty()) {
    auto keys = scheduler::ApiKeys::Load(flags.api_key_file);
    if (!keys.ok()) return Fail(keys.status(), 2);
    options.api_keys = std::make_shared<const scheduler::ApiKeys>(std::move(*keys));
    std::cerr << "moeserve serve: " << options.api_keys->size() << " API keys from " << flags.api_key_file << "\n";
  } else if (flags.api_key_protect_metrics) {
    return Fail(absl::InvalidArgumentError("--api-key-protect-metrics needs --api-key-file"), 2);
  }
  options.protect_metrics = flags.api_key_protect_metrics;
  options.allowed_origins = flags.allowed_origins;
  options.model_dir = flags.model;
  options.served_model_name = flags.served_model_name;
  options.chat_template_file = flags.chat_template_file;
  options.tokenizer_dir = flags.tokenizer;
  options.tool_call_parser = flags.tool_call_parser;
  options.reasoning_parser = flags.reasoning_parser;
  if (!flags.chat_template_file.empty() && ::access(flags.chat_template_file.c_str(), R_OK) != 0) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("--chat-template-file ", flags.chat_template_file, ": no such readable file")),
                2);
  }

  // The HTTP listener first, so that /health answers 503 "loading" while the model loads.
  auto frontend = scheduler::Frontend::Create(options);
  if (!frontend.ok())
    return Fail(frontend.status(), frontend.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  if ((*frontend)->http_port() != 0) {
    std::cerr << "moeserve serve: HTTP on port " << (*frontend)->http_port()
              << " (/v1/models, /v1/completions, /v1/chat/completions, /metrics, /health, /ready)"
              << (options.tls.enabled() ? " over TLS" : "") << "\n";
  }
  auto model =
      LoadModelForCommand(flags.model, flags.device, flags.experts, model_options, flags.kv_cache_mb << 20, "serve");
  if (!model.ok()) return Fail(model.status(), 1);
  const runtime::ModelSpec& spec = (*model)->spec();

  scheduler::SchedulerConfig& sc = options.scheduler;
  sc.max_seqs = flags.max_seqs;
  sc.max_queue = flags.max_queue;
  sc.max_batch_tokens = flags.max_batch_tokens;
  sc.prefix_cache = flags.prefix_cache == "on";
  sc.prefix_cache_salt = scheduler::PrefixCacheSalt(flags.device.kv_cache_dtype);
  sc.max_draft = speculative->max_draft();
  sc.draft_type = speculative->type;
  sc.draft_adaptive = speculative->adaptive;
  if (absl::Status s = PlanKvCache(flags, spec, **model, &sc); !s.ok()) return Fail(s, 2);
  options.placement = (*model)->expert_pool() != nullptr
                          ? (*model)->expert_pool()->Describe()
                          : absl::StrCat("routed experts on ", (*model)->backend().name());

  // The executor holds the KV cache just planned and runs the model in this process. The model
  // outlives it: Drain below ends the engine, and the executor with it.
  auto executor = runtime::ModelExecutor::Create(**model, sc.num_blocks, sc.block_size);
  if (!executor.ok()) return Fail(executor.status(), 1);
  std::unique_ptr<runtime::Executor> serving;
  if (speculative->type == runtime::SpecType::kMtp) {
    auto drafting = WithMtpHead(*std::move(executor), flags.model, model_options, flags.max_seqs, &draft_model);
    if (!drafting.ok()) return Fail(drafting.status(), 1);
    serving = *std::move(drafting);
  } else {
    serving = *std::move(executor);
  }
  if (speculative->type == runtime::SpecType::kDraft) {
    auto drafting = WithDraftModel(std::move(serving), *speculative, model_options, flags.max_seqs, &draft_model);
    if (!drafting.ok()) return Fail(drafting.status(), 1);
    serving = *std::move(drafting);
  }
  const runtime::KvCapacity kv = serving->kv_capacity();
  (*frontend)->set_scheduler(sc, options.placement);
  if (absl::Status s = (*frontend)->Serve(std::move(serving)); !s.ok()) {
    return Fail(s, s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  }
  std::cerr << absl::StrFormat(
      "moeserve serve: %s\nmoeserve serve: %s; KV cache %d blocks of %d positions; context %d\n", spec.Summary(),
      options.placement, kv.num_blocks, kv.block_size, sc.context);
  std::cerr << "moeserve serve: text: " << (*frontend)->DescribeText() << "\n";
  if (speculative->type != runtime::SpecType::kOff) {
    std::cerr << absl::StrFormat("moeserve serve: speculative decoding: %s, up to %d drafts a step, adaptive %s\n",
                                 runtime::SpecTypeName(speculative->type), speculative->n_max,
                                 speculative->adaptive ? "on" : "off");
  }
  std::cout << "serving on port " << (*frontend)->port() << std::endl;
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (g_signals.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::cerr << absl::StrFormat(
      "moeserve serve: draining: no new requests; running ones have up to %d s to finish (--drain-seconds; a "
      "second SIGTERM or SIGINT ends them now)\n",
      flags.drain_seconds);
  const int aborted =
      (*frontend)->Drain(std::chrono::seconds(flags.drain_seconds), [] { return g_signals.load() > 1; });
  if (g_signals.load() > 1) std::cerr << "moeserve serve: a second signal: the drain ended at once\n";
  std::cerr << absl::StrFormat("moeserve serve: stopped (%d requests cut off by the drain's end)\n", aborted);
  return 0;
}

}  // namespace

void AddServeCommand(CLI::App& root, CommandRun* selected) {
  auto f = std::make_shared<ServeFlags>();
  CLI::App* app = AddCommand(
      root, "serve", "serve a model over gRPC and HTTP with continuous batching (one process, on a GPU or the CPU)",
      "Serves a model over gRPC (moeserve.v1.Generation, grpc.health.v1.Health, reflection v1 and v1alpha)\n"
      "from one process (on --device: a GPU when one is visible and the model fits, else the CPU),\n"
      "batching requests continuously, with an HTTP listener for\n"
      "the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions), /metrics (Prometheus),\n"
      "/health and /ready. On SIGINT or SIGTERM it drains: it stops accepting\n"
      "requests, lets the running ones finish for up to --drain-seconds, then ends the rest with\n"
      "UNAVAILABLE \"server shutting down\". One JSON line per request goes to stderr.",
      [f] { return RunServe(*f); }, selected);
  app->add_option("--model", f->model, "the model (one process; or --config): a Hugging Face folder or a GGUF file (the first part of a split one, or a folder of one model's GGUF files)");
  app->add_option("--config", f->config,
                  "a cluster file (YAML): the model, the nodes and GPUs, the split, the experts' placement, the "
                  "scheduler and the server; this process starts and supervises its node's workers, and on node 0 "
                  "serves the client APIs (see the README's \"Several GPUs and nodes\")");
  app->add_option("--node", f->node, "with --config: which of the file's nodes this is (0 serves the client APIs)")
      ->check(IntIn(0, 4096))
      ->capture_default_str();
  app->add_option("--listen", f->listen, "gRPC address, HOST:PORT ([::1]:PORT for IPv6; port 0 picks one)")
      ->capture_default_str();
  app->add_option("--http", f->http, "HTTP address for the OpenAI API, /metrics, /health and /ready; 'off' for none")
      ->capture_default_str();
  app->add_option("--max-seqs", f->max_seqs, "sequences running at once")->check(IntIn(1, 4096))->capture_default_str();
  app->add_option("--max-queue", f->max_queue,
                  "requests waiting for a free slot; past it Generate fails at once with RESOURCE_EXHAUSTED. 0 is no "
                  "waiting room: a request that cannot start at once is refused")
      ->check(IntIn(0, 1 << 20))
      ->capture_default_str();
  app->add_option("--max-batch-tokens", f->max_batch_tokens,
                  "tokens per step (decode tokens first, then prefill chunks)")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--ctx", f->ctx,
                  "context: prompt plus max_new_tokens (default: the model's max_position_embeddings, or what the KV "
                  "cache holds if less)")
      ->check(IntIn(1, kMaxContext));
  app->add_option("--kv-cache-mb", f->kv_cache_mb, "memory for the paged KV cache, in MiB")
      ->check(IntIn(1, int64_t{1} << 30))
      ->capture_default_str();
  app->add_option("--prefix-cache", f->prefix_cache,
                  "automatic prefix caching: a request whose prompt starts as an earlier one did reuses that "
                  "prompt's KV blocks and prefills only the rest (usage.prompt_tokens_details.cached_tokens)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app->add_option("--max-prompt-tokens", f->max_prompt_tokens,
                  "longest prompt accepted, in tokens (default: the context); longer ones get INVALID_ARGUMENT")
      ->check(IntIn(1, kMaxContext));
  app->add_option("--max-request-bytes", f->max_request_bytes,
                  "largest request message accepted, in bytes (gRPC and HTTP); larger ones are refused")
      ->check(IntIn(1024, int64_t{1} << 30))
      ->capture_default_str();
  app->add_option("--drain-seconds", f->drain_seconds,
                  "on SIGTERM, how long running requests may take to finish before they are cut off")
      ->check(IntIn(0, 3600))
      ->capture_default_str();
  app->add_flag("--no-request-log", f->no_request_log, "no JSON line per request on stderr");
  app->add_option("--threads", f->threads, "CPU threads for the backend; 0 uses every core")
      ->check(IntIn(0, 4096))
      ->capture_default_str();
  app->add_option("--tls-cert", f->tls_cert, "PEM certificate (chain) of the server: gRPC and HTTP serve TLS");
  app->add_option("--tls-key", f->tls_key, "PEM private key of --tls-cert (unencrypted)");
  app->add_option("--tls-client-ca", f->tls_client_ca,
                  "PEM CA certificate: clients must present a certificate it signed (mutual TLS)");
  app->add_option("--api-key-file", f->api_key_file,
                  "file of API keys, one per line: gRPC calls need 'authorization: Bearer KEY' metadata and HTTP an "
                  "'Authorization: Bearer KEY' header; keys are never logged");
  app->add_option("--allowed-origins", f->allowed_origins,
                  "web pages (Origin, e.g. https://app.example; * for any) that may call the HTTP API from a "
                  "browser; none by default: a request with another Origin gets 403")
      ->delimiter(',');
  app->add_flag("--api-key-protect-metrics", f->api_key_protect_metrics,
                "ask for an API key on /metrics, /health and /ready too (they are open by default)");
  app->add_option("--served-model-name", f->served_model_name,
                  "the model's name in the OpenAI API (/v1/models, the 'model' field); default: --model's basename");
  app->add_option("--chat-template-file", f->chat_template_file,
                  "Jinja chat template for /v1/chat/completions, in place of the model's own (tokenizer_config.json's "
                  "chat_template, or a GGUF file's tokenizer.chat_template)");
  app->add_option("--tokenizer", f->tokenizer,
                  "a folder with the model's tokenizer.json (and tokenizer_config.json) to use in place of the "
                  "model's own: for a GGUF file whose vocabulary moeserve cannot read, or that carries none");
  app->add_option("--tool-call-parser", f->tool_call_parser,
                  "how tool calls are read from chat output (e.g. hermes); default: the model type's; 'none' "
                  "leaves them in the content");
  app->add_option("--reasoning-parser", f->reasoning_parser,
                  "how reasoning is split from chat output (qwen3, deepseek_r1, glm45, think); default: the model "
                  "type's; 'none' leaves it in the content");
  f->experts.Add(app);
  f->device.Add(app);
  f->spec.Add(app);
  f->app = app;
}

}  // namespace moe::deploy
