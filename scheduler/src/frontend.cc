#include "moe/scheduler/frontend.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <regex>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "moe/scheduler/http_server.h"
#include "moe/scheduler/listen_address.h"
#include "moe/scheduler/metrics.h"
#include "moe/scheduler/structured_output.h"
#include "moe/scheduler/text_pipeline.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "openai_api.h"
#include "reflection_v1.h"

namespace moe::scheduler {
namespace {

namespace pb = ::moeserve::v1;

// `bytes` random bytes from the kernel, in hex: request ids nobody can guess.
std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string hex;
  for (unsigned char c : raw) absl::StrAppendFormat(&hex, "%02x", c);
  return hex;
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

pb::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return pb::FINISH_REASON_LENGTH;
    case FinishReason::kEos:
      return pb::FINISH_REASON_EOS;
    case FinishReason::kStopToken:
      return pb::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kStopString:
      return pb::FINISH_REASON_STOP_STRING;
    case FinishReason::kAborted:
    case FinishReason::kDeadline:
      return pb::FINISH_REASON_ABORTED;
    case FinishReason::kError:
      return pb::FINISH_REASON_ERROR;
  }
  return pb::FINISH_REASON_UNSPECIFIED;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr const char* kGenerationService = "moeserve.v1.Generation";

// One JSON line per request on stderr. Thread-safety: Write from any thread; lines are whole.
class RequestLog {
 public:
  explicit RequestLog(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  void Write(const nlohmann::ordered_json& line) {
    const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    absl::MutexLock lock(&mu_);
    std::cerr << text << std::flush;
  }

 private:
  const bool enabled_;
  absl::Mutex mu_;  // serializes the writes to std::cerr, so that lines do not interleave
};

double Ms(std::optional<Clock::time_point> at, Clock::time_point from) {
  return at ? std::chrono::duration<double, std::milli>(*at - from).count() : -1.0;
}

// The client API over one engine. Thread-safety: every method runs on gRPC's threads, many at
// once; the service's own state is immutable but for an atomic id counter.
class GenerationService final : public pb::Generation::Service {
 public:
  using StructuredOutputsFn = internal::OpenAiApi::StructuredOutputsFn;
  GenerationService(Engine& engine, const TextModel& text, std::string placement, RequestLog& log, const ApiKeys* keys,
                    StructuredOutputsFn structured)
      : engine_(engine),
        text_(text),
        placement_(std::move(placement)),
        log_(log),
        keys_(keys),
        structured_(std::move(structured)) {}

  // Counts a call refused before it ran, and returns its status.
  grpc::Status Rejected(grpc::Status status) {
    engine_.CountRejected(static_cast<absl::StatusCode>(status.error_code()));
    return status;
  }

  grpc::Status AuthorizeReflection(const grpc::ServerContext& context) {
    grpc::Status status = Authorize(context);
    return status.ok() ? status : Rejected(status);
  }

  // Who made a call, for Abort: the authorization it carried (the API key), "" without keys.
  std::string Caller(const grpc::ServerContext& context) const {
    if (keys_ == nullptr || keys_->empty()) return "";
    const auto& metadata = context.client_metadata();
    const auto it = metadata.find("authorization");
    return it == metadata.end() ? "" : std::string(it->second.data(), it->second.size());
  }

  // UNAUTHENTICATED unless the call carries `authorization: Bearer KEY` for a key (when keys are set).
  grpc::Status Authorize(const grpc::ServerContext& context) {
    if (keys_ == nullptr || keys_->empty()) return grpc::Status::OK;
    const auto& metadata = context.client_metadata();
    const auto it = metadata.find("authorization");
    if (it == metadata.end()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing API key: send the metadata 'authorization: Bearer KEY'");
    }
    if (!keys_->AcceptsAuthorization(std::string_view(it->second.data(), it->second.size()))) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid API key in the authorization metadata");
    }
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext* context, const pb::GenerateRequest* in,
                        grpc::ServerWriter<pb::GenerateResponse>* writer) override {
    const Clock::time_point arrival = Clock::now();
    const std::string id = in->request_id().empty() ? absl::StrCat("req-", RandomHex(16)) : in->request_id();
    Served served;
    grpc::Status status = Authorize(*context);
    const std::string owner = Caller(*context);
    if (status.ok()) {
      bool mine = false;  // a live id stays its first owner's; the engine refuses the duplicate
      {
        absl::MutexLock lock(&owners_mu_);
        mine = owners_.emplace(id, owner).second;
      }
      status = Run(context, *in, id, writer, &served);
      if (mine) {
        absl::MutexLock lock(&owners_mu_);
        owners_.erase(id);
      }
    }
    // A request the engine never took (refused, or the call's metadata was wrong) counts as rejected.
    if (!status.ok() && served.stream == nullptr) {
      engine_.CountRejected(static_cast<absl::StatusCode>(status.error_code()));
    }
    if (log_.enabled()) Log(*context, *in, id, arrival, status, served);
    return status;
  }

  grpc::Status Abort(grpc::ServerContext* context, const pb::AbortRequest* in, pb::AbortResponse*) override {
    if (grpc::Status auth = Authorize(*context); !auth.ok()) return Rejected(auth);
    {
      // Only the key that made a request may abort it; to any other the id is as unknown.
      absl::MutexLock lock(&owners_mu_);
      const auto it = owners_.find(in->request_id());
      if (it == owners_.end() || it->second != Caller(*context)) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND, "no live request '" + in->request_id() + "'");
      }
    }
    if (!engine_.Abort(in->request_id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no live request '" + in->request_id() + "'");
    }
    return grpc::Status::OK;
  }

  grpc::Status GetModelInfo(grpc::ServerContext* context, const pb::GetModelInfoRequest*, pb::ModelInfo* out) override {
    if (grpc::Status auth = Authorize(*context); !auth.ok()) return Rejected(auth);
    const runtime::ModelInfo& model = engine_.model_info();
    out->set_architecture(model.architecture);
    out->set_context_length(engine_.config().context);
    out->set_vocab_size(model.vocab_size);
    out->set_num_experts(model.num_experts);
    out->set_experts_per_token(model.experts_per_token);
    out->set_placement(placement_);
    out->set_version("0.1.0");
    out->mutable_eos_token_ids()->Add(engine_.config().eos_token_ids.begin(), engine_.config().eos_token_ids.end());
    return grpc::Status::OK;
  }

 private:
  // What Run did for a request, for the request log.
  struct Served {
    std::shared_ptr<Stream> stream;  // set once the engine took the request
    int completion_tokens = 0;
    int cached_tokens = 0;
    DraftCounts drafts;
    std::string finish_reason;
  };

  void Log(const grpc::ServerContext& context, const pb::GenerateRequest& in, const std::string& id,
           Clock::time_point arrival, const grpc::Status& status, const Served& served) {
    nlohmann::ordered_json line = {
        {"event", "request"},
        {"id", id},
        {"peer", context.peer()},
        {"status", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()))},
        {"finish_reason", served.finish_reason},
        {"prompt_tokens", in.token_ids_size()},
        {"output_tokens", served.completion_tokens},
        {"cached_tokens", served.cached_tokens}};
    if (served.drafts.drafts > 0) {
      line["spec_drafts"] = served.drafts.drafts;
      line["draft_tokens"] = served.drafts.draft_tokens;
      line["accepted_draft_tokens"] = served.drafts.accepted;
    }
    if (!status.ok()) line["error"] = status.error_message();
    if (served.stream != nullptr) {
      line["queue_ms"] = Ms(served.stream->admitted(), arrival);
      line["ttft_ms"] = Ms(served.stream->first_token(), arrival);
    }
    line["total_ms"] = Ms(Clock::now(), arrival);
    log_.Write(line);
  }

  // Validates, submits and streams one request.
  grpc::Status Run(grpc::ServerContext* context, const pb::GenerateRequest& in, const std::string& id,
                   grpc::ServerWriter<pb::GenerateResponse>* writer, Served* served) {
    Request request;
    request.id = id;
    request.logprobs = in.logprobs();
    if (absl::Status s = GrammarOf(in, &request.grammar); !s.ok()) return ToGrpc(s);
    internal::ToolChoice tools;
    if (absl::Status s = ToolsOf(in, request.grammar != nullptr, &tools); !s.ok()) return ToGrpc(s);
    if (tools.grammar != nullptr) request.grammar = tools.grammar;
    if (absl::Status s = PromptOf(in, tools, &request.prompt); !s.ok()) return ToGrpc(s);
    const pb::SamplingParams& sp = in.sampling();
    request.sampling.temperature = sp.temperature();
    request.sampling.top_p = sp.has_top_p() ? sp.top_p() : 1.0f;
    request.sampling.repetition_penalty = sp.repetition_penalty() == 0.0f ? 1.0f : sp.repetition_penalty();
    request.sampling.presence_penalty = sp.presence_penalty();
    request.sampling.frequency_penalty = sp.frequency_penalty();
    request.sampling.top_k = sp.top_k();
    request.sampling.min_p = sp.min_p();
    if (sp.has_seed()) request.sampling.seed = sp.seed();
    const pb::StoppingParams& st = in.stopping();
    request.stopping.max_new_tokens = st.max_new_tokens() == 0 ? 16 : st.max_new_tokens();
    request.stopping.min_new_tokens = st.min_new_tokens();
    request.stopping.stop_token_ids.assign(st.stop_token_ids().begin(), st.stop_token_ids().end());
    request.stopping.ignore_eos = st.ignore_eos();
    if (in.has_speculative()) {
      if (in.speculative().off()) {
        request.max_draft = 0;
      } else if (in.speculative().has_n_max()) {
        request.max_draft = in.speculative().n_max();
      }
    }
    // The call's deadline, on the scheduler's clock.
    const auto deadline = context->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      request.deadline = Clock::now() + (deadline - std::chrono::system_clock::now());
    }
    std::unique_ptr<OutputText> text;
    if (text_.has_tokenizer()) {
      OutputTextOptions text_options;
      text_options.stop.assign(in.stop().begin(), in.stop().end());
      text_options.include_stop_str_in_output = in.include_stop_str_in_output();
      text_options.skip_special_tokens = !in.has_skip_special_tokens() || in.skip_special_tokens();
      text_options.prompt = request.prompt;
      if (in.messages_size() > 0) {
        text_options.parse_reasoning = tools.enforced.empty();
        text_options.parse_tool_calls = tools.parse_tool_calls;
        if (text_options.parse_tool_calls) text_options.tools = tools.tools;
      }
      auto made = text_.NewOutput(std::move(text_options));
      if (!made.ok()) return ToGrpc(made.status());
      text = *std::move(made);
    } else if (in.stop_size() > 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "stop: stop strings need the model's tokenizer, which this server does not have; use "
                          "stopping.stop_token_ids");
    }
    auto stream = engine_.Submit(std::move(request));
    if (!stream.ok()) return ToGrpc(stream.status());
    served->stream = *stream;
    bool stopped_by_string = false;
    std::string enforced_text;  // an enforced tool_choice's output, sent as calls at the end

    int& completion = served->completion_tokens;
    bool aborted_by_client = false;
    while (true) {
      // Checked on every pass: a request that keeps producing tokens never lets Next time out.
      if (!aborted_by_client && context->IsCancelled()) {
        aborted_by_client = true;
        engine_.Abort(id);  // frees its KV blocks at the next step
      }
      Output out;
      if (!(*stream)->Next(&out, std::chrono::milliseconds(20))) continue;
      TextChunk chunk;
      if (text != nullptr && !stopped_by_string) {
        const int before = text->tokens();
        chunk = text->Add(out.new_tokens);
        // Tokens past the stop string are not the client's: cut them and their logprobs.
        const size_t taken = static_cast<size_t>(text->tokens() - before);
        out.new_tokens.resize(std::min(out.new_tokens.size(), taken));
        if (out.logprobs.size() > taken) out.logprobs.resize(taken);
        if (text->stopped()) {
          stopped_by_string = true;
          engine_.FinishByStopString(id);
        }
      } else if (stopped_by_string) {
        out.new_tokens.clear();
        out.logprobs.clear();
      }
      if (out.finished && text != nullptr) chunk.Append(text->Finish());
      std::vector<ToolCallChunk> enforced_calls;
      if (!tools.enforced.empty()) {
        // An enforced tool call goes whole in the last message, once its JSON is complete, as the
        // HTTP API sends it; cut short (max_new_tokens), what was written goes as text.
        enforced_text += chunk.content;
        chunk.content.clear();
        if (out.finished) {
          const nlohmann::json calls =
              internal::EnforcedToolCalls(tools.enforced, tools.function, absl::StrCat("call_", id, "_"), enforced_text);
          if (calls.is_null()) {
            chunk.content = enforced_text;
          } else {
            for (size_t i = 0; i < calls.size(); ++i) {
              ToolCallChunk c;
              c.index = static_cast<int>(i);
              c.id = calls[i]["id"];
              c.name = calls[i]["function"]["name"];
              c.arguments = calls[i]["function"]["arguments"];
              chunk.tool_calls.push_back(std::move(c));
            }
          }
        }
      }
      completion += static_cast<int>(out.new_tokens.size());
      if (!out.new_tokens.empty() || !chunk.empty() || out.finished) {
        pb::GenerateResponse delta;
        delta.set_request_id(id);
        delta.set_text(chunk.content);
        delta.set_reasoning(chunk.reasoning);
        for (const ToolCallChunk& c : chunk.tool_calls) {
          pb::ToolCallDelta* call = delta.add_tool_calls();
          call->set_index(c.index);
          call->set_id(c.id);
          call->set_name(c.name);
          call->set_arguments(c.arguments);
        }
        delta.mutable_token_ids()->Add(out.new_tokens.begin(), out.new_tokens.end());
        for (size_t i = 0; i < out.logprobs.size(); ++i) {
          pb::TokenLogprob* lp = delta.add_logprobs();
          lp->set_token_id(out.new_tokens[i]);
          lp->set_logprob(out.logprobs[i].logprob);
          for (const auto& [token, logprob] : out.logprobs[i].top) {
            pb::TopLogprob* alt = lp->add_top();
            alt->set_token_id(token);
            alt->set_logprob(logprob);
          }
        }
        if (out.finished) {
          FillFinal(**stream, out, completion, &delta);
          if (stopped_by_string) {
            delta.set_finish_reason(pb::FINISH_REASON_STOP_STRING);
            delta.clear_error();
          }
        }
        if (!aborted_by_client) writer->Write(delta);
      }
      if (!out.finished) continue;
      served->finish_reason = stopped_by_string ? "stop_string" : FinishReasonName(*out.finished);
      served->cached_tokens = out.cached_tokens;
      served->drafts = out.drafts;
      if (aborted_by_client) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
      if (stopped_by_string) return grpc::Status::OK;
      // The error of a failed request, a passed deadline, or a shutdown; none for an ending or an Abort.
      return ToGrpc(out.error);
    }
  }

  // The grammar of response_format (the same compiler and cache as the OpenAI API's), or none.
  absl::Status GrammarOf(const pb::GenerateRequest& in, std::shared_ptr<const TokenGrammar>* grammar) const {
    if (in.response_format().empty()) return absl::OkStatus();
    auto format = core::ParseJson(in.response_format(), "response_format");
    if (!format.ok()) return format.status();
    auto made = GrammarForResponseFormat(*format, structured_());
    if (!made.ok()) return made.status();
    *grammar = *std::move(made);
    return absl::OkStatus();
  }

  // tools and tool_choice (with messages), as the HTTP API takes them: "required" and a named
  // function bring the grammar that enforces them.
  absl::Status ToolsOf(const pb::GenerateRequest& in, bool constrained, internal::ToolChoice* out) const {
    if (in.messages_size() == 0) return absl::OkStatus();  // PromptOf refuses tools without messages
    nlohmann::json tools, choice;
    if (!in.tools().empty()) {
      auto parsed = core::ParseJson(in.tools(), "tools");
      if (!parsed.ok()) return parsed.status();
      if (!parsed->is_array()) return absl::InvalidArgumentError("tools: expected a JSON list of tools");
      tools = *std::move(parsed);
    }
    if (!in.tool_choice().empty()) {
      // JSON text; a bare word (auto, none, required) is taken as that string.
      choice = nlohmann::json::parse(in.tool_choice(), nullptr, /*allow_exceptions=*/false);
      if (choice.is_discarded()) choice = in.tool_choice();
    }
    auto resolved = internal::ResolveToolChoice(tools.is_null() ? nullptr : &tools,
                                                choice.is_null() ? nullptr : &choice, constrained, structured_());
    if (!resolved.ok()) return resolved.status();
    *out = *std::move(resolved);
    return absl::OkStatus();
  }

  // The prompt's token ids, from token_ids, text or messages (exactly one of them).
  absl::Status PromptOf(const pb::GenerateRequest& in, const internal::ToolChoice& tools,
                        std::vector<int32_t>* prompt) const {
    const int given = (in.token_ids_size() > 0) + !in.text().empty() + (in.messages_size() > 0);
    if (given > 1) {
      return absl::InvalidArgumentError("token_ids, text, messages: send exactly one of them as the prompt");
    }
    if (!in.text().empty()) {
      auto ids = text_.EncodeText(in.text());
      if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message()));
      *prompt = *std::move(ids);
      return absl::OkStatus();
    }
    if (in.messages_size() == 0) {
      prompt->assign(in.token_ids().begin(), in.token_ids().end());
      if (!in.tools().empty() || !in.tool_choice().empty() || !in.chat_template_kwargs().empty()) {
        return absl::InvalidArgumentError("tools, tool_choice, chat_template_kwargs: only with messages");
      }
      return absl::OkStatus();
    }
    ChatPrompt chat;
    for (const pb::ChatMessage& m : in.messages()) {
      nlohmann::json message = {{"role", m.role()}, {"content", m.content()}};
      if (!m.name().empty()) message["name"] = m.name();
      if (!m.tool_call_id().empty()) message["tool_call_id"] = m.tool_call_id();
      if (!m.tool_calls().empty()) {
        auto calls = core::ParseJson(m.tool_calls(), "messages.tool_calls");
        if (!calls.ok()) return calls.status();
        message["tool_calls"] = *calls;
      }
      chat.messages.push_back(std::move(message));
    }
    chat.tools = tools.tools;
    if (!in.chat_template_kwargs().empty()) {
      auto kwargs = core::ParseJsonObject(in.chat_template_kwargs(), "chat_template_kwargs");
      if (!kwargs.ok()) return kwargs.status();
      chat.template_kwargs = *std::move(kwargs);
    }
    auto ids = text_.EncodeChat(chat);
    if (!ids.ok()) {
      return absl::Status(ids.status().code(), absl::StrCat("messages: ", ids.status().message()));
    }
    *prompt = *std::move(ids);
    return absl::OkStatus();
  }

  void FillFinal(const Stream& stream, const Output& out, int completion, pb::GenerateResponse* msg) {
    msg->set_finish_reason(ToProto(*out.finished));
    if (!out.error.ok()) msg->set_error(std::string(out.error.message()));
    msg->mutable_usage()->set_prompt_tokens(out.prompt_tokens);
    msg->mutable_usage()->set_completion_tokens(completion);
    msg->mutable_usage()->set_cached_tokens(out.cached_tokens);
    msg->mutable_usage()->set_spec_drafts(out.drafts.drafts);
    msg->mutable_usage()->set_draft_tokens(out.drafts.draft_tokens);
    msg->mutable_usage()->set_accepted_draft_tokens(out.drafts.accepted);
    pb::Timings* t = msg->mutable_timings();
    const Clock::time_point now = Clock::now();
    if (auto admitted = stream.admitted()) t->set_queue_seconds(Seconds(*admitted - stream.arrival()));
    if (auto first = stream.first_token()) {
      t->set_first_token_seconds(Seconds(*first - stream.arrival()));
      const double decode = Seconds(now - *first);
      if (completion > 1 && decode > 0) t->set_decode_tokens_per_second((completion - 1) / decode);
    }
  }

  Engine& engine_;
  const TextModel& text_;
  const std::string placement_;
  RequestLog& log_;
  const ApiKeys* keys_;  // not owned; null: no keys asked for
  const StructuredOutputsFn structured_;
  absl::Mutex owners_mu_;
  // Live requests' ids and the authorization that made each.
  absl::flat_hash_map<std::string, std::string> owners_ ABSL_GUARDED_BY(owners_mu_);
};

}  // namespace

// Thread-safety: the fields are the owner thread's (see Frontend), except what /metrics reads,
// which is guarded by metrics_mu.
class Frontend::Impl {
 public:
  FrontendOptions options;
  std::unique_ptr<RequestLog> log;
  std::unique_ptr<HttpServer> http;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<TextModel> text;
  std::unique_ptr<GenerationService> service;
  std::unique_ptr<internal::ReflectionV1Service> reflection_v1;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  // What /metrics reads: the engine while it serves, nothing before or after.
  absl::Mutex metrics_mu;
  Engine* metrics_engine ABSL_GUARDED_BY(metrics_mu) = nullptr;
  // What the OpenAI routes serve: set by Serve, cleared by Shutdown. A streamed response holds
  // its own reference until it ends.
  std::shared_ptr<internal::OpenAiApi> openai ABSL_GUARDED_BY(metrics_mu);

  std::function<std::string()> extra_metrics ABSL_GUARDED_BY(metrics_mu);

  // Structured outputs for both APIs, with one grammar cache: built on the first request that asks
  // (the trie of a large vocabulary takes a moment), after Serve set text and engine; null
  // without a tokenizer. Any thread.
  StructuredOutputs* Structured() {
    absl::call_once(structured_once, [this] {
      if (std::shared_ptr<const VocabularyTrie> trie = text->vocabulary_trie()) {
        structured = std::make_unique<StructuredOutputs>(std::move(trie), engine->model_info().vocab_size,
                                                         engine->config().eos_token_ids);
      }
    });
    return structured.get();
  }
  absl::once_flag structured_once;
  std::unique_ptr<StructuredOutputs> structured;  // written once, under structured_once

  std::string RenderMetrics() {
    absl::MutexLock lock(&metrics_mu);
    std::string text = metrics_engine != nullptr ? metrics_engine->RenderMetrics() : std::string();
    if (extra_metrics) text += extra_metrics();
    return text;
  }

  // The API, or null after a 503 saying why there is none.
  std::shared_ptr<internal::OpenAiApi> OpenAi(httplib::Response& response) {
    std::shared_ptr<internal::OpenAiApi> api;
    {
      absl::MutexLock lock(&metrics_mu);
      api = openai;
    }
    const ServingState state = http->state();
    if (api != nullptr && state == ServingState::kServing) return api;
    if (api != nullptr && state == ServingState::kRestarting) return api;  // requests queue meanwhile
    SetJsonError(response, 503,
                 state == ServingState::kLoading ? "the model is loading; retry when /ready answers 200"
                                                 : "the server is shutting down",
                 "server_error");
    return nullptr;
  }

  absl::Status AddOpenAiRoutes();
};

absl::Status Frontend::Impl::AddOpenAiRoutes() {
  using Method = void (internal::OpenAiApi::*)(const httplib::Request&, httplib::Response&);
  const std::tuple<const char*, const char*, Method> routes[] = {
      {"GET", "/v1/models", &internal::OpenAiApi::ListModels},
      {"GET", "/v1/models/(.+)", &internal::OpenAiApi::GetModel},
      {"POST", "/v1/completions", &internal::OpenAiApi::Completions},
      {"POST", "/v1/chat/completions", &internal::OpenAiApi::ChatCompletions}};
  for (const auto& [method, pattern, handler] : routes) {
    MOE_RETURN_IF_ERROR(http->Handle(
        method, pattern, [this, handler = handler](const httplib::Request& request, httplib::Response& response) {
          if (auto api = OpenAi(response)) ((*api).*handler)(request, response);
        }));
  }
  return absl::OkStatus();
}

namespace {

// The model's name in the OpenAI API.
std::string ModelId(const FrontendOptions& options) {
  if (!options.served_model_name.empty()) return options.served_model_name;
  std::string dir = options.model_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  std::string base = slash == std::string::npos ? dir : dir.substr(slash + 1);
  // A GGUF file by its name without the extension (and a split set's part suffix).
  if (base.size() > 5 && base.ends_with(".gguf")) {
    base.resize(base.size() - 5);
    static const std::regex kPart(R"(-\d{5}-of-\d{5}$)");
    base = std::regex_replace(base, kPart, "");
  }
  return base.empty() ? "default" : base;
}

}  // namespace

Frontend::Frontend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Frontend::~Frontend() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Frontend>> Frontend::Create(const FrontendOptions& options) {
  if (auto address = ParseListenAddress(options.listen); !address.ok()) return address.status();
  // Any TLS file named, even one alone, is checked now: before the model loads.
  if (absl::Status s = CheckTlsFiles(options.tls); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->log = std::make_unique<RequestLog>(options.request_log);
  if (!options.http_listen.empty()) {
    HttpServerOptions http;
    http.listen = options.http_listen;
    http.tls = options.tls;
    http.api_keys = options.api_keys.get();
    http.protect_metrics = options.protect_metrics;
    http.allowed_origins = options.allowed_origins;
    http.max_request_bytes = static_cast<size_t>(options.max_request_bytes);
    Impl* raw = impl.get();
    http.render_metrics = [raw] { return raw->RenderMetrics(); };  // /health: 503 "loading" until Serve
    impl->http = std::make_unique<HttpServer>();
    if (absl::Status routes = impl->AddOpenAiRoutes(); !routes.ok()) return routes;
    if (absl::Status started = impl->http->Start(http); !started.ok()) return started;
  }
  return std::unique_ptr<Frontend>(new Frontend(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Frontend>> Frontend::Start(std::unique_ptr<runtime::Executor> executor,
                                                          const FrontendOptions& options) {
  auto frontend = Create(options);
  if (!frontend.ok()) return frontend.status();
  if (absl::Status s = (*frontend)->Serve(std::move(executor)); !s.ok()) return s;
  return frontend;
}

void Frontend::set_scheduler(const SchedulerConfig& scheduler, std::string placement) {
  impl_->options.scheduler = scheduler;
  impl_->options.placement = std::move(placement);
}

absl::Status Frontend::Serve(std::unique_ptr<runtime::Executor> executor) {
  Impl& impl = *impl_;
  const FrontendOptions& options = impl.options;
  auto credentials = GrpcServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  if (executor == nullptr) return absl::InvalidArgumentError("Frontend::Serve: null executor");
  TextModelOptions text_options;
  text_options.model_dir = options.model_dir;
  text_options.model_type = executor->model_info().architecture;
  text_options.chat_template_file = options.chat_template_file;
  text_options.tokenizer_dir = options.tokenizer_dir;
  text_options.tool_call_parser = options.tool_call_parser;
  text_options.reasoning_parser = options.reasoning_parser;
  auto text = TextModel::Load(text_options);
  if (!text.ok()) return text.status();
  impl.text = std::move(*text);
  auto engine = Engine::Start(std::move(executor), options.scheduler);
  if (!engine.ok()) return engine.status();
  impl.engine = std::move(*engine);
  Impl* raw = &impl;
  const GenerationService::StructuredOutputsFn structured = [raw] { return raw->Structured(); };
  impl.service = std::make_unique<GenerationService>(*impl.engine, *impl.text, options.placement, *impl.log,
                                                     options.api_keys.get(), structured);
  // Reflection follows the API keys: with keys, v1 asks for one as every other call does, and
  // gRPC's own v1alpha (which cannot be asked to) is not served.
  const bool keyed = options.api_keys != nullptr && !options.api_keys->empty();
  std::vector<std::string> listed = {kGenerationService, "grpc.health.v1.Health",
                                     "grpc.reflection.v1.ServerReflection"};
  if (!keyed) listed.push_back("grpc.reflection.v1alpha.ServerReflection");
  impl.reflection_v1 = std::make_unique<internal::ReflectionV1Service>(
      std::move(listed), [service = impl.service.get()](const grpc::ServerContext& context) {
        return service->AuthorizeReflection(context);
      });
  grpc::EnableDefaultHealthCheckService(true);
  if (!keyed) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // No port sharing: a second server on a port in use must fail, not split the clients.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(options.max_request_bytes, INT32_MAX)));
  builder.AddListeningPort(options.listen, *credentials, &impl.port);
  builder.RegisterService(impl.service.get());
  builder.RegisterService(impl.reflection_v1.get());
  impl.server = builder.BuildAndStart();
  if (impl.server == nullptr || impl.port == 0) {
    if (impl.server != nullptr) impl.server->Shutdown();
    impl.server.reset();
    // No handler ever saw the engine: it goes now, and the executor (with what it holds) with it.
    impl.engine->Stop();
    impl.service.reset();
    impl.engine.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen, ": the address is in use or not available here"));
  }
  grpc::HealthCheckServiceInterface* health = impl.server->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kGenerationService, true);
  {
    absl::MutexLock lock(&impl.metrics_mu);
    impl.metrics_engine = impl.engine.get();
    internal::OpenAiApi::RequestLogFn log;
    if (impl.log->enabled())
      log = [request_log = impl.log.get()](const nlohmann::ordered_json& line) { request_log->Write(line); };
    impl.openai =
        std::make_shared<internal::OpenAiApi>(*impl.engine, *impl.text, ModelId(options), structured, std::move(log));
  }
  if (impl.http != nullptr) impl.http->set_state(ServingState::kServing);
  return absl::OkStatus();
}

int Frontend::http_port() const { return impl_->http != nullptr ? impl_->http->port() : 0; }

int Frontend::port() const { return impl_->port; }
StructuredOutputs* Frontend::structured_outputs() { return impl_->text != nullptr ? impl_->Structured() : nullptr; }
std::string Frontend::DescribeText() const { return impl_->text != nullptr ? impl_->text->Describe() : ""; }
Engine& Frontend::engine() { return *impl_->engine; }

void Frontend::SetWorkersReady(bool ready) {
  if (impl_ == nullptr || impl_->server == nullptr) return;
  grpc::HealthCheckServiceInterface* health = impl_->server->GetHealthCheckService();
  health->SetServingStatus(ready);
  health->SetServingStatus(kGenerationService, ready);
  if (impl_->http != nullptr && impl_->http->state() != ServingState::kDraining) {
    impl_->http->set_state(ready ? ServingState::kServing : ServingState::kRestarting);
  }
}

void Frontend::set_extra_metrics(std::function<std::string()> render) {
  absl::MutexLock lock(&impl_->metrics_mu);
  impl_->extra_metrics = std::move(render);
}

int Frontend::Drain(std::chrono::milliseconds grace, const std::function<bool()>& cut_short) {
  if (impl_ == nullptr) return 0;
  if (impl_->http != nullptr) impl_->http->set_state(ServingState::kDraining);
  if (impl_->server == nullptr) {
    Shutdown();
    return 0;
  }
  grpc::HealthCheckServiceInterface* health = impl_->server->GetHealthCheckService();
  health->SetServingStatus(false);
  health->SetServingStatus(kGenerationService, false);
  impl_->engine->StopAccepting();
  // In slices, so that `cut_short` (a second SIGTERM) ends the wait within one.
  const Clock::time_point deadline = Clock::now() + grace;
  while (!impl_->engine->WaitIdle(std::min(deadline, Clock::now() + std::chrono::milliseconds(50))) &&
         Clock::now() < deadline && !(cut_short && cut_short())) {
  }
  const int cut = impl_->engine->Stop();
  Shutdown();
  return cut;
}

void Frontend::Shutdown() {
  if (impl_ == nullptr) return;
  {
    absl::MutexLock lock(&impl_->metrics_mu);
    impl_->metrics_engine = nullptr;
    impl_->openai.reset();
  }
  // The engine ends the live requests (UNAVAILABLE "server shutting down") and refuses new ones,
  // so that HTTP handlers waiting on them return and the HTTP server can stop; then the gRPC
  // server stops, its handlers done; the engine goes last, as handlers hold it.
  if (impl_->engine != nullptr) impl_->engine->Stop();
  if (impl_->http != nullptr) impl_->http->Stop();
  if (impl_->server == nullptr) return;
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  impl_->server.reset();
  impl_->engine.reset();
}

void Frontend::Wait() {
  if (impl_->server != nullptr) impl_->server->Wait();
}

}  // namespace moe::scheduler
