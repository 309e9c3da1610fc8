#include "test_util.h"

#include <csignal>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include "gtest/gtest.h"
#include "moe/runtime/weight_source.h"

namespace moe::testing {

namespace fs = std::filesystem;

std::string TestdataDir() {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return env != nullptr ? env : MOE_TESTDATA_DIR;
}

std::string FixtureDir(const std::string& arch) { return TestdataDir() + "/fixtures/" + arch; }

nlohmann::json LoadGolden(const std::string& arch) {
  std::ifstream in(FixtureDir(arch) + "/golden.json");
  return nlohmann::json::parse(in);
}

ScratchDir::ScratchDir() {
  static std::atomic<int> counter{0};
  path_ = fs::temp_directory_path() / ("moeserve_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  fs::remove_all(path_);
  fs::create_directories(path_);
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void CopyFixture(const std::string& arch, const std::string& dir) {
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(FixtureDir(arch) + "/" + f, dir + "/" + f, fs::copy_options::overwrite_existing);
    fs::permissions(dir + "/" + f, fs::perms::owner_write, fs::perm_options::add);
  }
}

void EditConfig(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  {
    std::ifstream in(dir + "/config.json");
    j = nlohmann::json::parse(in);
  }
  edit(j);
  std::ofstream(dir + "/config.json", std::ios::trunc) << j.dump(2);
}

void RewriteWeights(const std::string& dir, const std::function<bool(runtime::TensorEntry&)>& edit,
                    const std::function<void(const runtime::TensorEntry&, std::string*)>& edit_bytes) {
  const std::string path = dir + "/model.safetensors";
  std::vector<runtime::TensorEntry> entries;
  std::vector<std::string> bytes;
  {
    auto source = runtime::OpenSafetensorsFile(path);
    ASSERT_TRUE(source.ok()) << source.status();
    for (const std::string& name : (*source)->Names()) {
      auto view = (*source)->Get(name);
      runtime::TensorEntry e{name, view->dtype, view->shape};
      if (!edit(e)) continue;
      std::string b(static_cast<const char*>(view->data), view->bytes());
      b.resize(e.bytes(), '\0');
      if (edit_bytes) edit_bytes(e, &b);
      entries.push_back(e);
      bytes.push_back(std::move(b));
    }
  }
  auto writer = runtime::SafetensorsWriter::Create(path, entries);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (size_t i = 0; i < entries.size(); ++i) std::memcpy(writer->data(i), bytes[i].data(), bytes[i].size());
  ASSERT_TRUE(writer->Finish().ok());
}

CommandResult RunMoeserve(const std::vector<std::string>& args) {
  ScratchDir scratch;
  const std::string out_path = scratch / "stdout", err_path = scratch / "stderr";
  CommandResult result;
  std::fflush(stdout);  // or the child would write our buffered output again
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid == 0) {
    const char* bin_dir = std::getenv("MOE_BINARY_DIR");
    std::vector<std::string> argv_storage = {std::string(bin_dir != nullptr ? bin_dir : MOE_BINARY_DIR) + "/moeserve"};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_storage) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (!std::freopen(out_path.c_str(), "w", stdout) || !std::freopen(err_path.c_str(), "w", stderr)) _exit(126);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  auto slurp = [](const std::string& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  result.out = slurp(out_path);
  result.err = slurp(err_path);
  return result;
}

ServeProcess::ServeProcess(const std::vector<std::string>& args) {
  int out[2];
  if (::pipe(out) != 0) return;
  const std::string err_path = scratch_ / "stderr";
  std::fflush(stdout);
  std::fflush(stderr);
  pid_ = ::fork();
  if (pid_ == 0) {
    const char* bin_dir = std::getenv("MOE_BINARY_DIR");
    std::vector<std::string> argv_storage = {std::string(bin_dir != nullptr ? bin_dir : MOE_BINARY_DIR) + "/moeserve",
                                             "serve"};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_storage) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::dup2(out[1], 1);
    ::close(out[0]);
    if (!std::freopen(err_path.c_str(), "w", stderr)) _exit(126);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  ::close(out[1]);
  std::string printed;
  char c;
  while (printed.find('\n') == std::string::npos && ::read(out[0], &c, 1) == 1) printed += c;
  ::close(out[0]);
  const std::string marker = "serving on port ";
  if (const size_t at = printed.find(marker); at != std::string::npos) {
    port_ = std::atoi(printed.c_str() + at + marker.size());
  } else {
    Wait();
  }
}

ServeProcess::~ServeProcess() {
  if (exit_code_ < 0 && pid_ > 0) Stop(SIGKILL);
}

int ServeProcess::Stop(int signal) {
  if (exit_code_ >= 0 || pid_ <= 0) return exit_code_;
  ::kill(pid_, signal);
  return Wait();
}

void ServeProcess::Signal(int signal) {
  if (exit_code_ < 0 && pid_ > 0) ::kill(pid_, signal);
}

int ServeProcess::Wait() {
  if (exit_code_ >= 0 || pid_ <= 0) return exit_code_;
  int status = 0;
  ::waitpid(pid_, &status, 0);
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return exit_code_;
}

std::string ServeProcess::err() const {
  std::ifstream in(scratch_ / "stderr");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::vector<float>> FullForward(runtime::Model& model, const std::vector<int32_t>& ids) {
  const int blocks = runtime::BlocksFor(ids.size(), 16);
  auto cache = model.NewKvCache(blocks);
  EXPECT_TRUE(cache.ok());
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  runtime::ForwardBatch batch;
  batch.token_ids = ids;
  batch.sequences = {runtime::SequenceChunk{0, static_cast<int32_t>(ids.size()), table}};
  batch.logit_rows.resize(ids.size());
  std::iota(batch.logit_rows.begin(), batch.logit_rows.end(), 0);
  std::vector<float> logits;
  const absl::Status st = model.Forward(batch, **cache, &logits);
  EXPECT_TRUE(st.ok()) << st;
  if (!st.ok()) return {};
  const int vocab = model.spec().vocab_size;
  std::vector<std::vector<float>> rows;
  for (size_t i = 0; i < ids.size(); ++i) rows.emplace_back(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
  return rows;
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

}  // namespace moe::testing
