// Command-line flags of one subcommand: declared with their help text, parsed from
// `--name value` or `--name=value`, with clear errors for unknown or malformed flags.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/model.h"

namespace moe::deploy {

class Flags {
 public:
  Flags(std::string command, std::string summary) : command_(std::move(command)), summary_(std::move(summary)) {}

  // Declares a flag taking a value ("" default means "not set").
  void Add(const std::string& name, const std::string& value_name, const std::string& help,
           const std::string& default_value = "");
  // Declares a switch (no value).
  void AddSwitch(const std::string& name, const std::string& help);

  // kInvalidArgument naming the flag for an unknown flag or a missing value.
  absl::Status Parse(int argc, char** argv);
  // Parses; with --help prints the help and returns 0, on an error prints it and returns 2;
  // otherwise returns nothing and the command goes on. Needs a "help" switch declared.
  std::optional<int> ParseOrExit(int argc, char** argv);

  bool Has(const std::string& name) const;
  std::string Get(const std::string& name) const;
  bool Switch(const std::string& name) const { return Has(name); }
  // Typed getters: kInvalidArgument naming the flag when the value does not parse.
  absl::StatusOr<int64_t> Int(const std::string& name) const;
  absl::StatusOr<double> Double(const std::string& name) const;
  absl::StatusOr<std::string> Required(const std::string& name) const;

  std::string Help() const;

 private:
  struct Spec {
    std::string value_name, help, default_value;
    bool is_switch = false;
  };
  std::string command_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
};

// The expert-pool flags shared by the commands that load a model: --experts, --expert-format,
// --expert-group, --expert-kernel, --expert-threads, --expert-shm.
void AddExpertFlags(Flags& flags);
// kInvalidArgument naming the flag for a bad value.
absl::Status ReadExpertFlags(const Flags& flags, runtime::ModelOptions* options);

// "1,2,3" -> {1, 2, 3}; kInvalidArgument naming the bad element.
absl::StatusOr<std::vector<int32_t>> ParseIdList(const std::string& text, const std::string& flag);

}  // namespace moe::deploy
