// `moeserve bench control`: what the control plane costs a step. The same decode steps (batch 1,
// greedy) run on the model in this process (ModelExecutor) and on one worker process behind a
// RemoteExecutor (what a deployment's frontend uses); the difference of the medians is the cost of
// the control stream, against the round trip of an empty call to the worker measured in the same
// run (its floor).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "absl/strings/str_format.h"
#include "commands.h"
#include "launcher.h"
#include "model_loading.h"
#include "moe/core/status.h"
#include "moe/runtime/model_executor.h"
#include "moeserve/v1/worker.grpc.pb.h"

namespace moe::deploy {
namespace {

using Clock = std::chrono::steady_clock;

struct ControlBenchFlags {
  std::string model;
  int steps = 200;
  DeviceFlags device;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// A prompt's prefill, then `steps` greedy decode steps of one sequence: each step's seconds.
absl::StatusOr<std::vector<double>> TimeDecode(runtime::Executor& executor, int steps) {
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  const int block = executor.kv_capacity().block_size;
  const int total = static_cast<int>(prompt.size()) + steps + 1;
  std::vector<int32_t> table(runtime::BlocksFor(total, block));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  auto plan_for = [&](std::vector<int32_t> ids, int64_t first) {
    runtime::StepPlan plan;
    plan.batch.token_ids = std::move(ids);
    const int32_t n = static_cast<int32_t>(plan.batch.token_ids.size());
    plan.batch.sequences = {runtime::SequenceChunk{
        first, n, std::vector<int32_t>(table.begin(), table.begin() + runtime::BlocksFor(first + n, block)), 1}};
    plan.batch.logit_rows = {n - 1};
    runtime::SampleRow row;
    row.seed = 1;
    row.position = static_cast<uint32_t>(first + n);
    plan.samples = {row};
    return plan;
  };
  MOE_ASSIGN_OR_RETURN(auto first, executor.Execute(plan_for(prompt, 0)));
  int32_t token = first.sequences.at(0).tokens.at(0);
  std::vector<double> seconds;
  for (int i = 0; i < steps; ++i) {
    const auto start = Clock::now();
    MOE_ASSIGN_OR_RETURN(auto out, executor.Execute(plan_for({token}, static_cast<int64_t>(prompt.size()) + i)));
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    token = out.sequences.at(0).tokens.at(0);
  }
  return seconds;
}

int BenchControl(const ControlBenchFlags& f) {
  auto fail = [](const absl::Status& s, int code = 1) { return FailCommand("bench control", s, code); };
  if (absl::Status s = CheckModelFlags(f.device, ExpertFlags{}, "bench control"); !s.ok()) return fail(s, 2);
  const bool gpu = f.device.device.rfind("cuda", 0) == 0;
  // In this process.
  runtime::ModelOptions options;
  options.max_logit_rows = 8;
  auto model = LoadModelForCommand(f.model, f.device, ExpertFlags{}, options, 0, "bench control");
  if (!model.ok()) return fail(model.status());
  auto local = runtime::ModelExecutor::Create(**model, 64, 16);
  if (!local.ok()) return fail(local.status());
  auto in_process = TimeDecode(**local, f.steps);
  if (!in_process.ok()) return fail(in_process.status());
  local->reset();
  model->reset();

  // One worker process, as a deployment starts it.
  ClusterConfig config;
  config.path = "(bench control)";
  config.model = f.model;
  ClusterNode node;
  if (gpu) node.gpus = {0};
  node.workers = gpu ? 0 : 1;
  config.nodes = {node};
  config.kv_cache_mb = 64;
  config.max_seqs = 8;
  LaunchOptions launch;
  launch.program = "/proc/self/exe";
  auto workers = StartLocalWorkers(config, launch);
  if (!workers.ok()) return fail(workers.status());
  const worker::RemoteExecutor::Options eo = (*workers)->executor_options();
  auto remote = worker::RemoteExecutor::Connect(eo);
  if (!remote.ok()) return fail(remote.status());
  auto over_stream = TimeDecode(**remote, f.steps);
  if (!over_stream.ok()) return fail(over_stream.status());
  // The floor: an empty call's round trip to the same worker.
  auto stub = moeserve::v1::Worker::NewStub(grpc::CreateChannel(
      eo.workers[0], eo.credentials != nullptr ? eo.credentials : grpc::InsecureChannelCredentials()));
  std::vector<double> round_trips;
  for (int i = 0; i < f.steps; ++i) {
    grpc::ClientContext ctx;
    for (const auto& [key, value] : eo.call_metadata) ctx.AddMetadata(key, value);
    moeserve::v1::WorkerHealthResponse health;
    const auto start = Clock::now();
    (void)stub->Health(&ctx, moeserve::v1::WorkerHealthRequest{}, &health);
    round_trips.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const double a = Median(*in_process), b = Median(*over_stream), rt = Median(round_trips);
  std::cout << absl::StrFormat(
      "decode batch 1, median of %d steps: %.1f us in this process, %.1f us through one worker's control stream\n"
      "control plane: %.1f us a step (aim: at most 100 us); floor, an empty call's round trip to the worker: "
      "%.1f us (%.2fx of it)\n",
      f.steps, 1e6 * a, 1e6 * b, 1e6 * (b - a), 1e6 * rt, rt > 0 ? (b - a) / rt : 0.0);
  return 0;
}

}  // namespace

void AddBenchControl(CLI::App& bench, CommandRun* selected) {
  auto f = std::make_shared<ControlBenchFlags>();
  CLI::App* app = AddCommand(
      bench, "control", "what the control plane costs a step: one worker process against this process",
      "Runs the same greedy decode steps (batch 1) on the model in this process and on one worker\n"
      "process behind the control stream a deployment's frontend uses, and prints the medians, their\n"
      "difference (the control plane's cost a step; the aim is at most 100 us) and the round trip of\n"
      "an empty call to the worker measured in the same run.",
      [f] { return BenchControl(*f); }, selected);
  app->add_option("--model", f->model, "the model: a Hugging Face folder (config.json + safetensors) or a GGUF file (the first part of a split one, or a folder of one model's GGUF files)")->required();
  app->add_option("--steps", f->steps, "timed decode steps each way")->check(IntIn(10, 100000))->capture_default_str();
  f->device.device = "cpu";
  f->device.Add(app);
}

}  // namespace moe::deploy
