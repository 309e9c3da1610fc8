// `moeserve bench comm`: the all-reduce of a tensor split on CPU workers (GlooCommunicator, one
// process per rank on 127.0.0.1) at the two sizes a step sends: one hidden-state row (decode) and a
// chunk of prefill tokens, against the bound measured in the same run: one plain TCP stream
// between two processes over 127.0.0.1 moving the same bytes.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::bench {

struct CommBenchOptions {
  int ranks = 2;
  int64_t hidden = 2048;           // fp32 elements of one row
  int64_t chunk_tokens = 2048;     // rows of the prefill chunk
  double seconds_per_point = 1.0;  // spent on each size, for the all-reduce and for the bound
};

struct CommBenchRow {
  std::string name;  // "row (1 x 2048 fp32)"
  int64_t bytes = 0;
  int repeats = 0;
  double allreduce_seconds = 0;  // median over the repeats, measured on rank 0 after a barrier
  double algbw_gbps = 0;         // bytes / time
  double busbw_gbps = 0;         // 2 (n - 1) / n * bytes / time: what each rank sends (and receives)
  double tcp_gbps = 0;           // the bound: bytes / median time of one TCP transfer and its 1-byte ack
  double ratio = 0;              // busbw / tcp
};

struct CommBenchResult {
  int ranks = 0;
  std::string communicator;  // rank 0's Describe()
  std::vector<CommBenchRow> rows;
};

// Forks the ranks (the calling process must not have started threads yet: see RunLocalRanks),
// measures, and returns rank 0's figures. Errors: a rank's failure, named.
absl::StatusOr<CommBenchResult> RunCommBench(const CommBenchOptions& options);

// A table with a line on the bound, or one JSON object on one line.
void PrintCommBench(const CommBenchResult& result, bool json, std::ostream& out);

}  // namespace moe::bench
