// What a real model folder, a careless client or an attacker sends a `moeserve serve` process, and
// what it must answer: each case runs the real binary (or a real Frontend) on loopback.
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

namespace pb = ::moeserve::v1;
using ::nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

void WriteJson(const std::string& path, const json& j) { std::ofstream(path) << j.dump(1); }

// The HTTP port a serve process logged ("HTTP on port N"), or 0.
int HttpPort(const testing::ServeProcess& serve) {
  std::smatch m;
  const std::string log = serve.err();
  return std::regex_search(log, m, std::regex("HTTP on port ([0-9]+)")) ? std::stoi(m[1]) : 0;
}

std::unique_ptr<pb::Generation::Stub> GrpcStub(int port) {
  return pb::Generation::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

struct Generated {
  grpc::Status status;
  std::vector<int32_t> tokens;
  pb::GenerateResponse last;
};

Generated Generate(pb::Generation::Stub& stub, const pb::GenerateRequest& request) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub.Generate(&ctx, request);
  Generated g;
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
    g.tokens.insert(g.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    g.last = msg;
  }
  g.status = reader->Finish();
  return g;
}

// generation_config.json's eos_token_id (a list) and the tokenizer's eos_token (an AddedToken
// object in tokenizer_config.json) stop a generation, as config.json's would; GetModelInfo and
// /v1/models say which ids stop.
TEST(StopIdsTest, GenerationConfigAndTheTokenizersEosTokenStopAGeneration) {
  testing::ScratchDir dir;
  const std::string model = dir / "model";
  testing::CopyFixture("qwen3_moe", model);
  const json golden = testing::LoadGolden("qwen3_moe");
  // Case 0 continues 247 x5, 73, ...; case 1 continues 118, 105, ...
  ASSERT_EQ(golden["cases"][0]["greedy_ids"][5], 73);
  ASSERT_EQ(golden["cases"][1]["greedy_ids"][1], 105);
  WriteJson(model + "/generation_config.json", {{"eos_token_id", {73}}, {"transformers_version", "5.17.0"}});
  std::string content_105;
  const json vocab = ReadJson(model + "/tokenizer.json")["model"]["vocab"];
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (it.value().get<int>() == 105) content_105 = it.key();
  }
  ASSERT_FALSE(content_105.empty());
  json tokenizer_config = ReadJson(model + "/tokenizer_config.json");
  tokenizer_config["eos_token"] = {{"content", content_105}, {"special", true}};
  WriteJson(model + "/tokenizer_config.json", tokenizer_config);

  testing::ServeProcess serve(
      {"--model", model, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--kv-cache-mb", "16"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = GrpcStub(serve.port());
  {
    grpc::ClientContext ctx;
    pb::ModelInfo info;
    ASSERT_TRUE(stub->GetModelInfo(&ctx, pb::GetModelInfoRequest{}, &info).ok());
    EXPECT_THAT(info.eos_token_ids(), ElementsAre(73, 105));
  }
  for (int c : {0, 1}) {
    pb::GenerateRequest r;
    const std::vector<int32_t> prompt = golden["cases"][c]["prompt_ids"];
    r.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    r.mutable_stopping()->set_max_new_tokens(16);
    const Generated g = Generate(*stub, r);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    const std::vector<int32_t> greedy = golden["cases"][c]["greedy_ids"];
    const size_t n = c == 0 ? 6 : 2;
    EXPECT_EQ(g.tokens, std::vector<int32_t>(greedy.begin(), greedy.begin() + n)) << "case " << c;
    EXPECT_EQ(g.last.finish_reason(), pb::FINISH_REASON_EOS) << "case " << c;
  }
  httplib::Client http("127.0.0.1", HttpPort(serve));
  auto models = http.Get("/v1/models");
  ASSERT_TRUE(models) << serve.err();
  EXPECT_EQ(json::parse(models->body)["data"][0]["eos_token_ids"], json({73, 105})) << models->body;

  // A generation_config.json id outside the vocabulary is the file's error, as config.json's are.
  WriteJson(model + "/generation_config.json", {{"eos_token_id", {73, 100000}}});
  const testing::CommandResult bad =
      testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1,2", "--max-new-tokens", "1"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.err, HasSubstr("generation_config.json: eos_token_id[1]=100000 is out of range: must be between 0 "
                                 "and 511 (vocab_size=512)"));
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
}

// With API keys: reflection asks for one like every other call (and gRPC's v1alpha, which cannot
// ask, is not served); generated request ids are unguessable, and only the key that made a
// request may abort it; an error message names no server path.
TEST(ServeKeysTest, ReflectionAbortAndMessagesFollowTheKeys) {
  testing::ScratchDir dir;
  const std::string model = dir / "model";
  testing::CopyFixture("qwen3_moe", model);
  std::filesystem::remove(model + "/tokenizer.json");
  const std::string keys = dir / "keys.txt";
  std::ofstream(keys) << "key-of-alice-0123456789\nkey-of-bob-0123456789\n";
  testing::ServeProcess serve({"--model", model, "--listen", "127.0.0.1:0", "--http", "off", "--kv-cache-mb", "16",
                               "--api-key-file", keys, "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(serve.port()), grpc::InsecureChannelCredentials());
  namespace reflection = ::grpc::reflection::v1;
  auto reflect = [&](const char* key, reflection::ServerReflectionResponse* out) {
    auto stub = reflection::ServerReflection::NewStub(channel);
    grpc::ClientContext ctx;
    if (key != nullptr) ctx.AddMetadata("authorization", std::string("Bearer ") + key);
    auto stream = stub->ServerReflectionInfo(&ctx);
    reflection::ServerReflectionRequest request;
    request.set_list_services("*");
    stream->Write(request);
    stream->WritesDone();
    while (stream->Read(out)) {
    }
    return stream->Finish();
  };
  reflection::ServerReflectionResponse listed;
  EXPECT_EQ(reflect(nullptr, &listed).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(reflect("key-of-alice-0123456789", &listed).ok());
  std::vector<std::string> names;
  for (const auto& service : listed.list_services_response().service()) names.push_back(service.name());
  EXPECT_THAT(names, ::testing::Contains("moeserve.v1.Generation"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("grpc.reflection.v1alpha.ServerReflection")));

  auto stub = pb::Generation::NewStub(channel);
  pb::GenerateRequest long_request;
  for (int id : {5, 6, 7}) long_request.add_token_ids(id);
  long_request.mutable_stopping()->set_max_new_tokens(2000);
  long_request.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext alice;
  alice.AddMetadata("authorization", "Bearer key-of-alice-0123456789");
  alice.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub->Generate(&alice, long_request);
  pb::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first)) << serve.err();
  const std::string id = first.request_id();
  EXPECT_TRUE(std::regex_match(id, std::regex("req-[0-9a-f]{32}"))) << id;
  auto abort_as = [&](const std::string& key) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + key);
    pb::AbortRequest request;
    request.set_request_id(id);
    pb::AbortResponse response;
    return stub->Abort(&ctx, request, &response);
  };
  const grpc::Status by_bob = abort_as("key-of-bob-0123456789");
  EXPECT_EQ(by_bob.error_code(), grpc::StatusCode::NOT_FOUND) << by_bob.error_message();
  EXPECT_TRUE(abort_as("key-of-alice-0123456789").ok());
  pb::GenerateResponse msg, last;
  int tokens = first.token_ids_size();
  while (reader->Read(&msg)) {
    tokens += msg.token_ids_size();
    last = msg;
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(last.finish_reason(), pb::FINISH_REASON_ABORTED);
  EXPECT_LT(tokens, 2000);

  grpc::ClientContext text_ctx;
  text_ctx.AddMetadata("authorization", "Bearer key-of-bob-0123456789");
  pb::GenerateRequest text;
  text.set_text("hello");
  const Generated refused = [&] {
    auto r = stub->Generate(&text_ctx, text);
    Generated g;
    pb::GenerateResponse m;
    while (r->Read(&m)) {
    }
    g.status = r->Finish();
    return g;
  }();
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("this model has no tokenizer.json"));
  EXPECT_THAT(refused.status.error_message(), ::testing::Not(HasSubstr(dir.path().string())));
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace moe
