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

struct DecodeRow {
  int batch = 0;
  double tokens_per_s = 0;
  double ms_per_step = 0;
  double weight_bytes = 0;    // read per step (routed experts: the expected distinct ones)
  double bound_tokens_per_s = 0;  // at the measured bandwidth
  double ratio = 0;           // achieved weight bandwidth / measured bandwidth
  std::optional<StepBudget> budget;  // where the backend times its operations
};

struct PrefillRow {
  int tokens = 0;
  double tokens_per_s = 0;
  double tflops = 0;
  double ratio = 0;  // / the measured matrix rate
};

struct ModelBenchResult {
  runtime::Backend::Roofline roofline;
  std::vector<DecodeRow> decode;
  std::vector<PrefillRow> prefill;
};

// Bytes of weights one decode step of `batch` sequences reads: everything but the routed experts,
// plus the routed experts a batch touches when routing is uniform, E (1 - (1 - k/E)^batch) per
// layer, in the backend's weight dtype (bf16 on a GPU).
double DecodeWeightBytes(const runtime::ModelSpec& spec, int batch, int bytes_per_weight);
// Multiply-adds x 2 of one prefill of `tokens` tokens (the routed experts' top-k, causal attention).
double PrefillFlops(const runtime::ModelSpec& spec, int tokens);

// The budget as a table, most time first.
void PrintStepBudget(const StepBudget& budget, std::ostream& log);

// One JSON object on `out`: the backend, both ceilings and every row.
void PrintModelBenchJson(const ModelBenchResult& result, const std::string& backend, std::ostream& out);

absl::StatusOr<ModelBenchResult> RunModelBench(runtime::Model& model, const ModelBenchOptions& options,
                                               std::ostream& log);

}  // namespace moe::bench
