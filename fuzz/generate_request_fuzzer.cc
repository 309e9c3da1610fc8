// Fuzz target: the input bytes as a moeserve.v1.GenerateRequest, sent over a real gRPC stub to a
// Frontend on loopback that serves the tiny qwen3_moe fixture with a small context and small
// limits. Inputs that are not a GenerateRequest are skipped (and kept out of the corpus).
// Findings, besides crashes and hangs: a status other than OK, INVALID_ARGUMENT,
// RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED or UNAVAILABLE; an error without a message; a
// token outside the vocabulary; an OK stream without a finish reason or with more tokens than
// asked; and an engine that, once idle again, still holds KV blocks or requests.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "fuzz_util.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_executor.h"
#include "moe/scheduler/frontend.h"
#include "moeserve/v1/generation.grpc.pb.h"

namespace {

namespace pb = ::moeserve::v1;

// Small limits so that one input costs at most a couple of hundred decode steps.
constexpr int kContext = 256;
constexpr int kMaxSeqs = 4;
constexpr int kMaxQueue = 8;
constexpr auto kCallDeadline = std::chrono::seconds(2);
// How long the engine may take to free what an ended call held. A request past its deadline
// ends at the engine's next step, a few milliseconds on this model; this only bounds a hang.
constexpr auto kIdleWait = std::chrono::seconds(10);

// The model and server, started once per process and shut down at exit.
class Server {
 public:
  Server() {
    moe::runtime::ModelOptions mo;
    mo.threads = 1;
    mo.pool.threads = 1;
    mo.pool.progress = false;
    const char* testdata = std::getenv("MOE_TESTDATA_DIR");  // as the tests: set when run from a bundle
    const std::string dir = std::string(testdata != nullptr ? testdata : MOE_TESTDATA_DIR) + "/fixtures/qwen3_moe";
    auto model = moe::runtime::Model::Load(dir, mo);
    MOE_FUZZ_CHECK(model.ok(), "cannot load %s: %s", dir.c_str(), std::string(model.status().message()).c_str());
    model_ = std::move(*model);
    moe::scheduler::FrontendOptions options;
    options.listen = "127.0.0.1:0";
    options.scheduler.context = kContext;
    options.scheduler.max_seqs = kMaxSeqs;
    options.scheduler.max_queue = kMaxQueue;
    options.scheduler.max_batch_tokens = 64;
    options.placement = "fuzz";
    auto executor = moe::runtime::ModelExecutor::Create(*model_, kMaxSeqs * kContext / options.scheduler.block_size,
                                                        options.scheduler.block_size);
    MOE_FUZZ_CHECK(executor.ok(), "cannot create the KV cache: %s", std::string(executor.status().message()).c_str());
    auto frontend = moe::scheduler::Frontend::Start(*std::move(executor), options);
    MOE_FUZZ_CHECK(frontend.ok(), "cannot start the server: %s", std::string(frontend.status().message()).c_str());
    frontend_ = std::move(*frontend);
    stub_ = pb::Generation::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(frontend_->port()), grpc::InsecureChannelCredentials()));
  }
  ~Server() { frontend_->Shutdown(); }

  int vocab_size() const { return model_->spec().vocab_size; }
  pb::Generation::Stub& stub() { return *stub_; }

  bool WaitUntilIdle() {
    const auto give_up = std::chrono::steady_clock::now() + kIdleWait;
    while (std::chrono::steady_clock::now() < give_up) {
      const auto s = frontend_->engine().stats();
      if (s.blocks_used == 0 && s.running == 0 && s.waiting == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }
  moe::scheduler::SchedulerStats stats() { return frontend_->engine().stats(); }

 private:
  std::unique_ptr<moe::runtime::Model> model_;
  std::unique_ptr<moe::scheduler::Frontend> frontend_;
  std::unique_ptr<pb::Generation::Stub> stub_;
};

bool IsExpectedCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNAVAILABLE:
      return true;
    default:
      return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Server server;
  pb::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  auto reader = server.stub().Generate(&context, request);
  pb::GenerateResponse message;
  int64_t tokens = 0;
  pb::FinishReason finish = pb::FINISH_REASON_UNSPECIFIED;
  while (reader->Read(&message)) {
    for (int32_t token : message.token_ids()) {
      MOE_FUZZ_CHECK(token >= 0 && token < server.vocab_size(), "token %d outside the vocabulary of %d", token,
                     server.vocab_size());
    }
    tokens += message.token_ids_size();
    if (message.finish_reason() != pb::FINISH_REASON_UNSPECIFIED) finish = message.finish_reason();
  }
  const grpc::Status status = reader->Finish();
  // What each input got, for whoever writes corpus files (MOE_FUZZ_VERBOSE=1).
  static const bool verbose = std::getenv("MOE_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "  status %d (%s), %lld tokens, finish reason %d\n", static_cast<int>(status.error_code()),
                 status.error_message().c_str(), static_cast<long long>(tokens), static_cast<int>(finish));
  }
  MOE_FUZZ_CHECK(IsExpectedCode(status.error_code()), "status %d: %s", static_cast<int>(status.error_code()),
                 status.error_message().c_str());
  if (status.ok()) {
    const int asked = request.stopping().max_new_tokens() == 0 ? 16 : request.stopping().max_new_tokens();
    MOE_FUZZ_CHECK(finish != pb::FINISH_REASON_UNSPECIFIED, "an OK stream without a finish reason");
    MOE_FUZZ_CHECK(tokens <= asked, "%lld tokens for max_new_tokens=%d", static_cast<long long>(tokens), asked);
    MOE_FUZZ_CHECK(tokens + request.token_ids_size() <= kContext, "%lld tokens after a %d-token prompt, context %d",
                   static_cast<long long>(tokens), request.token_ids_size(), kContext);
  } else {
    MOE_FUZZ_CHECK(!status.error_message().empty(), "status %d without a message",
                   static_cast<int>(status.error_code()));
  }
  if (!server.WaitUntilIdle()) {
    const auto s = server.stats();
    MOE_FUZZ_CHECK(false, "the engine holds %d KV blocks, %d running and %d waiting requests after the call ended",
                   s.blocks_used, s.running, s.waiting);
  }
  return 0;
}
