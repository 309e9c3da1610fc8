// moeserve tokenize: the token ids of a text under a model's tokenizer.json, for checking a
// prompt's length or comparing with another implementation.
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/str_join.h"
#include "commands.h"
#include "flags.h"
#include "moe/core/file.h"
#include "moe/scheduler/text_pipeline.h"
#include "moe/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace moe::deploy {
namespace {

// A text file for --text-file: 16 MiB is millions of tokens, more than any context, and bounds
// the tokenizer's time and memory (its ids and pieces take several times the text).
constexpr size_t kMaxTextFileBytes = size_t{16} << 20;

struct TokenizeFlags {
  std::string model, text, text_file;
  bool json = false, no_special = false;
};

int RunTokenize(const TokenizeFlags& flags, bool have_text) {
  if (have_text == !flags.text_file.empty())
    return FailCommand("tokenize", absl::InvalidArgumentError("give exactly one of --text and --text-file"), 2);
  std::string text = flags.text;
  if (!flags.text_file.empty()) {
    auto content = core::ReadBoundedFile(flags.text_file, kMaxTextFileBytes, "--text-file");
    if (!content.ok()) {
      return FailCommand(
          "tokenize", absl::Status(content.status().code(), "--text-file: " + std::string(content.status().message())),
          2);
    }
    text = *std::move(content);
  }
  auto loaded = scheduler::LoadModelTokenizer(flags.model);
  if (!loaded.ok()) return FailCommand("tokenize", loaded.status(), 1);
  if (loaded->tokenizer == nullptr) {
    return FailCommand("tokenize", absl::NotFoundError(absl::StrCat(loaded->none_reason, " (", loaded->where, ")")), 1);
  }
  const std::unique_ptr<text::Tokenizer>* tokenizer = &loaded->tokenizer;
  const std::vector<int32_t> ids = (*tokenizer)->Encode(text, /*add_special_tokens=*/!flags.no_special);
  if (flags.json) {
    nlohmann::ordered_json j = {{"ids", ids}, {"decoded", (*tokenizer)->Decode(ids, /*skip_special_tokens=*/false)}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << absl::StrJoin(ids, " ") << "\n";
  }
  return 0;
}

}  // namespace

void AddTokenizeCommand(CLI::App& root, CommandRun* selected) {
  auto flags = std::make_shared<TokenizeFlags>();
  auto have_text = std::make_shared<CLI::Option*>(nullptr);
  CLI::App* app = AddCommand(
      root, "tokenize", "print the token ids of a text under a model's tokenizer",
      "Encodes a text with the model's tokenizer.json, as Hugging Face tokenizers does, and prints\n"
      "the ids space-separated, or with --json {\"ids\": [...], \"decoded\": \"...\"} (decoded with\n"
      "the special tokens kept). Invalid UTF-8 in the text is replaced by U+FFFD first.",
      [flags, have_text] { return RunTokenize(*flags, (*have_text)->count() > 0); }, selected);
  app->add_option("--model", flags->model, "the model: a Hugging Face folder with tokenizer.json, or a GGUF file with its vocabulary")->required();
  CLI::Option* text = app->add_option("--text", flags->text, "the text to encode");
  CLI::Option* file = app->add_option("--text-file", flags->text_file, "a file whose whole content is the text");
  text->excludes(file);
  *have_text = text;
  app->add_flag("--json", flags->json, "print {\"ids\": [...], \"decoded\": \"...\"}");
  app->add_flag("--no-special", flags->no_special, "leave out the special tokens the template adds (bos etc.)");
}

}  // namespace moe::deploy
