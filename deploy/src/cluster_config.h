// The cluster file of `moeserve serve --config FILE`: one YAML file describes a deployment (the
// model, the nodes and their GPUs, the split, the experts' placement, the scheduler and the
// server), and the same file serves every node (`--node N`). Every key has a default; an unknown
// key, a value of the wrong type and a plan that cannot work are errors that name the file, the
// line, the key and the fix.
//
//   model: /models/Qwen3-30B-A3B
//   nodes:
//     - {host: 127.0.0.1, gpus: [0, 1]}     # gpus: [] (or none) means CPU workers (workers: N)
//   parallel: {mode: tensor, size: 2}       # or {mode: layer, stages: 2}, or none
//   experts:
//     cpu_pool: {dtype: int8, threads: 0, group: 32, shm: NAME}
//     cpu_moe: true                          # or n_cpu_moe: N, or rules
//     rules: [{match: 'layers\.[0-3]\.', place: cpu}]
//     defer: 0
//     gpu_cache: {per_layer: 32, refresh_steps: 256, profile: FILE}   # beside GPUs
//   scheduler: {max_batch_tokens: 2048, max_seqs: 64, max_queue: 256, ctx: 32768, kv_cache_mb: 1024}
//   speculative: {type: ngram, n_max: 3, adaptive: true}   # or mtp, or {type: draft, model: DIR, device: cpu}
//   server: {listen: 127.0.0.1:50051, http: 127.0.0.1:8080}   # and api_key_file, tls_cert, tls_key, ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/parallel.h"
#include "moe/runtime/speculative.h"

namespace moe::deploy {

struct ClusterNode {
  std::string host = "127.0.0.1";
  std::vector<int> gpus;  // empty: CPU workers
  int workers = 0;        // CPU workers on this node (0: its share of the ranks)
  int port = 0;           // the first worker's port (the others follow); 0 picks free ports (one node)
};

struct ClusterConfig {
  std::string path;  // the file, for messages
  std::string model;
  std::string served_model_name;
  std::vector<ClusterNode> nodes;
  runtime::ParallelMode mode = runtime::ParallelMode::kNone;
  int ranks = 1;  // parallel.size or parallel.stages
  // experts
  std::string expert_format = "auto";
  int expert_group = 32;
  int expert_threads = 0;  // per worker; 0: its share of the node's cores
  std::string expert_shm;  // the shared arena's name; empty: one is derived from the model
  bool cpu_moe = false;
  int n_cpu_moe = 0;
  std::vector<std::string> override_tensor;  // rules, as --override-tensor REGEX=DEVICE
  int defer_experts = 0;
  // gpu_cache: of each CPU layer, experts held on the GPU too (ranked by a profile, or by the picks
  // counted while serving)
  int gpu_experts_per_layer = 0;
  int gpu_experts_refresh_steps = 256;
  std::string expert_profile;
  // scheduler
  int max_batch_tokens = 2048;
  int max_seqs = 64;
  int max_queue = 256;
  std::optional<int64_t> ctx;
  int64_t kv_cache_mb = 1024;  // per worker
  std::string kv_cache_dtype = "auto";
  bool prefix_cache = true;
  int drain_seconds = 10;
  // speculative decoding: the frontend's scheduler drafts and the workers verify the rows the step
  // plan carries, so workers need no setting of their own beyond the logit rows a step may ask for
  runtime::SpeculativeConfig speculative;
  // server
  std::string listen = "127.0.0.1:50051";
  std::string http = "127.0.0.1:8080";
  std::string api_key_file;
  bool api_key_protect_metrics = false;
  std::string tls_cert, tls_key, tls_client_ca;
  int64_t max_request_bytes = 4 << 20;
  std::string chat_template_file, tokenizer, tool_call_parser, reasoning_parser;
  std::vector<std::string> allowed_origins;
  std::optional<int> max_prompt_tokens;
  // the control plane
  int comm_timeout_ms = 30000;
  std::string rendezvous;  // HOST:PORT of the Gloo store on node 0 (several nodes); empty: a free port
  // A file holding the control plane's secret, the same on every node (or MOESERVE_CONTROL_SECRET);
  // one node alone makes a new secret each launch.
  std::string secret_file;
  // Mutual TLS on the workers' control service (comm.tls {cert, key, ca}): each node's certificate
  // and key serve its workers and identify its launcher; ca signs every node's.
  std::string control_tls_cert, control_tls_key, control_tls_ca;
  // supervision
  int max_restarts = 100;        // in a row without a healthy minute between; then the launcher exits
  int restart_backoff_ms = 500;  // doubled after each restart in a row, up to 30 s
  // A step whose results are not all back by then fails, and the group is restarted (a worker
  // stopped or stuck: its connection stays open, so nothing else would notice).
  int step_timeout_ms = 60000;

  bool gpu() const { return !nodes.empty() && !nodes[0].gpus.empty(); }
  // Workers (ranks) on node `n`, and the first rank there.
  int WorkersOn(int n) const;
  int FirstRankOn(int n) const;
};

// Reads and checks `path`. kInvalidArgument ("FILE:LINE:COL: KEY: what is wrong; the fix") for an
// unknown key, a wrong type, a value out of range or a plan that cannot work (a split the model's
// heads or layers do not allow, more ranks than GPUs, a missing model directory); kNotFound when
// there is no such file.
absl::StatusOr<ClusterConfig> LoadClusterConfig(const std::string& path);

// What only the machine that runs node `node` can check, before any worker starts: that
// nodes[node].host is one of its addresses (a file copied to the wrong host, or --node N on the
// wrong one), and that the KV caches of its CPU workers fit in its memory. kInvalidArgument naming
// the file, the key and the fix.
absl::Status CheckThisMachine(const ClusterConfig& c, int node);

}  // namespace moe::deploy
