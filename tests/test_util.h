// Helpers for the integration tests: fixture paths, scratch directories, broken copies of a
// fixture model, and running the real `moeserve` binary.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "moe/runtime/model.h"
#include "moe/runtime/safetensors_writer.h"
#include "nlohmann/json.hpp"

namespace moe::testing {

// testdata/ of the source tree, or $MOE_TESTDATA_DIR when set (tests run from a bundle on
// another machine); the moeserve binary likewise comes from $MOE_BINARY_DIR when set.
std::string TestdataDir();
std::string FixtureDir(const std::string& arch);

// Logits of every position of `ids`, computed in one step on a fresh cache.
std::vector<std::vector<float>> FullForward(runtime::Model& model, const std::vector<int32_t>& ids);
float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b);
nlohmann::json LoadGolden(const std::string& arch);

// A fresh directory under the system temp dir, removed on destruction.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Copies fixture `arch` into `dir` (config, weights, tokenizer).
void CopyFixture(const std::string& arch, const std::string& dir);
void EditConfig(const std::string& dir, const std::function<void(nlohmann::json&)>& edit);
// Rewrites dir/model.safetensors: `edit` sees every tensor with its bytes and may change the
// entry (shape, dtype; the bytes are cut or zero-padded to fit) or return false to drop it.
// `edit_bytes`, when given, may then change each kept tensor's bytes in place.
void RewriteWeights(const std::string& dir, const std::function<bool(runtime::TensorEntry&)>& edit,
                    const std::function<void(const runtime::TensorEntry&, std::string*)>& edit_bytes = nullptr);

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
// Runs the built `moeserve` binary with `args`, capturing stdout and stderr.
CommandResult RunMoeserve(const std::vector<std::string>& args);

// `moeserve serve ARGS` as a child process: started, waited on until it prints "serving on port
// N" (or exits), stderr kept in a file. The destructor kills a child still running.
class ServeProcess {
 public:
  explicit ServeProcess(const std::vector<std::string>& args);
  ~ServeProcess();
  int port() const { return port_; }  // 0 if it never served
  // Sends `signal` and waits for the exit: the exit code, or 128 + the signal that ended it.
  int Stop(int signal);
  void Signal(int signal);  // sends it without waiting
  int Wait();  // for a child that exits by itself
  std::string err() const;  // what it wrote to stderr so far

 private:
  ScratchDir scratch_;
  int pid_ = -1;
  int port_ = 0;
  int exit_code_ = -1;
};

}  // namespace moe::testing
