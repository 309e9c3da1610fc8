// The OpenAI-compatible HTTP API over one engine: GET /v1/models, POST /v1/completions and
// POST /v1/chat/completions, whole or streamed as server-sent events, with OpenAI's error shape.
// Prompts and outputs go through the TextModel; the engine sees token ids only.
//
// Thread-safety: the handlers run on the HTTP server's threads, many at once; the API's own state
// is immutable but for an atomic id counter. The engine and the text model must outlive every
// request: the frontend stops the engine (which ends the live ones) before the HTTP server.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

#include "moe/scheduler/engine.h"
#include "moe/scheduler/structured_output.h"
#include "moe/scheduler/text_pipeline.h"

namespace moe::scheduler::internal {

class OpenAiApi : public std::enable_shared_from_this<OpenAiApi> {
 public:
  // One JSON line per request (the frontend's request log), or empty for none.
  using RequestLogFn = std::function<void(const nlohmann::ordered_json& line)>;
  // Structured outputs over the model's vocabulary (one grammar cache for both APIs), or null when
  // the model has no tokenizer; called on the handlers' threads.
  using StructuredOutputsFn = std::function<StructuredOutputs*()>;
  // `model_id` is the one model name requests may ask for.
  OpenAiApi(Engine& engine, const TextModel& text, std::string model_id, StructuredOutputsFn structured,
            RequestLogFn log = nullptr);

  void ListModels(const httplib::Request& request, httplib::Response& response);
  void GetModel(const httplib::Request& request, httplib::Response& response);
  void Completions(const httplib::Request& request, httplib::Response& response);
  void ChatCompletions(const httplib::Request& request, httplib::Response& response);

  const std::string& model_id() const { return model_id_; }

 private:
  enum class Kind { kCompletion, kChat };
  void Generate(Kind kind, const httplib::Request& request, httplib::Response& response);
  nlohmann::json ModelCard() const;

  Engine& engine_;
  const TextModel& text_;
  const std::string model_id_;
  const std::string id_prefix_;  // random per process, so ids differ across restarts
  const RequestLogFn log_;
  std::atomic<int64_t> next_id_{1};
  const StructuredOutputsFn structured_;
};

// tool_choice over tools, OpenAI's values, as both APIs take them.
struct ToolChoice {
  nlohmann::json tools;           // the tools the chat template sees; null: none ("none")
  bool parse_tool_calls = false;  // the server's parser looks for calls in the output text
  // "required" and a named function are enforced by `grammar`: the output is JSON (a list of
  // {"name", "parameters"}, or the named function's arguments) that EnforcedToolCalls turns into calls.
  std::string enforced;  // "", "required" or "named"
  std::string function;  // with "named"
  std::shared_ptr<const TokenGrammar> grammar;
};

// `tools` and `tool_choice` as the request's JSON (null pointers: absent); `constrained`: the
// request has another grammar (response_format). INVALID_ARGUMENT's message starts with the field
// at fault ("tools..." or "tool_choice: ...").
absl::StatusOr<ToolChoice> ResolveToolChoice(const nlohmann::json* tools, const nlohmann::json* tool_choice,
                                             bool constrained, StructuredOutputs* structured);

// The calls an enforced tool choice's output holds, as OpenAI's message.tool_calls (ids
// `id_prefix` + index), or null when the output is not whole (cut short).
nlohmann::json EnforcedToolCalls(const std::string& enforced, const std::string& function,
                                 const std::string& id_prefix, const std::string& text);

}  // namespace moe::scheduler::internal
