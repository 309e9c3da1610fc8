// moeserve bench: the expert pool against its rooflines, and loading the expert arena.
#include <chrono>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "commands.h"
#include "expert_bench.h"
#include "load_bench.h"
#include "moe/core/status.h"
#include "moe/experts/arena.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_executor.h"
#include "moe/scheduler/frontend.h"
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
  if (flags.json) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const bench::ExpertBenchRow& r : *rows) {
      out.push_back({{"format", r.format},
                     {"kernel", r.kernel},
                     {"batch", r.batch},
                     {"ms_per_call", r.ms_per_call},
                     {"weight_gbps", r.weight_gbps},
                     {"read_gbps", r.read_gbps},
                     {"ratio", r.ratio},
                     {"tflops", r.tflops}});
    }
    std::cout << out.dump() << std::endl;
  }
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
  app->add_option("--formats", f->formats, "bf16, int8, int4")->capture_default_str();
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

constexpr int kDiskReadsInFlight = 16;

// The bound for a load: reading the checkpoint files at page-cache speed for the share that was
// cached before it, at disk speed for the rest.
struct LoadBound {
  double page_cache_gbps = 0, disk_gbps = 0, gbps = 0;
  // Copying the files from the page cache into fresh memory of the arena's kind and size, and
  // the bound that gives (the disk's share as in gbps).
  double copy_gbps = 0, copy_bound_gbps = 0;
  std::string disk_note;  // why the disk's speed is not in the bound, if it is not
};

// Fresh memory of the arena's kind and size: a private arena, or a shared one of the same cut
// under NAME-bound (removed when the returned arena goes).
struct FreshArena {
  std::unique_ptr<experts::HostArena> arena;
  std::string shm_name;
  ~FreshArena() {
    arena.reset();
    if (!shm_name.empty()) experts::HostArena::Unlink(shm_name).IgnoreError();
  }
};

absl::Status MakeFreshArena(const experts::HostArena& like, const std::string& shm_name, FreshArena* fresh) {
  if (shm_name.empty()) {
    MOE_ASSIGN_OR_RETURN(fresh->arena, experts::HostArena::CreatePrivate(like.size()));
    return absl::OkStatus();
  }
  fresh->shm_name = shm_name + "-bound";
  MOE_RETURN_IF_ERROR(experts::HostArena::Unlink(fresh->shm_name));  // one a killed run left
  MOE_ASSIGN_OR_RETURN(fresh->arena, experts::HostArena::OpenShared(fresh->shm_name, /*key=*/0, like.size()));
  return absl::OkStatus();
}

absl::Status MeasureLoadBound(const std::vector<std::string>& files, double cached_before, int threads,
                              const experts::HostArena& arena, const std::string& shm_name, LoadBound* bound) {
  // Past the page cache first, which leaves it as it is; then a read that brings every page in
  // (the load read only the experts' parts of the files), and the timed ones.
  // Disk reads with at least kDiskReadsInFlight in flight: a deep queue is what the disk needs to
  // reach its speed (the load's mapped reads get the kernel's readahead).
  absl::StatusOr<double> disk = 0.0;
  if (cached_before < 1.0) disk = bench::ReadFilesGbps(files, std::max(threads, kDiskReadsInFlight), /*direct=*/true);
  MOE_RETURN_IF_ERROR(bench::ReadFilesGbps(files, threads, /*direct=*/false).status());
  for (int repeat = 0; repeat < 3; ++repeat) {  // the best of three
    MOE_ASSIGN_OR_RETURN(const double gbps, bench::ReadFilesGbps(files, threads, /*direct=*/false));
    bound->page_cache_gbps = std::max(bound->page_cache_gbps, gbps);
  }
  double seconds_per_gb = cached_before / bound->page_cache_gbps;
  if (cached_before < 1.0) {
    if (disk.ok()) {
      bound->disk_gbps = *disk;
      seconds_per_gb += (1.0 - cached_before) / *disk;
    } else if (disk.status().code() == absl::StatusCode::kUnimplemented) {
      // Without the disk's speed the page cache's is the bound: stricter than the truth.
      bound->disk_note = "disk speed not measured: " + std::string(disk.status().message());
      seconds_per_gb += (1.0 - cached_before) / bound->page_cache_gbps;
    } else {
      return disk.status();
    }
  }
  bound->gbps = 1.0 / seconds_per_gb;
  // A load also fills the arena: each new page is zeroed by the kernel, then written. Copying the
  // files into fresh memory of the arena's kind and size, with the same threads, is the least any
  // load from the page cache can do (best of three, each into memory never touched).
  for (int repeat = 0; repeat < 3; ++repeat) {
    FreshArena fresh;
    MOE_RETURN_IF_ERROR(MakeFreshArena(arena, shm_name, &fresh));
    MOE_ASSIGN_OR_RETURN(const double gbps,
                         bench::CopyFilesGbps(files, threads, fresh.arena->data(), fresh.arena->size()));
    bound->copy_gbps = std::max(bound->copy_gbps, gbps);
  }
  bound->copy_bound_gbps =
      1.0 / (seconds_per_gb - cached_before / bound->page_cache_gbps + cached_before / bound->copy_gbps);
  return absl::OkStatus();
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
  const std::string* model_dir = &flags.model;
  // What the page cache holds before the load decides its bound: page-cache or disk speed. (A
  // directory the load cannot use gets the load's own error below.)
  auto files = bench::CheckpointFiles(*model_dir);
  absl::StatusOr<double> cached_before = files.ok() ? bench::CachedShare(*files) : files.status();
  const auto start = std::chrono::steady_clock::now();
  auto model = runtime::Model::Load(*model_dir, options);
  if (!model.ok()) return Fail(model.status(), 1);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  experts::ExpertPool* pool = (*model)->expert_pool();
  if (pool == nullptr) return Fail(absl::FailedPreconditionError("the model has no MoE layers"), 1);
  const bool attached = pool->arena().attached();
  const double gbps = attached ? 0.0 : pool->loaded_bytes() / 1e9 / std::max(pool->load_seconds(), 1e-9);
  // The bound: the files read whole by as many threads as the pool has. Read again after the
  // load they come from the page cache; the share that was not cached before is timed at the
  // disk's speed, read past the page cache.
  LoadBound bound;
  if (!attached) {
    if (!cached_before.ok()) return Fail(cached_before.status(), 1);
    if (absl::Status s =
            MeasureLoadBound(*files, *cached_before, pool->threads(), pool->arena(), options.pool.shm_name, &bound);
        !s.ok()) {
      return Fail(s, 1);
    }
  }
  const double ratio = bound.gbps > 0 ? gbps / bound.gbps : 0.0;
  const double copy_ratio = bound.copy_bound_gbps > 0 ? gbps / bound.copy_bound_gbps : 0.0;
  if (flags.json) {
    nlohmann::ordered_json j = {{"attached", attached},
                                {"arena_bytes", pool->arena().size()},
                                {"checkpoint_bytes", pool->loaded_bytes()},
                                {"expert_seconds", pool->load_seconds()},
                                {"load_gbps", gbps},
                                {"model_load_seconds", total},
                                {"pages", pool->arena().page_kind()},
                                {"cached_before", attached ? 0.0 : *cached_before},
                                {"page_cache_gbps", bound.page_cache_gbps},
                                {"disk_gbps", bound.disk_gbps},
                                {"read_gbps", bound.gbps},
                                {"ratio", ratio},
                                {"copy_gbps", bound.copy_gbps},
                                {"copy_bound_gbps", bound.copy_bound_gbps},
                                {"copy_ratio", copy_ratio}};
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << pool->Describe() << "\n";
    if (attached) {
      std::cout << absl::StrFormat("attached to the published arena in %.3f s (model load %.3f s)\n",
                                   pool->load_seconds(), total);
    } else {
      std::cout << absl::StrFormat("loaded %.2f GB of checkpoint experts in %.2f s: %.2f GB/s (model load %.2f s)\n",
                                   pool->loaded_bytes() / 1e9, pool->load_seconds(), gbps, total);
      std::cout << absl::StrFormat(
          "the checkpoint files (%.0f%% in the page cache before the load) read at %.2f GB/s "
          "from the page cache",
          100 * *cached_before, bound.page_cache_gbps);
      if (bound.disk_gbps > 0) {
        std::cout << absl::StrFormat(" and %.2f GB/s from disk (%d reads at a time)", bound.disk_gbps,
                                     std::max(pool->threads(), kDiskReadsInFlight));
      }
      if (!bound.disk_note.empty()) std::cout << " (" << bound.disk_note << ")";
      std::cout << absl::StrFormat(" with %d threads: the load ran at %.0f%% of the %.2f GB/s they allow\n",
                                   pool->threads(), 100 * ratio, bound.gbps);
      std::cout << absl::StrFormat(
          "copied from the page cache into fresh memory of the arena's kind and size (%.2f GB), "
          "the files went at %.2f GB/s: the load ran at %.0f%% of the %.2f GB/s that allows\n",
          pool->arena().size() / 1e9, bound.copy_gbps, 100 * copy_ratio, bound.copy_bound_gbps);
    }
  }
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
  app->add_option("--model", f->model, "Hugging Face model directory")->required();
  f->experts.Add(app);
  app->add_flag("--unlink", f->unlink, "remove the shared-memory segment at the end");
  app->add_flag("--json", f->json, "print one JSON object");
}

struct ServeBenchFlags {
  bench::ServingBenchOptions options;
  std::string target, model, concurrency = "1,4,16";
  int requests = 0, max_batch_tokens = 2048;
  ExpertFlags experts;
  bool json = false;
};

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
  std::unique_ptr<runtime::Model> model;
  std::unique_ptr<scheduler::Frontend> frontend;
  if (!flags.model.empty()) {
    runtime::ModelOptions model_options;
    if (absl::Status s = flags.experts.Apply(&model_options, "bench serve"); !s.ok()) return Fail(s, 2);
    model_options.pool.progress = false;
    auto loaded = runtime::Model::Load(flags.model, model_options);
    if (!loaded.ok()) return Fail(loaded.status(), 1);
    model = std::move(*loaded);
    scheduler::FrontendOptions fo;
    fo.listen = "127.0.0.1:0";
    fo.scheduler.max_batch_tokens = flags.max_batch_tokens;
    fo.scheduler.max_seqs = 64;
    fo.scheduler.context = model->spec().max_position_embeddings;
    auto executor = runtime::ModelExecutor::Create(*model, /*num_blocks=*/4096, fo.scheduler.block_size);
    if (!executor.ok()) return Fail(executor.status(), 1);
    auto started = scheduler::Frontend::Start(*std::move(executor), fo);
    if (!started.ok()) return Fail(started.status(), 1);
    frontend = std::move(*started);
    o.target = absl::StrCat("127.0.0.1:", frontend->port());
    o.vocab = model->spec().vocab_size;
  }
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  const bool json = flags.json;
  for (int c : *concurrency) {
    o.concurrency = c;
    o.requests = flags.requests > 0 ? flags.requests : std::max(8, 4 * c);
    auto r = bench::RunServingBench(o);
    if (!r.ok()) return Fail(r.status(), 1);
    if (json) {
      auto stats = [](const bench::LatencyStats& s) {
        return nlohmann::ordered_json{{"mean", s.mean}, {"p50", s.p50}, {"p99", s.p99}};
      };
      rows.push_back({{"concurrency", c},
                      {"requests", r->requests},
                      {"failed", r->failed},
                      {"output_tokens_per_s", r->output_tokens_per_second},
                      {"ttft_ms", stats(r->ttft_ms)},
                      {"tpot_ms", stats(r->tpot_ms)},
                      {"itl_ms", stats(r->itl_ms)},
                      {"e2e_ms", stats(r->e2e_ms)}});
    } else {
      std::cout << absl::StrFormat(
          "concurrency %3d: %8.1f output tokens/s | TTFT ms mean %.1f p50 %.1f p99 %.1f | TPOT ms mean %.2f p50 %.2f "
          "p99 %.2f | ITL ms mean %.2f p50 %.2f p99 %.2f | %d requests, %d failed\n",
          c, r->output_tokens_per_second, r->ttft_ms.mean, r->ttft_ms.p50, r->ttft_ms.p99, r->tpot_ms.mean,
          r->tpot_ms.p50, r->tpot_ms.p99, r->itl_ms.mean, r->itl_ms.p50, r->itl_ms.p99, r->requests, r->failed);
    }
  }
  if (json) std::cout << rows.dump() << std::endl;
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
  app->add_option("--output-len", f->options.output_len, "tokens generated per request")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--max-batch-tokens", f->max_batch_tokens, "with --model: tokens per step")
      ->check(IntIn(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--csv", f->options.csv, "append one row per request");
  f->experts.Add(app);
  app->add_flag("--json", f->json, "print one JSON array of rows");
}

}  // namespace

void AddBenchCommand(CLI::App& root, CommandRun* selected) {
  CLI::App* bench = root.add_subcommand("bench", "benchmarks: bench experts, bench load, bench serve, bench model");
  bench->require_subcommand(1);
  AddBenchExperts(*bench, selected);
  AddBenchLoad(*bench, selected);
  AddBenchServe(*bench, selected);
  AddBenchModel(*bench, selected);
}

}  // namespace moe::deploy
