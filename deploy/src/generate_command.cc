// moeserve generate: one process, one prompt. For debugging and quick checks.
#include <cstdio>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "flags.h"
#include "model_loading.h"
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

struct GenerateFlags {
  std::string model, prompt_ids, dump_logits;
  int64_t max_new_tokens = 16;
  double temperature = 0, top_p = 1, min_p = 0;
  int top_k = 0;
  std::optional<uint64_t> seed;
  int threads = 0;
  bool ignore_eos = false, json = false;
  ExpertFlags experts;
  DeviceFlags device;
  SpecFlags spec;
};

int RunGenerate(const GenerateFlags& flags);

}  // namespace

void AddGenerateCommand(CLI::App& root, CommandRun* selected) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* app = AddCommand(
      root, "generate", "run one prompt (token ids) through a model and print the tokens and speed",
      "Runs one prompt through a model on the CPU backend: prefill, then greedy or sampled\n"
      "decode with the KV cache. Prints the generated token ids and the prefill and decode speed.",
      [flags] { return RunGenerate(*flags); }, selected);
  app->add_option("--model", flags->model, "the model: a Hugging Face folder (config.json + safetensors) or a GGUF file (the first part of a split one, or a folder of one model's GGUF files)")->required();
  app->add_option("--prompt-ids", flags->prompt_ids, "prompt as comma-separated token ids, e.g. 1,2,3")->required();
  app->add_option("--max-new-tokens", flags->max_new_tokens,
                  "tokens to generate (prompt plus these must fit the model's context)")
      ->check(IntIn(0, 1 << 24))
      ->capture_default_str();
  app->add_option("--temperature", flags->temperature, "sampling temperature; 0 is greedy")
      ->check(NumberIn(0, 100))
      ->capture_default_str();
  app->add_option("--top-k", flags->top_k, "sample from the K most likely tokens; 0 is off")
      ->check(IntIn(0, 1 << 24))
      ->capture_default_str();
  app->add_option("--top-p", flags->top_p, "sample from the smallest set with probability >= P")
      ->check(NumberIn(0, 1))
      ->capture_default_str();
  app->add_option("--min-p", flags->min_p, "drop tokens below P times the best token's probability")
      ->check(NumberIn(0, 1))
      ->capture_default_str();
  app->add_option("--seed", flags->seed, "random seed for sampling (same seed, same tokens)")
      ->check(IntIn(0, INT64_MAX));
  app->add_option("--threads", flags->threads, "CPU threads; 0 uses every core")
      ->check(IntIn(0, 4096))
      ->capture_default_str();
  flags->experts.Add(app);
  flags->device.Add(app);
  flags->spec.Add(app);
  app->add_flag("--ignore-eos", flags->ignore_eos, "keep generating after an end-of-sequence token");
  app->add_flag("--json", flags->json, "print one JSON object: generated_ids, token counts, timings");
  app->add_option("--dump-logits", flags->dump_logits,
                  "write the logits of every prompt position as a JSON array of rows");
}

namespace {

int RunGenerate(const GenerateFlags& flags) {
  auto prompt = ParseIdList(flags.prompt_ids, "prompt-ids");
  if (!prompt.ok()) return Fail(prompt.status(), 2);

  runtime::GenerateOptions options;
  options.max_new_tokens = static_cast<int>(flags.max_new_tokens);
  options.sampling.temperature = static_cast<float>(flags.temperature);
  options.sampling.top_k = flags.top_k;
  options.sampling.top_p = static_cast<float>(flags.top_p);
  options.sampling.min_p = static_cast<float>(flags.min_p);
  if (flags.seed) options.sampling.seed = *flags.seed;
  options.stop_at_eos = !flags.ignore_eos;
  options.prompt_logits = !flags.dump_logits.empty();
  if (absl::Status s = options.sampling.Validate(); !s.ok()) return Fail(s, 2);
  if (flags.spec.type == "mtp") {
    if (absl::Status s = CheckMtpHead(flags.model, "--spec-type mtp"); !s.ok()) return Fail(s, 2);
  }
  auto speculative = flags.spec.Config();
  if (!speculative.ok()) return Fail(speculative.status(), 2);
  if (speculative->type == runtime::SpecType::kDraft) {
    return Fail(absl::FailedPreconditionError(absl::StrCat("--spec-type ", flags.spec.type,
                                                           ": generate drafts with ngram or mtp; serve runs draft")),
                2);
  }
  if (speculative->type == runtime::SpecType::kMtp && !flags.dump_logits.empty()) {
    return Fail(absl::InvalidArgumentError("--dump-logits: the prompt's logits are not returned with --spec-type mtp"),
                2);
  }
  options.speculative = *speculative;
  WarnIfMoreThreadsThanCores(flags.threads, "threads", "generate");

  const auto load_start = std::chrono::steady_clock::now();
  runtime::ModelOptions model_options;
  model_options.threads = flags.threads;
  if (absl::Status s = CheckModelFlags(flags.device, flags.experts, "generate"); !s.ok()) return Fail(s, 2);
  auto model = LoadModelForCommand(flags.model, flags.device, flags.experts, model_options, 0, "generate");
  if (!model.ok()) return Fail(model.status());
  std::unique_ptr<runtime::Model> head;
  if (speculative->type == runtime::SpecType::kMtp) {
    if (!(*model)->backend().HostAddressable()) {
      return Fail(absl::FailedPreconditionError(absl::StrCat("--spec-type mtp: the MTP head drafts beside a target on ",
                                                             "the CPU backend for now (--device cpu), not on ",
                                                             (*model)->backend().name())),
                  2);
    }
    runtime::ModelOptions head_options;
    head_options.threads = flags.threads;
    head_options.max_step_tokens = (*model)->options().max_step_tokens + 1;  // and a chunk's waiting row
    head_options.max_logit_rows = 1;
    head_options.pool.progress = false;
    head_options.nextn_head = true;
    auto loaded = runtime::Model::Load(flags.model, head_options);
    if (!loaded.ok()) return Fail(core::Annotate(loaded.status(), "--spec-type mtp"));
    head = *std::move(loaded);
    options.mtp_head = head.get();
  }
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  auto result = runtime::Generate(**model, *prompt, options);
  if (!result.ok()) return Fail(result.status());
  if (!flags.dump_logits.empty()) {
    if (absl::Status s = DumpLogits(flags.dump_logits, result->prompt_logits); !s.ok()) return Fail(s);
  }

  const size_t generated = result->generated_ids.size();
  const double decode_tokens = generated > 1 ? static_cast<double>(generated - 1) : 0.0;
  const double prefill_tps = PerSecond(static_cast<double>(prompt->size()), result->prefill_seconds);
  const double decode_tps = PerSecond(decode_tokens, result->decode_seconds);
  if (flags.json) {
    nlohmann::ordered_json j = {{"generated_ids", result->generated_ids},
                                {"prompt_tokens", prompt->size()},
                                {"generated_tokens", generated},
                                {"load_seconds", load_seconds},
                                {"prefill_seconds", result->prefill_seconds},
                                {"decode_seconds", result->decode_seconds},
                                {"prefill_tokens_per_s", prefill_tps},
                                {"decode_tokens_per_s", decode_tps},
                                {"decode_steps", result->decode_steps},
                                {"spec_drafts", result->spec_drafts},
                                {"draft_tokens", result->draft_tokens},
                                {"accepted_draft_tokens", result->accepted_draft_tokens},
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
  if (options.speculative.type != runtime::SpecType::kOff) {
    std::cout << absl::StrFormat(
        "speculative (%s): %d of %d drafts kept over %d verify steps; %d decode steps for %.0f tokens\n",
        runtime::SpecTypeName(options.speculative.type), result->accepted_draft_tokens, result->draft_tokens,
        result->spec_drafts, result->decode_steps, decode_tokens);
  }
  return 0;
}

}  // namespace
}  // namespace moe::deploy
