// moeserve bench experts, load, serve and comm: their flags, and the calls into the benchmarks, which
// measure and print (bench/).
#include <functional>
#include <iostream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "comm_bench.h"
#include "commands.h"
#include "expert_bench.h"
#include "load_bench.h"
#include "model_loading.h"
#include "moe/core/status.h"
#include "moe/experts/arena.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_executor.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/scheduler/frontend.h"
#include "moe/scheduler/structured_output.h"
#include "nlohmann/json.hpp"
#include "serving_bench.h"

namespace moe::deploy {
namespace {

int Fail(const absl::Status& s, int code) {
  std::cerr << "moeserve bench: error: " << s.message() << "\n";
  return code;
}

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) out.emplace_back(part);
  return out;
}

struct ExpertBenchFlags {
  bench::ExpertBenchOptions options;
  std::string batches = "1,4,16,64,256,1024", formats = "bf16,int8,int4", kernels;
  int64_t read_mb = 2048;
  bool json = false;
};

int BenchExperts(ExpertBenchFlags flags) {
  bench::ExpertBenchOptions& options = flags.options;
  if (options.top_k > options.num_experts) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("--top-k ", options.top_k, " is more than --experts ", options.num_experts)),
                2);
  }
  auto batches = ParseIntList(flags.batches, "batches");
  if (!batches.ok()) return Fail(batches.status(), 2);
  options.batches = *batches;
  options.formats = SplitList(flags.formats);
  options.kernels = SplitList(flags.kernels);
  options.read_bytes = flags.read_mb << 20;
  WarnIfMoreThreadsThanCores(options.threads, "threads", "bench experts");
  auto rows = bench::RunExpertBench(options, flags.json ? std::cerr : std::cout);
  if (!rows.ok()) return Fail(rows.status(), 1);
  if (flags.json) bench::PrintExpertBenchJson(*rows, std::cout);
  return 0;
}

void AddBenchExperts(CLI::App& bench, CommandRun* selected) {
  auto f = std::make_shared<ExpertBenchFlags>();
  CLI::App* app = AddCommand(
      bench, "experts", "the CPU expert pool against the read-bandwidth roofline",
      "Times one MoE layer call of the CPU expert pool at a real layer shape (default Qwen3-30B-A3B:\n"
      "hidden 2048, 128 experts, top-8, intermediate 768) for every format, kernel and batch, against\n"
      "the host read bandwidth measured with the same threads in the same run. Weights are random.\n"
      "Columns: ms per call, GB/s of expert weights touched, ratio to the read bandwidth, TFLOP/s.\n"
      "After each kernel's points, the kernel alone over every expert of the arena (--stream-tokens).\n"
      "Last, at 64 tokens and more, each kernel's speed over its format's AVX-512 path (the same run),\n"
      "and the most it could be: the AVX-512 time over the time to read the weights once.",
      [f] { return BenchExperts(*f); }, selected);
  bench::ExpertBenchOptions& o = f->options;
  app->add_option("--threads", o.threads, "pool threads; 0 uses every core")
      ->check(IntIn(0, 4096))
      ->capture_default_str();
  app->add_option("--layers", o.layers, "layers the calls cycle through (keeps the weights out of the caches)")
      ->check(IntIn(1, 1024))
      ->capture_default_str();
  app->add_option("--batches", f->batches, "tokens per call")->check(IntListIn(1, 1 << 16))->capture_default_str();
  app->add_option("--formats", f->formats,
                  "expert formats, comma-separated: bf16, int8, int4, fp8, or GGUF types (q8_0, q4_k, iq3_xxs, ...)")
      ->capture_default_str();
  app->add_option("--kernels", f->kernels, "only these kernels (portable, avx512, avx512bf16, vnni, amx); default all");
  app->add_option("--read-mb", f->read_mb, "buffer for the read-bandwidth roofline, in MiB")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--seconds", o.seconds_per_point, "time spent per point")
      ->check(NumberIn(0.001, 3600))
      ->capture_default_str();
  app->add_option("--hidden", o.hidden, "hidden size")->check(IntIn(32, 1 << 16))->capture_default_str();
  app->add_option("--intermediate", o.intermediate, "expert intermediate size")
      ->check(IntIn(32, 1 << 17))
      ->capture_default_str();
  app->add_option("--experts", o.num_experts, "experts per layer")->check(IntIn(1, 4096))->capture_default_str();
  app->add_option("--top-k", o.top_k, "experts per token (at most --experts)")
      ->check(IntIn(1, 4096))
      ->capture_default_str();
  app->add_option("--decode-max-tokens", o.decode_max_tokens,
                  "calls of at most N tokens use the pool's decode schedule; 0: never")
      ->check(IntIn(0, 1 << 16))
      ->capture_default_str();
  app->add_option("--decode-units", o.decode_units, "units of work per thread and stage in the decode schedule")
      ->check(IntIn(1, 1024))
      ->capture_default_str();
  app->add_option("--gap-us", o.gap_us,
                  "microseconds the caller spins between calls, as a forward does on the rest of a layer (only the "
                  "calls are timed); 0: back to back")
      ->check(NumberIn(0, 1e7))
      ->capture_default_str();
  app->add_option("--linger-us", o.linger_us,
                  "microseconds the pool's threads stay awake after a call for the next one; 0: they sleep")
      ->check(IntIn(0, 10'000'000))
      ->capture_default_str();
  app->add_option("--stream-tokens", o.stream_tokens,
                  "after each kernel's points, the kernel alone running over every expert of the arena with N tokens "
                  "per expert (no sorting, gathering or sums): gate+up, down and both in GB/s of weights, against "
                  "the read bandwidth; 0: skip")
      ->check(IntIn(0, 1 << 16))
      ->capture_default_str();
  app->add_flag("--phases", o.phases,
                "after each point, its trials, the time of each phase of a call, and how the threads spent the sort "
                "and experts phase");
  app->add_flag("--json", f->json,
                "print one JSON array of rows: format, kernel, batch, ms_per_call, weight_gbps, read_gbps, ratio, "
                "tflops");
}

struct LoadBenchFlags {
  std::string model;
  ExpertFlags experts;
  bool unlink = false, json = false;
};

int BenchLoad(const LoadBenchFlags& flags) {
  runtime::ModelOptions options;
  if (absl::Status s = flags.experts.Apply(&options, "bench load"); !s.ok()) return Fail(s, 2);
  if (options.experts != runtime::RoutedExpertsMode::kPool) {
    return Fail(absl::InvalidArgumentError("bench load measures the expert pool; drop --experts reference"), 2);
  }
  options.pool.progress = !flags.json;
  std::unique_ptr<runtime::Model> model;  // owns the pool RunLoadBench measures, to the end of the command
  auto load = [&]() -> absl::StatusOr<const experts::ExpertPool*> {
    MOE_ASSIGN_OR_RETURN(model, runtime::Model::Load(flags.model, options));
    if (model->expert_pool() == nullptr) return absl::FailedPreconditionError("the model has no MoE layers");
    return model->expert_pool();
  };
  auto result = bench::RunLoadBench(flags.model, options.pool.shm_name, load);
  if (!result.ok()) return Fail(result.status(), 1);
  bench::PrintLoadBench(*result, flags.json, std::cout);
  if (flags.unlink && !options.pool.shm_name.empty()) {
    if (absl::Status s = experts::HostArena::Unlink(options.pool.shm_name); !s.ok()) return Fail(s, 1);
  }
  return 0;
}

void AddBenchLoad(CLI::App& bench, CommandRun* selected) {
  auto f = std::make_shared<LoadBenchFlags>();
  CLI::App* app = AddCommand(
      bench, "load", "loading the expert arena (and attaching to a shared one)",
      "Loads a model's routed experts into the expert arena and reports the speed (checkpoint bytes read\n"
      "per second), against the bound measured right after with the pool's thread count: reading the\n"
      "checkpoint files themselves from the page cache, and from disk (O_DIRECT) for the share that was\n"
      "not cached before the load. A second bound copies the files from the page cache into fresh memory\n"
      "of the arena's kind and size (every new page is zeroed by the kernel before it is written, for the\n"
      "load as for the copy). With --expert-shm the arena is a named shared-memory segment: the\n"
      "first run fills it, later runs attach to it and report the attach time.",
      [f] { return BenchLoad(*f); }, selected);
  app->add_option("--model", f->model, "the model: a Hugging Face folder (config.json + safetensors) or a GGUF file (the first part of a split one, or a folder of one model's GGUF files)")->required();
  f->experts.Add(app);
  app->add_flag("--unlink", f->unlink, "remove the shared-memory segment at the end");
  app->add_flag("--json", f->json, "print one JSON object");
}

struct ServeBenchFlags {
  bench::ServingBenchOptions options;
  std::string target, model, concurrency = "1,4,16";
  int requests = 0, max_batch_tokens = 2048;
  int multi_turn = 0, turn_len = 64;
  std::string response_format;  // a file: a response_format object or a bare JSON schema
  ExpertFlags experts;
  DeviceFlags device;
  SpecFlags spec;
  bool json = false;
};

// --response-format FILE: OpenAI's response_format object ({"type": "json_schema", ...} or
// "json_object"), or a JSON schema alone, which becomes {"type": "json_schema", ...}; as JSON text.
absl::StatusOr<std::string> ReadResponseFormat(const std::string& path) {
  auto text = core::ReadBoundedFile(path, 4 << 20, "--response-format");
  if (!text.ok()) return text.status();
  auto value = core::ParseJsonObject(*text, path);
  if (!value.ok()) return value.status();
  const auto type = value->find("type");
  if (type != value->end() && (*type == "json_schema" || *type == "json_object" || *type == "text")) {
    return value->dump();
  }
  return nlohmann::json{{"type", "json_schema"}, {"json_schema", {{"name", "bench"}, {"schema", *value}}}}.dump();
}

int BenchServe(const ServeBenchFlags& flags) {
  bench::ServingBenchOptions o = flags.options;
  auto concurrency = ParseIntList(flags.concurrency, "concurrency");
  if (!concurrency.ok()) return Fail(concurrency.status(), 2);
  if (flags.target.empty() == flags.model.empty()) {
    return Fail(absl::InvalidArgumentError("give one of --target HOST:PORT or --model DIR"), 2);
  }
  if (!flags.target.empty()) {
    if (absl::Status s = CheckListenAddress(flags.target, "target"); !s.ok()) return Fail(s, 2);
    o.target = flags.target;
  }
  std::unique_ptr<runtime::Model> model, draft_model;
  std::unique_ptr<scheduler::Frontend> frontend;
  if (flags.spec.type == "mtp" && !flags.model.empty()) {
    if (absl::Status s = CheckMtpHead(flags.model, "--spec-type mtp"); !s.ok()) return Fail(s, 2);
  }
  auto spec_config = flags.spec.Config();
  if (!spec_config.ok()) return Fail(spec_config.status(), 2);
  const runtime::SpeculativeConfig speculative = *spec_config;
  if (speculative.type != runtime::SpecType::kOff && flags.model.empty()) {
    return Fail(absl::InvalidArgumentError("--spec-type sets the speculative decoding of the server --model starts; "
                                           "a --target server takes it from its own serve flags"),
                2);
  }
  if (speculative.type == runtime::SpecType::kDraft) {
    if (absl::Status s = CheckDraftVocabulary(flags.model, speculative.draft_model); !s.ok()) return Fail(s, 2);
  }
  runtime::ModelOptions model_options;
  // With --model, a server in this process: the prefix cache on or off.
  auto start_server = [&](bool prefix_cache) -> absl::Status {
    if (frontend) frontend->Shutdown();
    frontend.reset();
    scheduler::FrontendOptions fo;
    fo.listen = "127.0.0.1:0";
    fo.model_dir = flags.model;  // its tokenizer, for --response-format
    fo.scheduler.max_batch_tokens = flags.max_batch_tokens;
    fo.scheduler.max_seqs = 64;
    fo.scheduler.context = model->spec().max_position_embeddings;
    fo.scheduler.prefix_cache = prefix_cache;
    fo.scheduler.max_draft = speculative.max_draft();
    fo.scheduler.draft_type = speculative.type;
    fo.scheduler.draft_adaptive = speculative.adaptive;
    auto executor = runtime::ModelExecutor::Create(*model, /*num_blocks=*/4096, fo.scheduler.block_size);
    if (!executor.ok()) return executor.status();
    std::unique_ptr<runtime::Executor> serving;
    if (speculative.type == runtime::SpecType::kMtp) {
      auto drafting = WithMtpHead(*std::move(executor), flags.model, model_options, fo.scheduler.max_seqs, &draft_model);
      if (!drafting.ok()) return drafting.status();
      serving = *std::move(drafting);
    } else {
      serving = *std::move(executor);
    }
    if (speculative.type == runtime::SpecType::kDraft) {
      auto drafting = WithDraftModel(std::move(serving), speculative, model_options, fo.scheduler.max_seqs, &draft_model);
      if (!drafting.ok()) return drafting.status();
      serving = *std::move(drafting);
    }
    auto started = scheduler::Frontend::Start(std::move(serving), fo);
    if (!started.ok()) return started.status();
    frontend = std::move(*started);
    o.target = absl::StrCat("127.0.0.1:", frontend->port());
    return absl::OkStatus();
  };
  if (!flags.model.empty()) {
    if (absl::Status s = CheckModelFlags(flags.device, flags.experts, "bench serve"); !s.ok()) return Fail(s, 2);
    model_options.pool.progress = false;
    model_options.max_step_tokens = flags.max_batch_tokens;
    model_options.max_logit_rows = MaxLogitRows(64, flags.max_batch_tokens, speculative);  // max_seqs below
    auto loaded = LoadModelForCommand(flags.model, flags.device, flags.experts, model_options, 0, "bench serve");
    if (!loaded.ok()) return Fail(loaded.status(), 1);
    model = std::move(*loaded);
    if (absl::Status s = start_server(/*prefix_cache=*/true); !s.ok()) return Fail(s, 1);
    o.vocab = model->spec().vocab_size;
  }
  if (!flags.response_format.empty()) {
    if (flags.multi_turn > 0) {
      return Fail(absl::InvalidArgumentError("--response-format and --multi-turn: give one of them"), 2);
    }
    auto format = ReadResponseFormat(flags.response_format);
    if (!format.ok()) return Fail(format.status(), 2);
    o.response_format = *format;
    std::function<bench::MaskCounters()> counters;
    if (frontend != nullptr) {
      scheduler::StructuredOutputs* structured = frontend->structured_outputs();
      if (structured == nullptr) {
        return Fail(absl::FailedPreconditionError(absl::StrCat(
                        "--response-format: ", flags.model, " has no tokenizer.json, which structured outputs need")),
                    2);
      }
      // The grammar the requests get: the server's cache hands the same one back.
      auto grammar = structured->ForResponseFormat(nlohmann::json::parse(*format));
      if (!grammar.ok()) return Fail(grammar.status(), 2);
      if (*grammar == nullptr) return Fail(absl::InvalidArgumentError("--response-format: {\"type\": \"text\"} constrains nothing"), 2);
      counters = [grammar = *grammar] { return bench::MaskCounters{grammar->masks_computed(), grammar->mask_seconds()}; };
    }
    if (!flags.json) {
      std::cout << absl::StrFormat("structured outputs: %s, prompt %d tokens, up to %d output tokens%s\n",
                                   flags.response_format, o.prompt_len, o.output_len,
                                   counters ? "; mask time from the server's grammar" : "");
    }
    if (absl::Status s = bench::RunStructuredSweep(o, *concurrency, flags.requests, counters, flags.json, std::cout);
        !s.ok()) {
      return Fail(s, 1);
    }
    return 0;
  }
  if (flags.multi_turn > 0) {
    // Each concurrency: its conversations on the server as it is; with --model, then again on a
    // server without the prefix cache, side by side.
    for (int c : *concurrency) {
      o.concurrency = c;
      if (model && !frontend) {
        if (absl::Status s = start_server(true); !s.ok()) return Fail(s, 1);
      }
      auto on = bench::RunMultiTurnBench(o, flags.multi_turn, flags.turn_len);
      if (!on.ok()) return Fail(on.status(), 1);
      std::optional<std::vector<bench::MultiTurnRow>> off;
      if (model) {
        if (absl::Status s = start_server(false); !s.ok()) return Fail(s, 1);
        auto rows = bench::RunMultiTurnBench(o, flags.multi_turn, flags.turn_len);
        if (!rows.ok()) return Fail(rows.status(), 1);
        off = *std::move(rows);
        frontend->Shutdown();
        frontend.reset();
      }
      if (!flags.json) {
        std::cout << absl::StrFormat("multi-turn: %d conversations, system prompt %d tokens, %d user tokens and %d "
                                     "output tokens a turn%s\n",
                                     c, o.prompt_len, flags.turn_len, o.output_len,
                                     model ? "; prefix cache on, then off" : "");
      }
      bench::PrintMultiTurn(*on, off ? &*off : nullptr, flags.json, std::cout);
    }
    return 0;
  }
  if (absl::Status s = bench::RunServingSweep(o, *concurrency, flags.requests, flags.json, std::cout); !s.ok()) {
    return Fail(s, 1);
  }
  return 0;
}

void AddBenchServe(CLI::App& bench, CommandRun* selected) {
  auto f = std::make_shared<ServeBenchFlags>();
  CLI::App* app = AddCommand(
      bench, "serve", "load generator: TTFT, TPOT, ITL and tokens/s per concurrency",
      "Load generator: concurrent Generate streams against a moeserve server, reporting time to first\n"
      "token (TTFT), time per output token (TPOT), inter-token latency (ITL) and output tokens/s for\n"
      "each concurrency. Give --target of a running server, or --model to start one in this process.",
      [f] { return BenchServe(*f); }, selected);
  app->add_option("--target", f->target, "a running server, HOST:PORT");
  app->add_option("--model", f->model, "start a server in this process on this model instead (CPU backend)");
  app->add_option("--concurrency", f->concurrency, "concurrent streams, one run each")
      ->check(IntListIn(1, 4096))
      ->capture_default_str();
  app->add_option("--requests", f->requests, "requests per run; 0: 4 per stream, at least 8")
      ->check(IntIn(0, 1 << 20))
      ->capture_default_str();
  app->add_option("--prompt-len", f->options.prompt_len, "prompt tokens (random ids)")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--prompt-period", f->options.prompt_period,
                  "prompts that repeat a random run of this many tokens (text that repeats itself, where "
                  "--spec-type ngram pays); 0: random throughout")
      ->check(IntIn(0, 1 << 20))
      ->capture_default_str();
  app->add_option("--output-len", f->options.output_len, "tokens generated per request")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--max-batch-tokens", f->max_batch_tokens, "with --model: tokens per step")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--multi-turn", f->multi_turn,
                  "conversations of this many turns sharing a system prompt (--prompt-len tokens), each turn adding "
                  "--turn-len user tokens and keeping the --output-len tokens answered: TTFT and cached tokens per "
                  "turn; with --model, with the prefix cache on and then off")
      ->check(IntIn(0, 1000))
      ->capture_default_str();
  app->add_option("--turn-len", f->turn_len, "with --multi-turn: user tokens added each turn")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--response-format", f->response_format,
                  "structured outputs: a JSON file with a response_format object or a JSON schema; each concurrency "
                  "runs unconstrained, then constrained, printing both tokens/s, the ratio and (with --model) the "
                  "grammar mask's time");
  app->add_option("--csv", f->options.csv, "append one row per request");
  f->experts.Add(app);
  f->device.Add(app);
  f->spec.Add(app);
  app->add_flag("--json", f->json, "print one JSON array of rows");
}

struct CommBenchFlags {
  bench::CommBenchOptions options;
  bool json = false;
};

int BenchComm(const CommBenchFlags& flags) {
  auto result = bench::RunCommBench(flags.options);
  if (!result.ok()) return Fail(result.status(), 1);
  bench::PrintCommBench(*result, flags.json, std::cout);
  return 0;
}

void AddBenchComm(CLI::App& bench, CommandRun* selected) {
  auto f = std::make_shared<CommBenchFlags>();
  CLI::App* app = AddCommand(
      bench, "comm", "the CPU workers' all-reduce (Gloo over TCP) against a plain TCP stream",
      "Starts --ranks processes on 127.0.0.1 that form a GlooCommunicator group (the CPU workers of a\n"
      "tensor split), and times the fp32 all-reduce of one hidden-state row (decode) and of a chunk of\n"
      "--tokens rows (prefill): the median over repeats, each after a barrier. The bound is measured in\n"
      "the same run: one TCP stream between two of the processes over 127.0.0.1 moving the same bytes.\n"
      "Columns: all-reduce time, algorithm bandwidth (bytes / time), bus bandwidth (2(n-1)/n x bytes /\n"
      "time: what each rank sends and receives), the TCP stream's GB/s, and bus bandwidth over it.",
      [f] { return BenchComm(*f); }, selected);
  bench::CommBenchOptions& o = f->options;
  app->add_option("--ranks", o.ranks, "processes in the group")->check(IntIn(2, 64))->capture_default_str();
  app->add_option("--hidden", o.hidden, "fp32 elements of one row")->check(IntIn(1, 1 << 16))->capture_default_str();
  app->add_option("--tokens", o.chunk_tokens, "rows of the prefill chunk")
      ->check(IntIn(1, 1 << 16))
      ->capture_default_str();
  app->add_option("--seconds", o.seconds_per_point, "time spent on each size, for the all-reduce and for the bound")
      ->check(NumberIn(0.01, 600))
      ->capture_default_str();
  app->add_flag("--json", f->json,
                "print one JSON object: ranks, communicator, rows (name, bytes, repeats, allreduce_us, algbw_gbps, "
                "busbw_gbps, tcp_gbps, ratio)");
}

}  // namespace

void AddBenchCommand(CLI::App& root, CommandRun* selected) {
  CLI::App* bench =
      root.add_subcommand("bench", "benchmarks: bench experts, bench load, bench serve, bench model, bench comm, bench control");
  bench->require_subcommand(1);
  AddBenchExperts(*bench, selected);
  AddBenchLoad(*bench, selected);
  AddBenchServe(*bench, selected);
  AddBenchModel(*bench, selected);
  AddBenchComm(*bench, selected);
  AddBenchControl(*bench, selected);
}

}  // namespace moe::deploy
