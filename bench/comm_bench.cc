#include "comm_bench.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "moe/comm/gloo_communicator.h"
#include "moe/comm/local_ranks.h"
#include "moe/comm/rendezvous.h"
#include "moe/comm/tcp_socket.h"
#include "moe/core/status.h"
#include "nlohmann/json.hpp"

namespace moe::bench {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(60);
constexpr char kTcpPortKey[] = "bench-comm/tcp-port";

struct Size {
  std::string name;
  int64_t floats = 0;
  int64_t bytes() const { return floats * static_cast<int64_t>(sizeof(float)); }
};

std::vector<Size> Sizes(const CommBenchOptions& o) {
  return {{absl::StrFormat("row (1 x %d fp32)", o.hidden), o.hidden},
          {absl::StrFormat("chunk (%d x %d fp32)", o.chunk_tokens, o.hidden), o.chunk_tokens * o.hidden}};
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// How many repeats of something that took `one` seconds fill `budget` seconds: 5 to 10000.
int RepeatsFor(double budget, double one) {
  return static_cast<int>(std::clamp(budget / std::max(one, 1e-7), 5.0, 10000.0));
}

// The bound, between ranks 0 and 1: rank 0 sends each size's bytes over one TCP connection and
// rank 1 answers with one byte once all have arrived. Rank 0 leads with (bytes, count) headers,
// (0, 0) at the end; it returns the median seconds of one transfer for each size.
absl::StatusOr<std::vector<double>> MeasureTcp(int rank, comm::RendezvousClient& client, const std::vector<Size>& sizes,
                                               double budget) {
  int64_t largest = 0;
  for (const Size& s : sizes) largest = std::max(largest, s.bytes());
  std::vector<char> buffer(largest);
  char ack = 1;
  const auto deadline = [] { return absl::Now() + kTimeout; };
  if (rank == 1) {
    int port = 0;
    MOE_ASSIGN_OR_RETURN(comm::TcpSocket listener, comm::ListenTcp("127.0.0.1", 0, &port));
    MOE_RETURN_IF_ERROR(client.Set(kTcpPortKey, std::to_string(port)));
    MOE_ASSIGN_OR_RETURN(comm::TcpSocket socket, comm::AcceptTcp(listener, deadline()));
    for (;;) {
      int64_t header[2];
      MOE_RETURN_IF_ERROR(comm::RecvAll(socket, header, sizeof(header), deadline(), "tcp bound header"));
      if (header[0] <= 0 || header[0] > largest) return std::vector<double>{};
      for (int64_t i = 0; i < header[1]; ++i) {
        MOE_RETURN_IF_ERROR(comm::RecvAll(socket, buffer.data(), header[0], deadline(), "tcp bound data"));
        MOE_RETURN_IF_ERROR(comm::SendAll(socket, &ack, 1, deadline(), "tcp bound answer"));
      }
    }
  }
  MOE_ASSIGN_OR_RETURN(const std::string port_text, client.Get(kTcpPortKey, kTimeout));
  int port = 0;
  if (!absl::SimpleAtoi(port_text, &port)) return absl::InternalError("rank 1 published no TCP port");
  MOE_ASSIGN_OR_RETURN(comm::TcpSocket socket, comm::ConnectTcp("127.0.0.1", port, deadline()));
  // As Gloo does for its sends: a send buffer as large as the transfer, up to what the kernel allows.
  const int sndbuf = static_cast<int>(std::min<int64_t>(largest, 32 << 20));
  (void)setsockopt(socket.fd(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  auto run = [&](int64_t bytes, int64_t count, std::vector<double>* seconds) -> absl::Status {
    const int64_t header[2] = {bytes, count};
    MOE_RETURN_IF_ERROR(comm::SendAll(socket, header, sizeof(header), deadline(), "tcp bound header"));
    for (int64_t i = 0; i < count; ++i) {
      const absl::Time start = absl::Now();
      MOE_RETURN_IF_ERROR(comm::SendAll(socket, buffer.data(), bytes, deadline(), "tcp bound data"));
      MOE_RETURN_IF_ERROR(comm::RecvAll(socket, &ack, 1, deadline(), "tcp bound answer"));
      seconds->push_back(SecondsSince(start));
    }
    return absl::OkStatus();
  };
  std::vector<double> medians;
  for (const Size& s : sizes) {
    std::vector<double> warm, timed;
    MOE_RETURN_IF_ERROR(run(s.bytes(), 2, &warm));
    MOE_RETURN_IF_ERROR(run(s.bytes(), RepeatsFor(budget, warm.back()), &timed));
    medians.push_back(Median(timed));
  }
  const int64_t end[2] = {0, 0};
  MOE_RETURN_IF_ERROR(comm::SendAll(socket, end, sizeof(end), deadline(), "tcp bound end"));
  return medians;
}

// The median seconds of an all-reduce of `floats` on rank 0 (each after a barrier), and the
// repeats; rank 0 picks the count from a warm-up and broadcasts it, since every rank must make
// the same calls.
absl::StatusOr<std::pair<double, int>> MeasureAllReduce(comm::Communicator& comm, int64_t floats, double budget) {
  std::vector<float> data(floats, 1e-3f);
  absl::Time start;
  for (int i = 0; i < 2; ++i) {
    MOE_RETURN_IF_ERROR(comm.Barrier());
    start = absl::Now();
    MOE_RETURN_IF_ERROR(comm.AllReduceSum(data.data(), floats, core::DType::kF32));
  }
  int32_t repeats = RepeatsFor(budget, SecondsSince(start));
  MOE_RETURN_IF_ERROR(comm.Broadcast(&repeats, sizeof(repeats), 0));
  std::vector<double> seconds;
  for (int i = 0; i < repeats; ++i) {
    MOE_RETURN_IF_ERROR(comm.Barrier());
    start = absl::Now();
    MOE_RETURN_IF_ERROR(comm.AllReduceSum(data.data(), floats, core::DType::kF32));
    seconds.push_back(SecondsSince(start));
  }
  return std::make_pair(Median(seconds), static_cast<int>(repeats));
}

// One rank's part. Rank 0 answers its communicator's description, then "seconds repeats
// tcp_seconds" per size, one line each.
absl::StatusOr<std::string> RunRank(const CommBenchOptions& o, int rank, const std::string& store) {
  comm::GlooOptions go;
  go.rank = rank;
  go.size = o.ranks;
  go.store_address = store;
  go.prefix = "bench-comm";
  go.timeout = kTimeout;
  MOE_ASSIGN_OR_RETURN(auto communicator, comm::GlooCommunicator::Create(go));
  MOE_ASSIGN_OR_RETURN(auto client, comm::RendezvousClient::Connect(store, kTimeout));
  const std::vector<Size> sizes = Sizes(o);
  std::vector<double> tcp_seconds(sizes.size(), 0.0);
  if (rank < 2) {
    MOE_ASSIGN_OR_RETURN(std::vector<double> measured, MeasureTcp(rank, *client, sizes, o.seconds_per_point));
    if (rank == 0) tcp_seconds = measured;
  }
  std::string out = communicator->Describe();
  for (size_t i = 0; i < sizes.size(); ++i) {
    MOE_ASSIGN_OR_RETURN(const auto measured, MeasureAllReduce(*communicator, sizes[i].floats, o.seconds_per_point));
    absl::StrAppendFormat(&out, "\n%.9g %d %.9g", measured.first, measured.second, tcp_seconds[i]);
  }
  return out;
}

std::string FormatSeconds(double s) {
  return s < 1e-3 ? absl::StrFormat("%.1f us", s * 1e6) : absl::StrFormat("%.2f ms", s * 1e3);
}

std::string FormatBytes(int64_t bytes) {
  if (bytes >= (1 << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  return absl::StrFormat("%.1f KiB", bytes / 1024.0);
}

}  // namespace

absl::StatusOr<CommBenchResult> RunCommBench(const CommBenchOptions& o) {
  if (o.ranks < 2) return absl::InvalidArgumentError("bench comm needs at least 2 ranks");
  const std::vector<Size> sizes = Sizes(o);
  MOE_ASSIGN_OR_RETURN(
      auto results, comm::RunLocalRanks({.ranks = o.ranks, .deadline = absl::Minutes(10)},
                                        [&o](int rank, const std::string& store) { return RunRank(o, rank, store); }));
  for (int r = 0; r < o.ranks; ++r) {
    if (!results[r].ok()) return core::Annotate(results[r].status(), absl::StrCat("bench comm: rank ", r));
  }
  const std::vector<std::string> lines = absl::StrSplit(*results[0], '\n');
  if (lines.size() != sizes.size() + 1) return absl::InternalError("bench comm: rank 0 answered " + *results[0]);
  CommBenchResult result;
  result.ranks = o.ranks;
  result.communicator = lines[0];
  for (size_t i = 0; i < sizes.size(); ++i) {
    CommBenchRow row;
    row.name = sizes[i].name;
    row.bytes = sizes[i].bytes();
    double tcp_seconds = 0;
    const std::vector<std::string> fields = absl::StrSplit(lines[i + 1], ' ');
    if (fields.size() != 3 || !absl::SimpleAtod(fields[0], &row.allreduce_seconds) ||
        !absl::SimpleAtoi(fields[1], &row.repeats) || !absl::SimpleAtod(fields[2], &tcp_seconds)) {
      return absl::InternalError("bench comm: rank 0 answered " + lines[i + 1]);
    }
    const double bytes = static_cast<double>(row.bytes);
    row.algbw_gbps = bytes / row.allreduce_seconds / 1e9;
    row.busbw_gbps = row.algbw_gbps * 2.0 * (o.ranks - 1) / o.ranks;
    row.tcp_gbps = tcp_seconds > 0 ? bytes / tcp_seconds / 1e9 : 0;
    row.ratio = row.tcp_gbps > 0 ? row.busbw_gbps / row.tcp_gbps : 0;
    result.rows.push_back(row);
  }
  return result;
}

void PrintCommBench(const CommBenchResult& result, bool json, std::ostream& out) {
  if (json) {
    nlohmann::ordered_json rows = nlohmann::ordered_json::array();
    for (const CommBenchRow& r : result.rows) {
      rows.push_back({{"name", r.name},
                      {"bytes", r.bytes},
                      {"repeats", r.repeats},
                      {"allreduce_us", r.allreduce_seconds * 1e6},
                      {"algbw_gbps", r.algbw_gbps},
                      {"busbw_gbps", r.busbw_gbps},
                      {"tcp_gbps", r.tcp_gbps},
                      {"ratio", r.ratio}});
    }
    nlohmann::ordered_json j = {{"ranks", result.ranks}, {"communicator", result.communicator}, {"rows", rows}};
    out << j.dump() << std::endl;
    return;
  }
  out << "all-reduce (sum, fp32) over " << result.ranks
      << " ranks, one process each on 127.0.0.1: " << result.communicator << "\n";
  out << "bound, measured in this run: one TCP stream between two processes over 127.0.0.1 moving the same bytes "
         "(then a 1-byte answer); busbw = 2(n-1)/n x bytes / time, what each rank sends and receives\n";
  out << absl::StrFormat("%-26s %10s %8s %12s %11s %11s %9s %10s\n", "size", "bytes", "repeats", "all-reduce",
                         "algbw GB/s", "busbw GB/s", "TCP GB/s", "busbw/TCP");
  for (const CommBenchRow& r : result.rows) {
    out << absl::StrFormat("%-26s %10s %8d %12s %11.3f %11.3f %9.3f %10.2f\n", r.name, FormatBytes(r.bytes), r.repeats,
                           FormatSeconds(r.allreduce_seconds), r.algbw_gbps, r.busbw_gbps, r.tcp_gbps, r.ratio);
  }
}

}  // namespace moe::bench
