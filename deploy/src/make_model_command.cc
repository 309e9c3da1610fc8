// moeserve make-model: writes a random-weight checkpoint at a real model's shape.
#include <iostream>

#include "absl/strings/str_join.h"
#include "commands.h"
#include "make_model.h"

namespace moe::deploy {
namespace {

int RunMakeModel(const MakeModelOptions& options) {
  if (absl::Status s = MakeModel(options); !s.ok()) {
    std::cerr << "moeserve make-model: error: " << s.message() << "\n";
    const bool usage = s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kAlreadyExists;
    return usage ? 2 : 1;
  }
  std::cerr << "make-model: wrote " << options.out << "\n";
  return 0;
}

}  // namespace

void AddMakeModelCommand(CLI::App& root, CommandRun* selected) {
  auto o = std::make_shared<MakeModelOptions>();
  auto quiet = std::make_shared<bool>(false);
  CLI::App* app = AddCommand(
      root, "make-model", "write a random-weight checkpoint at a real model's shape, for demos and benchmarks",
      "Writes a random-weight checkpoint in the Hugging Face format (config.json + safetensors) at the\n"
      "shape of a real model, for any architecture the loader reads. Presets (by --arch):\n"
      "  qwen3_moe: " +
          absl::StrJoin(MakeModelPresets("qwen3_moe"), ", ") +
          "\n  qwen2_moe: " + absl::StrJoin(MakeModelPresets("qwen2_moe"), ", ") +
          "\n  mixtral: " + absl::StrJoin(MakeModelPresets("mixtral"), ", ") +
          "\n  glm4_moe: " + absl::StrJoin(MakeModelPresets("glm4_moe"), ", ") +
          "\n  deepseek_v3: " + absl::StrJoin(MakeModelPresets("deepseek_v3"), ", ") +
          "\nqwen3-30b-a3b has hidden 2048, 128 experts top-8 of width 768, 32 query and 4 KV heads of 128.\n"
          "The checkpoint is written beside --out under a temporary name and renamed at the end; free space is\n"
          "checked first, and nothing is left behind on an error.",
      [o, quiet] {
        MakeModelOptions options = *o;
        options.progress = !*quiet;
        return RunMakeModel(options);
      },
      selected);
  app->add_option("--arch", o->arch, "architecture (model_type)")->capture_default_str();
  app->add_option("--preset", o->preset, "shape preset")->capture_default_str();
  app->add_option("--layers", o->layers, "number of layers instead of the preset's")
      ->check(IntIn(1, kMakeModelMaxLayers));
  app->add_option("--vocab", o->vocab, "vocabulary size instead of the preset's")->check(IntIn(1, kMakeModelMaxVocab));
  app->add_option("--seed", o->seed, "random seed")->check(IntIn(0, INT64_MAX))->capture_default_str();
  app->add_option_function<int64_t>(
         "--max-shard-mb", [o](int64_t mb) { o->max_shard_bytes = mb << 20; },
         "tensor bytes per safetensors shard, in MiB; bigger checkpoints are split, with an index (default 4096)")
      ->check(IntIn(kMakeModelMinShardBytes >> 20, kMakeModelMaxShardBytes >> 20));
  app->add_option("--out", o->out, "output directory")->required();
  app->add_flag("--overwrite", o->overwrite,
                "replace an existing non-empty --out (only once the new checkpoint is complete)");
  app->add_flag("--fp8", o->fp8,
                "write the projections and routed experts as an FP8 release does (F8_E4M3 with one fp32 "
                "weight_scale_inv per 128 x 128 block, quantization_config in config.json); norms, router and "
                "embedding stay bf16");
  app->add_flag("--quiet", *quiet, "no progress lines");
}

}  // namespace moe::deploy
