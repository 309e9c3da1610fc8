#include "moe/scheduler/text_pipeline.h"

#include "absl/base/call_once.h"
#include "moe/scheduler/structured_output.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/runtime/checkpoint.h"
#include "moe/text/chat_template.h"
#include "moe/text/incremental_detokenizer.h"
#include "moe/text/reasoning_parser.h"
#include "moe/text/stop_matcher.h"
#include "moe/text/tokenizer.h"
#include "moe/text/tool_call_parser.h"

namespace moe::scheduler {
namespace {

// Reasoning markers by parser name. DeepSeek-R1's template opens <think> itself, so its output
// starts inside the reasoning.
struct ReasoningMarkers {
  std::string start = "<think>", end = "</think>";
  bool starts_in_reasoning = false;
};

absl::StatusOr<std::optional<ReasoningMarkers>> ReasoningMarkersFor(const std::string& name) {
  if (name.empty() || name == "none") return std::optional<ReasoningMarkers>();
  if (name == "deepseek_r1") return std::optional<ReasoningMarkers>(ReasoningMarkers{"<think>", "</think>", true});
  if (name == "qwen3" || name == "glm45" || name == "think") return std::optional<ReasoningMarkers>(ReasoningMarkers{});
  return absl::InvalidArgumentError(absl::StrCat("--reasoning-parser '", name,
                                                 "' is not known; use qwen3, deepseek_r1, glm45, think or none"));
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--chat-template-file ", path, ": cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// OpenAI's content may be a list of parts; templates expect a string, so text parts are joined.
absl::StatusOr<nlohmann::json> NormalizeMessages(const nlohmann::json& messages) {
  if (!messages.is_array() || messages.empty()) {
    return absl::InvalidArgumentError("messages: expected a non-empty list of messages");
  }
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "]: expected an object with a string 'role'"));
    }
    nlohmann::json copy = m;
    if (m.contains("content") && m["content"].is_array()) {
      std::string text;
      for (const nlohmann::json& part : m["content"]) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "messages[", i, "].content: only text parts ({\"type\": \"text\", \"text\": ...}) are supported"));
        }
        text += part["text"].get<std::string>();
      }
      copy["content"] = text;
    } else if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].content: expected a string or a list of parts"));
    }
    out.push_back(std::move(copy));
  }
  return out;
}

}  // namespace

void TextChunk::Append(TextChunk more) {
  content += more.content;
  reasoning += more.reasoning;
  for (ToolCallChunk& c : more.tool_calls) tool_calls.push_back(std::move(c));
}

struct TextModel::Impl {
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::string no_tokenizer_reason;
  std::string operator_detail;  // what Describe() adds for the operator's log: paths, the engine's error
  text::TokenizerConfig config;
  std::unique_ptr<text::ChatTemplate> chat_template;
  absl::Status chat_status;  // why chat_template is null
  std::string tool_call_parser;
  std::optional<ReasoningMarkers> reasoning;
  absl::once_flag trie_once;
  std::shared_ptr<const VocabularyTrie> trie;
};

TextModel::TextModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TextModel::~TextModel() = default;

absl::StatusOr<ModelTokenizer> LoadModelTokenizer(const std::string& model, const std::string& tokenizer_dir) {
  ModelTokenizer out;
  const bool gguf = runtime::IsGgufCheckpoint(model);
  std::optional<runtime::TokenizerSource> embedded;
  if (gguf) {
    MOE_ASSIGN_OR_RETURN(auto checkpoint, runtime::OpenCheckpoint(model));
    embedded = checkpoint->tokenizer();
    out.config.chat_template = embedded->chat_template;
    const auto token = [&](std::optional<int32_t> id) { return id ? embedded->tokens[*id] : std::string(); };
    if (embedded->embedded()) {
      out.config.bos_token = token(embedded->bos_id);
      out.config.eos_token = token(embedded->eos_id);
    }
  }
  const std::string dir = !tokenizer_dir.empty() ? tokenizer_dir : gguf ? "" : model;
  if (!dir.empty()) {
    out.where = absl::StrCat("in ", dir);
    auto tokenizer = text::Tokenizer::FromModelDir(dir);
    if (tokenizer.ok()) {
      out.tokenizer = std::move(*tokenizer);
    } else if (tokenizer.status().code() == absl::StatusCode::kNotFound && tokenizer_dir.empty()) {
      out.none_reason = "this model has no tokenizer.json";
    } else {
      return tokenizer_dir.empty() ? tokenizer.status() : core::Annotate(tokenizer.status(), "--tokenizer");
    }
    if (auto config = text::LoadTokenizerConfig(dir); config.ok()) {
      // --tokenizer's own template where it has one; a GGUF file's otherwise.
      if (config->chat_template.empty()) config->chat_template = out.config.chat_template;
      out.config = *config;
    }
    return out;
  }
  out.where = absl::StrCat("in ", model);
  if (!embedded->embedded()) {
    out.none_reason = "this GGUF model carries no vocabulary (tokenizer.ggml.*)";
    return out;
  }
  auto json = runtime::EmbeddedTokenizerJson(*embedded);
  if (!json.ok()) return core::Annotate(json.status(), model);
  MOE_ASSIGN_OR_RETURN(out.tokenizer, text::Tokenizer::FromJson(*json, absl::StrCat(model, " (tokenizer.ggml.*)")));
  return out;
}

absl::StatusOr<std::unique_ptr<TextModel>> TextModel::Load(const TextModelOptions& options) {
  auto impl = std::make_unique<Impl>();
  if (options.model_dir.empty()) {
    impl->no_tokenizer_reason = "this server was given no model folder to read a tokenizer from";
    impl->chat_status = absl::InvalidArgumentError(impl->no_tokenizer_reason);
    return std::unique_ptr<TextModel>(new TextModel(std::move(impl)));
  }
  // A broken tokenizer is the operator's to fix before serving.
  MOE_ASSIGN_OR_RETURN(ModelTokenizer loaded, LoadModelTokenizer(options.model_dir, options.tokenizer_dir));
  impl->tokenizer = std::move(loaded.tokenizer);
  if (impl->tokenizer == nullptr) {
    // Clients read the reason; the model's path is the operator's to know (Describe() names it).
    impl->no_tokenizer_reason = loaded.none_reason;
    impl->operator_detail = absl::StrCat(" (", loaded.where, ")");
  }
  impl->config = std::move(loaded.config);

  std::string source = impl->config.chat_template;
  if (!options.chat_template_file.empty()) {
    auto file = ReadFile(options.chat_template_file);
    if (!file.ok()) return file.status();
    source = *std::move(file);
  }
  if (source.empty()) {
    impl->chat_status = absl::InvalidArgumentError(
        "this model has no chat template (no chat_template in tokenizer_config.json or the GGUF file); start the "
        "server with "
        "--chat-template-file FILE, or use /v1/completions");
  } else if (auto compiled = text::ChatTemplate::Compile(source); compiled.ok()) {
    impl->chat_template = std::move(*compiled);
  } else if (compiled.status().code() == absl::StatusCode::kUnavailable) {
    impl->chat_status = absl::FailedPreconditionError(
        "chat requests need the chat-template engine (jinja2 in an embedded Python), which this server lacks; "
        "install python3-jinja2, or use /v1/completions");
    impl->operator_detail = absl::StrCat(" (", compiled.status().message(), ")");
  } else if (!options.chat_template_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--chat-template-file ", options.chat_template_file, ": ", compiled.status().message()));
  } else {
    impl->chat_status = absl::InvalidArgumentError(
        absl::StrCat("the model's chat template does not compile (", compiled.status().message(),
                     "); start the server with --chat-template-file FILE"));
  }

  impl->tool_call_parser = options.tool_call_parser.empty() ? text::DefaultToolCallParser(options.model_type)
                                                            : options.tool_call_parser;
  if (impl->tool_call_parser == "none") impl->tool_call_parser.clear();
  if (!impl->tool_call_parser.empty()) {
    // An unknown name fails now, not on the first request with tools.
    auto probe = text::MakeToolCallParser(impl->tool_call_parser, nlohmann::json::array());
    if (!probe.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tool-call-parser ", impl->tool_call_parser, ": ", probe.status().message()));
    }
  }
  const std::string reasoning = options.reasoning_parser.empty()
                                    ? text::DefaultReasoningParser(options.model_type)
                                    : options.reasoning_parser;
  auto markers = ReasoningMarkersFor(reasoning);
  if (!markers.ok()) return markers.status();
  impl->reasoning = *markers;
  return std::unique_ptr<TextModel>(new TextModel(std::move(impl)));
}

bool TextModel::has_tokenizer() const { return impl_->tokenizer != nullptr; }
bool TextModel::has_chat_template() const { return impl_->chat_template != nullptr; }
const std::string& TextModel::tool_call_parser() const { return impl_->tool_call_parser; }

std::string TextModel::Describe() const {
  if (!has_tokenizer()) return absl::StrCat("token ids only: ", impl_->no_tokenizer_reason, impl_->operator_detail);
  std::string out = absl::StrCat("tokenizer with ", impl_->tokenizer->vocab_size(), " tokens");
  if (!has_chat_template()) {
    absl::StrAppend(&out, "; no chat: ", impl_->chat_status.message(), impl_->operator_detail);
  } else {
    absl::StrAppend(&out, "; chat template; tool calls: ",
                    impl_->tool_call_parser.empty() ? "not parsed" : impl_->tool_call_parser,
                    "; reasoning: ", impl_->reasoning ? "parsed" : "not parsed");
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> TextModel::EncodeText(std::string_view text) const {
  if (!has_tokenizer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(impl_->no_tokenizer_reason, ", so it takes prompts as token ids only (a list of integers)"));
  }
  return impl_->tokenizer->Encode(text, /*add_special_tokens=*/true);
}

absl::StatusOr<std::vector<int32_t>> TextModel::EncodeChat(const ChatPrompt& prompt) const {
  if (!has_tokenizer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(impl_->no_tokenizer_reason, ", so it cannot take chat messages; send token ids to completions"));
  }
  if (!has_chat_template()) return impl_->chat_status;
  auto messages = NormalizeMessages(prompt.messages);
  if (!messages.ok()) return messages.status();
  nlohmann::json variables = nlohmann::json::object();
  // Extra variables first, so that they cannot replace the messages or tools.
  if (prompt.template_kwargs.is_object()) variables = prompt.template_kwargs;
  variables["messages"] = *std::move(messages);
  if (prompt.tools.is_array() && !prompt.tools.empty()) variables["tools"] = prompt.tools;
  if (!variables.contains("add_generation_prompt")) variables["add_generation_prompt"] = prompt.add_generation_prompt;
  variables["bos_token"] = impl_->config.bos_token;
  variables["eos_token"] = impl_->config.eos_token;
  auto rendered = impl_->chat_template->Render(variables);
  if (!rendered.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("chat template: ", rendered.status().message()));
  }
  // The template writes the special tokens itself.
  return impl_->tokenizer->Encode(*rendered, /*add_special_tokens=*/false);
}

std::string TextModel::TokenText(int32_t id) const {
  if (!has_tokenizer()) return absl::StrCat("token_id:", id);
  return impl_->tokenizer->Decode({id}, /*skip_special_tokens=*/false);
}

std::shared_ptr<const VocabularyTrie> TextModel::vocabulary_trie() const {
  if (!has_tokenizer()) return nullptr;
  absl::call_once(impl_->trie_once, [this] {
    const text::Tokenizer& tokenizer = *impl_->tokenizer;
    std::vector<std::string> bytes(static_cast<size_t>(tokenizer.vocab_size()));
    for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
      if (!tokenizer.IsSpecial(id)) bytes[id] = tokenizer.TokenBytes(id);
    }
    impl_->trie = std::make_shared<const VocabularyTrie>(std::move(bytes));
  });
  return impl_->trie;
}

std::string TextModel::TokenBytes(int32_t id) const {
  if (!has_tokenizer()) return TokenText(id);
  return impl_->tokenizer->TokenBytes(id);
}

// ids -> detokenizer -> stop strings -> reasoning -> tool calls.
struct OutputText::Impl {
  std::unique_ptr<text::IncrementalDetokenizer> detokenizer;  // null without a tokenizer
  std::unique_ptr<text::StopMatcher> stop;                    // null without stop strings
  std::unique_ptr<text::ReasoningParser> reasoning;
  std::unique_ptr<text::ToolCallParser> tools;
  int tokens = 0;
  bool stopped = false;
  bool has_tool_calls = false;

  // Text after the stop-string cut, through the parsers.
  TextChunk Parse(const std::string& text, bool finish) {
    TextChunk out;
    if (reasoning != nullptr) {
      text::TextDelta d = reasoning->Add(text);
      if (finish) {
        text::TextDelta end = reasoning->Finish();
        d.content += end.content;
        d.reasoning += end.reasoning;
      }
      out.reasoning = std::move(d.reasoning);
      out.content = std::move(d.content);
    } else {
      out.content = text;
    }
    if (tools != nullptr) {
      text::TextDelta d = tools->Add(out.content);
      if (finish) {
        text::TextDelta end = tools->Finish();
        d.content += end.content;
        for (auto& c : end.tool_calls) d.tool_calls.push_back(std::move(c));
      }
      out.content = std::move(d.content);
      for (text::ToolCallDelta& c : d.tool_calls) {
        out.tool_calls.push_back({c.index, std::move(c.id), std::move(c.name), std::move(c.arguments)});
      }
      if (!out.tool_calls.empty() || !tools->calls().empty()) has_tool_calls = true;
    }
    return out;
  }
};

OutputText::OutputText(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OutputText::~OutputText() = default;

absl::StatusOr<std::unique_ptr<OutputText>> TextModel::NewOutput(OutputTextOptions options) const {
  auto impl = std::make_unique<OutputText::Impl>();
  if (has_tokenizer()) {
    const text::Tokenizer* tokenizer = impl_->tokenizer.get();
    const bool skip = options.skip_special_tokens;
    impl->detokenizer = std::make_unique<text::IncrementalDetokenizer>(
        [tokenizer, skip](const std::vector<int32_t>& ids) { return tokenizer->Decode(ids, skip); },
        std::move(options.prompt));
  }
  // One set of checks for both APIs' stop strings.
  if (options.stop.size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop: at most ", kMaxStopStrings, " stop strings, got ", options.stop.size()));
  }
  for (const std::string& s : options.stop) {
    if (s.empty()) return absl::InvalidArgumentError("stop: a stop string may not be empty");
    if (s.size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop: a stop string has at most ", kMaxStopStringBytes, " bytes, this one ", s.size()));
    }
  }
  if (!options.stop.empty() && !has_tokenizer()) {
    return absl::InvalidArgumentError(
        "stop: stop strings need the model's tokenizer, which this server does not have; use stop_token_ids");
  }
  if (!options.stop.empty()) {
    impl->stop = std::make_unique<text::StopMatcher>(std::move(options.stop), options.include_stop_str_in_output);
  }
  if (options.parse_reasoning && impl_->reasoning) {
    const ReasoningMarkers& m = *impl_->reasoning;
    impl->reasoning = std::make_unique<text::ReasoningParser>(m.start, m.end, m.starts_in_reasoning);
  }
  if (options.parse_tool_calls && !impl_->tool_call_parser.empty()) {
    auto parser = text::MakeToolCallParser(impl_->tool_call_parser, options.tools);
    if (!parser.ok()) return absl::InvalidArgumentError(absl::StrCat("tools: ", parser.status().message()));
    impl->tools = std::move(*parser);
  }
  return std::make_unique<OutputText>(std::move(impl));
}

TextChunk OutputText::Add(const std::vector<int32_t>& ids) {
  Impl& s = *impl_;
  std::string text;
  for (int32_t id : ids) {
    if (s.stopped) break;
    ++s.tokens;
    if (s.detokenizer == nullptr) continue;
    std::string piece = s.detokenizer->Add(id);
    if (s.stop != nullptr) {
      text += s.stop->Add(piece);
      s.stopped = s.stop->stopped();
    } else {
      text += piece;
    }
  }
  return s.Parse(text, /*finish=*/false);
}

TextChunk OutputText::Finish() {
  Impl& s = *impl_;
  std::string text;
  if (s.detokenizer != nullptr && !s.stopped) {
    const std::string rest = s.detokenizer->Finish();
    text = s.stop != nullptr ? s.stop->Add(rest) : rest;
  }
  if (s.stop != nullptr) {
    text += s.stop->Finish();
    s.stopped = s.stop->stopped();
  }
  return s.Parse(text, /*finish=*/true);
}

bool OutputText::stopped() const { return impl_->stopped; }
int OutputText::tokens() const { return impl_->tokens; }
bool OutputText::has_tool_calls() const { return impl_->has_tool_calls; }

}  // namespace moe::scheduler
