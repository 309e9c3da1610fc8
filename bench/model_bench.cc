#include "model_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <string>

#include "absl/strings/str_format.h"
#include "moe/core/status.h"
#include "nlohmann/json.hpp"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;
using runtime::ForwardBatch;
using runtime::SequenceChunk;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// "808.3 TFLOP/s" on a GPU, "52.4 GFLOP/s" on a small CPU.
std::string FlopRate(double tflops) {
  return tflops >= 1 ? absl::StrFormat("%.1f TFLOP/s", tflops) : absl::StrFormat("%.1f GFLOP/s", tflops * 1e3);
}

// Parameters of one layer's attention: q, k, v and o (MLA: the q LoRA or q_proj, the compressed KV
// projection, kv_b_proj and o, with their norms).
double AttentionParams(const runtime::ModelSpec& s, int layer) {
  const double h = s.hidden_size, heads = s.num_heads;
  if (s.attention(layer) == runtime::AttentionKind::kMla) {
    const runtime::MlaSpec& m = s.mla;
    const double q = m.q_lora_rank > 0
                         ? h * m.q_lora_rank + m.q_lora_rank + double(m.q_lora_rank) * heads * m.qk_head_dim()
                         : h * heads * m.qk_head_dim();
    return q + h * m.latent_width() + m.kv_lora_rank +
           double(m.kv_lora_rank) * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h;
  }
  const double qw = heads * s.head_dim, kvw = double(s.num_kv_heads) * s.head_dim;
  return (qw + 2 * kvw) * h + h * qw;
}

// Parameters of one layer that every token reads, routed experts aside.
double DenseLayerParams(const runtime::ModelSpec& s, int layer) {
  const double h = s.hidden_size;
  double p = AttentionParams(s, layer) + 2 * h;
  if (s.IsMoeLayer(layer)) {
    p += double(s.routing.num_experts) * h + 3.0 * h * s.shared_expert_intermediate_size;
    if (s.shared_expert_gate) p += h;
  } else {
    p += 3.0 * h * s.intermediate_size;
  }
  return p;
}

double ExpertParams(const runtime::ModelSpec& s) { return 3.0 * s.hidden_size * s.moe_intermediate_size; }

// One forward of `batch`, waiting for the device; the logits stay there.
absl::Status Step(runtime::Model& model, runtime::KvCache& cache, const ForwardBatch& batch) {
  MOE_RETURN_IF_ERROR(model.ForwardOnDevice(batch, cache).status());
  return model.backend().Synchronize();
}

}  // namespace

DecodeReads DecodeWeightReads(const runtime::ModelSpec& s, int batch, double bytes_per_weight,
                              const std::vector<int>& pool_layers, double pool_expert_bytes) {
  double params = double(s.vocab_size) * s.hidden_size + s.hidden_size;  // LM head, final norm
  DecodeReads reads;
  for (int l = 0; l < s.num_layers; ++l) {
    params += DenseLayerParams(s, l);
    if (s.IsMoeLayer(l)) {
      const double e = s.routing.num_experts, k = s.routing.top_k;
      const double touched = e * (1 - std::pow(1 - k / e, batch));
      if (std::find(pool_layers.begin(), pool_layers.end(), l) != pool_layers.end()) {
        reads.host += touched * pool_expert_bytes;
      } else {
        params += touched * ExpertParams(s);
      }
    }
  }
  reads.backend = params * bytes_per_weight;
  return reads;
}

double PrefillFlops(const runtime::ModelSpec& s, int tokens) {
  double per_token = 0, attention = 0;
  for (int l = 0; l < s.num_layers; ++l) {
    per_token += DenseLayerParams(s, l);
    if (s.IsMoeLayer(l)) per_token += s.routing.top_k * ExpertParams(s);
    // QK^T and PV over the causal triangle (MLA's prefill expands: keys of qk_head_dim, values of
    // v_head_dim; its expansion of the latent through kv_b_proj is one more Linear of every token).
    const bool mla = s.attention(l) == runtime::AttentionKind::kMla;
    const double kv_width = mla ? s.mla.qk_head_dim() + s.mla.v_head_dim : 2.0 * s.head_dim;
    attention += 2.0 * s.num_heads * kv_width * double(tokens) * (tokens + 1) / 2;
  }
  return 2.0 * per_token * tokens + attention + 2.0 * s.vocab_size * s.hidden_size;
}

void PrintStepBudget(const StepBudget& b, std::ostream& log) {
  const double n = b.steps;
  const double busy = b.ops.busy_seconds / n * 1e3;
  log << absl::StrFormat(
      "  step budget (device time per step; %d eager steps, each queued whole before it runs, timed op by op):\n",
      b.steps);
  for (const auto& op : b.ops.ops) {
    log << absl::StrFormat("    %-28s %8.1f us %5.1f%%  %5.1f calls\n", op.op, op.seconds / n * 1e6,
                           100 * op.seconds / b.ops.busy_seconds, op.calls / n);
  }
  const double span = b.ops.span_seconds / n * 1e3;
  int calls = 0;
  for (const auto& op : b.ops.ops) calls += op.calls;
  const double overhead = b.ops.overhead_seconds_per_op * calls / n * 1e3;  // ms per step
  log << absl::StrFormat("    %-28s %8.1f us (back to back: %.1f us from the first start to the last end)\n",
                         "operations", busy * 1e3, span * 1e3);
  // The operations' own time: their sum less what the timing events add to each.
  const double own = busy - overhead;
  log << absl::StrFormat(
      "    the timing events add %.2f us to each of %.1f operations a step: %.3f ms of operations without them\n",
      b.ops.overhead_seconds_per_op * 1e6, calls / n, own);
  log << absl::StrFormat("    eager: %.3f ms/step, %.3f ms of it between operations (launch gaps, host work)\n",
                         b.eager_ms_per_step, b.eager_ms_per_step - own);
  if (b.graph_ms_per_step > 0) {
    log << absl::StrFormat("    graphs: %.3f ms/step, %.3f ms of it between operations\n", b.graph_ms_per_step,
                           b.graph_ms_per_step - own);
  }
}

void PrintModelBenchJson(const ModelBenchResult& result, const std::string& backend, std::ostream& out) {
  nlohmann::ordered_json j;
  j["backend"] = backend;
  j["bandwidth_gbps"] = result.roofline.memory_gbps;
  j["bandwidth_measured_as"] = result.roofline.memory_what;
  j["matmul_tflops"] = result.roofline.matmul_tflops;
  j["matmul_measured_as"] = result.roofline.matmul_what;
  if (result.host_read_gbps > 0) j["host_read_gbps"] = result.host_read_gbps;
  for (const auto& r : result.decode) {
    j["decode"].push_back({{"batch", r.batch},
                           {"tokens_per_s", r.tokens_per_s},
                           {"ms_per_step", r.ms_per_step},
                           {"weight_bytes_per_step", r.weight_bytes},
                           {"host_expert_bytes_per_step", r.host_expert_bytes},
                           {"bound_tokens_per_s", r.bound_tokens_per_s},
                           {"ratio_to_bound", r.ratio}});
    if (r.host) {
      j["decode"].back()["host_experts"] = {{"calls_per_step", r.host->calls_per_step},
                                            {"compute_us_per_call", r.host->compute_us_per_call},
                                            {"between_us", r.host->between_us},
                                            {"gpu_ops_us_per_layer", r.host->gpu_ops_us_per_layer}};
    }
    if (r.budget) {
      nlohmann::ordered_json ops = nlohmann::ordered_json::array();
      for (const auto& op : r.budget->ops.ops) {
        ops.push_back({{"op", op.op},
                       {"us_per_step", op.seconds / r.budget->steps * 1e6},
                       {"calls_per_step", double(op.calls) / r.budget->steps}});
      }
      j["decode"].back()["budget"] = {{"ops", ops},
                                      {"ops_ms_per_step", r.budget->ops.busy_seconds / r.budget->steps * 1e3},
                                      {"timing_overhead_us_per_op", r.budget->ops.overhead_seconds_per_op * 1e6},
                                      {"eager_ms_per_step", r.budget->eager_ms_per_step},
                                      {"graph_ms_per_step", r.budget->graph_ms_per_step}};
    }
  }
  for (const auto& r : result.prefill) {
    j["prefill"].push_back({{"tokens", r.tokens},
                            {"tokens_per_s", r.tokens_per_s},
                            {"tflops", r.tflops},
                            {"ratio_to_matmul", r.ratio},
                            {"experts_path", r.experts_path}});
  }
  out << j.dump() << std::endl;
}

absl::StatusOr<ModelBenchResult> RunModelBench(runtime::Model& model, const ModelBenchOptions& o, std::ostream& log) {
  const runtime::ModelSpec& spec = model.spec();
  runtime::Backend& backend = model.backend();
  ModelBenchResult result;
  MOE_ASSIGN_OR_RETURN(result.roofline, backend.MeasureRoofline(o.copy_bytes));
  log << absl::StrFormat("bandwidth: %.0f GB/s (%s)\nmatrix rate: %s (%s)\n", result.roofline.memory_gbps,
                         result.roofline.memory_what, FlopRate(result.roofline.matmul_tflops),
                         result.roofline.matmul_what);
  // The GPU keeps weights in bf16; the CPU reads bf16 checkpoints where they lie. The pool's
  // routed experts are read in its packed format, at the bandwidth its own threads measure.
  // The CPU backend's packed Linears (--weight-format): int8 a byte a weight, int4 half of one and
  // a 4-byte scale per group.
  double weight_bytes = 2;
  const runtime::WeightPolicy& policy = backend.weight_policy();
  if (backend.HostAddressable() && policy.matrices != experts::ExpertFormat::kBF16) {
    weight_bytes = policy.matrices == experts::ExpertFormat::kInt8 ? 1.0 : 0.5 + 4.0 / policy.group;
  }
  experts::ExpertPool* pool = model.expert_pool();
  const bool hybrid = pool != nullptr && !backend.HostAddressable();
  if (pool != nullptr) {
    result.host_read_gbps = pool->MeasureReadBandwidth(static_cast<size_t>(o.copy_bytes));
    log << absl::StrFormat("host read bandwidth: %.0f GB/s (the expert pool's %d threads); %s\n", result.host_read_gbps,
                           pool->threads(), pool->Describe());
  }
  const double pool_expert_bytes = pool != nullptr ? static_cast<double>(pool->expert_bytes()) : 0;
  if (!model.prefill_offload_note().empty()) log << model.prefill_offload_note() << "\n";
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(0, spec.vocab_size - 1);
  const int block = 16;

  for (int batch : o.batches) {
    // Positions for the graph-timed steps, then (with a budget) the eager and the op-timed ones,
    // each after 4 untimed steps.
    // As many op-timed steps as the backend times whole: at most 16 operations a layer (norms,
    // QKV, RoPE, attention, o_proj, router, top-k, routed and shared experts) and 8 outside.
    const int ops_per_step = 16 * spec.num_layers + 8;
    const int budget_steps =
        std::clamp(o.decode_steps / 4, 1, std::max(1, runtime::Backend::kMaxTimedOperations / ops_per_step));
    const int decode_positions =
        (o.decode_steps + 8) + (hybrid ? o.decode_steps + 4 : 0) + (o.budget ? o.decode_steps + 4 + budget_steps : 0);
    const int per_seq = runtime::BlocksFor(o.decode_context + decode_positions + 1, block);
    MOE_ASSIGN_OR_RETURN(auto cache, model.NewKvCache(batch * per_seq, block));
    std::vector<std::vector<int32_t>> tables(batch);
    for (int s = 0; s < batch; ++s) {
      tables[s].resize(per_seq);
      std::iota(tables[s].begin(), tables[s].end(), s * per_seq);
      const int chunk = model.options().max_step_tokens;
      for (int first = 0; first < o.decode_context; first += chunk) {
        const int n = std::min(chunk, o.decode_context - first);
        ForwardBatch prefill;
        for (int i = 0; i < n; ++i) prefill.token_ids.push_back(token(rng));
        prefill.sequences = {SequenceChunk{first, n, tables[s]}};
        prefill.logit_rows = {n - 1};
        MOE_RETURN_IF_ERROR(Step(model, *cache, prefill));
      }
    }
    int position = o.decode_context;
    auto decode_step = [&]() -> absl::Status {
      ForwardBatch b;
      for (int s = 0; s < batch; ++s) {
        b.token_ids.push_back(token(rng));
        b.sequences.push_back(SequenceChunk{position, 1, tables[s]});
        b.logit_rows.push_back(s);
      }
      ++position;
      return Step(model, *cache, b);
    };
    auto timed_steps = [&](int steps) -> absl::StatusOr<double> {
      for (int i = 0; i < 4; ++i) MOE_RETURN_IF_ERROR(decode_step());  // the first records the step's graph
      const auto start = Clock::now();
      for (int i = 0; i < steps; ++i) MOE_RETURN_IF_ERROR(decode_step());
      return Seconds(start);
    };
    for (int i = 0; i < 4; ++i) MOE_RETURN_IF_ERROR(decode_step());  // graphs recorded, pool warm
    model.ResetHostExpertsTiming();
    MOE_ASSIGN_OR_RETURN(const double seconds, timed_steps(o.decode_steps));
    const runtime::HostExpertComputeTiming host_timing = model.host_experts_timing();
    DecodeRow row;
    row.batch = batch;
    row.ms_per_step = seconds / o.decode_steps * 1e3;
    row.tokens_per_s = batch * o.decode_steps / seconds;
    const DecodeReads reads = DecodeWeightReads(spec, batch, weight_bytes, model.pool_layers(), pool_expert_bytes);
    row.weight_bytes = reads.total();
    row.host_expert_bytes = reads.host;
    // The bound reads the backend's weights at its bandwidth and the pool's at the host's, one
    // after the other (a layer's experts need its attention's output).
    const double bound_s = reads.backend / (result.roofline.memory_gbps * 1e9) +
                           (reads.host > 0 ? reads.host / (result.host_read_gbps * 1e9) : 0);
    row.bound_tokens_per_s = batch / bound_s;
    row.ratio = bound_s / (row.ms_per_step / 1e3);
    if (reads.host > 0) {
      log << absl::StrFormat(
          "decode batch %3d: %8.1f tokens/s, %.3f ms/step; reads %.3f GB on %s and %.3f GB of %s experts from host "
          "memory; bound %.0f tokens/s, %.1f%% of it\n",
          batch, row.tokens_per_s, row.ms_per_step, reads.backend / 1e9, hybrid ? "the GPU" : "the CPU",
          reads.host / 1e9, experts::FormatName(pool->options().format), row.bound_tokens_per_s, 100 * row.ratio);
    } else {
      log << absl::StrFormat(
          "decode batch %3d: %8.1f tokens/s, %.3f ms/step, %.2f GB of weights/step, bound %.0f tokens/s, %.1f%% of "
          "the bandwidth\n",
          batch, row.tokens_per_s, row.ms_per_step, row.weight_bytes / 1e9, row.bound_tokens_per_s, 100 * row.ratio);
    }
    if (const runtime::Model::HeldExpertsStats held = model.held_experts_stats(); held.refreshes > 0) {
      log << absl::StrFormat(
          "  experts held on the GPU, chosen while serving: %d refreshes and %d swaps so far; %.1f%% of the picks "
          "counted ran on the GPU\n",
          held.refreshes, held.swaps, held.picks > 0 ? 100.0 * held.held_picks / held.picks : 0.0);
    }
    if (hybrid && host_timing.calls > 0) {
      HostExpertsRow h;
      const double steps = 4 + o.decode_steps;  // timed_steps' own warm-up steps are counted too
      h.calls_per_step = host_timing.calls / steps;
      h.compute_us_per_call = 1e6 * host_timing.compute_seconds / host_timing.calls;
      h.between_us = host_timing.betweens > 0 ? 1e6 * host_timing.between_seconds / host_timing.betweens : 0;
      auto handoff_name = [](runtime::Backend::HostHandoff m) {
        return m == runtime::Backend::HostHandoff::kMappedFlags ? "mapped flags" : "host-function nodes";
      };
      const runtime::Backend::HostHandoff handoff = backend.host_handoff();
      log << absl::StrFormat(
          "  per MoE layer on the CPU: %.1f us in the pool, %.1f us from one layer's pool call to the next one's "
          "(the GPU's work, the copies, the hand-off's latency; by %s)\n",
          h.compute_us_per_call, h.between_us, handoff_name(handoff));
      row.host = h;
      // The other hand-off, the same steps.
      const runtime::Backend::HostHandoff other = handoff == runtime::Backend::HostHandoff::kMappedFlags
                                                      ? runtime::Backend::HostHandoff::kHostFunction
                                                      : runtime::Backend::HostHandoff::kMappedFlags;
      MOE_RETURN_IF_ERROR(backend.SetHostHandoff(other));
      model.ResetHostExpertsTiming();
      absl::StatusOr<double> other_seconds = timed_steps(o.decode_steps);
      const runtime::HostExpertComputeTiming other_timing = model.host_experts_timing();
      MOE_RETURN_IF_ERROR(backend.SetHostHandoff(handoff));
      MOE_RETURN_IF_ERROR(other_seconds.status());
      log << absl::StrFormat(
          "  by %s instead: %.1f tokens/s, %.1f us in the pool, %.1f us from one layer's pool call to the next\n",
          handoff_name(other), batch * o.decode_steps / *other_seconds,
          1e6 * other_timing.compute_seconds / std::max<int64_t>(other_timing.calls, 1),
          other_timing.betweens > 0 ? 1e6 * other_timing.between_seconds / other_timing.betweens : 0.0);
    }
    // A backend that times its operations says so by starting (this probe's timing is dropped).
    if (o.budget && backend.BeginOpTiming().ok()) {
      MOE_RETURN_IF_ERROR(backend.EndOpTiming().status());
      StepBudget budget;
      const bool graphs = model.options().graphs && backend.SupportsGraphs();
      budget.graph_ms_per_step = graphs ? row.ms_per_step : 0;
      model.set_graphs(false);
      absl::StatusOr<double> eager = timed_steps(o.decode_steps);
      absl::Status timed = eager.ok() ? backend.BeginOpTiming() : eager.status();
      budget.steps = budget_steps;
      for (int i = 0; timed.ok() && i < budget.steps; ++i) timed = decode_step();
      absl::StatusOr<runtime::Backend::OpTiming> ops = backend.EndOpTiming();
      model.set_graphs(graphs);
      MOE_RETURN_IF_ERROR(timed);
      MOE_RETURN_IF_ERROR(ops.status());
      budget.eager_ms_per_step = (graphs ? *eager / o.decode_steps * 1e3 : row.ms_per_step);
      budget.ops = std::move(*ops);
      PrintStepBudget(budget, log);
      if (row.host) {
        // The GPU's own work between two pool calls, and what is left: copies and host-call latency.
        int calls = 0;
        for (const auto& op : budget.ops.ops) calls += op.calls;
        const double own = budget.ops.busy_seconds - budget.ops.overhead_seconds_per_op * calls;
        row.host->gpu_ops_us_per_layer = 1e6 * own / budget.steps / spec.num_layers;
        log << absl::StrFormat(
            "  per layer: GPU operations %.1f us (eager, op-timed), so the host path adds about %.1f us a layer "
            "beyond the pool's own time\n",
            row.host->gpu_ops_us_per_layer, row.host->between_us - row.host->gpu_ops_us_per_layer);
      }
      row.budget = std::move(budget);
    }
    result.decode.push_back(row);
  }

  for (int tokens : o.prompts) {
    const int chunk = model.options().max_step_tokens;
    MOE_ASSIGN_OR_RETURN(auto cache, model.NewKvCache(runtime::BlocksFor(tokens, block), block));
    std::vector<int32_t> table(runtime::BlocksFor(tokens, block));
    std::iota(table.begin(), table.end(), 0);
    std::vector<int32_t> ids(tokens);
    for (int32_t& id : ids) id = token(rng);
    auto prefill = [&]() -> absl::Status {
      for (int first = 0; first < tokens; first += chunk) {
        const int n = std::min(chunk, tokens - first);
        ForwardBatch b;
        b.token_ids.assign(ids.begin() + first, ids.begin() + first + n);
        b.sequences = {SequenceChunk{first, n, table}};
        b.logit_rows = {n - 1};
        MOE_RETURN_IF_ERROR(Step(model, *cache, b));
      }
      return absl::OkStatus();
    };
    MOE_RETURN_IF_ERROR(prefill());  // warm-up
    double best = 1e30;
    const int64_t streamed_before = backend.streamed_calls();
    for (int r = 0; r < o.prefill_repeats; ++r) {
      const auto start = Clock::now();
      MOE_RETURN_IF_ERROR(prefill());
      best = std::min(best, Seconds(start));
    }
    // Layers streamed a step, on average.
    const double streamed = static_cast<double>(backend.streamed_calls() - streamed_before) / o.prefill_repeats /
                            ((tokens + chunk - 1) / chunk);
    PrefillRow row;
    row.tokens = tokens;
    row.tokens_per_s = tokens / best;
    row.tflops = PrefillFlops(spec, tokens) / best / 1e12;
    row.ratio = row.tflops / result.roofline.matmul_tflops;
    if (pool != nullptr && streamed > 0) {
      row.experts_path = absl::StrFormat(
          "%zu layers' routed experts streamed to the GPU and run there (%.1f of %zu a step: chunks of %d tokens, "
          "streaming from %d)",
          model.pool_layers().size(), streamed, model.pool_layers().size(), std::min(chunk, tokens),
          model.prefill_offload_tokens());
    } else if (pool != nullptr) {
      // Every pool layer takes the same path: the kernel for the chunk's tokens per expert.
      const int64_t per_expert =
          std::max<int64_t>(1, int64_t{std::min(chunk, tokens)} * spec.routing.top_k / spec.routing.num_experts);
      row.experts_path =
          absl::StrFormat("%zu layers' routed experts on the CPU (%s kernel, ~%d tokens per expert)",
                          model.pool_layers().size(), experts::KernelName(pool->KernelFor(per_expert)), per_expert);
    } else {
      row.experts_path = "routed experts on " + backend.name();
    }
    log << absl::StrFormat("prefill %5d tokens: %9.1f tokens/s, %.1f ms, %s, %.1f%% of the matrix rate; %s\n", tokens,
                           row.tokens_per_s, best * 1e3, FlopRate(row.tflops), 100 * row.ratio, row.experts_path);
    result.prefill.push_back(row);
  }
  return result;
}

}  // namespace moe::bench
