// `serve --device cuda` against `generate --device cuda`: the tokens streamed over gRPC, one
// request at a time, equal what one `generate` process computes; batched with others (decode
// steps of several sequences replay the graphs of padded buckets) their first tokens do. Skips
// where no GPU is visible.
#include <future>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/device.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

namespace pb = moeserve::v1;

std::vector<int32_t> Streamed(pb::Generation::Stub* stub, const std::vector<int32_t>& prompt, int max_new_tokens) {
  pb::GenerateRequest request;
  for (int32_t id : prompt) request.add_token_ids(id);
  request.mutable_stopping()->set_max_new_tokens(max_new_tokens);
  request.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, request);
  pb::GenerateResponse msg;
  std::vector<int32_t> tokens;
  while (reader->Read(&msg)) tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
  const grpc::Status s = reader->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  return tokens;
}

std::vector<int32_t> Generated(const std::string& model, const std::vector<int32_t>& prompt, int max_new_tokens) {
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  auto r = testing::RunMoeserve({"generate", "--model", model, "--device", "cuda", "--prompt-ids", ids,
                                 "--max-new-tokens", std::to_string(max_new_tokens), "--ignore-eos", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  if (r.exit_code != 0) return {};
  return nlohmann::json::parse(r.out)["generated_ids"].get<std::vector<int32_t>>();
}

TEST(CudaServeTest, StreamsEqualGenerateAloneAndBatched) {
  if (runtime::CudaDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (const char* arch : {"qwen3_moe", "glm4_moe"}) {
    const std::string model = testing::FixtureDir(arch);
    const nlohmann::json golden = testing::LoadGolden(arch);
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& c : golden["cases"]) prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
    std::vector<std::vector<int32_t>> want;
    for (const auto& p : prompts) want.push_back(Generated(model, p, 20));
    testing::ServeProcess serve({"--model", model, "--device", "cuda", "--listen", "127.0.0.1:0", "--http", "off"});
    ASSERT_GT(serve.port(), 0) << serve.err();
    EXPECT_THAT(serve.err(), ::testing::HasSubstr("device cuda:0"));
    auto stub = pb::Generation::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(serve.port()),
                                                           grpc::InsecureChannelCredentials()));
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(Streamed(stub.get(), prompts[i], 20), want[i]) << arch << " " << i;
    std::vector<std::future<std::vector<int32_t>>> together;
    for (size_t i = 0; i < prompts.size(); ++i) {
      together.push_back(std::async(std::launch::async, [&, i] { return Streamed(stub.get(), prompts[i], 20); }));
    }
    // Batched, the linears run at other batch sizes (cuBLASLt may pick other algorithms, which
    // round differently), so only the first tokens, far from any near-tie, are held equal.
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<int32_t> got = together[i].get();
      ASSERT_EQ(got.size(), want[i].size()) << arch << " batched " << i;
      EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + 4), std::vector<int32_t>(want[i].begin(), want[i].begin() + 4))
          << arch << " batched " << i;
    }
    EXPECT_EQ(serve.Stop(SIGTERM), 0);
  }
}

}  // namespace
}  // namespace moe
