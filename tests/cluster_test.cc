// Deployments from cluster files, as a user runs them: `moeserve serve --config FILE` starts its
// CPU worker processes (Gloo over loopback) and serves the client API; a killed worker fails the
// streams in flight with UNAVAILABLE at once and the group heals; bad files exit with a message
// that names the line and the key.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "../scheduler/src/test_pki.h"
#include "../scheduler/src/test_socket.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/comm/rendezvous.h"
#include "moe/comm/tcp_socket.h"
#include "moe/experts/arena.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "moeserve/v1/worker.grpc.pb.h"
#include "test_util.h"

namespace moe {
namespace {

namespace pb = ::moeserve::v1;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// A cluster file in `dir` for the qwen3_moe fixture: `parallel` and more lines as given.
std::string WriteConfig(const testing::ScratchDir& dir, const std::string& name, const std::string& body) {
  const std::string path = dir / name;
  std::ofstream(path) << body;
  return path;
}

std::string Deployment(const std::string& parallel, const std::string& shm, const std::string& arch = "qwen3_moe") {
  return "model: " + testing::FixtureDir(arch) +
         "\n"
         "nodes:\n"
         "  - {host: 127.0.0.1, workers: 2}\n"
         "parallel: " +
         parallel +
         "\n"
         "experts:\n"
         "  cpu_pool: {dtype: bf16, shm: " +
         shm +
         "}\n"
         "scheduler: {max_seqs: 8, kv_cache_mb: 64, drain_seconds: 2}\n"
         "server: {listen: 127.0.0.1:0, http: 'off'}\n"
         "supervisor: {restart_backoff_ms: 100}\n";
}

struct Stream {
  std::vector<int32_t> tokens;
  grpc::Status status;
  int cached_tokens = 0;  // the final message's usage
};

Stream Generate(pb::Generation::Stub& stub, const std::vector<int32_t>& prompt, int n,
                std::chrono::seconds deadline = std::chrono::seconds(60),
                const std::function<void(int)>& on_token = nullptr) {
  pb::GenerateRequest r;
  r.mutable_token_ids()->Add(prompt.begin(), prompt.end());
  r.mutable_stopping()->set_max_new_tokens(n);
  r.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  auto reader = stub.Generate(&ctx, r);
  Stream s;
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
    s.tokens.insert(s.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (msg.has_usage()) s.cached_tokens = msg.usage().cached_tokens();
    if (on_token) on_token(static_cast<int>(s.tokens.size()));
  }
  s.status = reader->Finish();
  return s;
}

std::unique_ptr<pb::Generation::Stub> Connect(int port) {
  return pb::Generation::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

// A tensor split of 2 and a layer split of 2 serve the goldens' greedy continuations, as one
// process does, the second time from the frontend's prefix cache (the workers follow its block
// tables), and stop cleanly on SIGTERM. deepseek_v3's tensor split halves its query heads and
// keeps the whole latent cache on each rank.
class ClusterSplitTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ClusterSplitTest, TensorAndLayerSplitsServeTheGoldensGreedyTokens) {
  const nlohmann::json golden = testing::LoadGolden(GetParam());
  for (const std::string parallel : {"{mode: tensor, size: 2}", "{mode: layer, stages: 2}"}) {
    testing::ScratchDir dir;
    const std::string shm =
        "moeserve-test-" + std::to_string(::getpid()) + "-" + GetParam() + "-" + std::to_string(parallel.size());
    testing::ServeProcess serve({"--config", WriteConfig(dir, "cluster.yaml", Deployment(parallel, shm, GetParam()))});
    ASSERT_GT(serve.port(), 0) << parallel << ": " << serve.err();
    auto stub = Connect(serve.port());
    for (size_t c = 0; c < golden["cases"].size(); ++c) {
      const std::vector<int32_t> want = golden["cases"][c]["greedy_ids"];
      const Stream s =
          Generate(*stub, golden["cases"][c]["prompt_ids"].get<std::vector<int32_t>>(), static_cast<int>(want.size()));
      ASSERT_TRUE(s.status.ok()) << parallel << ": " << s.status.error_message() << "\n" << serve.err();
      EXPECT_EQ(s.tokens, want) << parallel << " case " << c;
    }
    for (size_t c = 0; c < golden["cases"].size(); ++c) {
      const std::vector<int32_t> want = golden["cases"][c]["greedy_ids"];
      const std::vector<int32_t> prompt = golden["cases"][c]["prompt_ids"];
      const Stream s = Generate(*stub, prompt, static_cast<int>(want.size()));
      ASSERT_TRUE(s.status.ok()) << parallel << ": " << s.status.error_message() << "\n" << serve.err();
      EXPECT_EQ(s.tokens, want) << parallel << " case " << c << ", again";
      EXPECT_EQ(s.cached_tokens, (static_cast<int>(prompt.size()) - 1) / 16 * 16) << parallel << " case " << c;
    }
    EXPECT_EQ(serve.Stop(SIGTERM), 0) << serve.err();
    // A named arena outlives its deployment (a restarted launcher attaches to it): this test's goes.
    for (const std::string& name : {shm, shm + "-s0", shm + "-s1"}) (void)experts::HostArena::Unlink(name);
    EXPECT_THAT(serve.err(), HasSubstr("2 workers (" +
                                       std::string(parallel.find("tensor") != std::string::npos ? "tensor" : "layer") +
                                       " split, Gloo)"));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ClusterSplitTest, ::testing::Values("qwen3_moe", "deepseek_v3"),
                         [](const auto& info) { return info.param; });

// Killing a worker while four streams run: each gets UNAVAILABLE within 5 s; the group restarts
// with the shared expert arena attached (not reloaded), and the next request gets its tokens.
TEST(ClusterTest, AKilledWorkerFailsTheStreamsAtOnceAndTheGroupHeals) {
  testing::ScratchDir dir;
  const std::string shm = "moeserve-test-heal-" + std::to_string(::getpid());
  testing::ServeProcess serve(
      {"--config", WriteConfig(dir, "cluster.yaml", Deployment("{mode: tensor, size: 2}", shm))});
  ASSERT_GT(serve.port(), 0) << serve.err();
  const std::smatch::string_type log = serve.err();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("worker 1 started \\(pid ([0-9]+)\\)"))) << log;
  const pid_t victim = std::stoi(m[1]);

  const nlohmann::json golden = testing::LoadGolden("qwen3_moe");
  const std::vector<int32_t> prompt = golden["cases"][0]["prompt_ids"];
  std::atomic<int> started{0};
  std::vector<Stream> streams(4);
  std::vector<Clock::time_point> ended(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      auto stub = Connect(serve.port());
      bool counted = false;
      streams[i] = Generate(*stub, prompt, 1000, std::chrono::seconds(120), [&](int n) {
        if (!counted && n > 0) {
          counted = true;
          started.fetch_add(1);
        }
      });
      ended[i] = Clock::now();
    });
  }
  const auto wait_until = Clock::now() + std::chrono::seconds(60);
  while (started.load() < 4 && Clock::now() < wait_until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const bool all_started = started.load() == 4;
  const Clock::time_point killed = Clock::now();
  EXPECT_EQ(::kill(victim, SIGKILL), 0);
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(all_started) << "the streams did not start: " << streams[0].status.error_message() << "\n" << serve.err();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(streams[i].status.error_code(), grpc::StatusCode::UNAVAILABLE) << streams[i].status.error_message();
    const double seconds = std::chrono::duration<double>(ended[i] - killed).count();
    EXPECT_LT(seconds, 5.0) << "stream " << i << " ended " << seconds << " s after the kill";
  }
  // The next request waits for the restart, then is served.
  auto stub = Connect(serve.port());
  const std::vector<int32_t> want = golden["cases"][0]["greedy_ids"];
  const Stream after = Generate(*stub, prompt, static_cast<int>(want.size()), std::chrono::seconds(120));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << serve.err();
  EXPECT_EQ(after.tokens, want);
  EXPECT_EQ(after.cached_tokens, 0) << "the restarted workers hold none of the blocks cached before";
  const std::string err = serve.err();
  EXPECT_THAT(err, HasSubstr("worker 1 killed by signal 9"));
  EXPECT_THAT(err, HasSubstr("group restarted (generation 2); 2 of 2 workers attached the shared expert arena"));
  EXPECT_EQ(serve.Stop(SIGTERM), 0) << err;
  (void)experts::HostArena::Unlink(shm);
}

// Waits (at most 10 s) until process `pid` maps nothing: it has exited.
void WaitUntilGone(pid_t pid) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < until) {
    std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
    std::string line;
    if (!maps || !std::getline(maps, line)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<int32_t> GeneratedIds(const testing::CommandResult& r) {
  const size_t brace = r.out.find('{');
  if (r.exit_code != 0 || brace == std::string::npos) return {};
  return nlohmann::json::parse(r.out.substr(brace))["generated_ids"].get<std::vector<int32_t>>();
}

// A launcher killed with SIGKILL leaves its derived arena behind; the model's files are then
// replaced. The next launcher on the same path must not attach the old experts: it serves what one
// process computes from the new files, removes the arena whose owner is gone, reports /dev/shm's
// use, and removes its own arena when it stops.
TEST(ClusterTest, AStaleExpertArenaIsNeverServed) {
  testing::ScratchDir dir;
  const std::string model = dir / "model";
  auto make_model = [&](const std::string& seed) {
    const testing::CommandResult r = testing::RunMoeserve({"make-model", "--arch", "qwen3_moe", "--preset", "tiny",
                                                           "--seed", seed, "--out", model, "--overwrite", "--quiet"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  };
  make_model("1");
  const std::string config = WriteConfig(dir, "cluster.yaml",
                                         "model: " + model +
                                             "\nnodes: [{host: 127.0.0.1, workers: 2}]\n"
                                             "parallel: {mode: tensor, size: 2}\n"
                                             "experts: {cpu_pool: {dtype: bf16}}\n"
                                             "scheduler: {max_seqs: 4, kv_cache_mb: 16}\n"
                                             "server: {listen: 127.0.0.1:0, http: 'off'}\n");
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  const std::regex arena_line("expert arena: /dev/shm/(moeserve-[0-9a-f]{16})");
  std::string old_arena;
  {
    testing::ServeProcess first({"--config", config});
    ASSERT_GT(first.port(), 0) << first.err();
    const Stream s = Generate(*Connect(first.port()), prompt, 8);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message() << "\n" << first.err();
    const std::string log = first.err();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, arena_line)) << log;
    old_arena = m[1];
    std::vector<pid_t> workers;
    const std::regex started("worker [0-9]+ started \\(pid ([0-9]+)\\)");
    for (std::sregex_iterator it(log.begin(), log.end(), started), end; it != end; ++it) {
      workers.push_back(std::stoi((*it)[1]));
    }
    ASSERT_EQ(workers.size(), 2u) << log;
    EXPECT_EQ(first.Stop(SIGKILL), 128 + SIGKILL);
    for (pid_t w : workers) WaitUntilGone(w);  // they die with the launcher (PR_SET_PDEATHSIG)
  }
  ASSERT_TRUE(std::filesystem::exists("/dev/shm/" + old_arena)) << "the killed launcher left no arena";

  make_model("2");  // new weights under the same path
  const std::vector<int32_t> want = GeneratedIds(testing::RunMoeserve(
      {"generate", "--model", model, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "8", "--ignore-eos", "--json"}));
  ASSERT_EQ(want.size(), 8u);

  testing::ServeProcess second({"--config", config});
  ASSERT_GT(second.port(), 0) << second.err();
  const Stream s = Generate(*Connect(second.port()), prompt, 8);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message() << "\n" << second.err();
  EXPECT_EQ(s.tokens, want) << "the experts of the old files were served\n" << second.err();
  const std::string log = second.err();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, arena_line)) << log;
  const std::string new_arena = m[1];
  EXPECT_NE(new_arena, old_arena);
  // Gone: removed at this launcher's start (its log says so), or at another's running beside
  // this test (every launcher removes the arenas whose owner is gone).
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + old_arena));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + old_arena + ".owner"));
  EXPECT_THAT(log, HasSubstr("/dev/shm: "));
  EXPECT_THAT(log, HasSubstr("moeserve arenas: "));
  EXPECT_EQ(second.Stop(SIGTERM), 0) << log;
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + new_arena));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + new_arena + ".owner"));
}

// The workers' control service and the rendezvous store answer only the launcher that holds the
// launch's secret: a local user without it can neither shut a worker down nor read the store, and
// the deployment goes on serving; a worker started by hand without a secret refuses to run.
TEST(ClusterTest, TheControlPlaneAnswersOnlyItsLauncher) {
  testing::ScratchDir dir;
  const std::string shm = "moeserve-test-secret-" + std::to_string(::getpid());
  testing::ServeProcess serve(
      {"--config", WriteConfig(dir, "cluster.yaml", Deployment("{mode: tensor, size: 2}", shm))});
  ASSERT_GT(serve.port(), 0) << serve.err();
  const std::string log = serve.err();
  std::vector<std::string> workers;
  const std::regex started("worker [0-9]+ started \\(pid [0-9]+\\) on ([^,\\s]+)");
  for (std::sregex_iterator it(log.begin(), log.end(), started), end; it != end; ++it) {
    workers.push_back((*it)[1]);
  }
  ASSERT_EQ(workers.size(), 2u) << log;
  for (const std::string& address : workers) {
    auto stub = pb::Worker::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    for (const char* secret : {"", "0123456789abcdef0123456789abcdef"}) {
      grpc::ClientContext shutdown_ctx;
      if (*secret != '\0') shutdown_ctx.AddMetadata("x-moeserve-control-secret", secret);
      pb::ShutdownResponse shutdown;
      const grpc::Status s = stub->Shutdown(&shutdown_ctx, pb::ShutdownRequest{}, &shutdown);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << address << ": " << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("control-plane secret"));
      grpc::ClientContext health_ctx;
      pb::WorkerHealthResponse health;
      EXPECT_EQ(stub->Health(&health_ctx, pb::WorkerHealthRequest{}, &health).error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("rendezvous store on ([^ ]+)"))) << log;
  auto store = comm::RendezvousClient::Connect(m[1].str(), absl::Seconds(10));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Get("moe/gen1/0", absl::Milliseconds(100)).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*store)->Set("moe/gen1/0", "forged").code(), absl::StatusCode::kUnauthenticated);

  const Stream s = Generate(*Connect(serve.port()), {1, 2, 3}, 4);
  EXPECT_TRUE(s.status.ok()) << s.status.error_message() << "\n" << serve.err();
  EXPECT_EQ(s.tokens.size(), 4u);
  EXPECT_EQ(serve.Stop(SIGTERM), 0) << serve.err();
  (void)experts::HostArena::Unlink(shm);

  const testing::CommandResult bare = testing::RunMoeserve({"worker", "--listen", "127.0.0.1:0"});
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_THAT(bare.err, HasSubstr("MOESERVE_CONTROL_SECRET is not set"));
}

// A worker stopped (SIGSTOP) mid-deployment: its connection stays open, so only the step deadline
// notices. The step fails with UNAVAILABLE naming the deadline and the stopped rank, with the
// other rank's Gloo timeout reported as such; /health turns 503 while the group restarts; the next
// request is served by the new group.
TEST(ClusterTest, AStoppedWorkerFailsTheStepAtItsDeadlineAndTheGroupRestarts) {
  testing::ScratchDir dir;
  const std::string shm = "moeserve-test-stuck-" + std::to_string(::getpid());
  const std::string body = "model: " + testing::FixtureDir("qwen3_moe") +
                           "\nnodes: [{host: 127.0.0.1, workers: 2}]\n"
                           "parallel: {mode: tensor, size: 2}\n"
                           "experts: {cpu_pool: {dtype: bf16, shm: " +
                           shm +
                           "}}\n"
                           "scheduler: {max_seqs: 4, kv_cache_mb: 16, drain_seconds: 1}\n"
                           "server: {listen: 127.0.0.1:0, http: 127.0.0.1:0}\n"
                           "comm: {timeout_ms: 500}\n"
                           "supervisor: {restart_backoff_ms: 1000, step_timeout_ms: 2000}\n";
  testing::ServeProcess serve({"--config", WriteConfig(dir, "cluster.yaml", body)});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = Connect(serve.port());
  ASSERT_TRUE(Generate(*stub, {1, 2, 3}, 2).status.ok()) << serve.err();
  const std::string log = serve.err();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("worker 1 started \\(pid ([0-9]+)\\)"))) << log;
  const pid_t victim = std::stoi(m[1]);
  ASSERT_TRUE(std::regex_search(log, m, std::regex("HTTP on port ([0-9]+)"))) << log;
  const int http_port = std::stoi(m[1]);
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);

  const Stream stuck = Generate(*stub, {1, 2, 3}, 4);
  EXPECT_EQ(stuck.status.error_code(), grpc::StatusCode::UNAVAILABLE) << stuck.status.error_message();
  EXPECT_THAT(stuck.status.error_message(), HasSubstr("step deadline: worker 1"));
  EXPECT_THAT(stuck.status.error_message(), HasSubstr("no progress within"));  // rank 0's Gloo timeout
  // While the group restarts, /health says so.
  bool saw_restarting = false;
  for (int i = 0; i < 2000 && !saw_restarting && serve.err().find("group restarted") == std::string::npos; ++i) {
    const int fd = moe::test_socket::ConnectLoopback(http_port);
    const std::string request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    std::string got;
    char buf[1024];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) got.append(buf, static_cast<size_t>(n));
    ::close(fd);
    saw_restarting = got.find(" 503 ") != std::string::npos && got.find("restarting") != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(saw_restarting);
  const Stream after = Generate(*stub, {1, 2, 3}, 4, std::chrono::seconds(120));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << serve.err();
  EXPECT_EQ(after.tokens.size(), 4u);
  EXPECT_THAT(serve.err(), HasSubstr("step deadline: worker 1"));
  EXPECT_EQ(serve.Stop(SIGTERM), 0) << serve.err();
  (void)experts::HostArena::Unlink(shm);
  ::kill(victim, SIGKILL);  // already gone with its group; never left stopped
}

// With comm.tls, the workers' control service takes only callers that present a certificate of
// the deployment's CA (and then still asks for the secret); the launcher's own calls present the
// node's certificate, and the deployment serves.
TEST(ClusterTest, MutualTlsBetweenTheLauncherAndItsWorkers) {
  scheduler::internal::TestPki pki;
  ASSERT_TRUE(pki.ok()) << "openssl could not make the test certificates in " << pki.dir();
  testing::ScratchDir dir;
  const std::string shm = "moeserve-test-tls-" + std::to_string(::getpid());
  const std::string tls = "comm: {tls: {cert: " + pki.Path("server.pem") + ", key: " + pki.Path("server.key") +
                          ", ca: " + pki.Path("ca.pem") + "}}\n";
  testing::ServeProcess serve(
      {"--config", WriteConfig(dir, "cluster.yaml", Deployment("{mode: tensor, size: 2}", shm) + tls)});
  ASSERT_GT(serve.port(), 0) << serve.err();
  const Stream s = Generate(*Connect(serve.port()), {1, 2, 3}, 4);
  EXPECT_TRUE(s.status.ok()) << s.status.error_message() << "\n" << serve.err();
  EXPECT_EQ(s.tokens.size(), 4u);

  std::smatch m;
  const std::string log = serve.err();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("worker 0 started \\(pid [0-9]+\\) on ([^,\\s]+)"))) << log;
  const std::string address = m[1];
  const auto read = [&](const std::string& name) {
    std::ifstream in(pki.Path(name));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const auto health = [&](std::shared_ptr<grpc::ChannelCredentials> credentials) {
    auto stub = pb::Worker::NewStub(grpc::CreateChannel(address, credentials));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    pb::WorkerHealthResponse response;
    return stub->Health(&ctx, pb::WorkerHealthRequest{}, &response);
  };
  EXPECT_EQ(health(grpc::InsecureChannelCredentials()).error_code(), grpc::StatusCode::UNAVAILABLE);
  grpc::SslCredentialsOptions no_certificate;
  no_certificate.pem_root_certs = read("ca.pem");
  EXPECT_EQ(health(grpc::SslCredentials(no_certificate)).error_code(), grpc::StatusCode::UNAVAILABLE);
  grpc::SslCredentialsOptions stranger = no_certificate;
  stranger.pem_private_key = read("stranger.key");
  stranger.pem_cert_chain = read("stranger.pem");
  EXPECT_EQ(health(grpc::SslCredentials(stranger)).error_code(), grpc::StatusCode::UNAVAILABLE);
  grpc::SslCredentialsOptions client = no_certificate;
  client.pem_private_key = read("client.key");
  client.pem_cert_chain = read("client.pem");
  EXPECT_EQ(health(grpc::SslCredentials(client)).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(serve.Stop(SIGTERM), 0) << serve.err();
  (void)experts::HostArena::Unlink(shm);

  const testing::CommandResult half =
      testing::RunMoeserve({"serve", "--config",
                            WriteConfig(dir, "half.yaml",
                                        "model: " + testing::FixtureDir("qwen3_moe") +
                                            "\ncomm: {tls: {cert: " + pki.Path("server.pem") + "}}\n")});
  EXPECT_EQ(half.exit_code, 2);
  EXPECT_THAT(half.err, HasSubstr("comm.tls: needs cert, key and ca"));
}

// A gRPC port another process holds fails the launch before any worker starts (it used to be
// found only when the loaded workers' frontend bound it, leaving their arena behind).
TEST(ClusterTest, AListenPortInUseStopsTheLaunchBeforeAnyWorker) {
  testing::ScratchDir dir;
  int port = 0;
  auto holder = comm::ListenTcp("127.0.0.1", 0, &port);
  ASSERT_TRUE(holder.ok()) << holder.status();
  const std::string body = "model: " + testing::FixtureDir("qwen3_moe") +
                           "\nnodes: [{host: 127.0.0.1, workers: 2}]\nparallel: {mode: tensor, size: 2}\n"
                           "server: {listen: '127.0.0.1:" +
                           std::to_string(port) + "', http: 'off'}\n";
  const testing::CommandResult r = testing::RunMoeserve({"serve", "--config", WriteConfig(dir, "cluster.yaml", body)});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("server.listen: cannot listen on 127.0.0.1:" + std::to_string(port) +
                               ": the address is in use; nothing was started"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("started (pid")));
}

// Bad cluster files: each exits 2 before any worker starts, naming the file's line and the key.
TEST(ClusterTest, BadClusterFilesExitWithWhatAndWhere) {
  testing::ScratchDir dir;
  const std::string model = testing::FixtureDir("qwen3_moe");
  const struct {
    std::string body, message;
  } cases[] = {
      {"model: " + model + "\nparalel: {mode: tensor, size: 2}\n",
       "cluster.yaml:2:1: paralel: unknown key; the file takes comm, experts, model, nodes, parallel"},
      {"model: " + model + "\nscheduler: {max_seqs: many}\n",
       "cluster.yaml:2:23: scheduler.max_seqs: expected an integer, found 'many'"},
      {"model: " + model + "\nnodes: [{host: 127.0.0.1, workers: 3}]\nparallel: {mode: tensor, size: 3}\n",
       "parallel.size: a tensor split of 3 needs num_attention_heads (4) divisible by it"},
      {"model: " + model + "\nnodes: [{host: 127.0.0.1, gpus: [0]}]\nparallel: {mode: tensor, size: 2}\n",
       "the split has 2 ranks and the nodes list 1 GPUs"},
      {"model: /nonexistent/model\n", "cluster.yaml:1:8: model: '/nonexistent/model'"},
      {"model: " + model + "\nparallel: {mode: pipeline}\n", "parallel.mode: 'pipeline' is not none, tensor or layer"},
      {"model: " + model + "\nspeculative: {draft: x}\n",
       "speculative.draft: unknown key; speculative takes adaptive, device, model, n_max, type"},
      {"model: " + model + "\nexperts: {gpu_cache: {per_layer: 4}}\n",
       "experts.gpu_cache: holds some of the CPU layers' experts on a GPU: it needs GPU nodes"},
      {"model: " + model + "\ncomm: {rendezvous: node0}\n",
       "cluster.yaml:2:20: comm.rendezvous: 'node0' is not HOST:PORT (an IPv6 host in brackets, port 0 to 65535)"},
  };
  for (const auto& c : cases) {
    const std::string path = WriteConfig(dir, "cluster.yaml", c.body);
    const testing::CommandResult r = testing::RunMoeserve({"serve", "--config", path});
    EXPECT_EQ(r.exit_code, 2) << c.body << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.body;
  }
  const testing::CommandResult missing = testing::RunMoeserve({"serve", "--config", dir / "none.yaml"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("none.yaml: no such file"));
}

// Files that parse but cannot work, and flags --config does not honour: each exits 2 before any
// worker starts, naming the key (and where the file has a line for it, the line).
TEST(ClusterTest, FilesAndFlagsThatCannotWorkStopBeforeAnyWorkerStarts) {
  testing::ScratchDir dir;
  const std::string model = testing::FixtureDir("qwen3_moe");
  const struct {
    std::string body;
    std::vector<std::string> flags;
    std::string message;
  } cases[] = {
      {"just a string\n",
       {"--node", "5"},
       "cluster.yaml:1:1: the file: expected a map of keys (model, nodes, parallel, ...) at the top level, found "
       "'just a string'"},
      {"[1, 2]\n", {"--node", "5"}, "at the top level, found a list"},
      {"model: " + model + "\nmodel: " + model + "\n",
       {"--node", "5"},
       "cluster.yaml:2:1: model: duplicate key: it is given twice in one map; keep one"},
      {"model: " + model + "\nscheduler: {max_seqs: 2, max_seqs: 4}\n",
       {"--node", "5"},
       "cluster.yaml:2:26: scheduler.max_seqs: duplicate key"},
      {"model: " + model + "\nnodes: [{host: 127.0.0.1, workers: 0}]\n",
       {"--node", "5"},
       "cluster.yaml:2:36: nodes[0].workers: 0 would run no worker on this node"},
      {"model: " + model + "\nserver: {listen: '127.0.0.1:50999', http: '127.0.0.1:50999'}\n",
       {"--node", "5"},
       "server.http: '127.0.0.1:50999' is server.listen's address too: gRPC and HTTP need a port each"},
      {"model: " + model + "\nnodes: [{host: 192.0.2.1, workers: 1}]\nparallel: {mode: tensor, size: 1}\n",
       {},
       "nodes[0].host: '192.0.2.1' is 192.0.2.1, not an address of this machine"},
      {"model: " + model + "\nscheduler: {kv_cache_mb: 1073741824}\n",
       {},
       "scheduler.kv_cache_mb: 1073741824 MiB for each of node 0's 1 CPU workers is more than this machine's"},
      {"model: " + model + "\n",
       {"--api-key-file", "keys.txt", "--tls-cert", "c.pem", "--kv-cache-mb", "8", "--node", "5"},
       "--config takes its settings from the cluster file, so it does not honour "},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"serve", "--config", WriteConfig(dir, "cluster.yaml", c.body)};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const testing::CommandResult r = testing::RunMoeserve(args);
    EXPECT_EQ(r.exit_code, 2) << c.body << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.body;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("started (pid"))) << c.body;
  }
  const testing::CommandResult flags =
      testing::RunMoeserve({"serve", "--config", WriteConfig(dir, "cluster.yaml", "model: " + model + "\n"),
                            "--api-key-file", "k.txt", "--tls-cert", "c.pem", "--expert-kernel", "x", "--node", "5"});
  EXPECT_EQ(flags.exit_code, 2);
  EXPECT_THAT(flags.err, HasSubstr("--api-key-file (the cluster file's server.api_key_file key)"));
  EXPECT_THAT(flags.err, HasSubstr("--tls-cert (the cluster file's server.tls_cert key)"));
  EXPECT_THAT(flags.err, HasSubstr("--expert-kernel (a deployment has no setting for it yet)"));
}

// Every example cluster file in deploy/examples/ reads and checks (with its model replaced by a
// fixture): `--node 99` then stops it before anything starts, naming how many nodes it lists.
TEST(ClusterTest, TheExampleFilesAreValid) {
  testing::ScratchDir dir;
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(MOE_SOURCE_DIR) + "/deploy/examples")) {
    if (entry.path().extension() != ".yaml" || entry.path().filename() == "kubernetes.yaml") continue;
    std::ifstream in(entry.path());
    std::stringstream body;
    body << in.rdbuf();
    const std::string text = std::regex_replace(body.str(), std::regex("(^|\n)model: [^\n]*"),
                                                "$1model: " + testing::FixtureDir("qwen3_moe"));
    const std::string path = WriteConfig(dir, entry.path().filename().string(), text);
    const testing::CommandResult r = testing::RunMoeserve({"serve", "--config", path, "--node", "99"});
    EXPECT_EQ(r.exit_code, 2) << entry.path();
    EXPECT_THAT(r.err, HasSubstr("--node 99: " + path + " lists")) << entry.path() << ": " << r.err;
    ++checked;
  }
  EXPECT_GE(checked, 6);
}

}  // namespace
}  // namespace moe
