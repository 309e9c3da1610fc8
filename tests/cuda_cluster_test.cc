// A GPU worker behind the control stream (`serve --config` with one GPU) gives the tokens of the
// in-process GPU path, all on the GPU and with the routed experts in the CPU pool beside it.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/experts/arena.h"
#include "moe/runtime/device.h"
#include "moe/runtime/generate.h"
#include "moe/runtime/model.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "test_util.h"

namespace moe {
namespace {

namespace pb = ::moeserve::v1;

TEST(CudaClusterTest, AGpuWorkerGivesTheTokensOfTheInProcessGpuPath) {
  if (runtime::CudaDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const nlohmann::json golden = testing::LoadGolden("qwen3_moe");
  const std::vector<int32_t> prompt = golden["cases"][0]["prompt_ids"];
  for (const bool hybrid : {false, true}) {
    // In this process, on the GPU.
    runtime::ModelOptions options;
    options.pool.progress = false;
    options.experts = hybrid ? runtime::RoutedExpertsMode::kPool : runtime::RoutedExpertsMode::kBackend;
    options.prefill_offload_tokens = 0;
    auto backend = runtime::CreateBackend(runtime::Device{runtime::Device::Kind::kCuda, 0});
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto model = runtime::Model::Load(testing::FixtureDir("qwen3_moe"), options, std::move(*backend));
    ASSERT_TRUE(model.ok()) << model.status();
    runtime::GenerateOptions generate;
    generate.max_new_tokens = 24;
    generate.stop_at_eos = false;
    auto want = runtime::Generate(**model, prompt, generate);
    ASSERT_TRUE(want.ok()) << want.status();
    model->reset();

    // One GPU worker.
    testing::ScratchDir dir;
    const std::string shm = "moeserve-cuda-test-" + std::to_string(::getpid());
    std::ofstream(dir / "cluster.yaml") << "model: " << testing::FixtureDir("qwen3_moe")
                                        << "\nnodes: [{host: 127.0.0.1, gpus: [0]}]\n"
                                        << (hybrid ? "experts: {cpu_moe: true, cpu_pool: {shm: " + shm + "}}\n" : "")
                                        << "scheduler: {max_seqs: 4, kv_cache_mb: 64}\n"
                                           "server: {listen: 127.0.0.1:0, http: 'off'}\n";
    testing::ServeProcess serve({"--config", dir / "cluster.yaml"});
    ASSERT_GT(serve.port(), 0) << serve.err();
    auto stub = pb::Generation::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(serve.port()), grpc::InsecureChannelCredentials()));
    pb::GenerateRequest r;
    r.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    r.mutable_stopping()->set_max_new_tokens(24);
    r.mutable_stopping()->set_ignore_eos(true);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, r);
    std::vector<int32_t> got;
    pb::GenerateResponse msg;
    while (reader->Read(&msg)) got.insert(got.end(), msg.token_ids().begin(), msg.token_ids().end());
    ASSERT_TRUE(reader->Finish().ok()) << serve.err();
    EXPECT_EQ(got, want->generated_ids) << (hybrid ? "hybrid" : "all on the GPU");
    EXPECT_EQ(serve.Stop(SIGTERM), 0) << serve.err();
    (void)experts::HostArena::Unlink(shm);
  }
}

}  // namespace
}  // namespace moe
