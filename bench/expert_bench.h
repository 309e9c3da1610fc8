// The expert pool benchmark: one MoE layer call at a real layer shape (Qwen3-30B-A3B by default:
// hidden 2048, 128 experts, top-8, intermediate 768) for each format, kernel and batch size,
// against the host read bandwidth measured with the same threads in the same run. Each point is
// the best of three trials, each preceded by a read-bandwidth measurement; the roofline is the best
// of all readings of the run.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::bench {

struct ExpertBenchOptions {
  int64_t hidden = 2048;
  int64_t intermediate = 768;
  int num_experts = 128;
  int top_k = 8;
  int layers = 4;  // calls cycle through layers so the touched experts come from RAM, not cache
  std::vector<int> batches = {1, 4, 16, 64, 256, 1024};
  // Also GGUF formats ("q8_0", "q4_k", "iq3_xxs", ...: random experts of that type, kept as the
  // file's blocks).
  std::vector<std::string> formats = {"bf16", "int8", "int4"};
  std::vector<std::string> kernels;  // empty: every kernel this CPU has
  int threads = 0;
  int64_t read_bytes = 2ll << 30;  // buffer for the read-bandwidth roofline
  double seconds_per_point = 0.3;
  int portable_max_batch = 16;  // the portable kernel is a reference, not a contender
  bool phases = false;          // print where each point's time goes
  int64_t decode_max_tokens = 16;  // ExpertPoolOptions: calls up to this size use the decode schedule
  int decode_units = 4;            // ExpertPoolOptions::decode_units_per_thread
  // Microseconds the caller spends between calls (as a forward does on the rest of a layer),
  // spinning; only the calls are timed. 0: back to back.
  double gap_us = 0;
  int64_t linger_us = 2000;  // ExpertPoolOptions::linger_us
  // After each kernel's points: the kernel alone streaming the whole arena with this many tokens
  // per expert (ExpertPool::MeasureKernelStream), against the read bandwidth; 0: skipped.
  int64_t stream_tokens = 64;
};

struct ExpertBenchRow {
  std::string format, kernel;
  int batch = 0;
  double ms_per_call = 0;
  double weight_gbps = 0;  // bytes of the experts touched per call / time
  double read_gbps = 0;    // the roofline: the best read bandwidth of the run, same threads
  double ratio = 0;        // weight_gbps / read_gbps
  double tflops = 0;
};

// Runs the sweep; `log` gets one human-readable line per point as it goes.
absl::StatusOr<std::vector<ExpertBenchRow>> RunExpertBench(const ExpertBenchOptions& options, std::ostream& log);

// The rows as one JSON array on one line of `out`: format, kernel, batch, ms_per_call,
// weight_gbps, read_gbps, ratio, tflops.
void PrintExpertBenchJson(const std::vector<ExpertBenchRow>& rows, std::ostream& out);

}  // namespace moe::bench
