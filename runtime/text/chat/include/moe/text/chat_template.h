// Chat templates: the Jinja source a model publishes (tokenizer_config.json's "chat_template", or
// chat_template.jinja) turned into the prompt text for a conversation.
//
// The template is rendered by jinja2 itself, in a CPython interpreter embedded in this process,
// with the environment transformers' apply_chat_template builds: an ImmutableSandboxedEnvironment
// with trim_blocks, lstrip_blocks and the loopcontrols extension; `tojson` as json.dumps with
// ensure_ascii=False; the globals `raise_exception` and `strftime_now`. Templates are written
// against exactly that environment (and its quirks), so running the same code is the one way to
// produce the same bytes; a reimplementation of Jinja would drift on the templates' corners.
//
// The interpreter starts on the first Compile (once per process) and is never finalized. A process
// without python3-jinja2 still runs: Compile answers kUnavailable and nothing else changes.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moe::text {

// What a model folder says about its prompt format (from tokenizer_config.json).
struct TokenizerConfig {
  std::string bos_token, eos_token;  // strings (AddedToken dicts' "content" too), "" when absent
  std::string chat_template;         // "" when absent
};

// Reads DIR/tokenizer_config.json. "chat_template" may be a string or a list of {name, template}
// (the one named "default" is taken); DIR/chat_template.jinja, when present, overrides it, as in
// transformers. kNotFound when there is no tokenizer_config.json; kInvalidArgument for a file that
// is not JSON or whose fields have the wrong types, naming the file and field.
absl::StatusOr<TokenizerConfig> LoadTokenizerConfig(const std::string& model_dir);

// One compiled chat template.
//
// Thread-safety: Render may be called from any number of threads at once. Each call holds the
// interpreter lock (the GIL) while it renders, so renders of all templates in the process run one
// at a time; nothing is held between calls. The object may be destroyed on any thread.
class ChatTemplate {
 public:
  // Compiles `source` once. kUnavailable when the interpreter or jinja2 cannot be loaded (the
  // message says to install python3-jinja2); kInvalidArgument with Jinja's message and line for a
  // template that does not parse.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> Compile(const std::string& source);

  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // Renders with every key of the object `variables` as a template variable (messages, tools,
  // add_generation_prompt, enable_thinking, bos_token, eos_token, ...). The values reach jinja2 as
  // json.loads makes them (dict, list, str, int, float, bool, None), as in transformers.
  // kInvalidArgument carrying Jinja's message: raise_exception's text, an undefined variable, a
  // type error inside the template ("TemplateError: Conversation roles must alternate ...
  // (chat template line 5)"); also for `variables` that is not an object.
  //
  // nlohmann::json keeps an object's keys sorted, so a template that prints a dict (`tools` through
  // `tojson`) sees them sorted, where transformers keeps the client's order: the server should use
  // RenderJsonText with the request's own text to match transformers byte for byte.
  absl::StatusOr<std::string> Render(const nlohmann::json& variables) const;

  // As Render, from the text of a JSON object, whose keys keep their order in every dict.
  absl::StatusOr<std::string> RenderJsonText(std::string_view variables_json) const;

  // For tests and `--now`: strftime_now formats this time (in the local time zone, as
  // datetime.now() does) instead of the clock's; std::nullopt goes back to the clock. Applies to
  // every template of the process.
  static void SetNowForTesting(std::optional<std::chrono::system_clock::time_point> now);

 private:
  struct PythonTemplate;  // the compiled jinja2.Template, owned; defined where Python.h is seen
  explicit ChatTemplate(std::unique_ptr<PythonTemplate> compiled);

  std::unique_ptr<PythonTemplate> compiled_;
};

}  // namespace moe::text
