// The text side of serving, shared by the OpenAI HTTP API and the gRPC API: a prompt (a string,
// or chat messages through the model's chat template) becomes token ids, and a request's
// generated ids become text deltas, cut at stop strings and split into reasoning, content and
// tool calls. The engine itself sees token ids only.
//
// A model without a tokenizer still serves token-id requests: TextModel::Load succeeds and text
// requests get kInvalidArgument saying why. A machine without python3-jinja2 (the chat
// template's engine) serves everything but chat, whose requests get kFailedPrecondition.
//
// Thread-safety: a TextModel is immutable once loaded and may be used from any thread, many at
// once; an OutputText belongs to one request and one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/text/chat_template.h"
#include "moe/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace moe::scheduler {

// Stop strings a request may give (both APIs): how many, and how long each.
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 1024;

// A model's tokenizer and its tokenizer_config (bos/eos tokens, chat template), wherever they come
// from: a Hugging Face folder's tokenizer.json and tokenizer_config.json, a GGUF file's embedded
// vocabulary and tokenizer.chat_template, or `tokenizer_dir` when given (--tokenizer DIR: its
// tokenizer.json, and its chat template where it has one, else the model's).
struct ModelTokenizer {
  std::unique_ptr<text::Tokenizer> tokenizer;  // null when the model carries none
  std::string none_reason;                     // why tokenizer is null, for clients
  std::string where;                           // where it was looked for, for the operator's log
  text::TokenizerConfig config;
};
// kInvalidArgument for a tokenizer that exists but does not load (a broken tokenizer.json, a GGUF
// vocabulary of a pre-tokenizer moeserve does not know: the message says to give --tokenizer).
absl::StatusOr<ModelTokenizer> LoadModelTokenizer(const std::string& model, const std::string& tokenizer_dir = "");

struct TextModelOptions {
  std::string model_dir;      // the model: a Hugging Face folder or a GGUF file
  std::string tokenizer_dir;  // --tokenizer: a folder whose tokenizer.json replaces the model's
  std::string model_type;   // config.json's model_type: picks the default parsers
  // A Jinja chat template file that replaces tokenizer_config.json's chat_template; "": that one.
  std::string chat_template_file;
  // Tool-call and reasoning parsers by name; "": the model type's default; "none": no parsing.
  std::string tool_call_parser;
  std::string reasoning_parser;
};

// One tool call as it streams: the first delta of a call carries its id and name, the later ones
// pieces of its JSON arguments.
struct ToolCallChunk {
  int index = 0;
  std::string id, name, arguments;
};

// What some generated tokens added to the text.
struct TextChunk {
  std::string content;
  std::string reasoning;  // what the model wrote between its reasoning markers (chat only)
  std::vector<ToolCallChunk> tool_calls;
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
  void Append(TextChunk more);
};

// A chat prompt as the OpenAI API and the gRPC API send it.
struct ChatPrompt {
  nlohmann::json messages = nlohmann::json::array();  // [{"role", "content", ...}]
  nlohmann::json tools;                               // null, or the OpenAI tools list
  nlohmann::json template_kwargs;                     // null, or extra template variables
  bool add_generation_prompt = true;
};

struct OutputTextOptions {
  std::vector<std::string> stop;  // stop strings; the text ends before the first match
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool parse_reasoning = false;   // split off the reasoning (chat)
  bool parse_tool_calls = false;  // parse tool calls out of the content (chat with tools)
  nlohmann::json tools;           // the request's tools, for the tool-call parser
  std::vector<int32_t> prompt;    // context for the first tokens' detokenization
};

class OutputText;
class VocabularyTrie;  // structured_output.h

class TextModel {
 public:
  // Reads the tokenizer and the chat template (compiled now, so a broken one shows at start).
  // kInvalidArgument for an unreadable or broken --chat-template-file or an unknown parser name;
  // a model without a tokenizer or a template, or a machine without the template engine, loads
  // and reports it through the accessors below.
  static absl::StatusOr<std::unique_ptr<TextModel>> Load(const TextModelOptions& options);
  ~TextModel();

  bool has_tokenizer() const;
  bool has_chat_template() const;
  // The parser a chat request with tools gets; "" when none, so tool calls come back as content.
  const std::string& tool_call_parser() const;
  // One line on what is missing for text or chat requests (for the server's start-up log).
  std::string Describe() const;

  // kInvalidArgument when the model has no tokenizer (the message says to send token ids).
  absl::StatusOr<std::vector<int32_t>> EncodeText(std::string_view text) const;
  // Renders the chat template and tokenizes the result. kInvalidArgument for a model without a
  // tokenizer or chat template, or a template error (Jinja's message); kFailedPrecondition when
  // this machine has no template engine.
  absl::StatusOr<std::vector<int32_t>> EncodeChat(const ChatPrompt& prompt) const;
  // The text of one token for logprobs ("token_id:N" without a tokenizer).
  std::string TokenText(int32_t id) const;
  // The token's own bytes (logprobs' `bytes`): part of a character stays its bytes, not U+FFFD.
  std::string TokenBytes(int32_t id) const;
  // Every token's bytes in a trie, for structured outputs' masks (special tokens left out); built on
  // first use. Null without a tokenizer.
  std::shared_ptr<const VocabularyTrie> vocabulary_trie() const;
  // kInvalidArgument for a tool-call parser that cannot take these tools.
  absl::StatusOr<std::unique_ptr<OutputText>> NewOutput(OutputTextOptions options) const;

  struct Impl;

 private:
  explicit TextModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One request's generated text. Feed it each step's new tokens, then Finish once.
class OutputText {
 public:
  ~OutputText();
  // The text these tokens completed; less than they hold while a stop string or a marker may
  // be starting, or a UTF-8 character is incomplete. Nothing once stopped().
  TextChunk Add(const std::vector<int32_t>& ids);
  // What was held back, at the end of the request.
  TextChunk Finish();
  // A stop string matched: the request should stop generating.
  bool stopped() const;
  // Tokens taken before the stop string completed (all of them when none matched).
  int tokens() const;
  // The parser found at least one tool call.
  bool has_tool_calls() const;

  struct Impl;
  explicit OutputText(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::scheduler
