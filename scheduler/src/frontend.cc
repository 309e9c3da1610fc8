#include "moe/scheduler/frontend.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "moe/runtime/model_spec.h"
#include "moe/scheduler/http_server.h"
#include "moe/scheduler/metrics.h"
#include "moeserve/v1/generation.grpc.pb.h"

namespace moe::scheduler {
namespace {

namespace pb = ::moeserve::v1;

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

pb::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return pb::FINISH_REASON_LENGTH;
    case FinishReason::kEos: return pb::FINISH_REASON_EOS;
    case FinishReason::kStopToken: return pb::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kAborted:
    case FinishReason::kDeadline: return pb::FINISH_REASON_ABORTED;
    case FinishReason::kError: return pb::FINISH_REASON_ERROR;
  }
  return pb::FINISH_REASON_UNSPECIFIED;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class GenerationService final : public pb::Generation::Service {
 public:
  GenerationService(Engine& engine, const runtime::ModelSpec& spec, std::string placement)
      : engine_(engine), spec_(spec), placement_(std::move(placement)) {}

  grpc::Status Generate(grpc::ServerContext* context, const pb::GenerateRequest* in,
                        grpc::ServerWriter<pb::GenerateResponse>* writer) override {
    if (!in->text().empty() || in->messages_size() > 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          std::string(in->text().empty() ? "messages" : "text") +
                              ": text and chat prompts need the tokenizer, which this server does not have yet; "
                              "send token_ids");
    }
    Request request;
    request.id = in->request_id().empty() ? absl::StrCat("req-", next_id_++) : in->request_id();
    request.logprobs = in->logprobs();
    request.prompt.assign(in->token_ids().begin(), in->token_ids().end());
    const pb::SamplingParams& sp = in->sampling();
    request.sampling.temperature = sp.temperature();
    request.sampling.top_p = sp.has_top_p() ? sp.top_p() : 1.0f;
    request.sampling.repetition_penalty = sp.repetition_penalty() == 0.0f ? 1.0f : sp.repetition_penalty();
    request.sampling.presence_penalty = sp.presence_penalty();
    request.sampling.frequency_penalty = sp.frequency_penalty();
    request.sampling.top_k = sp.top_k();
    request.sampling.min_p = sp.min_p();
    if (sp.has_seed()) request.sampling.seed = sp.seed();
    const pb::StoppingParams& st = in->stopping();
    request.stopping.max_new_tokens = st.max_new_tokens() == 0 ? 16 : st.max_new_tokens();
    request.stopping.min_new_tokens = st.min_new_tokens();
    request.stopping.stop_token_ids.assign(st.stop_token_ids().begin(), st.stop_token_ids().end());
    request.stopping.ignore_eos = st.ignore_eos();
    // The call's deadline, on the scheduler's clock.
    const auto deadline = context->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      request.deadline = Clock::now() + (deadline - std::chrono::system_clock::now());
    }
    const std::string id = request.id;
    auto stream = engine_.Submit(std::move(request));
    if (!stream.ok()) return ToGrpc(stream.status());

    int completion = 0;
    bool aborted_by_client = false;
    while (true) {
      // Checked on every pass: a request that keeps producing tokens never lets Next time out.
      if (!aborted_by_client && context->IsCancelled()) {
        aborted_by_client = true;
        engine_.Abort(id);  // frees its KV blocks at the next step
      }
      Output out;
      if (!(*stream)->Next(&out, std::chrono::milliseconds(20))) continue;
      completion += static_cast<int>(out.new_tokens.size());
      if (!out.new_tokens.empty() || out.finished) {
        pb::GenerateResponse delta;
        delta.set_request_id(id);
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
        if (out.finished) FillFinal(**stream, out, completion, &delta);
        if (!aborted_by_client) writer->Write(delta);
      }
      if (!out.finished) continue;
      if (aborted_by_client) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
      if (*out.finished == FinishReason::kDeadline) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded");
      }
      if (*out.finished == FinishReason::kError) return ToGrpc(out.error);
      return grpc::Status::OK;
    }
  }

  grpc::Status Abort(grpc::ServerContext*, const pb::AbortRequest* in, pb::AbortResponse*) override {
    if (!engine_.Abort(in->request_id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no live request '" + in->request_id() + "'");
    }
    return grpc::Status::OK;
  }

  grpc::Status GetModelInfo(grpc::ServerContext*, const pb::GetModelInfoRequest*, pb::ModelInfo* out) override {
    out->set_architecture(spec_.model_type);
    out->set_context_length(engine_.config().context);
    out->set_vocab_size(spec_.vocab_size);
    out->set_num_experts(spec_.routing.num_experts);
    out->set_experts_per_token(spec_.routing.top_k);
    out->set_placement(placement_);
    out->set_version("0.1.0");
    return grpc::Status::OK;
  }

 private:
  void FillFinal(const Stream& stream, const Output& out, int completion, pb::GenerateResponse* msg) {
    msg->set_finish_reason(ToProto(*out.finished));
    if (!out.error.ok()) msg->set_error(std::string(out.error.message()));
    msg->mutable_usage()->set_prompt_tokens(out.prompt_tokens);
    msg->mutable_usage()->set_completion_tokens(completion);
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
  const runtime::ModelSpec& spec_;
  const std::string placement_;
  std::atomic<int64_t> next_id_{1};
};

}  // namespace

class Frontend::Impl {
 public:
  std::unique_ptr<Engine> engine;
  std::unique_ptr<GenerationService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<HttpServer> metrics;
  int port = 0;
};

Frontend::Frontend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Frontend::~Frontend() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Frontend>> Frontend::Start(runtime::Model& model, const FrontendOptions& options) {
  auto impl = std::make_unique<Impl>();
  auto engine = Engine::Start(model, options.scheduler);
  if (!engine.ok()) return engine.status();
  impl->engine = std::move(*engine);
  impl->service = std::make_unique<GenerationService>(*impl->engine, model.spec(), options.placement);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &impl->port);
  builder.RegisterService(impl->service.get());
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, " (address in use or invalid?)"));
  }
  if (!options.metrics_listen.empty()) {
    Engine* engine_ptr = impl->engine.get();
    HttpServerOptions http;
    http.listen = options.metrics_listen;
    http.render_metrics = [engine_ptr] { return engine_ptr->RenderMetrics(); };
    http.initial_state = ServingState::kServing;
    impl->metrics = std::make_unique<HttpServer>();
    if (absl::Status started = impl->metrics->Start(http); !started.ok()) {
      impl->server->Shutdown();
      return started;
    }
  }
  return std::unique_ptr<Frontend>(new Frontend(std::move(impl)));
}

int Frontend::metrics_port() const { return impl_->metrics != nullptr ? impl_->metrics->port() : 0; }

int Frontend::port() const { return impl_->port; }
Engine& Frontend::engine() { return *impl_->engine; }

void Frontend::Shutdown() {
  if (impl_ == nullptr || impl_->server == nullptr) return;
  // The engine ends the live streams (as aborted) and refuses new ones; then the servers stop,
  // their handlers done; the engine goes last, as handlers hold it until then.
  impl_->engine->Stop();
  impl_->metrics.reset();
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  impl_->server.reset();
  impl_->engine.reset();
}

void Frontend::Wait() {
  if (impl_->server != nullptr) impl_->server->Wait();
}

}  // namespace moe::scheduler
