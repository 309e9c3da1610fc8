// moeserve chat-template: renders a model's chat template over a request, exactly as the server
// will build the prompt, to check a template or a request by hand.
#include <iostream>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "commands.h"
#include "flags.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "moe/runtime/checkpoint.h"
#include "moe/scheduler/text_pipeline.h"
#include "moe/text/chat_template.h"
#include "nlohmann/json.hpp"

namespace moe::deploy {
namespace {

constexpr const char kCommand[] = "chat-template";
constexpr size_t kMaxRequestBytes = size_t{64} << 20;
constexpr size_t kMaxTemplateBytes = size_t{16} << 20;

struct ChatTemplateFlags {
  std::string model, chat_template_file, request, now;
};

// --now as a local time (as datetime.now() is), or with its offset when it gives one.
absl::StatusOr<std::chrono::system_clock::time_point> ParseNow(const std::string& text) {
  absl::Time time;
  std::string error;
  if (absl::ParseTime("%Y-%m-%d%ET%H:%M:%E*S%Ez", text, &time, &error) ||
      absl::ParseTime("%Y-%m-%d%ET%H:%M:%E*S", text, absl::LocalTimeZone(), &time, &error) ||
      absl::ParseTime("%Y-%m-%d%ET%H:%M", text, absl::LocalTimeZone(), &time, &error)) {
    return absl::ToChronoTime(time);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--now '", text, "' is not a time like 2026-11-29T12:00:00 (local) or 2026-11-29T12:00:00+01:00"));
}

// The request's text, with the tokenizer's bos_token/eos_token added where the request has none
// (transformers passes the special tokens beside the request's own keywords, which win). The
// request's key order is kept: templates print dicts (`tools | tojson`) in it.
absl::StatusOr<std::string> RequestText(const std::string& text, const std::string& path,
                                        const text::TokenizerConfig* tokenizer) {
  MOE_RETURN_IF_ERROR(core::ParseJsonObject(text, path).status());  // errors with line and column
  if (tokenizer == nullptr) return text;
  nlohmann::ordered_json request = nlohmann::ordered_json::parse(text);
  bool added = false;
  for (const auto& [key, value] :
       {std::pair{"bos_token", &tokenizer->bos_token}, std::pair{"eos_token", &tokenizer->eos_token}}) {
    if (value->empty() || request.contains(key)) continue;
    request[key] = *value;
    added = true;
  }
  return added ? request.dump() : text;
}

int RunChatTemplate(const ChatTemplateFlags& flags) {
  if (flags.model.empty() == flags.chat_template_file.empty()) {
    std::cerr << "moeserve chat-template: error: give one of --model DIR or --chat-template-file FILE (see moeserve "
                 "chat-template --help)\n";
    return 2;
  }
  if (!flags.now.empty()) {
    absl::StatusOr<std::chrono::system_clock::time_point> now = ParseNow(flags.now);
    if (!now.ok()) return FailCommand(kCommand, now.status(), 2);
    text::ChatTemplate::SetNowForTesting(*now);
  }
  absl::StatusOr<std::string> request = core::ReadBoundedFile(flags.request, kMaxRequestBytes, "the request");
  if (!request.ok()) return FailCommand(kCommand, core::Annotate(request.status(), "--request"), 2);

  std::optional<text::TokenizerConfig> tokenizer;
  std::string source;
  if (!flags.model.empty()) {
    absl::StatusOr<text::TokenizerConfig> config;
    if (runtime::IsGgufCheckpoint(flags.model)) {
      absl::StatusOr<scheduler::ModelTokenizer> loaded = scheduler::LoadModelTokenizer(flags.model);
      if (!loaded.ok()) return FailCommand(kCommand, loaded.status());
      config = loaded->config;
    } else {
      config = text::LoadTokenizerConfig(flags.model);
    }
    if (!config.ok()) return FailCommand(kCommand, config.status());
    if (config->chat_template.empty()) {
      return FailCommand(kCommand, absl::FailedPreconditionError(absl::StrCat(
                                       flags.model,
                                       " has no chat template (no chat_template in tokenizer_config.json, no "
                                       "chat_template.jinja, no tokenizer.chat_template in a GGUF file); give one "
                                       "with --chat-template-file")));
    }
    source = config->chat_template;
    tokenizer = std::move(*config);
  } else {
    // Read as bytes: Jinja itself reads "\r\n" as "\n".
    absl::StatusOr<std::string> file =
        core::ReadBoundedFile(flags.chat_template_file, kMaxTemplateBytes, "the chat template");
    if (!file.ok()) return FailCommand(kCommand, core::Annotate(file.status(), "--chat-template-file"), 2);
    source = std::move(*file);
  }
  absl::StatusOr<std::string> variables =
      RequestText(*request, flags.request, tokenizer.has_value() ? &*tokenizer : nullptr);
  if (!variables.ok()) return FailCommand(kCommand, variables.status(), 2);

  absl::StatusOr<std::unique_ptr<text::ChatTemplate>> chat = text::ChatTemplate::Compile(source);
  if (!chat.ok()) return FailCommand(kCommand, chat.status());
  absl::StatusOr<std::string> prompt = (*chat)->RenderJsonText(*variables);
  if (!prompt.ok()) return FailCommand(kCommand, prompt.status());
  std::cout << *prompt << std::flush;  // exactly the prompt: no newline of our own
  return std::cout.good() ? 0 : 1;
}

}  // namespace

void AddChatTemplateCommand(CLI::App& root, CommandRun* selected) {
  auto flags = std::make_shared<ChatTemplateFlags>();
  CLI::App* app = AddCommand(
      root, kCommand, "render a model's chat template over a request and print the prompt",
      "Renders a chat template with jinja2 as transformers' apply_chat_template does, and prints the\n"
      "prompt exactly (no newline added). Every key of the request (a JSON object) is a template variable:\n"
      "messages, tools, add_generation_prompt, enable_thinking, ... With --model, bos_token and eos_token\n"
      "come from tokenizer_config.json unless the request gives them. Needs python3-jinja2.\n"
      "Exit 1 for a template error (Jinja's message on stderr), 2 for a usage error.",
      [flags] { return RunChatTemplate(*flags); }, selected);
  CLI::Option* model = app->add_option("--model", flags->model,
                                       "the model: a Hugging Face folder (tokenizer_config.json, chat_template.jinja) or a GGUF file");
  CLI::Option* file = app->add_option("--chat-template-file", flags->chat_template_file, "a Jinja chat template");
  model->excludes(file);
  app->add_option("--request", flags->request,
                  "JSON object of template variables, e.g. {\"messages\": [...], \"add_generation_prompt\": true}")
      ->required();
  app->add_option("--now", flags->now, "the time strftime_now sees, e.g. 2026-11-29T12:00:00 (local time)");
}

}  // namespace moe::deploy
