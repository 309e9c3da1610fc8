#include "flags.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "moe/core/status.h"

namespace moe::deploy {

CLI::App* AddCommand(CLI::App& parent, const std::string& name, const std::string& summary,
                     const std::string& description, CommandRun run, CommandRun* selected) {
  CLI::App* app = parent.add_subcommand(name, summary);
  app->footer(description);
  app->callback([run = std::move(run), selected] { *selected = run; });
  return app;
}

namespace {

// The integer's value if `text` is one (decimal, optional sign, nothing else), in int64.
std::optional<int64_t> StrictInt(const std::string& text) {
  int64_t v;
  if (!absl::SimpleAtoi(text, &v)) return std::nullopt;
  return v;
}

std::string Range(int64_t min, int64_t max) { return absl::StrCat("[", min, ", ", max, "]"); }

}  // namespace

CLI::Validator IntIn(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        const std::optional<int64_t> v = StrictInt(text);
        if (!v || *v < min || *v > max) return absl::StrCat(text, " is not an integer in ", Range(min, max));
        return "";
      },
      absl::StrCat("INT in ", Range(min, max)));
}

CLI::Validator NumberIn(double min, double max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        double v;
        if (!absl::SimpleAtod(text, &v) || !std::isfinite(v) || v < min || v > max) {
          return absl::StrFormat("%s is not a number in [%g, %g]", text, min, max);
        }
        return "";
      },
      absl::StrFormat("NUMBER in [%g, %g]", min, max));
}

CLI::Validator IntListIn(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        for (absl::string_view part : absl::StrSplit(text, ',')) {
          const std::optional<int64_t> v = StrictInt(std::string(absl::StripAsciiWhitespace(part)));
          if (!v || *v < min || *v > max) {
            return absl::StrCat("'", part, "' is not an integer in ", Range(min, max), " (want e.g. 1,4,16)");
          }
        }
        return "";
      },
      absl::StrCat("LIST of INT in ", Range(min, max)));
}

absl::StatusOr<std::vector<int>> ParseIntList(const std::string& text, const std::string& flag) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not an integer"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": the list is empty"));
  return out;
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

absl::Status CheckListenAddress(const std::string& address, const std::string& flag) {
  const size_t colon = address.rfind(':');
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " '", address, "': ", why));
  };
  if (colon == std::string::npos || colon == 0) return bad("want HOST:PORT, e.g. 127.0.0.1:50051 or [::1]:50051");
  const std::string host = address.substr(0, colon);
  if (host.find(':') != std::string::npos && (host.front() != '[' || host.back() != ']')) {
    return bad("an IPv6 host goes in brackets, e.g. [::1]:50051");
  }
  int64_t port;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return bad("the port must be an integer in [0, 65535] (0 picks a free one)");
  }
  return absl::OkStatus();
}

int AvailableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void WarnIfMoreThreadsThanCores(int threads, const std::string& flag, const std::string& command) {
  const int cores = AvailableCores();
  if (threads > cores) {
    std::cerr << absl::StrFormat(
        "moeserve %s: warning: --%s %d is more than the %d cores this process may use; the extra threads only "
        "share cores and slow every step (0 uses every core)\n",
        command, flag, threads, cores);
  }
}

int FailCommand(const std::string& command, const absl::Status& status, int code) {
  std::cerr << "moeserve " << command << ": error: " << status.message() << "\n";
  return code;
}

void ExpertFlags::Add(CLI::App* app) {
  app->add_option("--experts", mode,
                  "where routed experts run: auto (the CPU expert pool on the CPU, the GPU on a GPU), pool (on a GPU: "
                  "every routed expert in the CPU pool beside it, as --cpu-moe), gpu, or reference (the CPU backend's "
                  "plain path)")
      ->check(CLI::IsMember({"auto", "pool", "gpu", "reference"}))
      ->capture_default_str();
  app->add_flag("--cpu-moe", cpu_moe,
                "on a GPU: every routed expert in the CPU pool, computed by the CPU cores from host memory; "
                "attention, shared experts, the router and the KV cache stay on the GPU (hybrid execution)");
  app->add_option("--n-cpu-moe", n_cpu_moe,
                  "on a GPU: the routed experts of the first N MoE layers in the CPU pool, the rest on the GPU")
      ->check(IntIn(0, 100000));
  app->add_option(
         "--override-tensor", override_tensor,
         "REGEX=cpu|cuda[:N], repeatable: the checkpoint's tensors whose name the regex finds go there, the first "
         "matching rule winning over every other rule (as llama.cpp's -ot does), e.g. 'experts=cpu' or "
         "'layers\\.[0-9]\\.mlp\\.experts\\.=cpu'. Only routed experts can run on the CPU beside a GPU")
      ->expected(1)
      ->take_all();
  app->add_option(
         "--gpu-experts-per-layer", gpu_experts_per_layer,
         "on a GPU, with routed experts in the CPU pool: the N most used experts of each CPU layer are held on "
         "the GPU too, and the tokens routed to them run there; most used by --expert-profile, or without "
         "one by the picks counted while serving (see --gpu-experts-refresh-steps)")
      ->check(IntIn(0, 4096));
  app->add_option("--gpu-experts-refresh-steps", gpu_experts_refresh_steps,
                  "with --gpu-experts-per-layer and no --expert-profile: every N steps the picks counted since the "
                  "last refresh (older ones weighed down by 3/4) rank each CPU layer's experts, and the held ones that "
                  "fell out of "
                  "the top are replaced, one expert a step, without pausing")
      ->check(IntIn(1, 1 << 30))
      ->capture_default_str();
  app->add_option("--prefill-offload-tokens", prefill_offload_tokens,
                  "on a GPU, with routed experts on the CPU: steps of at least N tokens stream each CPU layer's "
                  "packed experts to the GPU over PCIe and compute them there; 0: never (default: measured at load, "
                  "one layer both ways)")
      ->check(IntIn(0, 1 << 20));
  app->add_option("--defer-experts", defer_experts,
                  "expert deferral, off by default and not lossless: each token's N lowest-weighted routed experts of "
                  "a CPU pool layer finish on the CPU while the next layer's attention runs, and their sum joins that "
                  "layer's output (as KTransformers' expert deferral); in [0, top-k)")
      ->check(IntIn(0, 64))
      ->capture_default_str();
  app->add_option("--expert-profile", expert_profile,
                  "routing profile (from moeserve profile-experts) that ranks each layer's experts for "
                  "--gpu-experts-per-layer");
  app->add_option("--weight-format", weight_format,
                  "on the CPU backend, every Linear's weights (attention, shared experts, dense layers, an untied LM "
                  "head): bf16 (as stored, fp32 math: the reference), or int8 or int4 packed and run by the expert "
                  "pool's kernels (int4 in groups of --expert-group)")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  app->add_option("--expert-format", format,
                  "format of the expert pool's weights: auto (a GGUF file's own types, kept as stored; an FP8 "
                  "checkpoint's e4m3 codes and block scales, kept as stored (fp8); bf16 for other Hugging Face "
                  "checkpoints), native (a GGUF file's types), bf16, int8 or int4 (packed from the checkpoint's "
                  "values), fp8 (e4m3 with a scale per row and --expert-group columns: an FP8 checkpoint's as stored, "
                  "other values quantized), or one GGUF type for every expert (q4_k, q8_0, iq3_xxs, ...)")
      ->capture_default_str();
  app->add_option("--expert-group", group,
                  "int4 and fp8 scale group size: 32, 64 or 128 (an FP8 checkpoint's experts keep its own blocks')")
      ->check(CLI::IsMember({32, 64, 128}))
      ->capture_default_str();
  app->add_option("--expert-kernel", kernel,
                  "force a kernel: portable, avx512, avx512bf16, vnni, amx (default: chosen per call)");
  app->add_option("--expert-threads", threads, "expert pool threads; 0 uses every core")
      ->check(IntIn(0, 4096))
      ->capture_default_str();
  app->add_option("--expert-linger-us", linger_us,
                  "microseconds the pool's threads stay awake after a MoE layer, ready for the next (default: 0 on "
                  "the CPU backend, where they rest after each step: within one they stay awake anyway when "
                  "--shared-threads is on, and with it off the backend's own threads need the cores)")
      ->check(IntIn(0, 10'000'000));
  app->add_option("--shared-threads", shared_threads,
                  "on the CPU backend with the expert pool: on runs the backend's operations on the pool's pinned "
                  "threads, one set for the whole step, awake from one operation to the next; off gives the backend "
                  "its own threads (--threads) beside the pool's")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app->add_option("--expert-shm", shm,
                  "keep the packed experts in shared memory /dev/shm/NAME (and NAME.1, ... when large); later "
                  "processes attach instead of loading");
}

absl::Status ExpertFlags::Apply(runtime::ModelOptions* options, const std::string& command) const {
  options->experts =
      mode == "reference" || mode == "gpu" ? runtime::RoutedExpertsMode::kBackend : runtime::RoutedExpertsMode::kPool;
  experts::ExpertPoolOptions& pool = options->pool;
  options->pool_format_auto = format == "auto";
  if (!options->pool_format_auto) {
    MOE_ASSIGN_OR_RETURN(pool.format, experts::ParseFormat(format));
  }
  pool.group = group;
  pool.threads = threads;
  WarnIfMoreThreadsThanCores(threads, "expert-threads", command);
  if (linger_us) options->expert_linger_us = *linger_us;
  options->share_host_threads = shared_threads == "on";
  if (!kernel.empty()) {
    MOE_ASSIGN_OR_RETURN(pool.kernel, experts::ParseKernel(kernel));
  }
  pool.shm_name = shm;
  MOE_ASSIGN_OR_RETURN(const experts::ExpertFormat matrices, experts::ParseFormat(weight_format));
  options->weights = runtime::WeightPolicy::Uniform(matrices, group);
  if (prefill_offload_tokens) options->prefill_offload_tokens = *prefill_offload_tokens;
  options->defer_experts = defer_experts;
  return absl::OkStatus();
}

void SpecFlags::Add(CLI::App* app) {
  app->add_option("--spec-type", type,
                  "speculative decoding: ngram (drafts from n-grams of the prompt and output: no model, pays on code "
                  "edits and text that repeats itself), mtp (the checkpoint's nextn layers) or draft (--draft-model), "
                  "or off. A step verifies each sequence's drafts with the model's own sampler, so the tokens are "
                  "the same as with off, at any temperature and seed; only the tokens per step change")
      ->check(CLI::IsMember({"mtp", "draft", "ngram", "off"}))
      ->capture_default_str();
  app->add_option("--spec-n-max", n_max,
                  "drafts a sequence carries per step, at most (a request's speculative.n_max may lower it)")
      ->check(IntIn(1, runtime::kMaxDraftTokens))
      ->capture_default_str();
  app->add_option("--spec-adaptive", adaptive,
                  "on: each sequence's draft length is chosen every step, from 0 to --spec-n-max, to serve the most "
                  "tokens per second, from the measured step time by rows and what the sequence accepted so far "
                  "(so prose, high concurrency and costly verify steps turn drafting off; a probe now and then turns "
                  "it back on); off: always --spec-n-max")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app->add_option("--draft-model", draft_model,
                  "with --spec-type draft: the draft model, a checkpoint with the target's tokenizer");
  app->add_option("--draft-device", draft_device, "with --spec-type draft: where the draft model runs: cpu or cuda:N");
}

absl::StatusOr<runtime::SpeculativeConfig> SpecFlags::Config() const {
  runtime::SpeculativeConfig c;
  auto parsed = runtime::ParseSpecType(type);
  if (!parsed.ok()) return core::Annotate(parsed.status(), "--spec-type");
  c.type = *parsed;
  c.n_max = n_max;
  c.adaptive = adaptive == "on";
  c.draft_model = draft_model;
  c.draft_device = draft_device;
  if (c.type != runtime::SpecType::kDraft && (!draft_model.empty() || !draft_device.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(!draft_model.empty() ? "--draft-model" : "--draft-device",
                                                   " needs --spec-type draft (got --spec-type ", type, ")"));
  }
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--spec-type ", type, ": ", s.message()));
  }
  return c;
}

int MaxLogitRows(int max_seqs, int max_batch_tokens, const runtime::SpeculativeConfig& speculative) {
  const int64_t rows = static_cast<int64_t>(max_seqs) * (speculative.max_draft() + 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, std::max(max_batch_tokens, max_seqs))));
}

}  // namespace moe::deploy
