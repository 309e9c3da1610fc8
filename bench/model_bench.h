// The end-to-end model benchmark (`moeserve bench model`): decode steps at several batch sizes
// and prefills of several lengths on a loaded model, each against the ceiling measured in the
// same run: decode against the memory-read bound (weight bytes a step reads over the measured
// bandwidth), prefill against the measured matrix rate.
#pragma once

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/model.h"

namespace moe::bench {

struct ModelBenchOptions {
  std::vector<int> batches = {1, 8, 32};
  std::vector<int> prompts = {512, 2048};
  int decode_context = 128;  // tokens each sequence holds before its timed decode steps
  int decode_steps = 64;     // timed steps per batch (after 4 untimed ones)
  int prefill_repeats = 3;
  int64_t copy_bytes = int64_t{2} << 30;  // the bandwidth measurement's buffer
  bool budget = true;                     // the step budget of each decode batch, where the backend times operations
};

// Where a decode step's time goes: device time per operation (eager steps, each operation
// between two events), and the step time with graphs and without.
struct StepBudget {
  runtime::Backend::OpTiming ops;  // over `steps` eager steps
  int steps = 0;
  double eager_ms_per_step = 0;  // eager steps timed without the events
  double graph_ms_per_step = 0;  // 0 where the backend has no graphs
};

// The routed experts the CPU pool computes beside a GPU (hybrid execution), per decode step.
struct HostExpertsRow {
  double calls_per_step = 0;
  double compute_us_per_call = 0;   // the pool's own time in a MoE layer
  double between_us = 0;            // from one layer's pool call ending to the next one's starting
  double gpu_ops_us_per_layer = 0;  // the GPU's operations a layer (eager, op-timed), with the budget
};

struct DecodeRow {
  int batch = 0;
  double tokens_per_s = 0;
  double ms_per_step = 0;
  double weight_bytes = 0;    // read per step (routed experts: the expected distinct ones)
  double host_expert_bytes = 0;      // of them, the routed experts the CPU pool reads from host memory
  double bound_tokens_per_s = 0;     // at the measured bandwidths
  double ratio = 0;                  // the bound's step time / the step time
  std::optional<StepBudget> budget;  // where the backend times its operations
  std::optional<HostExpertsRow> host;  // hybrid execution
};

struct PrefillRow {
  int tokens = 0;
  double tokens_per_s = 0;
  double tflops = 0;
  double ratio = 0;  // / the measured matrix rate
  std::string experts_path;  // where the routed experts ran, and how
};

struct ModelBenchResult {
  runtime::Backend::Roofline roofline;
  double host_read_gbps = 0;  // the expert pool's threads reading host memory, where the model has a pool
  std::vector<DecodeRow> decode;
  std::vector<PrefillRow> prefill;
};

// Bytes of weights one decode step of `batch` sequences reads: everything but the routed experts,
// plus the routed experts a batch touches when routing is uniform, E (1 - (1 - k/E)^batch) per
// layer. The backend reads its weights at `bytes_per_weight` (bf16 on a GPU); the routed experts
// of `pool_layers` are the CPU pool's, `pool_expert_bytes` each, read from host memory.
struct DecodeReads {
  double backend = 0;
  double host = 0;
  double total() const { return backend + host; }
};
DecodeReads DecodeWeightReads(const runtime::ModelSpec& spec, int batch, double bytes_per_weight,
                              const std::vector<int>& pool_layers, double pool_expert_bytes);
// Multiply-adds x 2 of one prefill of `tokens` tokens (the routed experts' top-k, causal attention).
double PrefillFlops(const runtime::ModelSpec& spec, int tokens);

// The budget as a table, most time first.
void PrintStepBudget(const StepBudget& budget, std::ostream& log);

// One JSON object on `out`: the backend, both ceilings and every row.
void PrintModelBenchJson(const ModelBenchResult& result, const std::string& backend, std::ostream& out);

absl::StatusOr<ModelBenchResult> RunModelBench(runtime::Model& model, const ModelBenchOptions& options,
                                               std::ostream& log);

}  // namespace moe::bench
