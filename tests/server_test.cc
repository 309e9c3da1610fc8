// The gRPC server as clients see it: a real server on loopback, real client stubs.
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <numeric>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/generate.h"
#include "moe/runtime/model_executor.h"
#include "moe/runtime/sampler.h"
#include "moe/scheduler/frontend.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "grpc/reflection/v1/reflection.pb.h"
#include <google/protobuf/descriptor.pb.h>
#include <future>
#include "test_util.h"

namespace moe {
namespace {

namespace pb = ::moeserve::v1;
using ::testing::HasSubstr;

class ServerTest : public ::testing::Test {
 protected:
  void StartServer(int max_seqs = 16, int max_queue = 64, const std::string& arch = "qwen3_moe") {
    runtime::ModelOptions mo;
    mo.pool.progress = false;
    mo.threads = 2;
    mo.pool.threads = 2;
    auto model = runtime::Model::Load(testing::FixtureDir(arch), mo);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    // The server's model runs one forward at a time: the expected tokens come from another copy.
    auto reference = runtime::Model::Load(testing::FixtureDir(arch), mo);
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = std::move(*reference);
    scheduler::FrontendOptions options;
    options.listen = "127.0.0.1:0";
    options.scheduler.max_seqs = max_seqs;
    options.scheduler.max_queue = max_queue;
    options.scheduler.max_batch_tokens = 64;
    options.scheduler.context = 2048;
    options.placement = "test";
    options.http_listen = "127.0.0.1:0";
    auto executor = runtime::ModelExecutor::Create(*model_, /*num_blocks=*/2048);
    ASSERT_TRUE(executor.ok()) << executor.status();
    auto frontend = scheduler::Frontend::Start(*std::move(executor), options);
    ASSERT_TRUE(frontend.ok()) << frontend.status();
    frontend_ = std::move(*frontend);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(frontend_->port()), grpc::InsecureChannelCredentials());
    stub_ = pb::Generation::NewStub(channel_);
    const nlohmann::json golden = testing::LoadGolden(arch);
    for (const auto& c : golden["cases"]) prompts_.push_back(c["prompt_ids"]);
  }
  void TearDown() override {
    if (frontend_) frontend_->Shutdown();
  }

  pb::GenerateRequest Make(const std::vector<int32_t>& prompt, int n, const std::string& id = "") {
    pb::GenerateRequest r;
    r.set_request_id(id);
    r.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    r.mutable_stopping()->set_max_new_tokens(n);
    r.mutable_stopping()->set_ignore_eos(true);
    return r;
  }

  struct Result {
    grpc::Status status;
    std::vector<int32_t> tokens;
    pb::GenerateResponse last;
  };
  // Runs one stream to its end; `cancel_after` tokens (if >= 0) cancels it from the client.
  Result Run(const pb::GenerateRequest& request, int cancel_after = -1,
             std::optional<std::chrono::milliseconds> deadline = std::nullopt) {
    grpc::ClientContext ctx;
    if (deadline) ctx.set_deadline(std::chrono::system_clock::now() + *deadline);
    Result result;
    auto reader = stub_->Generate(&ctx, request);
    pb::GenerateResponse msg;
    while (reader->Read(&msg)) {
      result.tokens.insert(result.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
      result.last = msg;
      if (cancel_after >= 0 && static_cast<int>(result.tokens.size()) >= cancel_after) ctx.TryCancel();
    }
    result.status = reader->Finish();
    return result;
  }

  // The KV blocks of ended requests are freed at the engine's next step: wait for it.
  bool WaitForNoBlocksInUse() {
    for (int i = 0; i < 200; ++i) {
      const auto s = frontend_->engine().stats();
      if (s.blocks_used == 0 && s.running == 0 && s.waiting == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  // GET /metrics over a plain socket; the value of one sample line.
  double Metric(const std::string& name) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(frontend_->http_port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string get = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    EXPECT_GT(::send(fd, get.data(), get.size(), 0), 0);
    std::string body;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) body.append(buf, n);
    ::close(fd);
    EXPECT_THAT(body, HasSubstr("200 OK"));
    const size_t at = body.find("\n" + name + " ");
    if (at == std::string::npos) return -1;
    return std::stod(body.substr(at + name.size() + 2));
  }

  std::vector<int32_t> Alone(const std::vector<int32_t>& prompt, int n) {
    runtime::GenerateOptions o;
    o.max_new_tokens = n;
    o.stop_at_eos = false;
    auto r = runtime::Generate(*reference_, prompt, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->generated_ids : std::vector<int32_t>{};
  }

  std::unique_ptr<runtime::Model> model_, reference_;
  std::unique_ptr<scheduler::Frontend> frontend_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Generation::Stub> stub_;
  std::vector<std::vector<int32_t>> prompts_;
};

class ServerArchTest : public ServerTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(ServerArchTest, ConcurrentGreedyStreamsMatchGenerate) {
  StartServer(16, 64, GetParam());
  std::vector<Result> results(prompts_.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    clients.emplace_back([&, i] { results[i] = Run(Make(prompts_[i], 12)); });
  }
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < prompts_.size(); ++i) {
    ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens, Alone(prompts_[i], 12)) << "prompt " << i;
    EXPECT_EQ(results[i].last.finish_reason(), pb::FINISH_REASON_LENGTH);
    EXPECT_EQ(results[i].last.usage().cached_tokens(), 0);
    EXPECT_EQ(results[i].last.usage().prompt_tokens(), static_cast<int>(prompts_[i].size()));
    EXPECT_EQ(results[i].last.usage().completion_tokens(), 12);
    EXPECT_GT(results[i].last.timings().first_token_seconds(), 0.0);
  }
  EXPECT_TRUE(WaitForNoBlocksInUse());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ServerArchTest,
                         ::testing::Values("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"),
                         [](const auto& info) { return info.param; });

TEST_F(ServerTest, CancellingAStreamFreesItsBlocksWhileOthersFinish) {
  StartServer();
  Result other;
  std::thread keep([&] { other = Run(Make(prompts_[2], 40)); });
  Result cancelled = Run(Make(prompts_[3], 1500), /*cancel_after=*/3);
  keep.join();
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(cancelled.tokens.size(), 1500u);
  ASSERT_TRUE(other.status.ok()) << other.status.error_message();
  EXPECT_EQ(other.tokens, Alone(prompts_[2], 40));
  EXPECT_TRUE(WaitForNoBlocksInUse());
  // The metrics endpoint shows it too.
  EXPECT_EQ(Metric("moeserve_kv_blocks_used"), 0);
  EXPECT_EQ(Metric("moeserve_kv_blocks_free"), 2048);
  EXPECT_EQ(Metric("moeserve_requests_aborted_total"), 1);
  EXPECT_EQ(Metric("moeserve_requests_finished_total"), 1);
  EXPECT_GE(Metric("moeserve_generated_tokens_total"), 43);
  EXPECT_EQ(Metric("moeserve_time_to_first_token_seconds_count"), 2);
}

TEST_F(ServerTest, AFullQueueAnswersResourceExhaustedAtOnce) {
  StartServer(/*max_seqs=*/1, /*max_queue=*/1);
  grpc::ClientContext running_ctx;
  auto running = stub_->Generate(&running_ctx, Make(prompts_[0], 1500));
  pb::GenerateResponse first;
  ASSERT_TRUE(running->Read(&first));  // running: the only slot
  grpc::ClientContext queued_ctx;
  auto queued = stub_->Generate(&queued_ctx, Make(prompts_[1], 5));
  for (int i = 0; i < 500 && frontend_->engine().stats().waiting < 1; ++i) {  // until it is queued
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(frontend_->engine().stats().waiting, 1);
  const auto start = std::chrono::steady_clock::now();
  Result refused = Run(Make(prompts_[2], 5));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("queue full"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  running_ctx.TryCancel();
  pb::GenerateResponse msg;
  while (running->Read(&msg)) {
  }
  (void)running->Finish();
  int queued_tokens = 0;
  while (queued->Read(&msg)) queued_tokens += msg.token_ids_size();
  EXPECT_TRUE(queued->Finish().ok());
  EXPECT_EQ(queued_tokens, 5);
  EXPECT_TRUE(WaitForNoBlocksInUse());
}

TEST_F(ServerTest, ADeadlineEndsTheRequestAndFreesItsBlocks) {
  StartServer();
  Result late = Run(Make(prompts_[0], 2000), -1, std::chrono::milliseconds(150));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(WaitForNoBlocksInUse());
  EXPECT_TRUE(Run(Make(prompts_[4], 3)).status.ok());  // and the server goes on
}

TEST_F(ServerTest, InvalidRequestsNameTheField) {
  StartServer();
  struct Case {
    pb::GenerateRequest request;
    const char* message;
  };
  std::vector<Case> cases;
  cases.push_back({Make({}, 4), "token_ids: empty prompt"});
  cases.push_back({Make({1, 2, 999}, 4), "token_ids[2]: 999 is outside the vocabulary [0, 512)"});
  cases.push_back({Make({1, 2}, 4000), "exceeds the context of 2048"});
  pb::GenerateRequest temp = Make({1, 2}, 4);
  temp.mutable_sampling()->set_temperature(-1);
  cases.push_back({temp, "sampling.temperature"});
  pb::GenerateRequest nan_temp = Make({1, 2}, 4);
  nan_temp.mutable_sampling()->set_temperature(std::nanf(""));
  cases.push_back({nan_temp, "sampling.temperature"});
  pb::GenerateRequest top_p = Make({1, 2}, 4);
  top_p.mutable_sampling()->set_top_p(1.5f);
  cases.push_back({top_p, "sampling.top_p"});
  pb::GenerateRequest top_k = Make({1, 2}, 4);
  top_k.mutable_sampling()->set_top_k(-3);
  cases.push_back({top_k, "sampling.top_k"});
  pb::GenerateRequest top_k_big = Make({1, 2}, 4);
  top_k_big.mutable_sampling()->set_top_k(600);
  cases.push_back({top_k_big, "sampling.top_k must be at most the vocabulary size (512)"});
  pb::GenerateRequest zero_top_p = Make({1, 2}, 4);
  zero_top_p.mutable_sampling()->set_top_p(0.0f);
  cases.push_back({zero_top_p, "sampling.top_p must be in (0, 1]"});
  pb::GenerateRequest penalty = Make({1, 2}, 4);
  penalty.mutable_sampling()->set_presence_penalty(3.0f);
  cases.push_back({penalty, "sampling.presence_penalty"});
  pb::GenerateRequest logprobs = Make({1, 2}, 4);
  logprobs.set_logprobs(21);
  cases.push_back({logprobs, "logprobs: must be between 0 and 20"});
  pb::GenerateRequest text;
  text.set_text("hello");
  cases.push_back({text, "tokenizer"});  // this server has no model folder, so no tokenizer
  pb::GenerateRequest chat;
  chat.add_messages()->set_content("hi");
  cases.push_back({chat, "messages: "});
  pb::GenerateRequest both = Make({1, 2}, 4);
  both.set_text("hello");
  cases.push_back({both, "token_ids, text, messages: send exactly one of them as the prompt"});
  pb::GenerateRequest stop = Make({1, 2}, 4);
  stop.add_stop("\n");
  cases.push_back({stop, "stop: stop strings need the model's tokenizer"});
  for (const Case& c : cases) {
    Result r = Run(c.request);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_THAT(r.status.error_message(), HasSubstr(c.message));
  }
  // A duplicate id while the first is live.
  grpc::ClientContext ctx;
  auto live = stub_->Generate(&ctx, Make(prompts_[0], 1500, "dup"));
  pb::GenerateResponse msg;
  ASSERT_TRUE(live->Read(&msg));
  Result dup = Run(Make({1, 2}, 3, "dup"));
  EXPECT_EQ(dup.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(dup.status.error_message(), HasSubstr("request_id: 'dup' is already in use"));
  // The Abort RPC ends it; an unknown id is NOT_FOUND.
  grpc::ClientContext abort_ctx;
  pb::AbortRequest abort;
  abort.set_request_id("dup");
  pb::AbortResponse abort_response;
  EXPECT_TRUE(stub_->Abort(&abort_ctx, abort, &abort_response).ok());
  pb::GenerateResponse last;
  while (live->Read(&msg)) last = msg;
  EXPECT_TRUE(live->Finish().ok());
  EXPECT_EQ(last.finish_reason(), pb::FINISH_REASON_ABORTED);
  grpc::ClientContext missing_ctx;
  abort.set_request_id("nope");
  EXPECT_EQ(stub_->Abort(&missing_ctx, abort, &abort_response).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(WaitForNoBlocksInUse());
}

// Greedy decoding with a repetition penalty, step by step on the reference model: the full
// forward of the sequence so far, the penalty applied to the last row, argmax.
TEST_F(ServerTest, PenaltiesAndLogprobs) {
  StartServer();
  const std::vector<int32_t>& prompt = prompts_[0];
  pb::GenerateRequest request = Make(prompt, 8);
  request.mutable_sampling()->set_repetition_penalty(1.8f);
  request.mutable_sampling()->set_presence_penalty(0.3f);
  request.set_logprobs(3);
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, request);
  pb::GenerateResponse msg;
  std::vector<int32_t> got;
  std::vector<pb::TokenLogprob> logprobs;
  while (reader->Read(&msg)) {
    got.insert(got.end(), msg.token_ids().begin(), msg.token_ids().end());
    logprobs.insert(logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
  }
  ASSERT_TRUE(reader->Finish().ok());

  runtime::SamplingParams params;
  params.repetition_penalty = 1.8f;
  params.presence_penalty = 0.3f;
  std::vector<int32_t> ids = prompt, want;
  const int vocab = reference_->spec().vocab_size;
  for (int step = 0; step < 8; ++step) {
    auto cache = reference_->NewKvCache(runtime::BlocksFor(ids.size(), 16));
    ASSERT_TRUE(cache.ok());
    std::vector<int32_t> table(runtime::BlocksFor(ids.size(), 16));
    std::iota(table.begin(), table.end(), 0);
    runtime::ForwardBatch batch;
    batch.token_ids = ids;
    batch.sequences = {runtime::SequenceChunk{0, static_cast<int32_t>(ids.size()), table}};
    batch.logit_rows = {static_cast<int32_t>(ids.size() - 1)};
    std::vector<float> logits;
    ASSERT_TRUE(reference_->Forward(batch, **cache, &logits).ok());
    runtime::ApplyPenalties(params, prompt.data(), static_cast<int>(prompt.size()), want.data(),
                            static_cast<int>(want.size()), logits.data(), vocab);
    want.push_back(runtime::ArgMax(logits.data(), vocab));
    ids.push_back(want.back());
  }
  EXPECT_EQ(got, want);
  EXPECT_NE(got, Alone(prompt, 8));  // the penalty changed something
  ASSERT_EQ(logprobs.size(), got.size());
  for (size_t i = 0; i < logprobs.size(); ++i) {
    EXPECT_EQ(logprobs[i].token_id(), got[i]);
    EXPECT_LE(logprobs[i].logprob(), 0.0f);
    ASSERT_EQ(logprobs[i].top_size(), 3);
    EXPECT_GE(logprobs[i].top(0).logprob(), logprobs[i].top(1).logprob());
    EXPECT_GE(logprobs[i].top(1).logprob(), logprobs[i].top(2).logprob());
  }
}

TEST_F(ServerTest, ModelInfoAndHealth) {
  StartServer();
  grpc::ClientContext ctx;
  pb::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.architecture(), "qwen3_moe");
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.num_experts(), 16);
  EXPECT_EQ(info.experts_per_token(), 4);
  EXPECT_EQ(info.context_length(), 2048);
  // grpc.health.v1.Health/Check with an empty request: the answer is {status: SERVING} = 08 01.
  grpc::GenericStub generic(channel_);
  grpc::ClientContext health_ctx;
  grpc::Slice empty_message{std::string()};  // HealthCheckRequest{service: ""} encodes to no bytes
  grpc::ByteBuffer request(&empty_message, 1), response;
  grpc::Status status;
  std::atomic<bool> done{false};
  generic.UnaryCall(&health_ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      status = s;
                      done = true;
                    });
  for (int i = 0; i < 500 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(done);
  ASSERT_TRUE(status.ok()) << status.error_message();
  grpc::Slice slice;
  ASSERT_TRUE(response.TrySingleSlice(&slice).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(slice.begin()), slice.size()), std::string("\x08\x01", 2));
}

TEST_F(ServerTest, FiveHundredRequestsWithRandomCancellationsLeaveNothingBehind) {
  StartServer(/*max_seqs=*/8, /*max_queue=*/600);
  std::atomic<int> ok{0}, cancelled{0}, other{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 10; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(c);
      for (int i = 0; i < 50; ++i) {
        const auto& prompt = prompts_[rng() % prompts_.size()];
        const int n = 1 + static_cast<int>(rng() % 12);
        const int cancel_after = rng() % 3 == 0 ? static_cast<int>(rng() % 4) : -1;
        Result r = Run(Make(prompt, n), cancel_after);
        if (r.status.ok()) {
          ++ok;
        } else if (r.status.error_code() == grpc::StatusCode::CANCELLED) {
          ++cancelled;
        } else {
          ++other;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok + cancelled + other, 500);
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_TRUE(WaitForNoBlocksInUse());
  Result after = Run(Make(prompts_[4], 4));  // still healthy
  ASSERT_TRUE(after.status.ok());
  EXPECT_EQ(after.tokens, Alone(prompts_[4], 4));
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// grpc.health.v1.Health/Check for `service`: the status code of the call and the answer's bytes.
std::pair<grpc::StatusCode, std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                                                     const std::string& service) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  std::string request_bytes;
  if (!service.empty()) request_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) { done.set_value(s); });
  const grpc::Status status = done.get_future().get();
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return {status.error_code(), bytes};
}

TEST_F(ServerTest, HealthAnswersPerServiceNameAndTurnsNotServingOnDrain) {
  StartServer();
  const std::string serving("\x08\x01", 2), not_serving("\x08\x02", 2);
  EXPECT_EQ(HealthCheck(channel_, ""), std::make_pair(grpc::StatusCode::OK, serving));
  EXPECT_EQ(HealthCheck(channel_, "moeserve.v1.Generation"), std::make_pair(grpc::StatusCode::OK, serving));
  EXPECT_EQ(HealthCheck(channel_, "no.such.Service").first, grpc::StatusCode::NOT_FOUND);
  // A drain with two streams running: health turns NOT_SERVING at once and new requests are
  // refused; the short stream finishes within the grace, the long one is cut off after it.
  std::atomic<int> got{0};
  Result cut, finished;
  std::thread long_stream([&] {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, Make(prompts_[0], 2000));
    pb::GenerateResponse msg;
    while (reader->Read(&msg)) got += msg.token_ids_size();
    cut.status = reader->Finish();
  });
  while (got < 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::thread short_stream([&] { finished = Run(Make(prompts_[2], 20)); });
  while (frontend_->engine().stats().running < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread drain([&] { EXPECT_EQ(frontend_->Drain(std::chrono::milliseconds(200)), 1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(HealthCheck(channel_, "moeserve.v1.Generation"), std::make_pair(grpc::StatusCode::OK, not_serving));
  Result refused = Run(Make(prompts_[1], 2));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("server shutting down: not accepting new requests"));
  drain.join();
  long_stream.join();
  short_stream.join();
  EXPECT_TRUE(finished.status.ok()) << finished.status.error_message();
  EXPECT_EQ(finished.tokens.size(), 20u);
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(cut.status.error_message(), "server shutting down");
}

// One ServerReflectionInfo exchange on `method` (v1 or v1alpha: the messages are the same).
grpc::reflection::v1::ServerReflectionResponse Reflect(const std::shared_ptr<grpc::Channel>& channel,
                                                       const std::string& method,
                                                       const grpc::reflection::v1::ServerReflectionRequest& request) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = generic.PrepareCall(&ctx, method, &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  grpc::Slice slice(request.SerializeAsString());
  grpc::ByteBuffer out(&slice, 1), in;
  call->WriteLast(out, grpc::WriteOptions(), reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  call->Read(&in, reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  grpc::reflection::v1::ServerReflectionResponse response;
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (ok && in.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  response.ParseFromString(bytes);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  return response;
}

TEST_F(ServerTest, ReflectionV1AndV1AlphaListAndDescribeTheServices) {
  StartServer();
  for (const char* method : {"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                             "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}) {
    grpc::reflection::v1::ServerReflectionRequest list;
    list.set_list_services("*");
    const auto listed = Reflect(channel_, method, list);
    std::vector<std::string> names;
    for (const auto& s : listed.list_services_response().service()) names.push_back(s.name());
    EXPECT_THAT(names, ::testing::Contains("moeserve.v1.Generation")) << method;

    grpc::reflection::v1::ServerReflectionRequest symbol;
    symbol.set_file_containing_symbol("moeserve.v1.Generation");
    const auto described = Reflect(channel_, method, symbol);
    ASSERT_GE(described.file_descriptor_response().file_descriptor_proto_size(), 1) << method;
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(described.file_descriptor_response().file_descriptor_proto(0)));
    EXPECT_EQ(file.name(), "moeserve/v1/generation.proto");
    ASSERT_GE(file.service_size(), 1);
    EXPECT_EQ(file.service(0).name(), "Generation");

    grpc::reflection::v1::ServerReflectionRequest missing;
    missing.set_file_containing_symbol("no.such.Symbol");
    EXPECT_EQ(Reflect(channel_, method, missing).error_response().error_code(),
              static_cast<int>(grpc::StatusCode::NOT_FOUND))
        << method;
  }
}

TEST_F(ServerTest, RejectedRequestsAreCountedByStatusCode) {
  StartServer();
  Result bad = Run(Make({}, 4));
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Metric("moeserve_requests_rejected_total{code=\"INVALID_ARGUMENT\"}"), 1);
  EXPECT_EQ(Metric("moeserve_requests_rejected_total{code=\"RESOURCE_EXHAUSTED\"}"), 0);
}

}  // namespace
}  // namespace moe
