// moeserve bench: the expert pool against its rooflines, and loading the expert arena.
#include <chrono>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "commands.h"
#include "expert_bench.h"
#include "load_bench.h"
#include "serving_bench.h"
#include "moe/scheduler/frontend.h"
#include "flags.h"
#include "moe/core/status.h"
#include "moe/experts/arena.h"
#include "moe/runtime/model.h"
#include "nlohmann/json.hpp"

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

absl::Status ReadBenchOptions(const Flags& flags, bench::ExpertBenchOptions* o) {
  MOE_ASSIGN_OR_RETURN(int64_t threads, flags.Int("threads"));
  MOE_ASSIGN_OR_RETURN(int64_t layers, flags.Int("layers"));
  MOE_ASSIGN_OR_RETURN(int64_t read_mb, flags.Int("read-mb"));
  MOE_ASSIGN_OR_RETURN(double seconds, flags.Double("seconds"));
  MOE_ASSIGN_OR_RETURN(o->hidden, flags.Int("hidden"));
  MOE_ASSIGN_OR_RETURN(o->intermediate, flags.Int("intermediate"));
  MOE_ASSIGN_OR_RETURN(int64_t experts, flags.Int("experts"));
  MOE_ASSIGN_OR_RETURN(int64_t top_k, flags.Int("top-k"));
  o->threads = static_cast<int>(threads);
  o->layers = static_cast<int>(layers);
  o->read_bytes = read_mb << 20;
  o->seconds_per_point = seconds;
  o->num_experts = static_cast<int>(experts);
  o->top_k = static_cast<int>(top_k);
  o->phases = flags.Switch("phases");
  MOE_ASSIGN_OR_RETURN(o->decode_max_tokens, flags.Int("decode-max-tokens"));
  MOE_ASSIGN_OR_RETURN(int64_t decode_units, flags.Int("decode-units"));
  if (o->decode_max_tokens < 0 || decode_units <= 0) {
    return absl::InvalidArgumentError("--decode-max-tokens must be at least 0 and --decode-units positive");
  }
  o->decode_units = static_cast<int>(decode_units);
  MOE_ASSIGN_OR_RETURN(o->gap_us, flags.Double("gap-us"));
  MOE_ASSIGN_OR_RETURN(o->linger_us, flags.Int("linger-us"));
  if (o->gap_us < 0 || o->linger_us < 0) return absl::InvalidArgumentError("--gap-us and --linger-us must be at least 0");
  MOE_ASSIGN_OR_RETURN(o->stream_tokens, flags.Int("stream-tokens"));
  if (o->stream_tokens < 0) return absl::InvalidArgumentError("--stream-tokens must be at least 0");
  o->formats = SplitList(flags.Get("formats"));
  o->kernels = SplitList(flags.Get("kernels"));
  o->batches.clear();
  for (const std::string& b : SplitList(flags.Get("batches"))) {
    int v;
    if (!absl::SimpleAtoi(b, &v) || v <= 0) {
      return absl::InvalidArgumentError("--batches: '" + b + "' is not a positive batch size");
    }
    o->batches.push_back(v);
  }
  if (o->batches.empty() || o->layers <= 0 || o->top_k <= 0 || o->top_k > o->num_experts || read_mb <= 0) {
    return absl::InvalidArgumentError("--batches, --layers, --top-k (at most --experts) and --read-mb must be positive");
  }
  return absl::OkStatus();
}

int BenchExperts(int argc, char** argv) {
  Flags flags("bench experts",
              "Times one MoE layer call of the CPU expert pool at a real layer shape (default Qwen3-30B-A3B:\n"
              "hidden 2048, 128 experts, top-8, intermediate 768) for every format, kernel and batch, against\n"
              "the host read bandwidth measured with the same threads in the same run. Weights are random.\n"
              "Columns: ms per call, GB/s of expert weights touched, ratio to the read bandwidth, TFLOP/s.\n"
              "After each kernel's points, the kernel alone over every expert of the arena (--stream-tokens).\n"
              "Last, at 64 tokens and more, each kernel's speed over its format's AVX-512 path (the same run),\n"
              "and the most it could be: the AVX-512 time over the time to read the weights once.");
  flags.Add("threads", "N", "pool threads; 0 uses every core", "0");
  flags.Add("layers", "N", "layers the calls cycle through (keeps the weights out of the caches)", "4");
  flags.Add("batches", "LIST", "tokens per call", "1,4,16,64,256,1024");
  flags.Add("formats", "LIST", "bf16, int8, int4", "bf16,int8,int4");
  flags.Add("kernels", "LIST", "only these kernels (portable, avx512, avx512bf16, vnni, amx); default all");
  flags.Add("read-mb", "MB", "buffer for the read-bandwidth roofline", "2048");
  flags.Add("seconds", "S", "time spent per point", "0.3");
  flags.Add("hidden", "N", "hidden size", "2048");
  flags.Add("intermediate", "N", "expert intermediate size", "768");
  flags.Add("experts", "N", "experts per layer", "128");
  flags.Add("top-k", "K", "experts per token", "8");
  flags.Add("decode-max-tokens", "N", "calls of at most N tokens use the pool's decode schedule; 0: never", "16");
  flags.Add("decode-units", "N", "units of work per thread and stage in the decode schedule", "4");
  flags.Add("gap-us", "US",
            "microseconds the caller spins between calls, as a forward does on the rest of a layer (only the calls "
            "are timed); 0: back to back",
            "0");
  flags.Add("linger-us", "US", "microseconds the pool's threads stay awake after a call for the next one; 0: they sleep",
            "2000");
  flags.Add("stream-tokens", "N",
            "after each kernel's points, the kernel alone running over every expert of the arena with N tokens per "
            "expert (no sorting, gathering or sums): gate+up, down and both in GB/s of weights, against the read "
            "bandwidth; 0: skip",
            "64");
  flags.AddSwitch("phases",
                  "after each point, its trials, the time of each phase of a call, and how the threads spent the sort "
                  "and experts phase");
  flags.AddSwitch("json", "print one JSON array of rows: format, kernel, batch, ms_per_call, weight_gbps, read_gbps, "
                          "ratio, tflops");
  flags.AddSwitch("help", "show this help");
  if (std::optional<int> exit_code = flags.ParseOrExit(argc, argv)) return *exit_code;
  bench::ExpertBenchOptions options;
  if (absl::Status s = ReadBenchOptions(flags, &options); !s.ok()) return Fail(s, 2);
  const bool json = flags.Switch("json");
  auto rows = bench::RunExpertBench(options, json ? std::cerr : std::cout);
  if (!rows.ok()) return Fail(rows.status(), 1);
  if (json) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const bench::ExpertBenchRow& r : *rows) {
      out.push_back({{"format", r.format}, {"kernel", r.kernel}, {"batch", r.batch}, {"ms_per_call", r.ms_per_call},
                     {"weight_gbps", r.weight_gbps}, {"read_gbps", r.read_gbps}, {"ratio", r.ratio},
                     {"tflops", r.tflops}});
    }
    std::cout << out.dump() << std::endl;
  }
  return 0;
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

int BenchLoad(int argc, char** argv) {
  Flags flags("bench load",
              "Loads a model's routed experts into the expert arena and reports the speed (checkpoint bytes read\n"
              "per second), against the bound measured right after with the pool's thread count: reading the\n"
              "checkpoint files themselves from the page cache, and from disk (O_DIRECT) for the share that was\n"
              "not cached before the load. A second bound copies the files from the page cache into fresh memory\n"
              "of the arena's kind and size (every new page is zeroed by the kernel before it is written, for the\n"
              "load as for the copy). With --expert-shm the arena is a named shared-memory segment: the\n"
              "first run fills it, later runs attach to it and report the attach time.");
  flags.Add("model", "DIR", "Hugging Face model directory");
  AddExpertFlags(flags);
  flags.AddSwitch("unlink", "remove the shared-memory segment at the end");
  flags.AddSwitch("json", "print one JSON object");
  flags.AddSwitch("help", "show this help");
  if (std::optional<int> exit_code = flags.ParseOrExit(argc, argv)) return *exit_code;
  auto model_dir = flags.Required("model");
  if (!model_dir.ok()) return Fail(model_dir.status(), 2);
  runtime::ModelOptions options;
  if (absl::Status s = ReadExpertFlags(flags, &options); !s.ok()) return Fail(s, 2);
  if (options.experts != runtime::RoutedExpertsMode::kPool) {
    return Fail(absl::InvalidArgumentError("bench load measures the expert pool; drop --experts reference"), 2);
  }
  options.pool.progress = !flags.Switch("json");
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
  if (flags.Switch("json")) {
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
      std::cout << absl::StrFormat("the checkpoint files (%.0f%% in the page cache before the load) read at %.2f GB/s "
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
  if (flags.Switch("unlink") && !options.pool.shm_name.empty()) {
    if (absl::Status s = experts::HostArena::Unlink(options.pool.shm_name); !s.ok()) return Fail(s, 1);
  }
  return 0;
}

int BenchServe(int argc, char** argv) {
  Flags flags("bench serve",
              "Load generator: concurrent Generate streams against a moeserve server, reporting time to first\n"
              "token (TTFT), time per output token (TPOT), inter-token latency (ITL) and output tokens/s for\n"
              "each concurrency. Give --target of a running server, or --model to start one in this process.");
  flags.Add("target", "HOST:PORT", "a running server");
  flags.Add("model", "DIR", "start a server in this process on this model instead (CPU backend)");
  flags.Add("concurrency", "LIST", "concurrent streams, one run each", "1,4,16");
  flags.Add("requests", "N", "requests per run; 0: 4 per stream, at least 8", "0");
  flags.Add("prompt-len", "N", "prompt tokens (random ids)", "32");
  flags.Add("output-len", "N", "tokens generated per request", "32");
  flags.Add("max-batch-tokens", "N", "with --model: tokens per step", "2048");
  flags.Add("csv", "PATH", "append one row per request");
  AddExpertFlags(flags);
  flags.AddSwitch("json", "print one JSON array of rows");
  flags.AddSwitch("help", "show this help");
  if (std::optional<int> exit_code = flags.ParseOrExit(argc, argv)) return *exit_code;
  bench::ServingBenchOptions o;
  auto requests = flags.Int("requests");
  auto prompt_len = flags.Int("prompt-len");
  auto output_len = flags.Int("output-len");
  auto batch = flags.Int("max-batch-tokens");
  for (const absl::Status& s : {requests.status(), prompt_len.status(), output_len.status(), batch.status()}) {
    if (!s.ok()) return Fail(s, 2);
  }
  o.prompt_len = static_cast<int>(*prompt_len);
  o.output_len = static_cast<int>(*output_len);
  o.csv = flags.Get("csv");
  std::vector<int> concurrency;
  for (const std::string& c : SplitList(flags.Get("concurrency"))) {
    int v;
    if (!absl::SimpleAtoi(c, &v) || v <= 0) {
      return Fail(absl::InvalidArgumentError("--concurrency: '" + c + "' is not a positive number"), 2);
    }
    concurrency.push_back(v);
  }
  std::unique_ptr<runtime::Model> model;
  std::unique_ptr<scheduler::Frontend> frontend;
  if (flags.Has("model")) {
    runtime::ModelOptions model_options;
    if (absl::Status s = ReadExpertFlags(flags, &model_options); !s.ok()) return Fail(s, 2);
    model_options.pool.progress = false;
    auto loaded = runtime::Model::Load(flags.Get("model"), model_options);
    if (!loaded.ok()) return Fail(loaded.status(), 1);
    model = std::move(*loaded);
    scheduler::FrontendOptions fo;
    fo.listen = "127.0.0.1:0";
    fo.scheduler.max_batch_tokens = static_cast<int>(*batch);
    fo.scheduler.max_seqs = 64;
    fo.scheduler.context = model->spec().max_position_embeddings;
    fo.scheduler.num_blocks = 4096;
    auto started = scheduler::Frontend::Start(*model, fo);
    if (!started.ok()) return Fail(started.status(), 1);
    frontend = std::move(*started);
    o.target = absl::StrCat("127.0.0.1:", frontend->port());
    o.vocab = model->spec().vocab_size;
  } else {
    auto target = flags.Required("target");
    if (!target.ok()) return Fail(absl::InvalidArgumentError("give --target HOST:PORT or --model DIR"), 2);
    o.target = *target;
  }
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  const bool json = flags.Switch("json");
  for (int c : concurrency) {
    o.concurrency = c;
    o.requests = *requests > 0 ? static_cast<int>(*requests) : std::max(8, 4 * c);
    auto r = bench::RunServingBench(o);
    if (!r.ok()) return Fail(r.status(), 1);
    if (json) {
      auto stats = [](const bench::LatencyStats& s) {
        return nlohmann::ordered_json{{"mean", s.mean}, {"p50", s.p50}, {"p99", s.p99}};
      };
      rows.push_back({{"concurrency", c}, {"requests", r->requests}, {"failed", r->failed},
                      {"output_tokens_per_s", r->output_tokens_per_second}, {"ttft_ms", stats(r->ttft_ms)},
                      {"tpot_ms", stats(r->tpot_ms)}, {"itl_ms", stats(r->itl_ms)}, {"e2e_ms", stats(r->e2e_ms)}});
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

}  // namespace

int BenchCommand(int argc, char** argv) {
  const std::string what = argc > 0 ? argv[0] : "";
  if (what == "experts") return BenchExperts(argc - 1, argv + 1);
  if (what == "load") return BenchLoad(argc - 1, argv + 1);
  if (what == "serve") return BenchServe(argc - 1, argv + 1);
  std::ostream& out = what == "--help" ? std::cout : std::cerr;
  out << "usage: moeserve bench experts [flags]   the expert pool against the read-bandwidth roofline\n"
      << "       moeserve bench load --model DIR   loading the expert arena (and attaching to a shared one)\n"
      << "       moeserve bench serve [flags]      load generator: TTFT, TPOT, ITL and tokens/s per concurrency\n";
  return what == "--help" ? 0 : 2;
}

}  // namespace moe::deploy
