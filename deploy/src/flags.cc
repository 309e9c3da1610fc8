#include "flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "moe/core/status.h"

namespace moe::deploy {

void Flags::Add(const std::string& name, const std::string& value_name, const std::string& help,
                const std::string& default_value) {
  order_.push_back(name);
  specs_[name] = Spec{value_name, help, default_value, false};
}

void Flags::AddSwitch(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{"", help, "", true};
}

absl::Status Flags::Parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "' (flags start with --)"));
    }
    std::string name(arg), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto spec = specs_.find(name);
    if (spec == specs_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see moeserve ", command_, " --help)"));
    }
    if (spec->second.is_switch) {
      if (has_value) return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      values_[name] = "1";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      value = argv[++i];
    }
    values_[name] = value;
  }
  return absl::OkStatus();
}

std::optional<int> Flags::ParseOrExit(int argc, char** argv) {
  if (absl::Status s = Parse(argc, argv); !s.ok()) {
    std::cerr << "moeserve " << command_ << ": error: " << s.message() << "\n";
    return 2;
  }
  if (Switch("help")) {
    std::cout << Help();
    return 0;
  }
  return std::nullopt;
}

bool Flags::Has(const std::string& name) const {
  return values_.count(name) > 0 || !specs_.at(name).default_value.empty();
}

std::string Flags::Get(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() ? it->second : specs_.at(name).default_value;
}

absl::StatusOr<std::string> Flags::Required(const std::string& name) const {
  if (!Has(name) || Get(name).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " is required (see moeserve ", command_, " --help)"));
  }
  return Get(name);
}

absl::StatusOr<int64_t> Flags::Int(const std::string& name) const {
  int64_t v;
  if (!absl::SimpleAtoi(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be an integer, got '", Get(name), "'"));
  }
  return v;
}

absl::StatusOr<double> Flags::Double(const std::string& name) const {
  double v;
  if (!absl::SimpleAtod(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be a number, got '", Get(name), "'"));
  }
  return v;
}

std::string Flags::Help() const {
  std::string s = absl::StrCat("usage: moeserve ", command_, " [flags]\n\n", summary_, "\n\nflags:\n");
  for (const std::string& name : order_) {
    const Spec& spec = specs_.at(name);
    std::string left = absl::StrCat("  --", name, spec.is_switch ? "" : " " + spec.value_name);
    if (left.size() < 28) left.append(28 - left.size(), ' ');
    absl::StrAppend(&s, left, " ", spec.help);
    if (!spec.default_value.empty()) absl::StrAppend(&s, " (default ", spec.default_value, ")");
    absl::StrAppend(&s, "\n");
  }
  return s;
}

void AddExpertFlags(Flags& flags) {
  flags.Add("experts", "pool|reference",
            "where routed experts run: the CPU expert pool, or the plain reference path", "pool");
  flags.Add("expert-format", "bf16|int8|int4", "packed format of the expert pool's weights", "bf16");
  flags.Add("expert-group", "N", "int4 scale group size: 32, 64 or 128", "32");
  flags.Add("expert-kernel", "NAME",
            "force a kernel: portable, avx512, avx512bf16, vnni, amx (default: chosen per call)");
  flags.Add("expert-threads", "N", "expert pool threads; 0 uses every core", "0");
  flags.Add("expert-linger-us", "US",
            "microseconds the pool's threads stay awake after a MoE layer, ready for the next (default: 0 on the "
            "CPU backend, whose own threads need the cores between layers; 2000 with the forward on a GPU)");
  flags.Add("expert-shm", "NAME",
            "keep the packed experts in shared memory /dev/shm/NAME (and NAME.1, ... when large); later processes attach "
            "instead of loading");
}

absl::Status ReadExpertFlags(const Flags& flags, runtime::ModelOptions* options) {
  const std::string mode = flags.Get("experts");
  if (mode == "reference") {
    options->experts = runtime::RoutedExpertsMode::kReference;
  } else if (mode != "pool") {
    return absl::InvalidArgumentError("--experts must be pool or reference, got '" + mode + "'");
  }
  experts::ExpertPoolOptions& pool = options->pool;
  MOE_ASSIGN_OR_RETURN(pool.format, experts::ParseFormat(flags.Get("expert-format")));
  MOE_ASSIGN_OR_RETURN(int64_t group, flags.Int("expert-group"));
  MOE_ASSIGN_OR_RETURN(int64_t threads, flags.Int("expert-threads"));
  pool.group = static_cast<int>(group);
  pool.threads = static_cast<int>(threads);
  if (flags.Has("expert-linger-us")) {
    MOE_ASSIGN_OR_RETURN(int64_t linger_us, flags.Int("expert-linger-us"));
    if (linger_us < 0) return absl::InvalidArgumentError("--expert-linger-us must be at least 0");
    options->expert_linger_us = linger_us;
  }
  if (flags.Has("expert-kernel")) {
    MOE_ASSIGN_OR_RETURN(pool.kernel, experts::ParseKernel(flags.Get("expert-kernel")));
  }
  pool.shm_name = flags.Get("expert-shm");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ParseIdList(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int32_t id;
    if (part.empty() || !absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not a token id (want e.g. 1,2,3)"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace moe::deploy
