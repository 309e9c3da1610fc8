#include "cluster_config.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "flags.h"
#include "model_loading.h"
#include "moe/comm/tcp_socket.h"
#include "moe/core/status.h"
#include "moe/experts/packed.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/placement.h"
#include "moe/scheduler/security.h"

namespace moe::deploy {

int ClusterConfig::WorkersOn(int n) const {
  const ClusterNode& node = nodes[n];
  if (!node.gpus.empty()) return static_cast<int>(node.gpus.size());
  if (node.workers > 0) return node.workers;
  // CPU workers not given: the ranks spread over the nodes, the first ones taking the rest.
  const int count = static_cast<int>(nodes.size());
  return ranks / count + (n < ranks % count ? 1 : 0);
}

int ClusterConfig::FirstRankOn(int n) const {
  int first = 0;
  for (int i = 0; i < n; ++i) first += WorkersOn(i);
  return first;
}

namespace {

// Reads one file's YAML with every error placed at its line and key.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  absl::Status Error(const YAML::Node& node, const std::string& key, const std::string& what) const {
    const YAML::Mark mark = node.Mark();
    if (mark.line < 0) return absl::InvalidArgumentError(absl::StrCat(path_, ": ", key, ": ", what));
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ":", mark.line + 1, ":", mark.column + 1, ": ", key, ": ", what));
  }

  // `map` (named `where`) is a map whose keys are all in `known`.
  absl::Status Keys(const YAML::Node& map, const std::string& where, const std::set<std::string>& known) const {
    if (!map.IsMap()) return Error(map, where, "expected a map of keys");
    std::set<std::string> seen;
    for (const auto& kv : map) {
      const std::string key = kv.first.as<std::string>();
      if (!seen.insert(key).second) {
        return Error(kv.first, Join(where, key), "duplicate key: it is given twice in one map; keep one");
      }
      if (known.count(key)) continue;
      return Error(
          kv.first, Join(where, key),
          absl::StrCat("unknown key; ", where.empty() ? "the file" : where, " takes ", absl::StrJoin(known, ", ")));
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status Get(const YAML::Node& map, const std::string& where, const char* key, T* out) const {
    const YAML::Node n = map[key];
    if (!n.IsDefined() || n.IsNull()) return absl::OkStatus();
    try {
      *out = n.as<T>();
    } catch (const YAML::Exception&) {
      return Error(n, Join(where, key), absl::StrCat("expected ", TypeName<T>(), ", found '", Text(n), "'"));
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status GetIn(const YAML::Node& map, const std::string& where, const char* key, T* out, T min, T max) const {
    MOE_RETURN_IF_ERROR(Get(map, where, key, out));
    if (*out < min || *out > max) {
      return Error(map[key], Join(where, key), absl::StrCat(*out, " is outside [", min, ", ", max, "]"));
    }
    return absl::OkStatus();
  }

  static std::string Join(const std::string& where, const std::string& key) {
    return where.empty() ? key : absl::StrCat(where, ".", key);
  }

 private:
  template <typename T>
  static const char* TypeName() {
    if constexpr (std::is_same_v<T, bool>) return "true or false";
    if constexpr (std::is_integral_v<T>) return "an integer";
    if constexpr (std::is_same_v<T, std::string>) return "a string";
    if constexpr (std::is_same_v<T, std::vector<int>>) return "a list of integers";
    if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a list of strings";
    return "a value";
  }
  static std::string Text(const YAML::Node& n) {
    if (n.IsScalar()) return n.Scalar();
    return n.IsSequence() ? "a list" : n.IsMap() ? "a map" : "?";
  }
  std::string path_;
};

absl::Status ReadNodes(const Reader& r, const YAML::Node& list, ClusterConfig* c) {
  if (!list.IsDefined() || list.IsNull()) {
    c->nodes = {ClusterNode{}};
    return absl::OkStatus();
  }
  if (!list.IsSequence() || list.size() == 0) return r.Error(list, "nodes", "expected a list of nodes");
  for (size_t i = 0; i < list.size(); ++i) {
    const YAML::Node n = list[i];
    const std::string where = absl::StrCat("nodes[", i, "]");
    MOE_RETURN_IF_ERROR(r.Keys(n, where, {"host", "gpus", "workers", "port"}));
    ClusterNode node;
    MOE_RETURN_IF_ERROR(r.Get(n, where, "host", &node.host));
    MOE_RETURN_IF_ERROR(r.Get(n, where, "gpus", &node.gpus));
    MOE_RETURN_IF_ERROR(r.GetIn(n, where, "workers", &node.workers, 0, 4096));
    if (n["workers"].IsDefined() && !n["workers"].IsNull() && node.workers == 0) {
      return r.Error(n["workers"], where + ".workers",
                     "0 would run no worker on this node; give 1 or more, or leave workers out for the node's share "
                     "of the ranks");
    }
    MOE_RETURN_IF_ERROR(r.GetIn(n, where, "port", &node.port, 0, 65535));
    for (int g : node.gpus) {
      if (g < 0) return r.Error(n["gpus"], where + ".gpus", absl::StrCat("GPU ", g, ": GPU indexes start at 0"));
    }
    if (!node.gpus.empty() && node.workers > 0) {
      return r.Error(n["workers"], where + ".workers", "a node with gpus runs one worker per GPU; drop workers");
    }
    c->nodes.push_back(std::move(node));
  }
  return absl::OkStatus();
}

absl::Status ReadParallel(const Reader& r, const YAML::Node& p, ClusterConfig* c) {
  if (!p.IsDefined() || p.IsNull()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(r.Keys(p, "parallel", {"mode", "size", "stages"}));
  std::string mode = "none";
  MOE_RETURN_IF_ERROR(r.Get(p, "parallel", "mode", &mode));
  if (mode == "none") {
    c->mode = runtime::ParallelMode::kNone;
  } else if (mode == "tensor") {
    c->mode = runtime::ParallelMode::kTensor;
    if (p["stages"].IsDefined())
      return r.Error(p["stages"], "parallel.stages", "a tensor split takes size, not stages");
    MOE_RETURN_IF_ERROR(r.GetIn(p, "parallel", "size", &c->ranks, 1, 4096));
  } else if (mode == "layer") {
    c->mode = runtime::ParallelMode::kLayer;
    if (p["size"].IsDefined()) return r.Error(p["size"], "parallel.size", "a layer split takes stages, not size");
    MOE_RETURN_IF_ERROR(r.GetIn(p, "parallel", "stages", &c->ranks, 1, 4096));
  } else {
    return r.Error(p["mode"], "parallel.mode", absl::StrCat("'", mode, "' is not none, tensor or layer"));
  }
  return absl::OkStatus();
}

absl::Status ReadExperts(const Reader& r, const YAML::Node& e, ClusterConfig* c) {
  if (!e.IsDefined() || e.IsNull()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(r.Keys(e, "experts", {"cpu_pool", "cpu_moe", "n_cpu_moe", "rules", "defer", "gpu_cache"}));
  if (const YAML::Node cache = e["gpu_cache"]; cache.IsDefined() && !cache.IsNull()) {
    const std::string w = "experts.gpu_cache";
    MOE_RETURN_IF_ERROR(r.Keys(cache, w, {"per_layer", "refresh_steps", "profile"}));
    MOE_RETURN_IF_ERROR(r.GetIn(cache, w, "per_layer", &c->gpu_experts_per_layer, 0, 4096));
    MOE_RETURN_IF_ERROR(r.GetIn(cache, w, "refresh_steps", &c->gpu_experts_refresh_steps, 1, 1 << 30));
    MOE_RETURN_IF_ERROR(r.Get(cache, w, "profile", &c->expert_profile));
  }
  if (const YAML::Node pool = e["cpu_pool"]; pool.IsDefined() && !pool.IsNull()) {
    MOE_RETURN_IF_ERROR(r.Keys(pool, "experts.cpu_pool", {"dtype", "group", "threads", "shm"}));
    MOE_RETURN_IF_ERROR(r.Get(pool, "experts.cpu_pool", "dtype", &c->expert_format));
    if (c->expert_format != "auto" && !experts::ParseFormat(c->expert_format).ok()) {
      return r.Error(pool["dtype"], "experts.cpu_pool.dtype",
                     absl::StrCat("'", c->expert_format, "' is not auto, native, bf16, int8, int4 or a GGUF type"));
    }
    MOE_RETURN_IF_ERROR(r.Get(pool, "experts.cpu_pool", "group", &c->expert_group));
    if (c->expert_group != 32 && c->expert_group != 64 && c->expert_group != 128) {
      return r.Error(pool["group"], "experts.cpu_pool.group", absl::StrCat(c->expert_group, " is not 32, 64 or 128"));
    }
    MOE_RETURN_IF_ERROR(r.GetIn(pool, "experts.cpu_pool", "threads", &c->expert_threads, 0, 4096));
    MOE_RETURN_IF_ERROR(r.Get(pool, "experts.cpu_pool", "shm", &c->expert_shm));
  }
  MOE_RETURN_IF_ERROR(r.Get(e, "experts", "cpu_moe", &c->cpu_moe));
  MOE_RETURN_IF_ERROR(r.GetIn(e, "experts", "n_cpu_moe", &c->n_cpu_moe, 0, 100000));
  MOE_RETURN_IF_ERROR(r.GetIn(e, "experts", "defer", &c->defer_experts, 0, 64));
  if (const YAML::Node rules = e["rules"]; rules.IsDefined() && !rules.IsNull()) {
    if (!rules.IsSequence()) return r.Error(rules, "experts.rules", "expected a list of {match, place}");
    for (size_t i = 0; i < rules.size(); ++i) {
      const std::string where = absl::StrCat("experts.rules[", i, "]");
      MOE_RETURN_IF_ERROR(r.Keys(rules[i], where, {"match", "place"}));
      std::string match, place;
      MOE_RETURN_IF_ERROR(r.Get(rules[i], where, "match", &match));
      MOE_RETURN_IF_ERROR(r.Get(rules[i], where, "place", &place));
      if (match.empty() || place.empty()) return r.Error(rules[i], where, "needs both match and place");
      const std::string rule = absl::StrCat(match, "=", place);
      if (auto parsed = runtime::ParseOverrideRule(rule); !parsed.ok()) {
        return r.Error(rules[i], where, std::string(parsed.status().message()));
      }
      c->override_tensor.push_back(rule);
    }
  }
  return absl::OkStatus();
}

absl::Status ReadScheduler(const Reader& r, const YAML::Node& s, ClusterConfig* c) {
  if (!s.IsDefined() || s.IsNull()) return absl::OkStatus();
  const std::string w = "scheduler";
  MOE_RETURN_IF_ERROR(r.Keys(s, w,
                             {"max_batch_tokens", "max_seqs", "max_queue", "ctx", "kv_cache_mb", "kv_cache_dtype",
                              "drain_seconds", "max_prompt_tokens", "prefix_cache"}));
  int max_prompt_tokens = 0;
  MOE_RETURN_IF_ERROR(r.GetIn(s, w, "max_prompt_tokens", &max_prompt_tokens, 0, 1 << 24));
  if (max_prompt_tokens > 0) c->max_prompt_tokens = max_prompt_tokens;
  MOE_RETURN_IF_ERROR(r.GetIn(s, w, "max_batch_tokens", &c->max_batch_tokens, 1, 1 << 20));
  MOE_RETURN_IF_ERROR(r.GetIn(s, w, "max_seqs", &c->max_seqs, 1, 4096));
  MOE_RETURN_IF_ERROR(r.GetIn(s, w, "max_queue", &c->max_queue, 0, 1 << 20));
  int64_t ctx = 0;
  MOE_RETURN_IF_ERROR(r.GetIn<int64_t>(s, w, "ctx", &ctx, 0, int64_t{1} << 24));
  if (ctx > 0) c->ctx = ctx;
  MOE_RETURN_IF_ERROR(r.GetIn<int64_t>(s, w, "kv_cache_mb", &c->kv_cache_mb, 1, int64_t{1} << 30));
  MOE_RETURN_IF_ERROR(r.Get(s, w, "kv_cache_dtype", &c->kv_cache_dtype));
  if (c->kv_cache_dtype != "auto" && c->kv_cache_dtype != "bf16" && c->kv_cache_dtype != "fp8") {
    return r.Error(s["kv_cache_dtype"], w + ".kv_cache_dtype",
                   absl::StrCat("'", c->kv_cache_dtype, "' is not auto, bf16 or fp8"));
  }
  MOE_RETURN_IF_ERROR(r.GetIn(s, w, "drain_seconds", &c->drain_seconds, 0, 3600));
  MOE_RETURN_IF_ERROR(r.Get(s, w, "prefix_cache", &c->prefix_cache));
  return absl::OkStatus();
}

absl::Status ReadSpeculative(const Reader& r, const YAML::Node& s, ClusterConfig* c) {
  if (!s.IsDefined() || s.IsNull()) return absl::OkStatus();
  const std::string w = "speculative";
  MOE_RETURN_IF_ERROR(r.Keys(s, w, {"type", "n_max", "adaptive", "model", "device"}));
  runtime::SpeculativeConfig& spec = c->speculative;
  std::string type = "off";
  MOE_RETURN_IF_ERROR(r.Get(s, w, "type", &type));
  auto parsed = runtime::ParseSpecType(type);
  if (!parsed.ok()) return r.Error(s["type"], w + ".type", std::string(parsed.status().message()));
  spec.type = *parsed;
  MOE_RETURN_IF_ERROR(r.GetIn(s, w, "n_max", &spec.n_max, 1, runtime::kMaxDraftTokens));
  MOE_RETURN_IF_ERROR(r.Get(s, w, "adaptive", &spec.adaptive));
  MOE_RETURN_IF_ERROR(r.Get(s, w, "model", &spec.draft_model));
  MOE_RETURN_IF_ERROR(r.Get(s, w, "device", &spec.draft_device));
  if (spec.type == runtime::SpecType::kMtp) {
    const absl::Status head = CheckMtpHead(c->model, "type mtp");
    return r.Error(s["type"], w + ".type",
                   head.ok() ? "an MTP head is served by one process (serve --model DIR --spec-type mtp) for now, not "
                               "by a deployment; use ngram here"
                             : std::string(head.message()));
  }
  if (spec.type == runtime::SpecType::kDraft) {
    return r.Error(s["type"], w + ".type",
                   "a draft model is served by one process (serve --model DIR --spec-type draft --draft-model DIR) "
                   "for now, not by a deployment; use ngram here");
  }
  if (absl::Status v = spec.Validate(); !v.ok()) {
    const YAML::Node at = s[v.message().find("n_max") == 0 ? "n_max" : "type"];
    return r.Error(at.IsDefined() ? at : s, w, std::string(v.message()));
  }
  return absl::OkStatus();
}

absl::Status ReadServer(const Reader& r, const YAML::Node& s, ClusterConfig* c) {
  if (!s.IsDefined() || s.IsNull()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(r.Keys(s, "server",
                             {"listen", "http", "api_key_file", "api_key_protect_metrics", "served_model_name",
                              "tls_cert", "tls_key", "tls_client_ca", "max_request_bytes", "chat_template_file", "tokenizer",
                              "tool_call_parser", "reasoning_parser", "allowed_origins"}));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "allowed_origins", &c->allowed_origins));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "listen", &c->listen));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "http", &c->http));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "api_key_file", &c->api_key_file));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "api_key_protect_metrics", &c->api_key_protect_metrics));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "served_model_name", &c->served_model_name));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "tls_cert", &c->tls_cert));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "tls_key", &c->tls_key));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "tls_client_ca", &c->tls_client_ca));
  MOE_RETURN_IF_ERROR(
      r.GetIn<int64_t>(s, "server", "max_request_bytes", &c->max_request_bytes, 1024, int64_t{1} << 30));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "chat_template_file", &c->chat_template_file));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "tokenizer", &c->tokenizer));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "tool_call_parser", &c->tool_call_parser));
  MOE_RETURN_IF_ERROR(r.Get(s, "server", "reasoning_parser", &c->reasoning_parser));
  if (c->api_key_protect_metrics && c->api_key_file.empty()) {
    return r.Error(s["api_key_protect_metrics"], "server.api_key_protect_metrics", "needs server.api_key_file");
  }
  if (c->tls_cert.empty() != c->tls_key.empty() || (!c->tls_client_ca.empty() && c->tls_cert.empty())) {
    return r.Error(s, "server.tls_cert", "tls_cert and tls_key go together, and tls_client_ca needs them");
  }
  if (absl::Status st = CheckListenAddress(c->listen, "listen"); !st.ok()) {
    return r.Error(s["listen"], "server.listen", std::string(st.message()));
  }
  if (c->http != "off") {
    if (absl::Status st = CheckListenAddress(c->http, "http"); !st.ok()) {
      return r.Error(s["http"], "server.http", std::string(st.message()));
    }
    const auto port = [](const std::string& address) { return address.substr(address.rfind(':') + 1); };
    if (c->http == c->listen && port(c->http) != "0") {
      return r.Error(s["http"], "server.http",
                     absl::StrCat("'", c->http, "' is server.listen's address too: gRPC and HTTP need a port each"));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadControl(const Reader& r, const YAML::Node& comm, const YAML::Node& sup, ClusterConfig* c) {
  if (comm.IsDefined() && !comm.IsNull()) {
    MOE_RETURN_IF_ERROR(r.Keys(comm, "comm", {"timeout_ms", "rendezvous", "secret_file", "tls"}));
    MOE_RETURN_IF_ERROR(r.Get(comm, "comm", "secret_file", &c->secret_file));
    if (const YAML::Node tls = comm["tls"]; tls.IsDefined() && !tls.IsNull()) {
      MOE_RETURN_IF_ERROR(r.Keys(tls, "comm.tls", {"cert", "key", "ca"}));
      MOE_RETURN_IF_ERROR(r.Get(tls, "comm.tls", "cert", &c->control_tls_cert));
      MOE_RETURN_IF_ERROR(r.Get(tls, "comm.tls", "key", &c->control_tls_key));
      MOE_RETURN_IF_ERROR(r.Get(tls, "comm.tls", "ca", &c->control_tls_ca));
      if (c->control_tls_cert.empty() || c->control_tls_key.empty() || c->control_tls_ca.empty()) {
        return r.Error(tls, "comm.tls", "needs cert, key and ca: mutual TLS between the nodes");
      }
      if (absl::Status s = scheduler::CheckTlsFiles({c->control_tls_cert, c->control_tls_key, c->control_tls_ca});
          !s.ok()) {
        return r.Error(tls, "comm.tls", std::string(s.message()));
      }
    }
    MOE_RETURN_IF_ERROR(r.GetIn(comm, "comm", "timeout_ms", &c->comm_timeout_ms, 100, 3600000));
    MOE_RETURN_IF_ERROR(r.Get(comm, "comm", "rendezvous", &c->rendezvous));
    if (!c->rendezvous.empty()) {
      if (!comm::ParseHostPort(c->rendezvous, "comm.rendezvous").ok()) {
        return r.Error(
            comm["rendezvous"], "comm.rendezvous",
            absl::StrCat("'", c->rendezvous, "' is not HOST:PORT (an IPv6 host in brackets, port 0 to 65535)"));
      }
    }
  }
  if (sup.IsDefined() && !sup.IsNull()) {
    MOE_RETURN_IF_ERROR(r.Keys(sup, "supervisor", {"max_restarts", "restart_backoff_ms", "step_timeout_ms"}));
    MOE_RETURN_IF_ERROR(r.GetIn(sup, "supervisor", "step_timeout_ms", &c->step_timeout_ms, 100, 3600000));
    MOE_RETURN_IF_ERROR(r.GetIn(sup, "supervisor", "max_restarts", &c->max_restarts, 0, 1000000));
    MOE_RETURN_IF_ERROR(r.GetIn(sup, "supervisor", "restart_backoff_ms", &c->restart_backoff_ms, 0, 600000));
  }
  return absl::OkStatus();
}

// The plan against the model and the machines: errors name the key behind the problem.
absl::Status CheckPlan(const Reader& r, const YAML::Node& root, ClusterConfig* c) {
  const runtime::ModelSpec spec = *runtime::ReadCheckpointSpec(c->model);
  const YAML::Node p = root["parallel"];
  if (c->mode == runtime::ParallelMode::kTensor) {
    if (auto s = runtime::PlanTensorShard(spec, 0, c->ranks); !s.ok()) {
      return r.Error(p["size"], "parallel.size", std::string(s.status().message()));
    }
  } else if (c->mode == runtime::ParallelMode::kLayer) {
    if (auto s = runtime::PlanLayerStage(spec, 0, c->ranks); !s.ok()) {
      return r.Error(p["stages"], "parallel.stages", std::string(s.status().message()));
    }
  } else if (c->ranks != 1) {
    c->ranks = 1;
  }
  const bool gpu = c->gpu();
  int workers = 0;
  for (size_t n = 0; n < c->nodes.size(); ++n) {
    if (c->nodes[n].gpus.empty() == gpu) {
      return r.Error(root["nodes"][n], absl::StrCat("nodes[", n, "]"),
                     "every node has GPUs, or none has: GPU and CPU workers do not mix in one group");
    }
    workers += c->WorkersOn(static_cast<int>(n));
  }
  if (workers != c->ranks) {
    const std::string key = c->mode == runtime::ParallelMode::kLayer ? "parallel.stages" : "parallel.size";
    const std::string what =
        gpu ? absl::StrCat("the split has ", c->ranks, " ranks and the nodes list ", workers,
                           " GPUs; a rank per GPU: list as many GPUs as ranks")
            : absl::StrCat("the split has ", c->ranks, " ranks and the nodes run ", workers,
                           " CPU workers; make nodes[].workers add up to ", c->ranks, " (or leave them out)");
    return r.Error(root["parallel"].IsDefined() ? root["parallel"] : root["nodes"], key, what);
  }
  if (c->nodes.size() > 1 && c->rendezvous.empty() && !gpu) {
    return r.Error(root["nodes"], "comm.rendezvous",
                   "several nodes of CPU workers need comm.rendezvous: HOST:PORT on node 0 that every node reaches");
  }
  if (c->gpu_experts_per_layer > 0 && (!gpu || (!c->cpu_moe && c->n_cpu_moe == 0 && c->override_tensor.empty()))) {
    return r.Error(root["experts"]["gpu_cache"], "experts.gpu_cache",
                   "holds some of the CPU layers' experts on a GPU: it needs GPU nodes and routed experts on the CPU "
                   "(cpu_moe, n_cpu_moe or rules)");
  }
  if (c->gpu_experts_per_layer > 0 && c->mode == runtime::ParallelMode::kTensor && c->ranks > 1) {
    return r.Error(root["experts"]["gpu_cache"], "experts.gpu_cache",
                   "a tensor split owns its share of the routed experts; held experts are not built for it yet");
  }
  if (c->defer_experts >= spec.routing.top_k && c->defer_experts > 0) {
    return r.Error(root["experts"]["defer"], "experts.defer",
                   absl::StrCat(c->defer_experts, ": the model picks ", spec.routing.top_k,
                                " experts a token, so at most ", spec.routing.top_k - 1, " can be deferred"));
  }
  return absl::OkStatus();
}

// The numeric addresses `host` resolves to (itself when numeric).
std::vector<std::string> Resolve(const std::string& host) {
  std::vector<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &list) != 0) return out;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* where = a->ai_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (::inet_ntop(a->ai_family, where, text, sizeof(text)) != nullptr) out.emplace_back(text);
  }
  ::freeaddrinfo(list);
  return out;
}

// This machine's interface addresses, numeric.
std::vector<std::string> LocalAddresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const int family = a->ifa_addr->sa_family;
    const void* where = family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr);
    if (::inet_ntop(family, where, text, sizeof(text)) != nullptr) out.emplace_back(text);
  }
  ::freeifaddrs(list);
  return out;
}

bool IsLoopback(const std::string& address) { return address.rfind("127.", 0) == 0 || address == "::1"; }

}  // namespace

absl::Status CheckThisMachine(const ClusterConfig& c, int node) {
  const ClusterNode& n = c.nodes[node];
  const std::vector<std::string> resolved = Resolve(n.host);
  const std::vector<std::string> local = LocalAddresses();
  const bool here = std::any_of(resolved.begin(), resolved.end(), [&](const std::string& a) {
    return IsLoopback(a) || std::find(local.begin(), local.end(), a) != local.end();
  });
  if (!here) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.path, ": nodes[", node, "].host: '", n.host, "' ",
                     resolved.empty() ? "does not resolve" : absl::StrCat("is ", absl::StrJoin(resolved, ", ")),
                     ", not an address of this machine (", local.empty() ? "none found" : absl::StrJoin(local, ", "),
                     "): run --node ", node, " on that host, or correct the file"));
  }
  if (n.gpus.empty()) {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    const int64_t memory_mb = pages > 0 && page > 0 ? (static_cast<int64_t>(pages) * page) >> 20 : INT64_MAX;
    const int64_t workers = c.WorkersOn(node);
    if (c.kv_cache_mb > memory_mb / std::max<int64_t>(workers, 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(c.path, ": scheduler.kv_cache_mb: ", c.kv_cache_mb, " MiB for each of node ", node, "'s ",
                       workers, " CPU workers is more than this machine's ", memory_mb, " MiB of memory; lower it"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ClusterConfig> LoadClusterConfig(const std::string& path) {
  if (!std::filesystem::exists(path)) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::ParserException& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ":", e.mark.line + 1, ":", e.mark.column + 1, ": not valid YAML: ", e.msg));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  Reader r(path);
  ClusterConfig c;
  c.path = path;
  if (!root.IsMap()) {
    return r.Error(root, "the file",
                   absl::StrCat("expected a map of keys (model, nodes, parallel, ...) at the top level, found ",
                                root.IsNull()       ? "nothing"
                                : root.IsSequence() ? "a list"
                                                    : absl::StrCat("'", root.Scalar(), "'")));
  }
  MOE_RETURN_IF_ERROR(r.Keys(
      root, "", {"model", "nodes", "parallel", "experts", "scheduler", "speculative", "server", "comm", "supervisor"}));
  if (!root["model"].IsDefined()) {
    return r.Error(root, "model", "missing: the model every worker loads (a Hugging Face folder or a GGUF file)");
  }
  MOE_RETURN_IF_ERROR(r.Get(root, "", "model", &c.model));
  if (auto spec = runtime::ReadCheckpointSpec(c.model); !spec.ok()) {
    return r.Error(root["model"], "model", absl::StrCat("'", c.model, "': ", spec.status().message()));
  }
  MOE_RETURN_IF_ERROR(ReadNodes(r, root["nodes"], &c));
  MOE_RETURN_IF_ERROR(ReadParallel(r, root["parallel"], &c));
  MOE_RETURN_IF_ERROR(ReadExperts(r, root["experts"], &c));
  MOE_RETURN_IF_ERROR(ReadScheduler(r, root["scheduler"], &c));
  MOE_RETURN_IF_ERROR(ReadSpeculative(r, root["speculative"], &c));
  MOE_RETURN_IF_ERROR(ReadServer(r, root["server"], &c));
  MOE_RETURN_IF_ERROR(ReadControl(r, root["comm"], root["supervisor"], &c));
  MOE_RETURN_IF_ERROR(CheckPlan(r, root, &c));
  return c;
}

}  // namespace moe::deploy
