// moeserve profile-experts: how often each MoE layer's router picks each expert over a file of
// prompts, written as a routing profile (runtime/routing_profile.h) for --gpu-experts-per-layer.
#include <algorithm>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "commands.h"
#include "flags.h"
#include "model_loading.h"
#include "moe/core/file.h"
#include "moe/core/status.h"
#include "moe/runtime/model.h"
#include "moe/runtime/routing_profile.h"
#include "moe/scheduler/text_pipeline.h"
#include "moe/text/tokenizer.h"

namespace moe::deploy {
namespace {

constexpr size_t kMaxPromptFileBytes = size_t{256} << 20;

struct ProfileFlags {
  std::string model, prompt_file, prompt_ids_file, out;
  int top = 32;
  DeviceFlags device;
  ExpertFlags experts;
};

// One prompt per non-empty line: text under the model's tokenizer, or comma-separated ids.
absl::StatusOr<std::vector<std::vector<int32_t>>> ReadPrompts(const ProfileFlags& f, int vocab) {
  const bool ids = !f.prompt_ids_file.empty();
  const std::string& path = ids ? f.prompt_ids_file : f.prompt_file;
  MOE_ASSIGN_OR_RETURN(const std::string content,
                       core::ReadBoundedFile(path, kMaxPromptFileBytes, ids ? "--prompt-ids-file" : "--prompt-file"));
  std::unique_ptr<text::Tokenizer> tokenizer;
  if (!ids) {
    MOE_ASSIGN_OR_RETURN(scheduler::ModelTokenizer loaded, scheduler::LoadModelTokenizer(f.model));
    if (loaded.tokenizer == nullptr) {
      return absl::NotFoundError(absl::StrCat(loaded.none_reason, " (", loaded.where, "); use --prompt-ids-file"));
    }
    tokenizer = std::move(loaded.tokenizer);
  }
  std::vector<std::vector<int32_t>> prompts;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(content, '\n')) {
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    std::vector<int32_t> prompt;
    if (ids) {
      auto parsed = ParseIdList(std::string(line), absl::StrCat("prompt-ids-file line ", line_number));
      if (!parsed.ok()) return parsed.status();
      for (int32_t id : *parsed) {
        if (id < 0 || id >= vocab) {
          return absl::InvalidArgumentError(absl::StrCat("--prompt-ids-file ", path, " line ", line_number,
                                                         ": token id ", id, " outside the vocabulary [0, ", vocab,
                                                         ")"));
        }
      }
      prompt = *std::move(parsed);
    } else {
      prompt = tokenizer->Encode(std::string(line), /*add_special_tokens=*/true);
    }
    if (!prompt.empty()) prompts.push_back(std::move(prompt));
  }
  if (prompts.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no prompt in it"));
  return prompts;
}

int RunProfileExperts(const ProfileFlags& f) {
  const std::string command = "profile-experts";
  if (f.prompt_file.empty() == f.prompt_ids_file.empty()) {
    return FailCommand(command, absl::InvalidArgumentError("give exactly one of --prompt-file and --prompt-ids-file"),
                       2);
  }
  if (absl::Status s = CheckModelFlags(f.device, f.experts, command); !s.ok()) return FailCommand(command, s, 2);
  runtime::ModelOptions options;
  auto loaded = LoadModelForCommand(f.model, f.device, f.experts, options, 0, command);
  if (!loaded.ok()) return FailCommand(command, loaded.status());
  runtime::Model& model = **loaded;
  const runtime::ModelSpec& spec = model.spec();
  auto prompts = ReadPrompts(f, spec.vocab_size);
  if (!prompts.ok()) return FailCommand(command, prompts.status(), 2);

  runtime::RoutingProfile profile = runtime::RoutingProfile::For(spec);
  const int k = spec.routing.top_k;
  std::vector<int32_t> ids;
  absl::Status tap_status;
  model.SetStepTap([&](std::string_view what, int layer, const runtime::Tensor& t) {
    if (what != "expert_ids" || !tap_status.ok()) return;
    ids.resize(t.numel());
    model.backend().CopyToHost(t, ids.data());
    tap_status = model.backend().Synchronize();
    if (!tap_status.ok()) return;
    std::vector<int64_t>& counts = profile.counts[layer];
    for (int32_t e : ids) ++counts[e];
  });
  const int chunk = model.options().max_step_tokens;
  size_t longest = 0;
  for (const auto& p : *prompts) longest = std::max(longest, p.size());
  if (static_cast<int64_t>(longest) > model.options().max_context) {
    return FailCommand(command,
                       absl::InvalidArgumentError(absl::StrCat(
                           "a prompt of ", longest, " tokens is beyond the context of ", model.options().max_context)),
                       2);
  }
  auto cache = model.NewKvCache(runtime::BlocksFor(static_cast<int64_t>(longest), 16), 16);
  if (!cache.ok()) return FailCommand(command, cache.status());
  std::vector<int32_t> table(runtime::BlocksFor(static_cast<int64_t>(longest), 16));
  std::iota(table.begin(), table.end(), 0);
  std::vector<float> logits;
  for (const auto& prompt : *prompts) {
    const int n = static_cast<int>(prompt.size());
    for (int first = 0; first < n; first += chunk) {
      const int m = std::min(chunk, n - first);
      runtime::ForwardBatch batch;
      batch.token_ids.assign(prompt.begin() + first, prompt.begin() + first + m);
      batch.sequences = {runtime::SequenceChunk{first, m, table}};
      batch.logit_rows = {m - 1};
      if (absl::Status s = model.Forward(batch, **cache, &logits); !s.ok()) return FailCommand(command, s);
      if (!tap_status.ok()) return FailCommand(command, tap_status);
    }
    profile.tokens += n;
  }
  model.SetStepTap(nullptr);
  if (absl::Status s = runtime::SaveRoutingProfile(f.out, profile); !s.ok()) return FailCommand(command, s);
  // How concentrated the routing is: the share of picks the `top` most used experts take.
  const double share = runtime::MeanShareOfMostUsed(profile, {}, f.top);
  std::cout << absl::StrFormat(
      "routing profile of %d tokens (%zu prompts, %d picks each) written to %s: the %d most used experts of a layer "
      "take %.1f%% of its picks on average (%.1f%% if routing were uniform)\n",
      profile.tokens, prompts->size(), k, f.out, f.top, 100 * share,
      100.0 * std::min(f.top, spec.routing.num_experts) / spec.routing.num_experts);
  return 0;
}

}  // namespace

void AddProfileExpertsCommand(CLI::App& root, CommandRun* selected) {
  auto f = std::make_shared<ProfileFlags>();
  CLI::App* app = AddCommand(
      root, "profile-experts", "count how often each layer's router picks each expert, for --gpu-experts-per-layer",
      "Runs every prompt of --prompt-file (one per line, under the model's tokenizer) or\n"
      "--prompt-ids-file (one per line, comma-separated token ids) through the model (prefill only)\n"
      "and counts, for each MoE layer, how many times its router picked each expert. Writes the\n"
      "counts to --out as a routing profile (JSON); serve, generate and bench take it with\n"
      "--gpu-experts-per-layer N --expert-profile FILE to hold each CPU layer's N most used experts\n"
      "on the GPU too. Use prompts like the ones you will serve.",
      [f] { return RunProfileExperts(*f); }, selected);
  app->add_option("--model", f->model, "the model: a Hugging Face folder (config.json + safetensors) or a GGUF file (the first part of a split one, or a folder of one model's GGUF files)")->required();
  app->add_option("--prompt-file", f->prompt_file, "text prompts, one per line");
  app->add_option("--prompt-ids-file", f->prompt_ids_file, "token-id prompts, one per line, ids comma-separated");
  app->add_option("--out", f->out, "the routing profile to write (JSON)")->required();
  app->add_option("--top", f->top, "report the share of picks of this many most used experts a layer")
      ->check(IntIn(1, 4096))
      ->capture_default_str();
  f->device.Add(app);
  f->experts.Add(app);
}

}  // namespace moe::deploy
