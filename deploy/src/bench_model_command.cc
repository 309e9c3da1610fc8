// `moeserve bench model`: the end-to-end model benchmark (bench/model_bench.h) on the device
// --device picks.
#include <iostream>

#include "commands.h"
#include "model_bench.h"
#include "model_loading.h"
#include "moe/core/logging.h"

namespace moe::deploy {
namespace {

struct ModelBenchFlags {
  std::string model, batches = "1,8,32", prompts = "512,2048";
  bench::ModelBenchOptions options;
  int max_step_tokens = 2048;
  int64_t roofline_mb = 2048;
  int threads = 0;
  ExpertFlags experts;
  DeviceFlags device;
  bool json = false;
};

int Fail(const absl::Status& s, int code = 1) { return FailCommand("bench model", s, code); }

int BenchModel(const ModelBenchFlags& flags) {
  bench::ModelBenchOptions o = flags.options;
  auto batches = ParseIntList(flags.batches, "batches");
  if (!batches.ok()) return Fail(batches.status(), 2);
  auto prompts = ParseIntList(flags.prompts, "prompts");
  if (!prompts.ok()) return Fail(prompts.status(), 2);
  o.batches = *batches;
  o.prompts = *prompts;
  o.copy_bytes = flags.roofline_mb << 20;
  if (absl::Status s = CheckModelFlags(flags.device, flags.experts, "bench model"); !s.ok()) return Fail(s, 2);
  runtime::ModelOptions model_options;
  model_options.threads = flags.threads;
  model_options.max_step_tokens = flags.max_step_tokens;
  int most = 1;
  for (int b : o.batches) most = std::max(most, b);
  model_options.max_logit_rows = std::max(most, 1);
  auto model = LoadModelForCommand(flags.model, flags.device, flags.experts, model_options, 0, "bench model");
  if (!model.ok()) return Fail(model.status());
  std::cerr << "model: " << (*model)->spec().Summary() << ", " << (*model)->weight_bytes() / (1 << 20)
            << " MiB of weights on " << (*model)->backend().name() << "\n";
  auto result = bench::RunModelBench(**model, o, flags.json ? std::cerr : std::cout);
  if (!result.ok()) return Fail(result.status());
  if (flags.json) bench::PrintModelBenchJson(*result, (*model)->backend().name(), std::cout);
  return 0;
}

}  // namespace

void AddBenchModel(CLI::App& bench, CommandRun* selected) {
  auto f = std::make_shared<ModelBenchFlags>();
  CLI::App* app = AddCommand(
      bench, "model", "the whole model: decode at several batch sizes, prefill of several lengths",
      "Loads a model on --device and measures it end to end with the weights as served: decode tokens/s\n"
      "at each --batches size (each sequence holding --decode-context tokens), with the weight bytes a\n"
      "step reads against the memory bandwidth measured in the same run (a large device-to-device copy\n"
      "on a GPU: the bound and the ratio), and prefill tokens/s for each --prompts length, with its\n"
      "TFLOP/s against a bf16 GEMM measured in the same run. Decode tokens are random ids: sampling is\n"
      "not timed.",
      [f] { return BenchModel(*f); }, selected);
  app->add_option("--model", f->model, "the model: a Hugging Face folder (config.json + safetensors) or a GGUF file (the first part of a split one, or a folder of one model's GGUF files)")->required();
  app->add_option("--batches", f->batches, "decode batch sizes")->check(IntListIn(1, 256))->capture_default_str();
  app->add_option("--prompts", f->prompts, "prefill lengths")->check(IntListIn(1, 1 << 20))->capture_default_str();
  app->add_option("--decode-context", f->options.decode_context, "tokens each sequence holds before decoding")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--decode-steps", f->options.decode_steps, "timed decode steps per batch size")
      ->check(IntIn(1, 100000))
      ->capture_default_str();
  app->add_option("--max-step-tokens", f->max_step_tokens, "prefill chunk: tokens in one step")
      ->check(IntIn(1, 65536))
      ->capture_default_str();
  app->add_option("--roofline-mb", f->roofline_mb, "MiB copied (read) to measure the memory bandwidth")
      ->check(IntIn(16, 1 << 20))
      ->capture_default_str();
  app->add_option("--threads", f->threads, "CPU backend threads; 0 uses every core")->check(IntIn(0, 4096));
  f->experts.Add(app);
  f->device.Add(app);
  app->add_flag("--json", f->json, "print one JSON object (the progress goes to stderr)");
}

}  // namespace moe::deploy
