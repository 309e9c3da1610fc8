// The command line of `moeserve`, on CLI11: one declaration per flag gives its type, range,
// default and help. Values are range-checked from their text, before conversion, so that a
// number too large for its type is an error rather than a wrapped or saturated value.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "moe/runtime/model.h"
#include "moe/runtime/speculative.h"

namespace moe::deploy {

// What a subcommand runs once its flags parsed: the process exit code (0 success, 1 a runtime
// error, 2 a usage error).
using CommandRun = std::function<int()>;

// Declares `name` under `parent`; its callback stores `run` in `*selected` after a successful
// parse, so that main runs exactly the command the user named.
CLI::App* AddCommand(CLI::App& parent, const std::string& name, const std::string& summary,
                     const std::string& description, CommandRun run, CommandRun* selected);

// Prints "moeserve COMMAND: error: MESSAGE" on stderr and returns `code` (the exit code).
int FailCommand(const std::string& command, const absl::Status& status, int code = 1);

// Validators on the flag's text: an integer (decimal, no fraction, no overflow) or a finite
// number within [min, max]. The message names the range: "99999999999 is not an integer in
// [1, 1048576]".
CLI::Validator IntIn(int64_t min, int64_t max);
CLI::Validator NumberIn(double min, double max);

// A comma-separated list of integers in [min, max], e.g. --batches 1,4,16.
CLI::Validator IntListIn(int64_t min, int64_t max);
absl::StatusOr<std::vector<int>> ParseIntList(const std::string& text, const std::string& flag);

// "1,2,3" -> {1, 2, 3}; kInvalidArgument naming the bad element.
absl::StatusOr<std::vector<int32_t>> ParseIdList(const std::string& text, const std::string& flag);

// HOST:PORT with the port in 0..65535 (0 picks a free one), IPv6 hosts in brackets ([::1]:PORT).
absl::Status CheckListenAddress(const std::string& address, const std::string& flag);

// The CPU threads of this process (its affinity mask), for defaults and warnings.
int AvailableCores();
// A warning on stderr when `threads` is more than the cores this process may use: the extra
// threads only share cores, which slows every step.
void WarnIfMoreThreadsThanCores(int threads, const std::string& flag, const std::string& command);

// The expert-pool flags shared by the commands that load a model: --experts, --expert-format,
// --expert-group, --expert-kernel, --expert-threads, --expert-linger-us, --expert-shm,
// --shared-threads, and the placement of routed experts beside a GPU: --cpu-moe, --n-cpu-moe,
// --override-tensor.
struct ExpertFlags {
  std::string mode = "auto";
  std::string format = "auto";
  int group = 32;
  std::string kernel;
  int threads = 0;
  std::optional<int64_t> linger_us;
  std::string shm;
  std::string shared_threads = "on";
  // Hybrid execution on a GPU: which layers' routed experts stay in the CPU pool.
  bool cpu_moe = false;
  int n_cpu_moe = 0;
  std::vector<std::string> override_tensor;
  int gpu_experts_per_layer = 0;
  std::string weight_format = "bf16";
  std::optional<int> prefill_offload_tokens;
  std::string expert_profile;
  int defer_experts = 0;
  int gpu_experts_refresh_steps = 256;

  // True when a placement flag asks for routed experts in the CPU pool beside a GPU.
  bool Hybrid() const { return mode == "pool" || cpu_moe || n_cpu_moe > 0 || !override_tensor.empty(); }
  void Add(CLI::App* app);
  // kInvalidArgument naming the flag for a value the pool cannot take.
  absl::Status Apply(runtime::ModelOptions* options, const std::string& command) const;
};

// Speculative decoding's flags, shared by serve, generate and bench serve: --spec-type,
// --spec-n-max, --spec-adaptive, --draft-model, --draft-device.
struct SpecFlags {
  std::string type = "off";
  int n_max = 3;
  std::string adaptive = "on";
  std::string draft_model, draft_device;

  void Add(CLI::App* app);
  // The settings the flags give; kInvalidArgument naming the flag for a bad combination,
  // kFailedPrecondition for a method this build cannot run (mtp, draft).
  absl::StatusOr<runtime::SpeculativeConfig> Config() const;
};

// Logit rows a step may ask for: one per running sequence, and one more per draft it carries.
int MaxLogitRows(int max_seqs, int max_batch_tokens, const runtime::SpeculativeConfig& speculative);

}  // namespace moe::deploy
