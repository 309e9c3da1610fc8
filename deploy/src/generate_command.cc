// moeserve generate: one process, one prompt. For debugging and quick checks.
#include <cstdio>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "flags.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"
#include "moe/runtime/generate.h"
#include "moe/runtime/model.h"
#include "nlohmann/json.hpp"

namespace moe::deploy {
namespace {

int Fail(const absl::Status& status, int code = 1) {
  std::cerr << "moeserve generate: error: " << status.message() << "\n";
  return code;
}

// One JSON array of rows; %.9g keeps every float exact.
absl::Status DumpLogits(const std::string& path, const std::vector<std::vector<float>>& rows) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("--dump-logits ", path, ": cannot write"));
  std::fputc('[', f);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::fputs(r == 0 ? "[" : ",\n[", f);
    for (size_t i = 0; i < rows[r].size(); ++i) std::fprintf(f, i == 0 ? "%.9g" : ",%.9g", rows[r][i]);
    std::fputc(']', f);
  }
  std::fputs("]\n", f);
  const bool ok = std::fclose(f) == 0;
  return ok ? absl::OkStatus() : absl::InternalError(absl::StrCat("--dump-logits ", path, ": write failed"));
}

double PerSecond(double count, double seconds) { return seconds > 0 ? count / seconds : 0.0; }

}  // namespace

int GenerateCommand(int argc, char** argv) {
  Flags flags("generate",
              "Runs one prompt through a model on the CPU backend: prefill, then greedy or sampled decode with the\n"
              "KV cache. Prints the generated token ids and the prefill and decode speed.");
  flags.Add("model", "DIR", "Hugging Face model directory (config.json + safetensors)");
  flags.Add("prompt-ids", "IDS", "prompt as comma-separated token ids, e.g. 1,2,3");
  flags.Add("max-new-tokens", "N", "tokens to generate", "16");
  flags.Add("temperature", "T", "sampling temperature; 0 is greedy", "0");
  flags.Add("top-k", "K", "sample from the K most likely tokens; 0 is off", "0");
  flags.Add("top-p", "P", "sample from the smallest set with probability >= P", "1");
  flags.Add("min-p", "P", "drop tokens below P times the best token's probability", "0");
  flags.Add("seed", "S", "random seed for sampling (same seed, same tokens)");
  flags.Add("threads", "N", "CPU threads; 0 uses every core", "0");
  flags.Add("rope-freqs", "f32|bf16",
            "precision of the RoPE frequencies: f32 as transformers loads checkpoints; bf16 reproduces a\n"
            "                               model cast whole to bf16 (the test fixtures' goldens)",
            "f32");
  AddExpertFlags(flags);
  flags.AddSwitch("ignore-eos", "keep generating after an end-of-sequence token");
  flags.AddSwitch("json", "print one JSON object: generated_ids, token counts, timings");
  flags.Add("dump-logits", "PATH", "write the logits of every prompt position as a JSON array of rows");
  flags.AddSwitch("help", "show this help");
  if (std::optional<int> exit_code = flags.ParseOrExit(argc, argv)) return *exit_code;

  auto model_dir = flags.Required("model");
  if (!model_dir.ok()) return Fail(model_dir.status(), 2);
  auto prompt_text = flags.Required("prompt-ids");
  if (!prompt_text.ok()) {
    return Fail(absl::InvalidArgumentError("--prompt-ids is required (text prompts need the tokenizer, not built yet)"), 2);
  }
  auto prompt = ParseIdList(*prompt_text, "prompt-ids");
  if (!prompt.ok()) return Fail(prompt.status(), 2);

  runtime::GenerateOptions options;
  auto max_new = flags.Int("max-new-tokens");
  auto temperature = flags.Double("temperature");
  auto top_k = flags.Int("top-k");
  auto top_p = flags.Double("top-p");
  auto min_p = flags.Double("min-p");
  auto threads = flags.Int("threads");
  for (const absl::Status& s : {max_new.status(), temperature.status(), top_k.status(), top_p.status(),
                                min_p.status(), threads.status()}) {
    if (!s.ok()) return Fail(s, 2);
  }
  options.max_new_tokens = static_cast<int>(*max_new);
  options.sampling.temperature = static_cast<float>(*temperature);
  options.sampling.top_k = static_cast<int>(*top_k);
  options.sampling.top_p = static_cast<float>(*top_p);
  options.sampling.min_p = static_cast<float>(*min_p);
  if (flags.Has("seed")) {
    auto seed = flags.Int("seed");
    if (!seed.ok()) return Fail(seed.status(), 2);
    options.sampling.seed = static_cast<uint64_t>(*seed);
  }
  options.stop_at_eos = !flags.Switch("ignore-eos");
  options.prompt_logits = flags.Has("dump-logits");
  if (absl::Status s = options.sampling.Validate(); !s.ok()) return Fail(s, 2);

  const auto load_start = std::chrono::steady_clock::now();
  runtime::ModelOptions model_options;
  model_options.threads = static_cast<int>(*threads);
  if (absl::Status s = ReadExpertFlags(flags, &model_options); !s.ok()) return Fail(s, 2);
  const std::string rope_freqs = flags.Get("rope-freqs");
  if (rope_freqs == "bf16") {
    model_options.rope_frequencies = runtime::RopeFrequencies::kBFloat16;
  } else if (rope_freqs != "f32") {
    return Fail(absl::InvalidArgumentError("--rope-freqs must be f32 or bf16, got '" + rope_freqs + "'"), 2);
  }
  auto model = runtime::Model::Load(*model_dir, model_options);
  if (!model.ok()) return Fail(model.status());
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  auto result = runtime::Generate(**model, *prompt, options);
  if (!result.ok()) return Fail(result.status());
  if (flags.Has("dump-logits")) {
    if (absl::Status s = DumpLogits(flags.Get("dump-logits"), result->prompt_logits); !s.ok()) return Fail(s);
  }

  const size_t generated = result->generated_ids.size();
  const double decode_tokens = generated > 1 ? static_cast<double>(generated - 1) : 0.0;
  const double prefill_tps = PerSecond(static_cast<double>(prompt->size()), result->prefill_seconds);
  const double decode_tps = PerSecond(decode_tokens, result->decode_seconds);
  if (flags.Switch("json")) {
    nlohmann::ordered_json j = {{"generated_ids", result->generated_ids},
                                {"prompt_tokens", prompt->size()},
                                {"generated_tokens", generated},
                                {"load_seconds", load_seconds},
                                {"prefill_seconds", result->prefill_seconds},
                                {"decode_seconds", result->decode_seconds},
                                {"prefill_tokens_per_s", prefill_tps},
                                {"decode_tokens_per_s", decode_tps},
                                {"backend", (*model)->backend().name()}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::cout << "model: " << (*model)->spec().Summary() << "\n"
            << "backend: " << (*model)->backend().name() << ", loaded in " << absl::StrFormat("%.2f s", load_seconds)
            << "\n"
            << ((*model)->expert_pool() != nullptr ? (*model)->expert_pool()->Describe()
                                                    : std::string("routed experts: reference path"))
            << "\n"
            << "prompt: " << prompt->size() << " tokens\n"
            << "generated " << generated << " tokens: " << absl::StrJoin(result->generated_ids, " ") << "\n"
            << absl::StrFormat("prefill: %zu tokens in %.1f ms (%.1f tokens/s)\n", prompt->size(),
                               result->prefill_seconds * 1e3, prefill_tps)
            << absl::StrFormat("decode: %.0f tokens in %.1f ms (%.1f tokens/s)\n", decode_tokens,
                               result->decode_seconds * 1e3, decode_tps);
  return 0;
}

}  // namespace moe::deploy
