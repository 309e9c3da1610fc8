// Bad input as a user or an attacker gives it to the `moeserve` binary: flags out of range,
// addresses in use, a context the model cannot hold, a model that computes NaN, SIGTERM with
// requests running. Each case must end in a clear error (exit 1 or 2, or a gRPC status), never a
// signal, a hang, or a file left behind. docs/bad-inputs.md lists them.
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../scheduler/src/test_pki.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
namespace pb = ::moeserve::v1;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

struct FlagCase {
  std::vector<std::string> args;
  int exit_code;
  std::string message;
};

TEST(BadFlagsTest, NumbersOutOfRangeAreRefusedBeforeAnythingRuns) {
  const std::string model = testing::FixtureDir("qwen3_moe");
  testing::ScratchDir dir;
  const std::vector<FlagCase> cases = {
      {{"make-model", "--vocab", "99999999999", "--out", dir / "m"},
       2,
       "--vocab: 99999999999 is not an integer in [1, 16777216]"},
      {{"make-model", "--layers", "4294967297", "--out", dir / "m"},
       2,
       "--layers: 4294967297 is not an integer in [1, 1024]"},
      {{"make-model", "--layers", "0", "--out", dir / "m"}, 2, "--layers: 0 is not an integer in [1, 1024]"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--max-new-tokens", "99999999999"},
       2,
       "--max-new-tokens: 99999999999 is not an integer in [0, 16777216]"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--seed", "99999999999999999999"},
       2,
       "--seed: 99999999999999999999 is not an integer"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--temperature", "nan"},
       2,
       "--temperature: nan is not a number in [0, 100]"},
      {{"serve", "--model", model, "--kv-cache-mb", "4294967297"},
       2,
       "--kv-cache-mb: 4294967297 is not an integer in [1, 1073741824]"},
      {{"serve", "--model", model, "--kv-cache-mb", "99999999", "--http", "off"},
       2,
       "--kv-cache-mb 99999999 is more than this machine's"},
      {{"serve", "--model", model, "--max-seqs", "99999999999"},
       2,
       "--max-seqs: 99999999999 is not an integer in [1, 4096]"},
      {{"serve", "--model", model, "--listen", "127.0.0.1:99999"},
       2,
       "--listen '127.0.0.1:99999': the port must be an integer in [0, 65535]"},
      {{"serve", "--model", model, "--http", "::1:8080"}, 2, "an IPv6 host goes in brackets"},
      {{"serve", "--model", model, "--ctx", "100000", "--http", "off"},
       2,
       "--ctx 100000 is beyond the model's max_position_embeddings (2048)"},
      {{"serve", "--model", model, "--ctx", "2048", "--kv-cache-mb", "1", "--http", "off"},
       2,
       "--ctx 2048 needs a KV cache of 2048 positions; --kv-cache-mb 1 holds 512"},
      {{"bench", "foo"}, 2, "moeserve bench: unknown command 'foo' (commands: experts, load, serve"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--tempreature", "1"}, 2, "unknown flag --tempreature"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "gpu"},
       2,
       "--device gpu: expected auto, cpu, cuda or cuda:N"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "cuda:x"},
       2,
       "--device cuda:x: the GPU index must be a number >= 0"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "cpu", "--cpu-moe"},
       2,
       "--cpu-moe, --n-cpu-moe and --override-tensor place routed experts beside a GPU; with --device cpu"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--n-cpu-moe", "2", "--experts", "gpu"},
       2,
       "--experts gpu keeps every routed expert off the CPU pool"},
      {{"serve", "--model", model, "--override-tensor", "experts"},
       2,
       "--override-tensor 'experts': expected REGEX=DEVICE"},
      {{"serve", "--model", model, "--override-tensor", "(experts=cpu"},
       2,
       "--override-tensor '(experts=cpu': '(experts' is not a valid regex"},
      {{"serve", "--model", model, "--override-tensor", "experts=tpu"},
       2,
       "--override-tensor 'experts=tpu': the device 'tpu' is not cpu, cuda or cuda:N"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "cpu", "--gpu-experts-per-layer", "4"},
       2,
       "--gpu-experts-per-layer holds some of the CPU layers' experts on a GPU: it needs a GPU device"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--cpu-moe", "--gpu-experts-per-layer", "4",
        "--gpu-experts-refresh-steps", "0"},
       2,
       "--gpu-experts-refresh-steps: 0 is not an integer in [1, 1073741824]"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--defer-experts", "99"},
       2,
       "--defer-experts: 99 is not an integer in [0, 64]"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--defer-experts", "1", "--experts", "reference"},
       2,
       "--defer-experts finishes routed experts in the CPU pool beside the next layer's attention"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "cuda", "--defer-experts", "1"},
       2,
       "--defer-experts finishes routed experts in the CPU pool"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "cpu", "--kv-cache-dtype", "fp8"},
       2,
       "--kv-cache-dtype fp8: the CPU backend keeps its KV cache in fp32"},
      {{"serve", "--model", model, "--kv-cache-dtype", "fp4"}, 2, "--kv-cache-dtype: fp4 not in {auto,bf16,fp8}"},
      {{"inspect", "--model", model, "--kv-cache-dtype", "fp16"}, 2, "--kv-cache-dtype: fp16 not in {bf16,fp8}"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--device", "cuda", "--weight-format", "int8"},
       2,
       "--weight-format int8 packs the CPU backend's weights; on a GPU they are bf16"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--weight-format", "int3"},
       2,
       "--weight-format: int3 not in {bf16,int8,int4}"},
      {{"generate", "--model", model, "--prompt-ids", "1", "--shared-threads", "yes"},
       2,
       "--shared-threads: yes not in {on,off}"},
      {{"serve", "--model", model, "--cpu-moe", "--prefill-offload-tokens", "-1"},
       2,
       "--prefill-offload-tokens: -1 is not an integer in [0, 1048576]"},
      {{"serve", "--model", model, "--device", "cpu", "--experts", "gpu"}, 2, "--experts gpu needs a GPU"},
  };
  for (const FlagCase& c : cases) {
    auto r = testing::RunMoeserve(c.args);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args[0] << " " << c.args[1] << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.args[0];
  }
  EXPECT_FALSE(fs::exists(dir / "m"));  // nothing written for a refused make-model
}

// A GPU that is not there is a runtime error (exit 1) naming what there is: on a machine without
// one, that none is visible (or that the build has no CUDA); with GPUs, how many.
TEST(BadFlagsTest, AnAbsentGpuIsAClearError) {
  const std::string model = testing::FixtureDir("qwen3_moe");
  for (const char* device : {"cuda:7", "cuda"}) {
    auto r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1", "--device", device});
    if (std::string(device) == "cuda" && r.exit_code == 0) continue;  // a machine with a GPU runs it
    EXPECT_EQ(r.exit_code, 1) << device << ": " << r.err;
    EXPECT_THAT(r.err,
                ::testing::AnyOf(HasSubstr("no GPU is visible"), HasSubstr("there is no GPU 7; this machine has"),
                                 HasSubstr("this build of moeserve has no CUDA backend")))
        << device;
  }
}

TEST(BadFlagsTest, MoreThreadsThanCoresWarns) {
  auto r = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("qwen3_moe"), "--prompt-ids", "1,2",
                                 "--max-new-tokens", "2", "--threads", "1000", "--expert-threads", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("warning: --threads 1000 is more than the"));
}

// A listening socket on a free loopback port, without SO_REUSEPORT; closed on destruction.
class HeldPort {
 public:
  HeldPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 4), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~HeldPort() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::unique_ptr<pb::Generation::Stub> Connect(int port) {
  return pb::Generation::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

TEST(ServeProcessTest, ASecondServerOnAPortInUseFailsInsteadOfSharingIt) {
  const std::string model = testing::FixtureDir("qwen3_moe");
  testing::ServeProcess first(
      {"--model", model, "--listen", "127.0.0.1:0", "--http", "off", "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(first.port(), 0) << first.err();
  const std::string taken = "127.0.0.1:" + std::to_string(first.port());
  auto r = testing::RunMoeserve(
      {"serve", "--model", model, "--listen", taken, "--http", "off", "--threads", "1", "--expert-threads", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot listen on " + taken + ": the address is in use"));
  HeldPort held;  // the HTTP listener likewise
  r = testing::RunMoeserve({"serve", "--model", model, "--listen", "127.0.0.1:0", "--http",
                            "127.0.0.1:" + std::to_string(held.port()), "--threads", "1", "--expert-threads", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("127.0.0.1:" + std::to_string(held.port())));
  EXPECT_EQ(first.Stop(SIGTERM), 0);
}

TEST(ServeProcessTest, ContextLengthIsWhatTheKvCacheHolds) {
  // 1 MiB of KV cache holds 512 positions of the tiny qwen3_moe (4 layers, 2 KV heads of 32).
  testing::ServeProcess serve({"--model", testing::FixtureDir("qwen3_moe"), "--listen", "127.0.0.1:0", "--http", "off",
                               "--kv-cache-mb", "1", "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  EXPECT_THAT(serve.err(), HasSubstr("holds 512 positions, less than the model's context of 2048"));
  auto stub = Connect(serve.port());
  grpc::ClientContext ctx;
  pb::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.context_length(), 512);
  // A prompt longer than that is blamed on the prompt.
  pb::GenerateRequest request;
  for (int i = 0; i < 600; ++i) request.add_token_ids(i % 500);
  grpc::ClientContext gen_ctx;
  auto reader = stub->Generate(&gen_ctx, request);
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("token_ids: prompt of 600 tokens"));
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
}

// Streams one request on its own thread: the status and the tokens it got.
struct Streamed {
  grpc::Status status;
  int tokens = 0;
};

Streamed StreamOne(pb::Generation::Stub* stub, int max_new_tokens, std::atomic<int>* seen = nullptr) {
  pb::GenerateRequest request;
  for (int id : {5, 6, 7}) request.add_token_ids(id);
  request.mutable_stopping()->set_max_new_tokens(max_new_tokens);
  request.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, request);
  pb::GenerateResponse msg;
  Streamed result;
  while (reader->Read(&msg)) {
    result.tokens += msg.token_ids_size();
    if (seen != nullptr) *seen = result.tokens;
  }
  result.status = reader->Finish();
  return result;
}

TEST(ServeProcessTest, SigtermDrainsThenCutsOffWithUnavailableAndLogsEachRequest) {
  testing::ServeProcess serve({"--model", testing::FixtureDir("qwen3_moe"), "--listen", "127.0.0.1:0", "--http", "off",
                               "--drain-seconds", "0", "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = Connect(serve.port());
  const Streamed done = StreamOne(stub.get(), 3);
  ASSERT_TRUE(done.status.ok()) << done.status.error_message();
  // A stream still running when the drain ends (at once: --drain-seconds 0) is cut off with
  // UNAVAILABLE and a message. (That running requests finish within the drain: server_test.)
  std::atomic<int> seen{0};
  Streamed cut;
  std::thread long_stream([&] { cut = StreamOne(stub.get(), 2000, &seen); });
  while (seen < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  serve.Signal(SIGTERM);
  long_stream.join();
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(cut.status.error_message(), HasSubstr("server shutting down"));
  EXPECT_LT(cut.tokens, 2000);
  EXPECT_EQ(serve.Wait(), 0);
  const std::string err = serve.err();
  EXPECT_THAT(err, HasSubstr("draining"));
  EXPECT_THAT(err, HasSubstr("1 requests cut off"));
  // One JSON line per request, with its id, peer, tokens, finish reason and times.
  int lines = 0;
  std::istringstream in(err);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("{\"event\":\"request\"", 0) != 0) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    ++lines;
    EXPECT_THAT(j["peer"].get<std::string>(), HasSubstr("127.0.0.1"));
    EXPECT_EQ(j["prompt_tokens"], 3);
    EXPECT_TRUE(j.contains("ttft_ms") && j.contains("queue_ms") && j.contains("total_ms")) << line;
    if (j["status"] == "OK") {
      EXPECT_EQ(j["output_tokens"], 3);
      EXPECT_EQ(j["finish_reason"], "length");
    } else {
      EXPECT_EQ(j["status"], "UNAVAILABLE");
    }
  }
  EXPECT_EQ(lines, 2) << err;
}

// A second SIGTERM during a drain ends it at once: the stream still running (it would have had an
// hour) is cut off with UNAVAILABLE and the process exits 0.
TEST(ServeProcessTest, ASecondSigtermEndsTheDrainAtOnce) {
  testing::ServeProcess serve({"--model", testing::FixtureDir("qwen3_moe"), "--listen", "127.0.0.1:0", "--http", "off",
                               "--drain-seconds", "3600", "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = Connect(serve.port());
  std::atomic<int> seen{0};
  Streamed cut;
  const int n = 2040;  // the context (2048) less the prompt
  std::thread long_stream([&] { cut = StreamOne(stub.get(), n, &seen); });
  for (int i = 0; i < 6000 && seen < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  serve.Signal(SIGTERM);
  for (int i = 0; i < 1000 && serve.err().find("draining") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  serve.Signal(SIGTERM);
  long_stream.join();
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::UNAVAILABLE) << cut.status.error_message();
  EXPECT_LT(cut.tokens, n);
  EXPECT_EQ(serve.Wait(), 0);
  EXPECT_THAT(serve.err(), HasSubstr("a second signal: the drain ended at once"));
}

// A copy of the fixture with bf16 NaN in the final norm's weight: it loads, and every logit of
// every position is NaN.
void CopyWithNanFinalNorm(const std::string& dir) {
  testing::CopyFixture("qwen3_moe", dir);
  testing::RewriteWeights(
      dir, [](runtime::TensorEntry&) { return true; },
      [](const runtime::TensorEntry& e, std::string* bytes) {
        if (e.name != "model.norm.weight") return;
        for (size_t i = 0; i + 1 < bytes->size(); i += 2) {
          (*bytes)[i] = static_cast<char>(0xc0);  // bf16 0x7fc0: a quiet NaN
          (*bytes)[i + 1] = static_cast<char>(0x7f);
        }
      });
}

TEST(NonFiniteLogitsTest, GenerateFailsAndWritesNoLogits) {
  testing::ScratchDir dir;
  CopyWithNanFinalNorm(dir / "nan");
  auto r = testing::RunMoeserve(
      {"generate", "--model", dir / "nan", "--prompt-ids", "1,2,3", "--dump-logits", dir / "logits.json"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("the model computed a non-finite logit (NaN"));
  EXPECT_FALSE(fs::exists(dir / "logits.json"));
  EXPECT_THAT(r.out, Not(HasSubstr("generated")));
}

TEST(NonFiniteLogitsTest, ServeFailsTheRequestAndFreesItsBlocks) {
  testing::ScratchDir dir;
  CopyWithNanFinalNorm(dir / "nan");
  testing::ServeProcess serve({"--model", dir / "nan", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads",
                               "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = Connect(serve.port());
  for (int i = 0; i < 2; ++i) {  // the server goes on after the first
    const Streamed s = StreamOne(stub.get(), 4);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INTERNAL);
    EXPECT_THAT(s.status.error_message(), HasSubstr("non-finite logit"));
    EXPECT_EQ(s.tokens, 0);
  }
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
  EXPECT_THAT(serve.err(), HasSubstr("0 requests cut off"));
}

// The Python example client, as a user runs it against `serve`; its output and exit code.
testing::CommandResult RunPythonClient(int port, const std::string& extra) {
  const std::string cmd = "PYTHONPATH=" + std::string(MOE_BINARY_DIR) + "/python /usr/bin/python3 " +
                          std::string(MOE_SOURCE_DIR) +
                          "/examples/stream_client.py --target localhost:" + std::to_string(port) +
                          " --prompt-ids 5,6,7 --max-new-tokens 4 " + extra + " 2>&1";
  testing::CommandResult r;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[512];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) r.out.append(buf, n);
    const int status = ::pclose(p);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  return r;
}

std::string Curl(const std::string& args) {
  std::string out;
  if (FILE* p = ::popen(("curl -sS --max-time 10 " + args + " 2>&1; echo \" curl=$?\"").c_str(), "r")) {
    char buf[512];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
    ::pclose(p);
  }
  return out;
}

TEST(SecureServeTest, TlsAndApiKeysForTheGrpcClientAndHttps) {
  scheduler::internal::TestPki pki;
  ASSERT_TRUE(pki.ok()) << "openssl failed in " << pki.dir();
  testing::ScratchDir dir;
  std::ofstream(dir / "keys") << "# one key per line\nsecret-key-1\n";
  testing::ServeProcess serve({"--model", testing::FixtureDir("qwen3_moe"), "--listen", "127.0.0.1:0", "--http",
                               "127.0.0.1:0", "--tls-cert", pki.Path("server.pem"), "--tls-key", pki.Path("server.key"),
                               "--api-key-file", dir / "keys", "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  const std::string ca = " --ca-cert " + pki.Path("ca.pem");
  auto r = RunPythonClient(serve.port(), ca + " --api-key secret-key-1");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, AllOf(HasSubstr("tokens:"), HasSubstr("finished: FINISH_REASON_LENGTH, 4 tokens")));
  r = RunPythonClient(serve.port(), ca);  // no key
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("UNAUTHENTICATED: missing API key"));
  r = RunPythonClient(serve.port(), ca + " --api-key wrong");
  EXPECT_THAT(r.out, HasSubstr("UNAUTHENTICATED: invalid API key"));
  EXPECT_THAT(serve.err(), Not(HasSubstr("secret-key-1")));  // keys are never logged

  // HTTPS: /metrics open (no --api-key-protect-metrics), read with the CA; it counts the rejections.
  const std::string http_port = serve.err().substr(serve.err().find("HTTP on port ") + 13);
  const std::string url = "https://localhost:" + std::to_string(std::atoi(http_port.c_str())) + "/metrics";
  const std::string metrics = Curl("--cacert " + pki.Path("ca.pem") + " " + url);
  EXPECT_THAT(metrics, HasSubstr("moeserve_requests_rejected_total{code=\"UNAUTHENTICATED\"} 2"));
  EXPECT_THAT(metrics, HasSubstr("curl=0"));
  EXPECT_THAT(Curl(url), Not(HasSubstr("curl=0")));  // an unknown CA is refused
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
}

TEST(SecureServeTest, MutualTlsNeedsAClientCertificateFromTheCa) {
  scheduler::internal::TestPki pki;
  ASSERT_TRUE(pki.ok()) << "openssl failed in " << pki.dir();
  testing::ServeProcess serve({"--model", testing::FixtureDir("qwen3_moe"), "--listen", "127.0.0.1:0", "--http", "off",
                               "--tls-cert", pki.Path("server.pem"), "--tls-key", pki.Path("server.key"),
                               "--tls-client-ca", pki.Path("ca.pem"), "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  const std::string ca = " --ca-cert " + pki.Path("ca.pem");
  auto r = RunPythonClient(serve.port(),
                           ca + " --client-cert " + pki.Path("client.pem") + " --client-key " + pki.Path("client.key"));
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("finished: FINISH_REASON_LENGTH, 4 tokens"));
  r = RunPythonClient(serve.port(), ca);  // no client certificate
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("UNAVAILABLE"));
  r = RunPythonClient(serve.port(),
                      ca + " --client-cert " + pki.Path("stranger.pem") + " --client-key " + pki.Path("stranger.key"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
}

TEST(SecureServeTest, BadTlsAndKeyFilesAreUsageErrors) {
  testing::ScratchDir dir;
  std::ofstream(dir / "empty-keys") << "# nothing\n";
  const std::string model = testing::FixtureDir("qwen3_moe");
  auto r = testing::RunMoeserve(
      {"serve", "--model", model, "--tls-cert", dir / "missing.pem", "--tls-key", dir / "missing.key"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("missing.pem"));
  r = testing::RunMoeserve({"serve", "--model", model, "--api-key-file", dir / "empty-keys"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("no key in it"));
  r = testing::RunMoeserve({"serve", "--model", model, "--api-key-protect-metrics"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--api-key-protect-metrics needs --api-key-file"));
}

TEST(ServeProcessTest, AMessageOverMaxRequestBytesIsRefusedAndTheServerGoesOn) {
  testing::ServeProcess serve({"--model", testing::FixtureDir("qwen3_moe"), "--listen", "127.0.0.1:0", "--http", "off",
                               "--max-request-bytes", "1024", "--threads", "1", "--expert-threads", "1"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = Connect(serve.port());
  pb::GenerateRequest big;
  for (int i = 0; i < 1000; ++i) big.add_token_ids(300 + i % 200);  // two bytes each: about 2 KB
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, big);
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  const grpc::Status refused = reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_FALSE(refused.error_message().empty());
  grpc::ClientContext info_ctx;
  pb::ModelInfo info;
  EXPECT_TRUE(stub->GetModelInfo(&info_ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(serve.Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace moe
