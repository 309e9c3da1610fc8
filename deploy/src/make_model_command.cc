// moeserve make-model: writes a random-weight checkpoint at a real model's shape.
#include <iostream>

#include "absl/strings/str_join.h"
#include "commands.h"
#include "flags.h"
#include "make_model.h"

namespace moe::deploy {

int MakeModelCommand(int argc, char** argv) {
  Flags flags("make-model",
              "Writes a random-weight checkpoint in the Hugging Face format (config.json + safetensors) at the\n"
              "shape of a real model, for demos and benchmarks. Presets: " +
                  absl::StrJoin(MakeModelPresets(), ", ") +
                  ".\n"
                  "qwen3-30b-a3b has hidden 2048, 128 experts top-8 of width 768, 32 query and 4 KV heads of 128.");
  flags.Add("arch", "ARCH", "architecture (model_type)", "qwen3_moe");
  flags.Add("preset", "NAME", "tiny or qwen3-30b-a3b", "tiny");
  flags.Add("layers", "N", "number of layers instead of the preset's");
  flags.Add("vocab", "N", "vocabulary size instead of the preset's");
  flags.Add("seed", "S", "random seed", "0");
  flags.Add("max-shard-mb", "MB", "tensor bytes per safetensors shard; bigger checkpoints are split, with an index", "4096");
  flags.Add("out", "DIR", "output directory");
  flags.AddSwitch("quiet", "no progress lines");
  flags.AddSwitch("help", "show this help");
  auto fail = [](const absl::Status& s, int code) {
    std::cerr << "moeserve make-model: error: " << s.message() << "\n";
    return code;
  };
  if (std::optional<int> exit_code = flags.ParseOrExit(argc, argv)) return *exit_code;
  MakeModelOptions o;
  auto out = flags.Required("out");
  if (!out.ok()) return fail(out.status(), 2);
  o.out = *out;
  o.arch = flags.Get("arch");
  o.preset = flags.Get("preset");
  for (const char* name : {"layers", "vocab", "seed", "max-shard-mb"}) {
    if (!flags.Has(name)) continue;
    auto v = flags.Int(name);
    if (!v.ok()) return fail(v.status(), 2);
    if (std::string(name) == "layers") o.layers = static_cast<int>(*v);
    if (std::string(name) == "vocab") o.vocab = static_cast<int>(*v);
    if (std::string(name) == "seed") o.seed = static_cast<uint64_t>(*v);
    if (std::string(name) == "max-shard-mb") o.max_shard_bytes = *v << 20;
  }
  o.progress = !flags.Switch("quiet");
  if (absl::Status s = MakeModel(o); !s.ok()) return fail(s, 1);
  std::cerr << "make-model: wrote " << o.out << "\n";
  return 0;
}

}  // namespace moe::deploy
