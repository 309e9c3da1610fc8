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

}  // namespace moe::scheduler::internal
